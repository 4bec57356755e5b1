"""SnapKV on Gemma 3: seeded passkey prompts of ~8000 tokens, one prefill each (scored, not evicted), then two
forks: the full cache and the cache evicted to the budget (global layers keep their SnapKV keep sets, local layers
their last 512-token window). Prints per-layer cache lengths, each answer, and whether the evicted cache answers
as the full one does.

    python benchmarks/gemma3_passkey.py [--model gemma3-270m] [--tokens 8000] [--budget 1024] [--trials 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import sharpi
from sharpi.testing.passkey import passkey_trials


def answer(session, logits, model, steps: int = 8) -> str:
    token, out = int(np.argmax(logits)), []
    for _ in range(steps):
        out.append(token)
        token = int(np.argmax(session.decode(token)))
    return model.detokenize(out)


def filler_for(model, tokens: int) -> int:
    """Filler groups that make a prompt of about `tokens` tokens with this model's tokenizer."""
    small, large = (len(model.tokenize(passkey_trials(1, n, seed=0)[0][1])) for n in (10, 110))
    per_group = (large - small) / 100
    return int(10 + (tokens - small) / per_group)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    model = sharpi.load(sharpi.compile(args.model, target="llvm", output="/tmp/sharpi-gemma3-passkey"))
    cfg = model.config
    local = [l for l in range(cfg.n_layers) if cfg.is_local(l)]
    rows = []
    for key, prompt in passkey_trials(args.trials, filler_for(model, args.tokens), seed=args.seed):
        ids = model.tokenize(prompt)
        t = time.perf_counter()
        with model.session(snapkv_budget=0) as base:
            logits = base.prefill(ids, keep_scores=True)
            prefill_s = time.perf_counter() - t
            with base.fork() as full:
                full_answer, full_kv = answer(full, logits, model), full.kv_bytes
            with base.fork() as fork:
                assert fork.evict(args.budget)
                lengths, kv = fork.kv_length, fork.kv_bytes
                evicted_answer = answer(fork, logits, model)
        row = {"key": key, "prompt_tokens": len(ids), "prefill_s": round(prefill_s, 1),
               "global_lengths": sorted({lengths[l] for l in range(cfg.n_layers) if l not in local}),
               "local_max_length": max(lengths[l] for l in local), "kv_bytes_full": full_kv, "kv_bytes_evicted": kv,
               "full_answer": full_answer, "evicted_answer": evicted_answer,
               "full_correct": str(key) in full_answer, "evicted_correct": str(key) in evicted_answer,
               "same_answer": full_answer == evicted_answer}
        rows.append(row)
        print(json.dumps(row), flush=True)
    same = sum(r["same_answer"] for r in rows)
    print(f"\n{args.model}, ~{args.tokens}-token passkey prompts, budget {args.budget}: evicted answers equal the full "
          f"cache's in {same}/{len(rows)}; correct: full {sum(r['full_correct'] for r in rows)}/{len(rows)}, evicted "
          f"{sum(r['evicted_correct'] for r in rows)}/{len(rows)}; global layers hold "
          f"{sorted({g for r in rows for g in r['global_lengths']})} slots, local layers at most "
          f"{max(r['local_max_length'] for r in rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
