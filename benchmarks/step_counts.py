"""Kernel launches and Relax VM builtin calls of one decode step, counted statically from cuda and vulkan artifacts
(sharpi.testing.step_count), as a table and a bar chart.

    python benchmarks/step_counts.py LABEL=ARTIFACT [LABEL=ARTIFACT ...] [--plot FILE]

A label names the bar ("SmolLM2 cuda, before"); the table gives each artifact's launches, launches a layer and
builtin calls (cuda; a vulkan plan has no VM).
"""
from __future__ import annotations

import argparse
import sys

from sharpi.common.manifest import Manifest
from sharpi.testing.step_count import step_count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+", help="LABEL=ARTIFACT")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    rows = []
    for item in args.artifacts:
        label, _, path = item.rpartition("=")
        count = step_count(path)
        layers = Manifest.read(path).config["n_layers"]
        rows.append((label or path, count.kernels_total(), count.kernels_total() / layers, count.builtins_total()))
    print("| artifact | launches | a layer (head included) | VM builtin calls |")
    print("|---|---|---|---|")
    for label, launches, per_layer, builtins in rows:
        print(f"| {label} | {launches} | {per_layer:.1f} | {builtins or '(no VM)'} |")
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.6))
    labels = [r[0] for r in rows][::-1]
    for ax, index, title in ((axes[0], 1, "kernel launches a decode step"), (axes[1], 3, "VM builtin calls a step")):
        values = [r[index] for r in rows][::-1]
        ax.barh(labels, values, color="tab:blue")
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,}" if v or index == 1 else " (a vulkan plan: no VM)", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max(values) * 1.2 or 1)
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
