"""A quantized KV cache on the Vulkan target (the GPU kernels' arithmetic; lavapipe here) against the CPU artifact with
the same cache (--matmuls float) and against the float32 numpy forward that rounds its cache as that type stores
it: teacher-forced over the golden text (max |d log-prob|, top-1 agreement), 32 greedy tokens (the near-tie rule
of sharpi.testing.backends), SnapKV keep sets at a budget of 128 of a 400-token prompt (overlap with the CPU's).
These are the figures benchmarks/gpu_check.py's bars for a rounded cache rest on.

    python benchmarks/kv_quant_vulkan.py --kv q4_ch/q4_0 [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from sharpi.testing.reference import log_softmax

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "smollm2-135m-instruct-q4_1.json"
SNAPKV_PROMPT, SNAPKV_BUDGET, GREEDY_TOKENS = 400, 128, 32


def _compare(name: str, got: np.ndarray, ref: np.ndarray, ids) -> dict:
    """Teacher-forced: max |d log-prob| of the next tokens and top-1 agreement."""
    targets = np.asarray(ids[1:])
    lg, lr = log_softmax(got[:-1]), log_softmax(ref[:-1])
    rows = np.arange(len(targets))
    row = {"against": name, "max_dlogprob": float(np.abs(lg[rows, targets] - lr[rows, targets]).max()),
           "top1": float((got.argmax(-1) == ref.argmax(-1)).mean())}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    import sharpi
    from sharpi.cli.bench import prompt_ids
    from sharpi.frontend.fetch import fetch
    from sharpi.testing.backends import greedy_agrees, snapkv_agreement
    from sharpi.testing.reference import NumpyReference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="q4_ch/q4_0", help="keys/values KV types (one name: both)")
    p.add_argument("--dir", default=None, help="where the artifacts go (default: a temporary folder)")
    args = p.parse_args(argv)
    k, _, v = args.kv.partition("/")
    kinds = {"kv_dtype_k": k, "kv_dtype_v": v or k}
    out = Path(args.dir or tempfile.mkdtemp(prefix="kvq-vulkan-"))
    gguf = fetch(args.model, show_progress=False)
    vk = sharpi.load(sharpi.compile(str(gguf), target="vulkan", output=out / "vulkan", **kinds))
    cpu = sharpi.load(sharpi.compile(str(gguf), target="llvm", matmuls="float", output=out / "cpu", **kinds))
    golden = json.loads(GOLDEN.read_text())
    ids = golden["teacher_forced"]["ids"]
    got = vk.score(ids)
    reference = NumpyReference(gguf)
    reference.kv_types = cpu.manifest.kv_types
    results = {"model": args.model, "kv": list(cpu.manifest.kv_types), "backend": vk.backend,
               "teacher_forced": [_compare("cpu", got, cpu.score(ids), ids),
                                  _compare("numpy, cache rounded", got, reference.forward(ids), ids)]}
    # the CPU generates; Vulkan scores the CPU's sequence in one pass and must pick its token at every step; and
    # Vulkan generates too, through its cache (decode kernels: q4_ch pages re-encoded as they fill)
    results["greedy"] = []
    for g in golden["greedy"]:
        prompt = list(g["prompt_ids"])
        tokens = cpu.generate(prompt, max_tokens=GREEDY_TOKENS).token_ids
        sequence = prompt + tokens
        agrees, steps = greedy_agrees(cpu.score(sequence)[len(prompt) - 1:-1], vk.score(sequence)[len(prompt) - 1:-1],
                                      tokens)
        generated = vk.generate(prompt, max_tokens=GREEDY_TOKENS).token_ids
        same = next((i for i, (a, b) in enumerate(zip(generated, tokens)) if a != b), min(len(generated), len(tokens)))
        results["greedy"].append({"scored_agrees": agrees, "steps": steps, "generated_same_tokens": same,
                                  "of": len(tokens)})
        print(json.dumps(results["greedy"][-1]), flush=True)
    prompt = prompt_ids(cpu, SNAPKV_PROMPT)
    snap = snapkv_agreement(vk, cpu, prompt, SNAPKV_BUDGET)
    results["snapkv"] = {key: snap[key] for key in ("overlap", "decode_agrees", "steps_compared")}
    print(json.dumps(results["snapkv"]), flush=True)
    (out / "kv_quant_vulkan.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'kv_quant_vulkan.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
