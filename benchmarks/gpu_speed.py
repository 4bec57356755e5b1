"""The speed half of the CUDA backend issue's device check (gpu_check.py runs it on the GPU machine): batch-1
prefill and decode at several prompt lengths with and without SnapKV, where a decode step's time goes per kernel,
the serving engine's decode_batch at several batch sizes, the bandwidth floor beside each decode figure, and a
roofline from PyTorch on the same GPU (the machine has PyTorch; llama.cpp's CUDA build does not fit the lease).

Nothing here checks numbers: gpu_check.py does. Every section respects a deadline (the lease is short), and the
caller writes what came back after each section, so a call cut short still returns what it measured.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BANDWIDTH = 4.8e12              # H200's HBM3e by NVIDIA's datasheet, bytes/s: the decode floor's denominator
PROFILE_TOP = 15


@dataclass(frozen=True)
class Sizes:
    # (prompt tokens, SnapKV budget; 0 keeps the whole prompt): the 512 and 4096, and SnapKV 1024 after 4096
    suite: tuple = ((512, 0), (4096, 0), (4096, 1024))
    decode_tokens: int = 128
    repeats: int = 3            # timed rounds after one warm-up round (compile caches, CUDA graph capture)
    batch_sizes: tuple = (1, 8, 32, 128)
    batch_prompt: int = 128
    batch_steps: int = 32
    profiles_checked: tuple = ((512, "decode"), (4096, "decode"), (512, "prefill"))
    profiles_speed: tuple = ((512, "decode"),)


# the CPU rehearsal's: every code path, in minutes on two cores
QUICK = Sizes(suite=((64, 0), (256, 0), (256, 128)), decode_tokens=8, repeats=1, batch_sizes=(1, 4),
              batch_prompt=32, batch_steps=4, profiles_checked=((64, "decode"), (64, "prefill")),
              profiles_speed=((64, "decode"),))


def suite(model, weight_bytes: int, deadline: float, sizes: Sizes) -> list[dict]:
    """Prefill and greedy decode of sizes.decode_tokens after each suite prompt: tok/s (median of the repeats),
    the KV cache's bytes, the decode floor (weights and cache read once a token at BANDWIDTH), the GPU's memory."""
    from sharpi.cli.bench import bench_sharpi, prompt_ids

    rows = []
    for tokens, budget in sizes.suite:
        row = {"prompt_tokens": tokens, "snapkv_budget": budget}
        rows.append(row)
        if time.monotonic() > deadline:
            row["skipped"] = "out of time"
            continue
        ids, knobs = prompt_ids(model, tokens), {"snapkv_budget": budget}
        try:
            bench_sharpi(model, ids, sizes.decode_tokens, 1, knobs)
            row.update(bench_sharpi(model, ids, sizes.decode_tokens, sizes.repeats, knobs))
        except Exception as exc:            # noqa: BLE001 - one failing cell must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            continue
        floor = BANDWIDTH / (weight_bytes + row["kv_bytes"])
        row.update(decode_tokens=sizes.decode_tokens, decode_floor_tok_s=floor,
                   floor_fraction=row["decode_tok_s"] / floor, gpu_memory_used_mib=gpu_memory_used_mib())
    return rows


def kernel_profile(model, tokens: int, function: str, synchronise: bool = True) -> dict:
    """One `function` call after `tokens` prompt tokens, every VM call timed with the device synchronised
    around it (benchmarks/profile_kernels.py): the kernels' total, the builtins', and the heaviest kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_kernels import profile

    # a CUDA graph's capture refuses a device synchronisation: a graph artifact is timed without
    totals, wall = profile(model, tokens, function, sync=model.engine.backend.device.sync if synchronise else None)
    kernels = {n: v for n, v in totals.items() if not n.startswith(("vm.", "runtime."))}
    builtins = {n: v for n, v in totals.items() if n not in kernels}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:PROFILE_TOP]
    return {"function": function, "tokens": tokens, "wall_ms_instrumented": wall * 1e3,
            "kernel_ms": sum(t for t, _ in kernels.values()) * 1e3,
            "kernel_calls": sum(n for _, n in kernels.values()),
            "builtin_ms": sum(t for t, _ in builtins.values()) * 1e3,
            "builtin_calls": sum(n for _, n in builtins.values()),
            "top": [[name, round(t * 1e3, 4), n] for name, (t, n) in top],
            "top_builtins": [[name, round(t * 1e3, 4), n]
                             for name, (t, n) in sorted(builtins.items(), key=lambda kv: -kv[1][1])[:8]]}


def batch_decode(directory: Path, deadline: float, sizes: Sizes, **load_options) -> list[dict]:
    """decode_batch's aggregate tok/s at each batch size B: B sessions each prefilled with a batch_prompt-token
    prompt, two warm-up steps, then batch_steps timed steps of one decode_batch call each (logits read back,
    argmax on the host)."""
    import numpy as np

    import sharpi
    from sharpi.cli.bench import prompt_ids
    from sharpi.runtime.session import decode_batch

    room = sizes.batch_prompt + sizes.batch_steps + 64
    model = sharpi.load(directory, pool_tokens=max(sizes.batch_sizes) * room, **load_options)
    ids = prompt_ids(model, sizes.batch_prompt + max(sizes.batch_sizes))
    rows = []
    for size in sizes.batch_sizes:
        if time.monotonic() > deadline:
            rows.append({"batch": size, "skipped": "out of time"})
            continue
        with contextlib.ExitStack() as stack:
            sessions = [stack.enter_context(model.session(snapkv_budget=0)) for _ in range(size)]
            tokens = [int(np.argmax(s.prefill(ids[i:i + sizes.batch_prompt]))) for i, s in enumerate(sessions)]
            for _ in range(2):
                tokens = decode_batch(sessions, tokens).argmax(-1).tolist()
            t = time.perf_counter()
            for _ in range(sizes.batch_steps):
                tokens = decode_batch(sessions, tokens).argmax(-1).tolist()
            seconds = time.perf_counter() - t
        rows.append({"batch": size, "steps": sizes.batch_steps, "step_ms": seconds / sizes.batch_steps * 1e3,
                     "aggregate_tok_s": size * sizes.batch_steps / seconds})
    return rows


def gpu_memory_used_mib() -> int | None:
    return _smi("memory.used")


def _smi(field: str):
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20)
    value = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return int(value) if value and value.isdigit() else value


def machine() -> dict:
    """The GPU, its driver and memory, the CUDA compiler, and whether a Vulkan loader and NVIDIA's Vulkan
    driver are present (the issue's last item needs both)."""
    def run(*cmd) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    loaders = [line.split()[0] for line in (run("ldconfig", "-p") or "").splitlines() if "libvulkan" in line]
    icds = [str(p) for pattern in ("/usr/local/nvidia/share/vulkan/icd.d/*.json", "/usr/share/vulkan/icd.d/*.json",
                                   "/etc/vulkan/icd.d/*.json") for p in Path("/").glob(pattern.lstrip("/"))]
    return {"gpu": _smi("name"), "driver": _smi("driver_version"), "memory_total_mib": _smi("memory.total"),
            "nvcc": (run("nvcc", "--version") or "").splitlines()[-1:] or None,
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "vulkan_loaders": loaders, "vulkan_icds": icds, "vulkaninfo": shutil.which("vulkaninfo")}


# PyTorch on the same GPU, in a process of its own (its CUDA context and allocator stay out of TVM's): the copy
# bandwidth the floors assume, and scaled_dot_product_attention on Qwen2.5-0.5B's attention shapes (14 query heads,
# 2 KV heads, 64 dims; the KV heads repeated, as PyTorch's kernels want) for prefill and one decode step
ROOFLINE = r"""
import json, torch
def timed(fn, reps=20):
    for _ in range(3): fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(reps): fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3
out = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
a = torch.empty(2**30, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
out["copy_read_write_tb_s"] = 2 * a.numel() / timed(lambda: b.copy_(a)) / 1e12
del a, b
f = torch.nn.functional.scaled_dot_product_attention
for n in (512, 4096):
    q = torch.randn(1, 14, n, 64, dtype=torch.float16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    out[f"sdpa_prefill_{n}_ms_per_layer"] = timed(lambda: f(q, k, v, is_causal=True)) * 1e3
    out[f"sdpa_decode_{n}_ms_per_layer"] = timed(lambda: f(q[:, :, -1:], k, v)) * 1e3
x = torch.randn(1, 896, dtype=torch.float16, device="cuda")
w = torch.randn(4864, 896, dtype=torch.float16, device="cuda")
out["matvec_896x4864_f16_us"] = timed(lambda: x @ w.T, 200) * 1e6
out["empty_kernel_launch_us"] = timed(lambda: torch.cuda._sleep(0), 500) * 1e6
print(json.dumps(out))
"""


def torch_roofline(timeout: float) -> dict:
    python = shutil.which("python3") or sys.executable
    try:
        out = subprocess.run([python, "-c", ROOFLINE], capture_output=True, text=True, timeout=max(timeout, 5))
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])
