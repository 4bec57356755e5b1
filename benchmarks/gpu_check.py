"""The CUDA backend issue's device check: run CUDA artifacts compiled here on a GPU machine that has Python 3.12,
numpy, tokenizers and jinja2 but neither TVM nor gguf nor a network, and receives at most 64 MiB per call.

Here (this machine, with sharpi, nvcc and network; `prepare --cpu` builds llvm artifacts instead, to try the whole
script here first, e.g. under a Python 3.12 venv with numpy, tokenizers and jinja2 but no TVM):

    python benchmarks/gpu_check.py prepare [--model smollm2-135m] [--arch sm_90] [--dir .gpu]

compiles the model for cuda five times (plain, with --cuda-graph, with a bf16 KV cache instead of f16, with a
q8_0 one, and with q4_ch keys and q4_0 values; the weights are the same; `--vulkan`: for vulkan three times, plain,
q8_0 and q4_ch, packing wgpu's wheels beside TVM's runtime, and `run` stops after the checks), and the speed
models (gemma3-270m, qwen2.5-coder-0.5b) twice each, whose weights do not travel (the machine fills random ones of
the same shapes: their runs measure speed only); computes the reference figures (the float32 numpy reference's
top-1 over the golden text; the CPU artifact's greedy tokens and SnapKV keep sets; for the q8_0 and q4_ch variants
the same figures with the cache rounded as it stores it: the numpy reference with NumpyReference.kv_types, a CPU
artifact with that cache), packs TVM's runtime without its compiler (libtvm_compiler.so is 250 MB; the runtime a
few MB) with a cp312 build of apache-tvm-ffi, and splits it all into parts of at most --part-mib, one per device
call (the repo's tracked files travel with each call too, ~25 MiB: cut the working tree to sharpi/, .gitignore
and these scripts for the calls, `git ls-files -d -z | xargs -0 git checkout --` after, as benchmarks/gpu.md
did; never while a job writes tracked files, which the cut deletes and the checkout puts back as committed). The
bundle must sit in a folder .gitignore ignores (.gpu/: one only .git/info/exclude ignores is removed there
between calls). It prints the calls: each carries one part (`carry: [".gpu/pN"]`); earlier parts stay on the
warm machine, so the calls must follow each other within its idle time (30 s). A `--vulkan` bundle's calls
first unpack the device README's Debian packages (Vulkan's loader and the GL dispatch libraries NVIDIA's ICD
loads) and name NVIDIA's ICD (gpu.md has the commands); its `receive` lists the Vulkan adapters. The last call
runs

    python3 benchmarks/gpu_check.py run --dir .gpu --out $OUT

which assembles the artifacts, runs TVM's runtime alone (TVM_USE_RUNTIME_LIB=1: never tvm.relax), and checks:
teacher-forced top-1 agreement with the float32 reference >= 99% (f16 or bf16 KV; q8_0 >= 98% and q4_ch >= 90%
against the reference that rounds its cache so: BARS, ROUNDED_BARS); greedy 32 tokens equal to the CPU artifact's
(float32; for q8_0 and q4_ch with the same cache; q4_ch's first 8) under the near-tie rule; SnapKV keep sets
overlapping the CPU's on >= 99% of slots (q8_0: 98%, q4_ch: 95%); and
decode speed, for each variant; and the speed model's decode speed. It prints a table and writes
$OUT/gpu_check.json; exit status 0 when every check passed.
The earlier calls run `receive`, which reports the parts present and, once the runtime part is there, whether the
runtime imports and sees the GPU (the first, cheapest check of this plan's assumptions); the first part alone
is enough for `speed`, which measures the speed models (benchmarks/gpu_speed.py) so that the first call's machine
time measures something too. `run` then measures the checked model's speed (with and without SnapKV and CUDA
graphs at 512 and 4096 tokens, a per-kernel profile, decode_batch at B = 1..128) and a PyTorch roofline, each
section under a deadline (`--seconds`), writing its JSON after every section.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "smollm2-135m-instruct-q4_1.json"
# the cuda artifact; with --cuda-graph; with --kv-dtype bf16, q8_0; with --kv-dtype-k q4_ch --kv-dtype-v q4_0
VARIANTS = ("plain", "graph", "bf16", "q8_0", "q4_ch")
# `prepare --vulkan`: WGSL has no bfloat16 and Vulkan no CUDA graph
VULKAN_VARIANTS = ("plain", "q8_0", "q4_ch")
# what the Vulkan backend needs beside sharpi on the GPU machine: wgpu (wgpu-native inside) and its imports, as
# wheels for that machine's Python. Vulkan's loader and the GL dispatch libraries NVIDIA's ICD needs are not there
# either: the device README's Debian packages, unpacked into / by the calls (benchmarks/gpu.md has the commands)
WGPU_WHEELS = ("wgpu", "cffi", "pycparser", "rendercanvas", "sniffio")
# a variant's (keys', values') KV types (the others: the target's default, f16)
VARIANT_KV = {"bf16": ("bf16", "bf16"), "q8_0": ("q8_0", "q8_0"), "q4_ch": ("q4_ch", "q4_0")}
ROUNDED_REFERENCES = ("q8_0", "q4_ch")      # variants checked against references that round the cache as they do
# the teacher-forced top-1 agreement and the SnapKV keep-set overlap a variant must reach. A rounded cache's are
# lower: one quant rounded the other way in one layer moves every layer after it, so even the CPU's q8_0 artifact
# agrees with the numpy forward that rounds its cache as q8_0 on 0.987 of SmolLM2's golden text; measured on Vulkan
# (lavapipe, the GPU kernels' arithmetic): top-1 0.997 against that forward, 0.991 against the CPU's q8_0 artifact,
# keep sets (budget 128) 0.992 of the CPU's. 4-bit keys move further: a quant that rounds the other way moves its key
# by a fifteenth of its channel's range in the page, and the CPU's q4_ch artifact itself agrees with the forward that
# rounds as it does on 0.950 of the golden text (max |d log-prob| 0.58); Vulkan 0.940 (0.943 against the CPU's), keep
# sets 0.974, and its greedy tokens leave the CPU's after 10, 18 and 29 of 32 (benchmarks/kv_quant_vulkan.py), so
# q4_ch's greedy check holds the first greedy_tokens of each prompt only
# The scorers' keep sets after a rounded cache move further again: on the H200 kvzip's kept 0.979 (q8_0) and 0.922
# (q4_ch) of the CPU's slots, the probe 0.986 and 0.947; the CPU's own int8-matmul artifact keeps of its float32
# one's (benchmarks/keep_set_noise.py) kvzip 0.953 / 0.891, the probe 0.966 / 0.914, keydiff 0.970 / 0.915, SnapKV's
# pyramid 0.974 / 0.944 (f16: 0.963 to 0.987). The rounded bars ask the GPU to agree with the CPU's float path at
# least as well as the CPU's other arithmetic does; a wrong kernel keeps about a quarter (256 of 1040 slots).
BARS = {"top1": 0.99, "overlap": 0.99, "scorers": 0.98}
ROUNDED_BARS = {"q8_0": {"top1": 0.98, "overlap": 0.98, "scorers": 0.95},
                "q4_ch": {"top1": 0.90, "overlap": 0.95, "scorers": 0.89, "greedy_tokens": 8}}
SPEED_BUILDS = ("plain", "graph")          # each speed model's, weights generated on the GPU machine
WORK = Path("/tmp/sharpi-gpu-check")        # where `run` assembles things on the GPU machine
NEAR_TIE = 1e-3                             # as sharpi.testing.backends.NEAR_TIE (not importable before setup)
SNAPKV_PROMPT, SNAPKV_BUDGET, SNAPKV_STEPS = 1040, 256, 16
SCORER_CHECKS = (("kvzip", "uniform"), ("probe", "uniform"), ("keydiff", "uniform"), ("snapkv", "pyramid"))
GREEDY_TOKENS = 32
SPEED_PROMPT, SPEED_TOKENS, SPEED_REPEATS = 512, 256, 3
# the tiny models' checks: a tiny qwen2moe's and a tiny qwen3next's (a hybrid: Gated DeltaNet layers and a mixture
# of experts) logits against the numpy reference's (teacher-forced, and prefill of TINY_PREFILL then decode), the
# float path's bound of tests/test_moe_models.py and tests/test_hybrid_models.py (their weights travel: ~2 MB)
TINY_IDS, TINY_PREFILL, TINY_BOUND = [1 + 7 * i % 200 for i in range(40)], 30, 1e-4
TINY_MODELS = {"moe": "tiny qwen2moe", "hybrid": "tiny qwen3next"}


# -- here: prepare ----------------------------------------------------------------------------------------------
def prepare(args) -> int:
    import sharpi
    from sharpi.cli.bench import prompt_ids
    from sharpi.frontend.fetch import fetch
    from sharpi.testing.reference import NumpyReference

    bundle = Path(args.dir)
    shutil.rmtree(bundle, ignore_errors=True)
    stage = bundle / "stage"
    stage.mkdir(parents=True)
    # the rehearsal on the CPU asks for float32 matmuls, the GPU's arithmetic (the CPU's default int8 ones agree
    # with the float32 reference's top-1 on ~98% of the golden text, under the check's 99%)
    target = {"target": "llvm", "matmuls": "float"} if args.cpu else \
        {"target": "vulkan"} if args.vulkan else {"target": "cuda", "arch": args.arch}
    variants = VULKAN_VARIANTS if args.vulkan else VARIANTS
    for variant in variants:
        print(f"compiling {args.model} for {target} ({variant})", flush=True)
        art = sharpi.compile(args.model, **target, cuda_graph=variant == "graph" and not args.cpu,
                             **_kv_types(variant), output=stage / variant)
        assert (art / "weights.bin").read_bytes() == (stage / "plain" / "weights.bin").read_bytes()
    speed_models = [m for m in args.speed_models.split(",") if m]
    for name in speed_models:
        for build in SPEED_BUILDS:
            print(f"compiling {name} for {target} ({build}; speed only)", flush=True)
            sharpi.compile(name, **target, cuda_graph=build == "graph" and not args.cpu,
                           output=stage / _speed_dir(name, build))
    golden = json.loads(GOLDEN.read_text())
    # the exact path (float32 matmuls and KV): the CPU's default int8 matmuls would be a reference of other arithmetic
    cpu = sharpi.load(sharpi.compile(args.model, target="llvm", matmuls="float", output=stage / "cpu"))
    prompt = prompt_ids(cpu, SNAPKV_PROMPT)
    numpy_reference = NumpyReference(fetch(args.model, show_progress=False))
    reference = {"model": args.model, "target": target["target"], "variants": variants,
                 "speed_models": speed_models, "arch": "vulkan" if args.vulkan else args.arch,
                 "cpu_backend": cpu.backend, **_references(cpu, numpy_reference, golden, prompt),
                 "speed_prompt_ids": prompt_ids(cpu, SPEED_PROMPT), "rounded": {}}
    for variant in (v for v in ROUNDED_REFERENCES if v in variants):
        print(f"references with a {'/'.join(VARIANT_KV[variant])} cache", flush=True)
        rounded = sharpi.load(sharpi.compile(args.model, target="llvm", matmuls="float", **_kv_types(variant),
                                             output=stage / f"cpu-{variant}"))
        numpy_reference.kv_types = rounded.manifest.kv_types
        reference["rounded"][variant] = _references(rounded, numpy_reference, golden, prompt)
        shutil.rmtree(stage / f"cpu-{variant}")
    for name in TINY_MODELS:
        reference[name] = _tiny_reference(stage, target, name)
    (stage / "reference.json").write_text(json.dumps(reference))
    shutil.rmtree(stage / "cpu")
    _pack(bundle, stage, args)
    shutil.rmtree(stage)
    return 0


def _tiny_reference(stage: Path, target: dict, name: str) -> dict:
    """A tiny model of TINY_MODELS (Q8_0) compiled for the target with a float32 KV cache into stage/<name>, and the
    numpy reference's logits over TINY_IDS: a qwen2moe (routed experts and a shared one) or a qwen3next (DeltaNet
    layers with 4 v-heads over 2 k-heads, an attention layer, experts)."""
    import sharpi
    from sharpi.testing.reference import NumpyReference
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_gguf import write_tiny_hybrid, write_tiny_moe
    print(f"compiling a {TINY_MODELS[name]} and its reference logits", flush=True)
    if name == "moe":
        path = write_tiny_moe(stage / "moe.gguf", "qwen2moe", heads=2, kv_heads=1, seed=3, router_scale=4.0,
                              matrix_type="Q8_0", shared_ffn=64)
    else:
        path = write_tiny_hybrid(stage / "hybrid.gguf", "qwen3next", router_scale=4.0, matrix_type="Q8_0",
                                 shared_ffn=64, ssm_state=32)
    sharpi.compile(str(path), **target, kv_dtype="float32", output=stage / name)
    logits = NumpyReference(path).forward(TINY_IDS)
    path.unlink()
    return {"ids": TINY_IDS, "logits": logits.tolist()}


def _speed_dir(model: str, build: str) -> str:
    return f"speed-{model}-{build}"


def _variants(reference: dict) -> tuple[str, ...]:
    """The variants a bundle holds (bundles from before `--vulkan` named none: the CUDA five)."""
    return tuple(reference.get("variants", VARIANTS))


def _speed_dirs(reference: dict) -> list[str]:
    return [_speed_dir(m, b) for m in reference["speed_models"] for b in SPEED_BUILDS]


def _kv_types(variant: str) -> dict:
    """sharpi.compile's KV type arguments for a variant (none: the target's default)."""
    if variant not in VARIANT_KV:
        return {}
    k, v = VARIANT_KV[variant]
    return {"kv_dtype_k": k, "kv_dtype_v": v}


def _references(cpu, numpy_reference, golden, prompt) -> dict:
    """The figures a variant is checked against: the numpy forward's top-1 over the golden text (and its margins),
    the CPU artifact's greedy tokens, SnapKV keep sets and the query-agnostic scorers' keep sets."""
    import numpy as np
    print("reference: float32 numpy forward over the golden text", flush=True)
    ids = golden["teacher_forced"]["ids"]
    logits = numpy_reference.forward(ids)
    reference = {"teacher_forced": {"ids": ids, "top1": logits.argmax(-1).tolist(), "margin": _margins(logits)}}
    print("reference: CPU greedy generation", flush=True)
    reference["greedy"] = []
    for g in golden["greedy"]:
        gen = cpu.generate(g["prompt_ids"], max_tokens=GREEDY_TOKENS)
        scored = cpu.score(g["prompt_ids"] + gen.token_ids)[len(g["prompt_ids"]) - 1:]
        reference["greedy"].append({"prompt_ids": g["prompt_ids"], "tokens": gen.token_ids,
                                    "margin": _margins(scored[:len(gen.token_ids)])})
    print("reference: CPU SnapKV keep sets", flush=True)
    with cpu.session(snapkv_budget=SNAPKV_BUDGET) as s:
        last = s.prefill(prompt)
        kept = [p.tolist() for p in s.kept_positions]
        tokens, margins = [], []
        for _ in range(SNAPKV_STEPS):
            tokens.append(int(np.argmax(last)))
            margins.extend(_margins(last[None]))
            last = s.decode(tokens[-1])
    reference["snapkv"] = {"prompt_ids": prompt, "budget": SNAPKV_BUDGET, "kept": kept, "tokens": tokens,
                           "margin": margins}
    print("reference: CPU keep sets of the query-agnostic scorers and the pyramid allocation", flush=True)
    reference["scorers"] = {name: _compressed_keep_sets(cpu, prompt, name, allocation)
                            for name, allocation in SCORER_CHECKS}
    return reference


def _margins(logits) -> list[float]:
    import numpy as np
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()


def _runtime_tree(stage: Path, python_version: str, vulkan: bool = False) -> Path:
    """TVM's Python package without its compiler library, plus apache-tvm-ffi and ml_dtypes (TVM's own
    dependencies: ml_dtypes gives numpy the bfloat16 a bf16 KV pool is read back as) built for the GPU machine's
    Python (downloaded as wheels: the ones installed here are built for this Python)."""
    import ml_dtypes
    import tvm
    import tvm_ffi

    site = stage / "site"
    ignore = shutil.ignore_patterns("libtvm_compiler.so", "3rdparty", "__pycache__", "include", "*.pyc")
    shutil.copytree(Path(tvm.__file__).parent, site / "tvm", ignore=ignore)
    wheels = stage / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", str(wheels),
                    f"apache-tvm-ffi=={tvm_ffi.__version__}", f"ml_dtypes=={ml_dtypes.__version__}",
                    *(_pinned(name) for name in (WGPU_WHEELS if vulkan else ()))], check=True)
    import zipfile
    for wheel in wheels.glob("*.whl"):
        zipfile.ZipFile(wheel).extractall(site)
    shutil.rmtree(wheels)
    for sub in ("include", "src", "3rdparty", "cython"):      # sources and headers: not needed to run
        shutil.rmtree(site / "tvm_ffi" / sub, ignore_errors=True)
    return site


def _pinned(name: str) -> str:
    """`name==the version installed here` (the wheels that run here with sharpi's Vulkan tests), or the name."""
    import importlib.metadata
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def _pack(bundle: Path, stage: Path, args) -> None:
    site = _runtime_tree(stage, args.python, vulkan=args.vulkan)
    first = bundle / "p1"
    first.mkdir()
    with tarfile.open(first / "runtime.tar.gz", "w:gz") as tar:
        tar.add(site, arcname="site")
    _pack_meta(first, stage)
    shutil.copy(stage / "reference.json", first / "reference.json")
    parts = _pack_weights(bundle, stage / "plain" / "weights.bin", args.part_mib << 20)
    print(f"\n{bundle}: {parts} parts ({', '.join(_size(bundle / f'p{i + 1}') for i in range(parts))})."
          f" Device calls, back to back (the machine goes back after 30 s idle):")
    for i in range(parts):
        verb = "run --out $OUT" if i == parts - 1 else "receive"
        print(f"  {i + 1}. carry [\"{bundle}/p{i + 1}\"]  command: python3 benchmarks/gpu_check.py {verb} "
              f"--dir {bundle}")


def _pack_meta(first: Path, stage: Path) -> None:
    """Every artifact's files but its weights (the kernels: model.so, or a vulkan artifact's plan and shaders; the
    manifest and tokenizer) in one xz tar, each distinct file once (the variants of one model share a tokenizer;
    Gemma's is 33 MB): copies.json names where the others are copied from."""
    reference = json.loads((stage / "reference.json").read_text())
    seen, copies = {}, {}
    with tarfile.open(first / "meta.tar.xz", "w:xz") as tar:
        tiny = tuple(name for name in TINY_MODELS if name in reference)   # the tiny models' weights travel here
        for variant in _variants(reference) + tuple(_speed_dirs(reference)) + tiny:
            for path in sorted(p for p in (stage / variant).iterdir() if p.name != "weights.bin" or variant in tiny):
                arcname = f"{variant}/{path.name}"
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                if digest in seen:
                    copies[arcname] = seen[digest]
                    continue
                seen[digest] = arcname
                tar.add(path, arcname=arcname)
    (first / "copies.json").write_text(json.dumps(copies))


def _pack_weights(bundle: Path, weights_path: Path, limit: int) -> int:
    """The checked model's weights, xz-compressed (quantized blocks still shrink by about a quarter: their f16
    scales and the q8_0 embedding), split to fill the first part and then whole parts; returns the part count."""
    import lzma

    weights = weights_path.read_bytes()
    packed = lzma.compress(weights, preset=6)
    room = limit - sum(f.stat().st_size for f in (bundle / "p1").iterdir())
    chunks, offset = [], 0
    while offset < len(packed):
        size = room if not chunks else limit
        chunks.append(packed[offset:offset + size])
        offset += size
    for i, chunk in enumerate(chunks):
        part = bundle / f"p{i + 1}"
        part.mkdir(exist_ok=True)
        (part / f"weights.{i:03d}").write_bytes(chunk)
    index = {"parts": len(chunks), "weights_bytes": len(weights), "compression": "xz",
             "weights_sha256": hashlib.sha256(weights).hexdigest()}
    (bundle / "p1" / "index.json").write_text(json.dumps(index))
    return len(chunks)


def _size(path: Path) -> str:
    return f"{sum(f.stat().st_size for f in path.iterdir()) / 2**20:.1f} MiB"


# -- there: receive and run -------------------------------------------------------------------------------------
def receive(args) -> int:
    bundle = Path(args.dir)
    index = json.loads((bundle / "p1" / "index.json").read_text()) if (bundle / "p1" / "index.json").is_file() \
        else None
    present = sorted(p.name for p in bundle.glob("p*") if p.is_dir())
    print(f"parts present: {present} of {index['parts'] if index else '?'}")
    print(f"python {sys.version.split()[0]}; disk free {shutil.disk_usage('/tmp').free / 2**30:.0f} GiB")
    for module in ("numpy", "tokenizers", "jinja2", "tqdm", "ml_dtypes"):
        try:
            print(f"  {module} {__import__(module).__version__}")
        except Exception as exc:       # noqa: BLE001 - a report, not a failure
            print(f"  {module}: MISSING ({exc})")
    if (bundle / "p1").is_dir():
        _setup_runtime(bundle)
        import tvm
        print(f"tvm runtime only: {tvm.base._RUNTIME_ONLY}; libraries {sorted(tvm.base._LOADED_LIBS)}")
        from sharpi.common.tvm_cuda import load_tvm_cuda_runtime
        try:
            load_tvm_cuda_runtime()
        except OSError as exc:
            print(f"TVM's CUDA runtime library: NOT LOADED ({exc})")
        dev = tvm.cuda(0)
        print(f"cuda device: exist={dev.exist} name={dev.device_name if dev.exist else None} "
              f"compute={dev.compute_version if dev.exist else None}")
        if json.loads((bundle / "p1" / "reference.json").read_text()).get("target") == "vulkan":
            from sharpi.runtime.wgpu_device import list_adapters
            print("vulkan adapters:", [(a["name"], a["type"]) for a in list_adapters()])
    return 0


def _setup_runtime(bundle: Path) -> None:
    """Unpack the runtime, point Python at it and at the repo's sharpi, and preload CUDA's runtime library."""
    site, runtime = WORK / "site", bundle / "p1" / "runtime.tar.gz"
    stamp, made = WORK / "site.stamp", f"{runtime.stat().st_size}:{runtime.stat().st_mtime_ns}"
    if not site.is_dir() or not stamp.is_file() or stamp.read_text() != made:   # another bundle's: unpack again
        shutil.rmtree(site, ignore_errors=True)
        WORK.mkdir(parents=True, exist_ok=True)
        with tarfile.open(runtime) as tar:
            tar.extractall(WORK)
        stamp.write_text(made)
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    sys.path[:0] = [str(site), str(ROOT)]
    _preload_cudart()


def _preload_cudart() -> str | None:
    """libtvm_runtime_cuda needs libcudart.so.13, which may live only inside a pip package (PyTorch's) here."""
    import ctypes
    import glob
    candidates = ["libcudart.so.13"] + sorted(
        glob.glob("/usr/local/cuda*/lib*/libcudart.so.13*") + glob.glob("/usr/local/cuda*/targets/*/lib/libcudart.so.13*")
        + glob.glob(f"{sys.prefix}/lib/python3*/site-packages/nvidia/*/lib/libcudart.so.13*")
        + glob.glob("/opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib/libcudart.so.13*"))
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


def _unpack_meta(bundle: Path) -> dict:
    """The artifacts' kernels, manifests and tokenizers from the first part; the reference figures."""
    with tarfile.open(bundle / "p1" / "meta.tar.xz") as tar:
        tar.extractall(WORK)
    for copy, original in json.loads((bundle / "p1" / "copies.json").read_text()).items():
        (WORK / copy).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(WORK / original, WORK / copy)
    return json.loads((bundle / "p1" / "reference.json").read_text())


def _assemble(bundle: Path) -> dict:
    index = json.loads((bundle / "p1" / "index.json").read_text())
    missing = [f"p{i + 1}" for i in range(index["parts"]) if not (bundle / f"p{i + 1}").is_dir()]
    if missing:
        raise SystemExit(f"parts missing on this machine: {missing} (the machine was given back between calls?)")
    reference = _unpack_meta(bundle)
    import lzma

    weights, stream = WORK / "plain" / "weights.bin", lzma.LZMADecompressor()
    digest = hashlib.sha256()
    with open(weights, "wb") as out:
        for i in range(index["parts"]):
            data = stream.decompress((bundle / f"p{i + 1}" / f"weights.{i:03d}").read_bytes())
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != index["weights_sha256"]:
        raise SystemExit("the weights assembled from the parts are not the ones packed (a part changed in transit?)")
    for variant in _variants(reference)[1:]:
        shutil.copy(weights, WORK / variant / "weights.bin")
    return reference


def _random_weights(directory: Path) -> None:
    """weights.bin for the artifact's parameter table: random quant bits, small random floats (norms, scales).
    The logits mean nothing; the kernels and their memory traffic are the real model's."""
    import numpy as np
    params = json.loads((directory / "manifest.json").read_text())["params"]
    rng = np.random.default_rng(0)
    size = max(p["offset"] + p["nbytes"] for p in params)
    data = np.zeros(size, np.uint8)
    for p in params:
        dtype = np.dtype(p["dtype"])
        view = data[p["offset"]:p["offset"] + p["nbytes"]].view(dtype)
        if dtype.kind == "f":
            view[:] = rng.normal(0, 0.02, view.size).astype(dtype)
        else:
            view[:] = rng.integers(0, 256, p["nbytes"], dtype=np.uint8).view(dtype)
    data.tofile(directory / "weights.bin")


def run(args) -> int:
    deadline = time.monotonic() + args.seconds
    bundle = Path(args.dir)
    _setup_runtime(bundle)
    reference = _assemble(bundle)
    import numpy as np
    import sharpi

    import gpu_speed

    results = {"python": sys.version.split()[0], "model": reference["model"], "arch": reference["arch"],
               "cpu_reference": reference["cpu_backend"], "machine": gpu_speed.machine(), "variants": {}}
    save = _saver(args, "gpu_check.json", results)

    for variant in _variants(reference):
        row = results["variants"][variant] = {}
        # a variant whose cache rounds is held to figures computed with the same rounding
        rounded = reference.get("rounded", {}).get(variant)
        checked_against = {**reference, **(rounded or {}), "bars": ROUNDED_BARS[variant] if rounded else BARS}
        for name, check in (("load", None), ("teacher_forced", _teacher_forced), ("greedy", _greedy),
                            ("snapkv", _snapkv), ("scorers", _scorers), ("speed", _speed)):
            t = time.perf_counter()
            try:
                if check is None:
                    model = sharpi.load(WORK / variant)
                    row["load"] = {"backend": model.backend}
                else:
                    row[name] = check(model, checked_against, np)
            except Exception as exc:        # noqa: BLE001 - record it and go on: one call must report everything
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                if check is None:
                    break
            row[name]["seconds"] = round(time.perf_counter() - t, 2)
            print(f"{variant:5} {name:14} {json.dumps(row[name])[:300]}", flush=True)
        model = None
        save()
    tiny = [name for name in TINY_MODELS if name in reference]
    for name in tiny:
        _section(results, name, lambda name=name: _tiny_check(name, reference[name], np), save)
    results["passed"] = all(_passed(row) for row in results["variants"].values()) and \
        all(results.get(name, {}).get("passed", False) for name in tiny)
    save()
    _print_table(results)
    if reference.get("target") == "vulkan":         # the speed suite below measures TVM's CUDA runtime
        return 0 if results["passed"] else 1
    sizes = gpu_speed.QUICK if args.quick else gpu_speed.Sizes()
    results["speed"] = {}
    _measure_speed(results["speed"], WORK / "plain", WORK / "graph", deadline, save, sizes, sizes.profiles_checked)
    _section(results["speed"], "decode_batch", lambda: gpu_speed.batch_decode(WORK / "plain", deadline, sizes), save)
    if not args.skip_speed_models:
        _measure_speed_models(results, reference, deadline, save, sizes)
    _section(results, "torch_roofline", lambda: gpu_speed.torch_roofline(min(60.0, deadline - time.monotonic())),
             save)
    print(json.dumps({k: results[k] for k in ("machine", "torch_roofline")}, indent=1))
    return 0 if results["passed"] else 1


def speed(args) -> int:
    """The speed models alone (random weights): what the first device call measures while the rest travels."""
    deadline = time.monotonic() + args.seconds
    bundle = Path(args.dir)
    _setup_runtime(bundle)
    reference = _unpack_meta(bundle)
    import gpu_speed

    results = {"python": sys.version.split()[0], "machine": gpu_speed.machine()}
    print(json.dumps(results["machine"]), flush=True)
    save = _saver(args, "gpu_speed.json", results)

    _measure_speed_models(results, reference, deadline, save, gpu_speed.QUICK if args.quick else gpu_speed.Sizes())
    return 0


def profile(args) -> int:
    """Where a speed model's decode step goes with and without its CUDA graph (the first part alone): the VM calls
    a step makes, timed with the device synchronised around each (gpu_speed.kernel_profile)."""
    bundle = Path(args.dir)
    _setup_runtime(bundle)
    reference = _unpack_meta(bundle)
    import sharpi

    import gpu_speed

    plain, graph = (WORK / _speed_dir(args.model or reference["speed_models"][-1], b) for b in SPEED_BUILDS)
    _random_weights(plain)
    shutil.copy(plain / "weights.bin", graph / "weights.bin")
    results = {"model": plain.name}
    save = _saver(args, "gpu_profile.json", results)
    for build, directory in (("plain", plain), ("graph", graph)):
        model = sharpi.load(directory, verify=False)
        with model.session(snapkv_budget=0) as s:      # the graph is captured at the first decode
            s.decode(int(s.prefill([1, 2, 3]).argmax()))
        _section(results, build, lambda: gpu_speed.kernel_profile(model, 512, "decode", synchronise=False), save)
    return 0


def _saver(args, name: str, results: dict):
    """A function writing `results` to --out/name (made if missing), for the call to run after every section."""
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    return lambda: (out / name).write_text(json.dumps(results, indent=1))


def _measure_speed_models(results: dict, reference: dict, deadline: float, save, sizes) -> None:
    rows = results["speed_models"] = {"weights": "random, the real shapes"}
    for name in reference["speed_models"]:
        plain, graph = (WORK / _speed_dir(name, build) for build in SPEED_BUILDS)
        if not (plain / "weights.bin").is_file():
            _random_weights(plain)
        shutil.copy(plain / "weights.bin", graph / "weights.bin")      # the same parameter table
        rows[name] = {}
        _measure_speed(rows[name], plain, graph, deadline, save, sizes, sizes.profiles_speed, verify=False)


def _measure_speed(rows: dict, plain: Path, graph: Path, deadline: float, save, sizes, profiles, **load) -> None:
    """gpu_speed's suite for a model's plain and CUDA-graph artifacts, and the plain one's kernel profiles."""
    import sharpi

    import gpu_speed

    weight_bytes = (plain / "weights.bin").stat().st_size
    for build, directory in (("plain", plain), ("graph", graph)):
        model = None

        def measure(directory=directory):
            nonlocal model
            model = sharpi.load(directory, **load)
            return gpu_speed.suite(model, weight_bytes, deadline, sizes)
        _section(rows, build, measure, save)
        if build == "plain" and model is not None:
            _section(rows, "profile", lambda: [gpu_speed.kernel_profile(model, n, f) for n, f in profiles
                                               if time.monotonic() < deadline], save)
        model = None


def _section(rows: dict, key: str, measure, save) -> None:
    """rows[key] = measure(), or the error it raised; printed and saved either way (a cut call keeps it)."""
    t = time.perf_counter()
    try:
        rows[key] = measure()
    except Exception as exc:                # noqa: BLE001 - the sections after it still run
        rows[key] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"{key} ({time.perf_counter() - t:.1f} s): {json.dumps(rows[key])[:1500]}", flush=True)
    save()


def _tiny_check(name: str, tiny: dict, np) -> dict:
    """A tiny model's teacher-forced logits, and prefill then decode through the cache, against the reference's:
    the largest difference over the logits' scale, within TINY_BOUND."""
    import sharpi
    model = sharpi.load(WORK / name)
    ids, want = tiny["ids"], np.array(tiny["logits"], np.float32)
    scale = float(np.abs(want).max())
    scored = float(np.abs(model.score(ids) - want).max()) / scale
    with model.session() as s:
        rows = [s.prefill(ids[:TINY_PREFILL])] + [s.decode(t) for t in ids[TINY_PREFILL:-1]]
    cached = float(np.abs(np.stack(rows) - want[TINY_PREFILL - 1:-1]).max()) / scale
    return {"teacher_forced_error": scored, "cached_error": cached, "bound": TINY_BOUND,
            "passed": max(scored, cached) < TINY_BOUND}


def _teacher_forced(model, reference, np) -> dict:
    tf = reference["teacher_forced"]
    got = model.score(tf["ids"]).argmax(-1)
    ref, margin = np.array(tf["top1"]), np.array(tf["margin"])
    clear = margin >= NEAR_TIE
    return {"tokens": len(tf["ids"]), "top1_agreement": float((got == ref).mean()),
            "top1_agreement_clear_margin": float((got[clear] == ref[clear]).mean()),
            "bar": reference["bars"]["top1"], "passed": bool((got == ref).mean() >= reference["bars"]["top1"])}


def _agrees(got: list[int], ref: list[int], margins: list[float]) -> tuple[bool, int]:
    """Equal up to the first step where the reference's top-2 margin is a near tie (the Vulkan issue's rule)."""
    for step, (g, r, m) in enumerate(zip(got, ref, margins)):
        if m < NEAR_TIE:
            return True, step
        if g != r:
            return False, step
    return len(got) >= len(ref), min(len(got), len(ref))


def _greedy(model, reference, np) -> dict:
    rows = []
    first = reference["bars"].get("greedy_tokens", GREEDY_TOKENS)
    for g in reference["greedy"]:
        gen = model.generate(g["prompt_ids"], max_tokens=GREEDY_TOKENS)
        agrees, compared = _agrees(gen.token_ids[:first], g["tokens"][:first], g["margin"][:first])
        rows.append({"equal": gen.token_ids == g["tokens"], "agrees": agrees, "compared": compared})
    return {"prompts": rows, "passed": all(r["agrees"] for r in rows)}


def _snapkv(model, reference, np) -> dict:
    snap = reference["snapkv"]
    with model.session(snapkv_budget=snap["budget"]) as s:
        last = s.prefill(snap["prompt_ids"])
        kv_length, logical_length = s.kv_length[0], s.logical_length
        same = total = 0
        for mine, theirs in zip(s.kept_positions, snap["kept"]):
            for x, y in zip(mine, theirs):
                same += np.intersect1d(x, y).size
                total += len(y)
        got = []
        for token in snap["tokens"]:
            got.append(int(np.argmax(last)))
            last = s.decode(token)
        agrees, compared = _agrees(got, snap["tokens"], snap["margin"])
        overlap = same / max(total, 1)
        return {"kv_length": kv_length, "logical_length": logical_length, "overlap": overlap,
                "decode_agrees": agrees, "steps_compared": compared,
                "bar": reference["bars"]["overlap"],
                "passed": bool(overlap >= reference["bars"]["overlap"] and agrees and kv_length == snap["budget"])}


def _compressed_keep_sets(model, prompt: list[int], scorer: str, allocation: str) -> list[list]:
    """Each layer's kept positions after `prompt` is ranked by `scorer` and compressed to SNAPKV_BUDGET slots
    with `allocation` (the question-after-the-compression path: scored, then evicted on a fork)."""
    with model.session(snapkv_budget=0, compress=scorer) as s:
        s.prefill(prompt, keep_scores=True)
        with s.fork() as f:
            f.evict(SNAPKV_BUDGET, allocation=allocation)
            return [p.tolist() for p in f.kept_positions]


def keep_set_overlap(got: list, want: list) -> float:
    """The share of `want`'s kept positions (per layer, per KV head) that `got` keeps too."""
    import numpy as np
    same = sum(np.intersect1d(x, y).size for a, b in zip(got, want) for x, y in zip(a, b))
    return same / max(sum(len(y) for b in want for y in b), 1)


def _scorers(model, reference, np) -> dict:
    """kvzip, probe and keydiff (and SnapKV with pyramid allocation): keep sets against the CPU's."""
    rows = {}
    for (name, allocation), want in zip(SCORER_CHECKS, reference["scorers"].values()):
        got = _compressed_keep_sets(model, reference["snapkv"]["prompt_ids"], name, allocation)
        lengths_equal = [len(a[0]) for a in got] == [len(b[0]) for b in want]
        rows[f"{name}/{allocation}"] = {"overlap": keep_set_overlap(got, want), "lengths_equal": lengths_equal}
    bar = reference["bars"]["scorers"]      # keep sets of ranks that near-tie differ a little (bf16 keys, rounding)
    return {**rows, "bar": bar, "passed": all(r["overlap"] >= bar and r["lengths_equal"] for r in rows.values())}


def _speed(model, reference, np) -> dict:
    """Median over repeats: prefill of the 512-token prompt, then greedy decode of 256 tokens (each step: one VM
    call, the logits read back, argmax on the host)."""
    ids = reference["speed_prompt_ids"]
    prefill, decode = [], []
    for _ in range(SPEED_REPEATS + 1):                   # the first round warms up (and captures the graph)
        with model.session(snapkv_budget=0) as s:
            t0 = time.perf_counter()
            last = s.prefill(ids)
            t1 = time.perf_counter()
            for _ in range(SPEED_TOKENS):
                last = s.decode(int(np.argmax(last)))
            t2 = time.perf_counter()
        prefill.append(len(ids) / (t1 - t0))
        decode.append(SPEED_TOKENS / (t2 - t1))
    return {"prompt_tokens": len(ids), "prefill_tok_s": float(np.median(prefill[1:])),
            "decode_tokens": SPEED_TOKENS, "decode_tok_s": float(np.median(decode[1:])),
            "decode_target_tok_s": 1000, "passed": True}


def _passed(row: dict) -> bool:
    return all(isinstance(v, dict) and "error" not in v and v.get("passed", True) for v in row.values()) and \
        "teacher_forced" in row


def _print_table(results: dict) -> None:
    print(f"\nGPU check of {results['model']} ({results['arch']}); reference {results['cpu_reference']}")
    for variant, row in results["variants"].items():
        print(f"-- {variant}: {row.get('load', {}).get('backend', row.get('load'))}")
        for name in ("teacher_forced", "greedy", "snapkv", "scorers", "speed"):
            v = row.get(name)
            if v is None:
                print(f"   {name:15} NOT RUN")
                continue
            status = "ERROR" if "error" in v else ("PASS" if v.get("passed") else "FAIL")
            detail = {"teacher_forced": lambda: f"top-1 {v['top1_agreement']:.4f} over {v['tokens']} tokens",
                      "greedy": lambda: f"{sum(r['agrees'] for r in v['prompts'])}/{len(v['prompts'])} prompts",
                      "snapkv": lambda: f"overlap {v['overlap']:.4f}, decode agrees {v['decode_agrees']}",
                      "scorers": lambda: "overlaps " + ", ".join(f"{k} {r['overlap']:.3f}" for k, r in v.items()
                                                                 if isinstance(r, dict)) + f" (bar {v['bar']})",
                      "speed": lambda: f"prefill {v['prefill_tok_s']:.0f} tok/s, decode {v['decode_tok_s']:.0f} "
                                       f"tok/s (target 1000)"}[name]
            print(f"   {name:15} {status:5} {v.get('error') or detail()}")
    for name, label in TINY_MODELS.items():
        if name not in results:
            continue
        v = results[name]
        status = "ERROR" if "error" in v else ("PASS" if v["passed"] else "FAIL")
        detail = v.get("error") or (f"teacher-forced {v['teacher_forced_error']:.1e}, through the cache "
                                    f"{v['cached_error']:.1e} (bound {v['bound']:.0e})")
        print(f"-- {name} ({label}): {status} {detail}")
    print("ALL PASSED" if results["passed"] else "SOME CHECKS FAILED")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    pp = sub.add_parser("prepare", help="here: compile, compute references, pack the parts")
    pp.add_argument("--model", default="smollm2-135m")
    pp.add_argument("--speed-models", default="gemma3-270m,qwen2.5-coder-0.5b",
                    help="measured for speed only, with random weights (comma-separated)")
    pp.add_argument("--arch", default="sm_90", help="the GPU's architecture (H100/H200: sm_90)")
    pp.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    where = pp.add_mutually_exclusive_group()
    where.add_argument("--cpu", action="store_true",
                       help="compile for llvm instead, to try this script here (everything but CUDA) before a "
                            "device call")
    where.add_argument("--vulkan", action="store_true",
                       help="compile for vulkan instead (WGSL through wgpu on the machine's Vulkan driver): the checks "
                            "without the CUDA speed suite, for the variants WGSL has (no bf16, no graph)")
    pp.add_argument("--part-mib", type=int, default=50,
                    help="largest part (a device call carries at most 64 MiB, the working tree included)")
    for name in ("receive", "speed", "run", "profile"):
        sp = sub.add_parser(name)
        if name == "profile":
            sp.add_argument("--model", default=None, help="a speed model (default: the last)")
        if name != "receive":
            sp.add_argument("--out", default=None)
            sp.add_argument("--seconds", type=float, default=300 if name == "run" else 150,
                            help="the speed sections start no cell after this many seconds")
            sp.add_argument("--quick", action="store_true", help="small sizes: the CPU rehearsal's")
        if name == "run":
            sp.add_argument("--skip-speed-models", action="store_true", help="`speed` measured them already")
    for sp in sub.choices.values():
        sp.add_argument("--dir", default=".gpu")
    args = p.parse_args(argv)
    return {"prepare": prepare, "receive": receive, "speed": speed, "run": run, "profile": profile}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
