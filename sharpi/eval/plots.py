"""PNG charts of a results file (matplotlib, Agg backend): depth x length heatmaps per budget (as in the SnapKV
paper's needle figures), accuracy against budget with one line per setting, and strips of the positions each
layer kept over the prompt, with the needles marked."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .scoring import accuracy
from .summary import budget_name, column, column_order, has_length, lines, slug

CMAP = "RdYlGn"          # red = missed, green = found, as needle-in-a-haystack figures are drawn
MARKERS = "osD^vP*X"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        from ..common.errors import ConfigError
        raise ConfigError("Plots need matplotlib: python -m pip install \".[eval]\" in the sharpi clone (or pass "
                          "--no-plots).") from None
    matplotlib.use("Agg")       # files only: no display is needed or wanted
    import matplotlib.pyplot as plt
    return plt


def heatmaps(rows: list[dict], task: str, directory: Path) -> list[Path]:
    """One PNG per setting: a depth x length panel per budget (full cache first), each cell hits/trials."""
    plt = _pyplot()
    depths = sorted({r["depth"] for r in rows})
    written = []
    for key, (label, by_budget) in lines(rows).items():
        lengths = [n for n in sorted({r["length"] for r in rows}) if has_length(by_budget, n)]
        budgets = sorted(by_budget, key=lambda b: (b != 0, column_order(b)))
        fig, axes = plt.subplots(1, len(budgets), figsize=(1.2 + 1.1 * len(lengths) * len(budgets), 3.6),
                                 squeeze=False, constrained_layout=True)
        for ax, budget in zip(axes[0], budgets):
            image = _heatmap_panel(ax, by_budget[budget], lengths, depths)
            ax.set_title(budget_name(budget), fontsize=10)
        axes[0][0].set_ylabel("needle depth (%)")
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
        fig.suptitle(f"{task}: {label}", fontsize=11)
        path = directory / f"heatmap-{task}-{slug(key)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _heatmap_panel(ax, rows: list[dict], lengths: list[int], depths: list[float]):
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, depth in enumerate(depths):
        for j, length in enumerate(lengths):
            acc = accuracy(r for r in rows if r["depth"] == depth and r["length"] == length)
            if acc.total:
                grid[i, j] = acc.fraction
                ax.text(j, i, acc.tally, ha="center", va="center", fontsize=8)
    image = ax.imshow(grid, cmap=CMAP, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
    ax.set_xlabel("prompt tokens", fontsize=8)
    return image


def accuracy_vs_budget(rows: list[dict], task: str, directory: Path) -> Path:
    """Accuracy (all depths and trials) against budget, one panel per length, one line per setting; the full
    cache is the rightmost point of every line."""
    plt = _pyplot()
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({column(r) for r in rows if column(r) != 0}, key=column_order)
    ticks = budgets + [0]
    fig, axes = plt.subplots(1, len(lengths), figsize=(1.5 + 3.6 * len(lengths), 3.6), squeeze=False,
                             sharey=True, constrained_layout=True)
    for ax, length in zip(axes[0], lengths):
        for i, (key, (label, by_budget)) in enumerate(lines(rows).items()):
            if not has_length(by_budget, length):
                continue
            xs, ys = [], []
            for x, budget in enumerate(ticks):
                acc = accuracy(r for r in by_budget.get(budget, ()) if r["length"] == length)
                if acc.total:
                    xs.append(x)
                    ys.append(acc.fraction)
            # Lines often coincide (all at 100%): each is drawn thinner with smaller markers than the one
            # before, so coinciding lines show as nested markers rather than hiding each other.
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=max(11 - 1.5 * i, 3),
                    linewidth=max(3.0 - 0.4 * i, 0.8), label=label, color=f"C{i}")
        ax.set_xticks(range(len(ticks)), [budget_name(b, short=True) for b in ticks])
        ax.set_title(f"{length} tokens", fontsize=10)
        ax.set_xlabel("budget (slots per layer and KV head) or compression", fontsize=8)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    fullest = max(axes[0], key=lambda ax: len(ax.lines))
    fullest.legend(fontsize=7, loc="best")
    fig.suptitle(f"{task}: accuracy against budget", fontsize=11)
    path = directory / f"budget-{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kept_strips(results, rows: list[dict], task: str, directory: Path) -> list[Path]:
    """For each prompt with saved keep sets: one row per (budget, setting), layers down, prompt positions
    across, shaded by the share of KV heads that kept each position, with a zoom on the asked needle (boxed in
    blue; distractors in orange) at the right."""
    from .sweep import load_kept
    plt = _pyplot()
    written = []
    spots = sorted({(r["length"], r["depth"], r["trial"]) for r in rows if r.get("kept")})
    for length, depth, trial in spots:
        panel_rows = sorted((r for r in rows if r.get("kept") and (r["length"], r["depth"], r["trial"]) ==
                             (length, depth, trial)), key=lambda r: (r["setting"], r["budget"]))
        fig, axes = plt.subplots(len(panel_rows), 2, figsize=(12, 1.0 + 1.25 * len(panel_rows)), squeeze=False,
                                 gridspec_kw={"width_ratios": [4, 1]}, constrained_layout=True)
        for (wide, zoom), row in zip(axes, panel_rows):
            share = _kept_share(load_kept(results, row), row["prompt_tokens"])
            _strip_panel(wide, share, row)
            _strip_panel(zoom, share, row, zoom=True)
        axes[-1][0].set_xlabel("prompt position (token)")
        axes[-1][1].set_xlabel("around the needle")
        fig.suptitle(f"{task}, {length} tokens, needle at {depth:g}% (trial {trial}): positions each layer kept "
                     "(darker: more KV heads kept it; blue box: the asked needle, orange: distractors)", fontsize=9)
        path = directory / f"kept-{task}-L{length}-D{depth:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _kept_share(kept: list[np.ndarray], tokens: int) -> np.ndarray:
    """[layers, tokens]: the share of each layer's KV heads that kept each prompt position."""
    share = np.zeros((len(kept), tokens))
    for layer, positions in enumerate(kept):
        heads = positions.shape[0]
        for head in range(heads):
            valid = positions[head][(positions[head] >= 0) & (positions[head] < tokens)]
            share[layer, valid] += 1.0 / heads
    return share


def _strip_panel(ax, share: np.ndarray, row: dict, zoom: bool = False) -> None:
    layers, tokens = share.shape
    ax.imshow(share, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest",
              extent=(0, tokens, layers - 0.5, -0.5))
    # Outlines, not fills: what the layers kept inside the needle is the point of the picture.
    for start, end in row.get("distractors", ()):
        ax.axvspan(start, end, facecolor="none", edgecolor="tab:orange", lw=1.2)
    ax.axvspan(*row["needle"], facecolor="none", edgecolor="tab:blue", lw=1.5)
    ax.tick_params(labelsize=7)
    if zoom:
        start, end = row["needle"]
        margin = 2 * (end - start)
        ax.set_xlim(max(start - margin, 0), min(end + margin, tokens))
        ax.set_yticks([])
        return
    verdict = "found" if row["hit"] else "missed"
    ax.set_title(f"budget {row['budget']}, {row['setting_label']}: {verdict} (output {row['output'].strip()!r})",
                 fontsize=8, loc="left")
    ax.set_ylabel("layer", fontsize=8)
