"""Loading an artifact with the TVM runtime alone (never tvm.relax): checks, weights, the VM."""
from __future__ import annotations

import errno
import mmap
import os
import warnings
from pathlib import Path

import numpy as np

from ..common.cpu import AMX_FLAGS, usable_cpu_flags
from ..common.errors import ArtifactError, SharpiWarning
from ..common.manifest import (CONTRACT_FUNCTION, LIBRARY, MANIFEST_NAME, TOKENIZER, WEIGHTS, Manifest,
                               check_contract, verify_files, weights_size)


def check_artifact(directory: Path, manifest: Manifest, code_file: str, verify_hashes: bool = True) -> None:
    """An ArtifactError for an artifact that is incomplete (a file missing: its code_file, a kernel of a Vulkan
    plan), corrupted (a file whose sha256 differs from the manifest's, checked when verify_hashes; a weights file
    of another size than its parameters take, always) or built for a CPU this one is not. Nothing is loaded
    before these checks pass."""
    needed = (code_file, WEIGHTS, TOKENIZER)
    for name in dict.fromkeys([*needed, *manifest.files]):        # presence is cheap: always checked
        if not (directory / name).is_file():
            raise ArtifactError(f"{directory} is incomplete: {name} is missing; compile it again.")
    if verify_hashes:
        verify_files(directory, manifest, needed)
    size, expected = (directory / WEIGHTS).stat().st_size, weights_size(manifest)
    if size != expected:
        state = "empty" if size == 0 else "truncated" if size < expected else "longer than its parameters"
        raise ArtifactError(f"{directory}/{WEIGHTS} is {state} ({size} bytes; the manifest's parameters take "
                            f"{expected}); compile it again.")
    required = set(manifest.target.get("cpu_features", []))      # a CPU target's: it runs on this CPU
    if not required:
        return
    flags = usable_cpu_flags()
    missing = sorted(required - flags) if flags else []
    if missing:
        lacks = ("which this CPU lacks or the operating system does not grant" if set(missing) & AMX_FLAGS
                 else "which this CPU lacks")
        raise ArtifactError(f"{directory} was built for CPU {manifest.target.get('mcpu')} and needs "
                            f"{', '.join(missing)}, {lacks}; compile it here or with a portable --mcpu.")


def weight_arrays(directory: Path, manifest: Manifest, mode: str = "r"):
    """(param entry, numpy view into the mapped weights file) for every parameter, in order (their layout and the
    file's size were checked by Manifest.read and check_artifact). Each view keeps the mapping alive; mode "c"
    maps it copy-on-write, so the views are writable (for DLPack) and nothing written could reach the file."""
    size = (directory / WEIGHTS).stat().st_size
    if size == 0:           # numpy cannot map an empty file
        yield from ((p, np.zeros(p.shape, p.dtype)) for p in manifest.params)
        return
    mapped = np.memmap(directory / WEIGHTS, dtype=np.uint8, mode=mode, shape=(size,))
    for p in manifest.params:
        yield p, mapped[p.offset:p.offset + p.nbytes].view(p.dtype).reshape(p.shape)


def key_offsets(directory: Path, manifest: Manifest, n_layers: int, shape: tuple[int, int]) -> list | None:
    """Per layer the [kv_heads, head_dim] vector its cached keys are stored minus (Manifest.kv_key_offset), as
    float32 copies; None when the artifact stores keys as they are."""
    if not manifest.kv_key_offset:
        return None
    names = {f"blk.{layer}.{manifest.kv_key_offset}": layer for layer in range(n_layers)}
    offsets = [None] * n_layers
    for entry, array in weight_arrays(directory, manifest):
        tensor = entry.name.partition(":")[0]          # "blk.0.attn_k.bias:w": the GGUF tensor, its part
        if tensor in names and array.dtype == np.float32 and array.size == shape[0] * shape[1]:
            offsets[names[tensor]] = np.array(array).reshape(shape)
    if any(offset is None for offset in offsets):
        raise ArtifactError(f"{directory}/{MANIFEST_NAME} says its keys are cached minus {manifest.kv_key_offset}, "
                            f"but not every layer has that vector of {shape[0] * shape[1]} values: compile the "
                            f"artifact again.")
    return offsets


def load_weights(directory: Path, manifest: Manifest, device, lock: bool = False) -> list:
    """Weights as TVM tensors on `device`, in parameter order. On the CPU they are views of the mapped file, not
    copies: loading reads nothing until a kernel first touches a page, and resident memory is the weights once
    (page cache pages, which the kernel may drop and read again) where a copy held them twice while loading and
    once for ever; `lock` reads them all now and keeps them in memory (lock_in_memory). A GPU gets a copy of
    each, from the file mapped while they are copied."""
    import tvm

    if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        return mapped_cpu_tensors(directory, manifest, lock)
    return [tvm.runtime.tensor(array, device) for _, array in weight_arrays(directory, manifest)]


def mapped_cpu_tensors(directory: Path, manifest: Manifest, lock: bool = False) -> list:
    """The weights as CPU tensors over one private mapping of the file (weight_arrays' mode "c"; nothing writes
    them). Each tensor keeps the mapping alive; a file replaced by a later compile is a new file, and this one
    stays mapped. (An empty file's parameters are all empty: plain tensors.) `lock`: the mapping is locked in
    memory first, a SharpiWarning saying why where the system refuses."""
    import tvm

    arrays = list(weight_arrays(directory, manifest, mode="c"))
    mapping = next((file_mapping(array) for _, array in arrays if array.nbytes), None) if lock else None
    if mapping is not None:
        refused = lock_in_memory(mapping)
        if refused:
            warnings.warn(f"The weights of {directory} could not be locked in memory ({refused}); they stay "
                          f"mapped from the file, and pages the kernel drops are read again.", SharpiWarning,
                          stacklevel=2)
    return [tvm.runtime.from_dlpack(array) if array.nbytes else tvm.runtime.tensor(array) for _, array in arrays]


def file_mapping(view: np.ndarray) -> np.ndarray:
    """The whole mapped file a weight_arrays view was cut from (the first array up its chain of bases that
    owns the mmap)."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


MLOCK_ONFAULT = 1           # mlock2's flag (linux/mman.h)
MADV_POPULATE_READ = 22     # Linux 5.14 (linux/mman.h)


def lock_in_memory(mapped: np.ndarray) -> str | None:
    """Lock a file mapping's pages in memory and read them all in now, as llama.cpp's --mlock does: pages that
    neither memory pressure nor a proactive reclaimer (a VM's DAMON pageout of memory idle for a minute) can
    drop, so a mixture's rarely chosen experts are never read from disk mid-decode. mlock2(MLOCK_ONFAULT) and
    then MADV_POPULATE_READ fault the pages in for reading: a private mapping keeps mapping the page cache's
    pages, where plain mlock would write-fault (copy) every page of a writable one. None once locked, else why
    not. (Python's mmap has neither call: libc through ctypes.)"""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    if libc is None or not hasattr(libc, "mlock2") or not hasattr(libc, "madvise"):
        return "this system has no mlock2"
    available = available_memory()
    if available is not None and mapped.nbytes > available:      # locked pages past it: the OOM killer
        return (f"they take {mapped.nbytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of memory "
                f"available")
    address, size = ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(mapped.nbytes)
    if libc.mlock2(address, size, MLOCK_ONFAULT) != 0:
        error = ctypes.get_errno()
        hint = "; raise `ulimit -l`" if error in (errno.ENOMEM, errno.EPERM, errno.EAGAIN) else ""
        return f"mlock2: {os.strerror(error)}{hint}"
    if libc.madvise(address, size, MADV_POPULATE_READ) != 0:      # older kernels: one read a page
        step = mmap.PAGESIZE
        for start in range(0, mapped.nbytes, 1 << 30):
            int(mapped[start:start + (1 << 30):step].sum())
    return None


def available_memory() -> int | None:
    """Linux's MemAvailable in bytes (what can be had without swapping: free memory and reclaimable caches,
    this file's cached pages among them); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_vm(directory: Path, manifest: Manifest, device):
    """The Relax VM of the artifact's library, once the kernel contract compiled into it matches the manifest."""
    from tvm.runtime.vm import VirtualMachine

    try:
        vm = VirtualMachine(_load_library(directory / LIBRARY), device)
    except Exception as exc:  # a corrupted or foreign .so; TVM's messages run over several lines
        raise ArtifactError(f"{directory}/{LIBRARY} could not be loaded ({first_line(exc)}); compile it "
                            f"again.") from None
    try:
        compiled = str(vm[CONTRACT_FUNCTION]())
    except Exception:         # no such function (or not one returning the contract)
        compiled = None
    check_contract(directory, manifest, compiled, LIBRARY)
    return vm


def first_line(exc: Exception) -> str:
    """The first non-empty line of an exception's message (TVM's run over many lines)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _load_library(path: Path):
    """dlopen the kernel library through a fresh symlink. dlopen matches an already loaded library by the path it
    was opened with before it looks at the file, so an artifact compiled again into the same directory would run
    the first library's kernels (a Q8_0 model calling Q4_0 kernels); under a name never used before, it matches by
    the file's identity (device and inode), which a recompile changes: the old file, deleted, stays mapped. This
    is tvm.runtime.load_module without its realpath(), which would undo the symlink."""
    import tempfile

    import tvm_ffi

    with tempfile.TemporaryDirectory(prefix="sharpi-lib-") as folder:
        link = Path(folder) / path.name
        link.symlink_to(path.resolve())
        return tvm_ffi.load_module(str(link))


def configure_threads(threads: int) -> None:
    import tvm_ffi

    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, threads)
