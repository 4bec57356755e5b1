"""How far two CPU arithmetics' keep sets differ: SmolLM2's CPU artifacts with float32 matmuls (gpu_check.py's
reference) and with the default int8 ones, for each of gpu_check's KV cache variants and its scorer checks (the
question-after-the-compression keep sets at SNAPKV_BUDGET of its 1040-token prompt). The overlaps say how much a
correct implementation of other arithmetic moves those keep sets, which is what gpu_check's scorer bars for the
rounded caches rest on.

    python benchmarks/keep_set_noise.py [--dir /tmp/keep-set-noise]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sharpi
from sharpi.cli.bench import prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (benchmarks/ is no package)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/keep-set-noise", help="where the CPU artifacts are compiled")
    args = p.parse_args()
    results = {}
    for variant in ("plain", "q8_0", "q4_ch"):
        sets = {}
        for matmuls in ("float", "int8"):
            model = sharpi.load(sharpi.compile("smollm2-135m", target="llvm", matmuls=matmuls,
                                               **gpu_check._kv_types(variant),
                                               output=Path(args.dir) / f"{variant}-{matmuls}"))
            prompt = prompt_ids(model, gpu_check.SNAPKV_PROMPT)
            sets[matmuls] = {f"{name}/{allocation}": gpu_check._compressed_keep_sets(model, prompt, name, allocation)
                             for name, allocation in gpu_check.SCORER_CHECKS}
        results[variant] = {key: gpu_check.keep_set_overlap(sets["int8"][key], want)
                            for key, want in sets["float"].items()}
        print(variant, json.dumps(results[variant]), flush=True)


if __name__ == "__main__":
    main()
