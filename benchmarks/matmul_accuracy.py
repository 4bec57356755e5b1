"""How far an artifact's log-probs are from the exact float32 numpy reference, and its perplexity beside
llama.cpp's, on the golden teacher-forced text (tests/data): the numbers behind conformance.INT8_MATMULS.

    python benchmarks/matmul_accuracy.py ARTIFACT GGUF tests/data/smollm2-135m-instruct-q4_1.json [--tokens 100]

Prints max |d log-prob| over the whole vocabulary (the conformance metric), the worst among each position's top 20,
top-1 agreement, and the text's perplexity (artifact, reference, llama.cpp).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import sharpi
from sharpi.testing import conformance
from sharpi.testing.reference import log_softmax


def perplexity(logprobs: np.ndarray, ids: np.ndarray) -> float:
    return float(np.exp(-logprobs[np.arange(len(ids) - 1), ids[1:]].mean()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("gguf")
    p.add_argument("golden", help="a golden JSON with a teacher_forced text (tests/data/*.json)")
    p.add_argument("--tokens", type=int, default=100, help="positions compared with the reference (it is slow)")
    args = p.parse_args(argv)
    model = sharpi.load(args.artifact)
    tf = json.load(open(args.golden))["teacher_forced"]
    ids = np.array(tf["ids"])
    got = log_softmax(model.score(tf["ids"]))
    ref = log_softmax(conformance.make_reference("numpy", args.gguf).logits(tf["ids"][:args.tokens]))
    diff = np.abs(got[:args.tokens] - ref)
    top = np.argsort(ref, -1)[:, -20:]
    print(f"{args.artifact} (matmuls {model.manifest.target.get('matmuls')}), {len(ref)} positions vs the float32 "
          f"reference: max |d log-prob| {diff.max():.3f} over the vocabulary, "
          f"{np.take_along_axis(diff, top, -1).max():.3f} among the top 20, "
          f"top-1 equal at {(got[:args.tokens].argmax(-1) == ref.argmax(-1)).mean():.1%}")
    print(f"perplexity of the {len(ids)}-token text: {perplexity(got, ids):.3f} (reference on its first "
          f"{len(ref)}: {perplexity(ref, ids[:len(ref)]):.3f} vs the artifact's {perplexity(got[:len(ref)], ids[:len(ref)]):.3f}; "
          f"llama.cpp {tf['perplexity']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
