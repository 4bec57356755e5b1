"""Loading an artifact with the TVM runtime alone (never tvm.relax): checks, weights, the VM."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..common.errors import ArtifactError
from ..common.manifest import LIBRARY, PLAN, WEIGHTS, Manifest, file_sha256


def host_cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_artifact(directory: Path, manifest: Manifest, verify_hashes: bool = True) -> None:
    kind = manifest.target.get("kind")
    code = {"vulkan": PLAN}.get(kind, LIBRARY)
    for name in (code, WEIGHTS, "tokenizer.json"):
        if not (directory / name).is_file():
            raise ArtifactError(f"{directory} is incomplete: {name} is missing; compile it again.")
    if verify_hashes:
        for name, expected in manifest.files.items():
            path = directory / name
            if not path.is_file():
                raise ArtifactError(f"{directory} is incomplete: {name} is missing; compile it again.")
            if file_sha256(path) != expected:
                raise ArtifactError(f"{directory}/{name} does not match the hash in the manifest "
                                    f"(corrupted or changed); compile it again.")
    if kind != "llvm":
        return
    required = set(manifest.target.get("cpu_features", []))
    flags = host_cpu_flags()
    missing = sorted(required - flags) if flags else []
    if missing:
        raise ArtifactError(f"{directory} was built for CPU {manifest.target.get('mcpu')} and needs "
                            f"{', '.join(missing)}, which this CPU lacks; compile it here or with a portable --mcpu.")


def weight_arrays(directory: Path, manifest: Manifest):
    """(param entry, numpy view into the mapped weights file) for every parameter, in order; a parameter that ends
    past the file is an ArtifactError. Views are valid only while iterating: callers copy each one (to a device)."""
    size = (directory / WEIGHTS).stat().st_size
    mapped = np.memmap(directory / WEIGHTS, dtype=np.uint8, mode="r", shape=(size,))
    try:
        for p in manifest.params:
            if p.offset + p.nbytes > size:
                raise ArtifactError(f"{directory}/{WEIGHTS} is truncated ({p.name} ends past the file).")
            yield p, mapped[p.offset:p.offset + p.nbytes].view(np.dtype(p.dtype)).reshape(p.shape)
    finally:
        del mapped


def load_weights(directory: Path, manifest: Manifest, device) -> list:
    """Weights as TVM tensors on `device`, in parameter order; the file is mapped, copied once, released."""
    import tvm

    return [tvm.runtime.tensor(array, device) for _, array in weight_arrays(directory, manifest)]


def load_vm(directory: Path, device):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    try:
        library = tvm.runtime.load_module(str(directory / LIBRARY))
    except Exception as exc:  # a corrupted or foreign .so
        raise ArtifactError(f"{directory}/{LIBRARY} could not be loaded: {exc}") from None
    return VirtualMachine(library, device)


def configure_threads(threads: int) -> None:
    import tvm_ffi

    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, threads)
