"""Long-context cells per KV cache type: the results files of `sharpi eval` run on artifacts that differ only in
their KV types (sharpi-compile --kv-dtype ...), each cell's score beside the f16 cache's on the same prompts, with
the paired, task-stratified bootstrap interval of the gap (sharpi.eval.report.gap_to_full).

    python benchmarks/kv_quant_cells.py f16=ruler-f16.json q8_0=ruler-q8_0.json q4_0=ruler-q4_0.json ...

The first file is the reference. A cell is a compression ratio (0: the full cache) of one results file; rows pair
by prompt (task, length, depth, trial, seed, question), so prompts one file lacks are left out of both sides.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from sharpi.eval.report import gap_to_full, suite_score
from sharpi.eval.scoring import row_score
from sharpi.eval.summary import first_questions, prompt_key


def rows_of(path: Path) -> list[dict]:
    return first_questions(list(json.loads(path.read_text())["cells"].values()))


def cell_name(ratio: int) -> str:
    return "full cache" if ratio == 0 else f"SnapKV at {ratio}% compression"


def table(named: list[tuple[str, list[dict]]]) -> str:
    (base_name, base), others = named[0], named[1:]
    lines = [f"| cell | KV cache | prompts | score | vs {base_name} (95% interval) | same answer as {base_name} |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for ratio in sorted({r["ratio"] for r in base}):
        reference = {prompt_key(r): r for r in base if r["ratio"] == ratio}
        for name, rows in named:
            cell = [r for r in rows if r["ratio"] == ratio and prompt_key(r) in reference]
            if not cell:
                continue
            paired = [reference[prompt_key(r)] for r in cell]
            gap = "" if name == base_name else str(gap_to_full(cell, {prompt_key(r): row_score(r) for r in paired}))
            same = sum(r["output"] == p["output"] for r, p in zip(cell, paired))
            lines.append(f"| {cell_name(ratio)} | {name} | {len(cell)} | {suite_score(cell):.1f} | {gap} | "
                         f"{same}/{len(cell)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="TYPE=RESULTS.json")
    args = parser.parse_args()
    named = []
    for item in args.files:
        name, _, path = item.partition("=")
        named.append((name, rows_of(Path(path))))
    print(table(named))


if __name__ == "__main__":
    main()
