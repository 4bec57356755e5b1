"""The TurboQuant section's perplexity tables of benchmarks/kv_quant.md as one picture: the change against f16 (or
f32 keys) of every cache type, per model and text, from the tables as measured (kv_quant_perplexity.py and
turboquant_keys.py wrote them).

    python benchmarks/kv_turboquant_plot.py [--md benchmarks/kv_quant.md] [--out benchmarks/kv-turboquant.png]
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTION = "## TurboQuant"
# the section's percentage tables, in order
TITLES = ["sharpi, int8 matmuls, against its f16 cache (golden texts and Alice 1024)",
          "float32 reference, golden texts: one side rounded, the other exact",
          "float32 reference, golden texts: TurboQuant keys with outlier channels apart"]


def tables(markdown: str) -> list[list[list[str]]]:
    """The markdown tables of the TurboQuant section, each a list of rows of cells (the header row first)."""
    start = markdown.index(SECTION)
    end = markdown.find("\n## ", start + 1)
    found, current = [], []
    for line in markdown[start:end if end > 0 else None].splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found + ([current] if current else [])


def percent(cell: str) -> float | None:
    match = re.fullmatch(r"\**([+-]?\d+(?:\.\d+)?)%\**", cell)
    return float(match.group(1)) if match else None


def panels(markdown: str) -> list[tuple[str, list[str], dict[str, list[float]]]]:
    """(title, row labels, {column: values}) for each table whose cells are percentages."""
    out = []
    for table in tables(markdown):
        header, rows = table[0], table[1:]
        columns, side = {}, ""
        for j, name in enumerate(header):
            if ":" in name:                  # "keys: f16", "values: q4_0": the side of this and later columns
                side, name = (part.strip() for part in name.split(":", 1))
            values = [percent(r[j]) if j < len(r) else None for r in rows]
            if all(v is not None for v in values):
                columns[f"{side} {name}".strip()] = values
        if columns:
            labels = [" ".join(c for c in r[:2] if percent(c) is None and not re.fullmatch(r"[\d.]+", c))
                      for r in rows]
            out.append((TITLES[len(out)] if len(out) < len(TITLES) else "", labels, columns))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--md", default=str(HERE / "kv_quant.md"))
    p.add_argument("--out", default=str(HERE / "kv-turboquant.png"))
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    found = panels(Path(args.md).read_text())
    fig, axes = plt.subplots(len(found), 1, figsize=(11, 3.2 * len(found)))
    for ax, (title, labels, columns) in zip(axes, found):
        width = 0.8 / len(columns)
        for i, (name, values) in enumerate(columns.items()):
            xs = [k + i * width for k in range(len(labels))]
            ax.bar(xs, [min(v, 40) for v in values], width, label=name)
            for x, v in zip(xs, values):
                if v > 40:
                    ax.text(x, 40, f"{v:.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(labels))], labels, fontsize=8, rotation=10)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_ylabel("perplexity change, % (cut at 40)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
