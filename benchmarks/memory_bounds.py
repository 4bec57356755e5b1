"""Compile and load memory against the model's size (the CPU issue's bounded-memory targets): for each GGUF, the
peak resident memory of `sharpi-compile` and of a load + SESSIONS sessions each prefilling PROMPT tokens, all held
at once, then GEN decode steps each, each in a fresh process, as the increase over the same command on a tiny model
(Python, TVM and LLVM alone take a few hundred MB); targets: compile <= 1.5x the GGUF's size, load-prefill-decode
<= 1.2x the weights' size; the artifact's weights against the GGUF's size (the MoE issue's: <= 1.05x).

    python benchmarks/memory_bounds.py GGUF_OR_NAME [...] [--prompt 512] [--gen 64] [--sessions 1]
        [--max-context 4096] [--out benchmarks/memory.md]

Peak resident memory is the child's ru_maxrss (os.wait4): mapped file pages a process touched count, as they do
in top's RES. A synthetic 7B-class GGUF comes from benchmarks/synthetic_gguf.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

_RUN = """
import sys, time, numpy as np, sharpi
t0 = time.perf_counter()
model = sharpi.load(sys.argv[1])
t1 = time.perf_counter()
prompt, gen, sessions = (int(a) for a in sys.argv[2:5])
rng = np.random.default_rng(0)
held, tokens = [], []
for i in range(sessions):
    s = model.session(snapkv_budget=0)
    ids = [int(i) for i in rng.integers(0, min(model.config.vocab_size, 30000), prompt)]
    tokens.append(int(np.argmax(s.prefill(ids))))
    held.append(s)
    print(f"session {i + 1} of {sessions}: {prompt} tokens in {time.perf_counter() - t1:.0f} s", file=sys.stderr,
          flush=True)
t2 = time.perf_counter()
for s, token in zip(held, tokens):
    for _ in range(gen):
        token = int(np.argmax(s.decode(token)))
t3 = time.perf_counter()
print(f"{t1 - t0:.2f} {sessions * prompt / (t2 - t1):.2f} {sessions * gen / (t3 - t2):.2f}")
"""


def _measured(command: list[str]) -> tuple[int, float, str]:
    """(peak resident bytes, wall seconds, stdout) of a command run as a child of its own (forked and reaped by
    os.wait4, which returns that child's own usage; subprocess would reap it first)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = _spawn(command, out, err)
        _, status, usage = os.wait4(pid, 0)
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{' '.join(command)} failed:\n{err.read()[-2000:]}")
        return usage.ru_maxrss * 1024, time.perf_counter() - started, out.read()


def _spawn(command: list[str], out, err) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    return pid


def measure(model: str, work: Path, prompt: int, gen: int, max_context: int, sessions: int = 1) -> dict:
    artifact = work / Path(model).stem
    compile_cmd = [sys.executable, "-m", "sharpi.cli.compile", model, "-o", str(artifact), "--no-cache", "--quiet",
                   "--max-context", str(max_context)]
    compile_rss, compile_s, _ = _measured(compile_cmd)
    run_rss, run_s, out = _measured([sys.executable, "-c", _RUN, str(artifact), str(prompt), str(gen),
                                     str(sessions)])
    load_s, prefill_tok_s, decode_tok_s = (float(x) for x in out.split())
    from sharpi.frontend.fetch import resolve_model
    gguf = resolve_model(model)
    return {"model": Path(gguf).name, "gguf_bytes": Path(gguf).stat().st_size,
            "weights_bytes": (artifact / "weights.bin").stat().st_size, "compile_rss": compile_rss,
            "compile_s": compile_s, "run_rss": run_rss, "load_s": load_s, "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s}


def tiny_gguf(work: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_gguf import write_tiny_llama
    return str(write_tiny_llama(work / "tiny.gguf", matrix_type="Q8_0", dim=256, ffn=512, context=32768))


def table(rows: list[dict], base: dict) -> str:
    gb = 1e9
    lines = ["| model | GGUF GB | weights GB | weights / GGUF | compile s | compile peak GB (+ over tiny) | / GGUF | "
             "load s | load+prefill+decode peak GB (+ over tiny) | / weights | prefill tok/s | decode tok/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        dc, dr = r["compile_rss"] - base["compile_rss"], r["run_rss"] - base["run_rss"]
        lines.append(f"| {r['model']} | {r['gguf_bytes'] / gb:.2f} | {r['weights_bytes'] / gb:.2f} | "
                     f"{r['weights_bytes'] / r['gguf_bytes']:.3f}x | {r['compile_s']:.0f} | {r['compile_rss'] / gb:.2f} (+{dc / gb:.2f}) | "
                     f"{dc / r['gguf_bytes']:.2f}x | {r['load_s']:.2f} | {r['run_rss'] / gb:.2f} (+{dr / gb:.2f}) | "
                     f"{dr / r['weights_bytes']:.2f}x | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--sessions", type=int, default=1, help="sessions prefilled and held at once")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sharpi-memory-") as folder:
        work = Path(folder)
        print("tiny model (the baseline)", file=sys.stderr, flush=True)
        base = measure(tiny_gguf(work), work, args.prompt, args.gen, args.max_context, args.sessions)
        rows = []
        for model in args.models:
            print(model, file=sys.stderr, flush=True)
            rows.append(measure(model, work, args.prompt, args.gen, args.max_context, args.sessions))
            (work / Path(model).stem / "weights.bin").unlink()      # disk: a 7B artifact is 5 GB
    text = (f"# Compile and load memory, {time.strftime('%Y-%m-%d %H:%M')}\n\n"
            f"`python benchmarks/memory_bounds.py {' '.join(argv or sys.argv[1:])}`; {args.sessions} session(s) "
            f"held at once, each a prefill of {args.prompt} tokens and {args.gen} decode steps, --max-context {args.max_context}; the tiny model's peaks: compile "
            f"{base['compile_rss'] / 1e9:.2f} GB, run {base['run_rss'] / 1e9:.2f} GB.\n\n{table(rows, base)}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
