"""The compression issue's figures from `sharpi eval ruler` results files: per model and protocol the suite's
score (mean over tasks of the mean over prompts) for each scorer and compression, its gap to the full cache on
the same prompts with the paired bootstrap 95% interval, the follow-up questions, each task at one compression,
the scorers' cost (seconds of their own pass against the prefill's, from the same runs), and a plot.

    python benchmarks/compression_summary.py OUT.png RESULTS.json [RESULTS.json ...] > tables.md
"""
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from sharpi.common.snapkv_settings import ALLOCATIONS
from sharpi.eval.report import gap_to_full, suite_score
from sharpi.eval.scoring import row_score
from sharpi.eval.summary import prompt_key
from sharpi.eval.sweep import Results

SCORER_ORDER = ("snapkv", "keydiff", "probe", "hybrid", "kvzip")


def line_of(r):
    """(scorer, allocation) of a row: the setting key names a non-uniform allocation (sharpi.eval.sweep.Setting)."""
    allocation = next((part for part in r["setting"].split("/") if part in ALLOCATIONS), "uniform")
    return r["scorer"] or "full", allocation


def gaps(rows):
    """{(scorer, allocation): {ratio: (score, Gap)}} over each prompt's own question, with the full cache's."""
    own = [r for r in rows if not r.get("question")]
    full = {prompt_key(r): row_score(r) for r in own if not r["scorer"]}
    by_line = defaultdict(lambda: defaultdict(list))
    for r in own:
        if r["scorer"]:
            by_line[line_of(r)][r["ratio"]].append(r)
    out = {}
    for line, by_ratio in by_line.items():
        out[line] = {}
        for ratio, cell in by_ratio.items():
            out[line][ratio] = (suite_score(cell), gap_to_full(cell, full))
    return out, suite_score([r for r in own if not r["scorer"]]), len(full)


def ordered(lines):
    return sorted(lines, key=lambda l: (ALLOCATIONS.index(l[1]), SCORER_ORDER.index(l[0]) if l[0] in SCORER_ORDER
                                        else 9))


def suite_table(name, rows):
    table, full, n = gaps(rows)
    ratios = sorted({ratio for cells in table.values() for ratio in cells})
    print(f"\n### {name}: full cache {full:.1f} on {n} prompts\n")
    print("| scorer | allocation | " + " | ".join(f"{r}% compression" for r in ratios) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in ratios) + " |")
    for line in ordered(table):
        cells = [f"{table[line][r][0]:.1f} ({table[line][r][1]})" if r in table[line] else "-" for r in ratios]
        print(f"| {line[0]} | {line[1]} | " + " | ".join(cells) + " |")
    return table, full


def followup_table(name, rows):
    asked = [r for r in rows if r["task"] in {x["task"] for x in rows if x.get("question")}]
    if not asked:
        return
    groups = defaultdict(lambda: [[], []])
    for r in asked:
        if line_of(r)[1] == "uniform":
            groups[(r["scorer"] or "full", r["ratio"])][bool(r.get("question"))].append(row_score(r))
    print(f"\n### {name}, several questions after one compression (multikey, multiquery; uniform allocation)\n")
    print("| scorer | compression | own question | follow-ups |\n| --- | --- | --- | --- |")
    for (scorer, ratio), (own, later) in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full",
                                                SCORER_ORDER.index(kv[0][0]) if kv[0][0] in SCORER_ORDER else 9,
                                                kv[0][1])):
        print(f"| {scorer} | {ratio or 'full'}{'%' if ratio else ''} | {100 * statistics.mean(own):.0f} (n={len(own)})"
              f" | {100 * statistics.mean(later):.0f} (n={len(later)}) |")


def task_table(name, rows, ratio):
    """Each task's mean at one compression for every scorer and allocation (where one task loses the suite's gap)."""
    own = [r for r in rows if not r.get("question")]
    tasks = sorted({r["task"] for r in own})
    print(f"\n### {name}, each task at {ratio}% compression (full cache first; mean score, points)\n")
    print("| scorer | " + " | ".join(tasks) + " |\n| --- | " + " | ".join("---" for _ in tasks) + " |")
    for allocation in ("uniform", "scores"):       # pyramid ran on the first round only
        for scorer in ("full", *SCORER_ORDER):
            if scorer == "full" and allocation != "uniform":
                continue
            cells = []
            for task in tasks:
                scores = [row_score(r) for r in own if r["task"] == task and line_of(r) == (scorer, allocation)
                          and (r["ratio"] == ratio or scorer == "full")]
                cells.append(f"{100 * statistics.mean(scores):.0f}" if scores else "-")
            if any(c != "-" for c in cells):
                label = scorer if allocation == "uniform" else f"{scorer}, {allocation}"
                print(f"| {label} | " + " | ".join(cells) + " |")


def cost_table(name, rows):
    per_prompt = {}
    for r in rows:
        if r["scorer"]:
            per_prompt[(prompt_key(r)[:5], r["scorer"])] = (r["prefill_s"], r.get("scoring_s"))
    by_scorer = defaultdict(list)
    for (_, scorer), (prefill, scoring) in per_prompt.items():
        if scoring is not None:
            by_scorer[scorer].append((prefill + scoring) / prefill)
    print(f"\n### {name}, cost of each scorer: (prefill + its own pass) / prefill, median over prompts\n")
    print("| scorer | cost | prompts |\n| --- | --- | --- |")
    for scorer in SCORER_ORDER:
        if by_scorer.get(scorer):
            print(f"| {scorer} | {statistics.median(by_scorer[scorer]):.2f}x | {len(by_scorer[scorer])} |")


def plot(path, panels):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, sharey=True,
                             constrained_layout=True)
    for ax, (title, table, full) in zip(axes[0], panels):
        for i, line in enumerate(ordered(table)):
            ratios = sorted(table[line])
            ax.plot([0] + ratios, [full] + [table[line][r][0] for r in ratios], marker="os^vD"[i % 5],
                    linestyle={"uniform": "-", "pyramid": ":", "scores": "--"}[line[1]],
                    label=line[0] + ("" if line[1] == "uniform" else f", {line[1]}"),
                    color=f"C{SCORER_ORDER.index(line[0]) % 10}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("compression (% of the tokens evicted)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("suite score (points)")
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, dpi=110)


def main(argv):
    print("# The compression suite's tables (benchmarks/compression_summary.py; see compression.md)")
    panels = []
    for path in argv[1:]:
        results = Results(path)
        rows = results.rows()
        protocol = rows[0]["protocol"]
        name = f"{results.model['name']}, {protocol} protocol ({Path(path).name})"
        table, full = suite_table(name, rows)
        panels.append((f"{results.model['name'].removesuffix('.gguf')}, {protocol}", table, full))
        followup_table(name, rows)
        task_table(name, rows, 50 if protocol == "agnostic" else 90)
        if protocol == "agnostic":
            cost_table(name, rows)
    plot(argv[0], panels)


if __name__ == "__main__":
    main(sys.argv[1:])
