"""Peak memory and time of one long prefill: python benchmarks/long_prompt_memory.py ARTIFACT [TOKENS]

Prints the prompt length, prefill seconds and tok/s, the process's peak RSS, and the KV bytes the session holds.
The issue's target: an 8000-token prompt prefills within 4 GB of peak memory.
"""
import resource
import sys
import time

import numpy as np

import sharpi
from sharpi.cli.bench import prompt_ids


def main() -> None:
    artifact, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8000
    model = sharpi.load(artifact)
    ids = prompt_ids(model, n)
    with model.session() as s:
        t0 = time.perf_counter()
        logits = s.prefill(ids)
        dt = time.perf_counter() - t0
        kv = s.kv_bytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"prompt {len(ids)} tokens: prefill {dt:.1f} s ({len(ids) / dt:.1f} tok/s), finite logits: "
          f"{bool(np.isfinite(logits).all())}, KV held {kv / 2**20:.0f} MiB, peak RSS {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
