"""The Markdown report of a results file (accuracy by budget, and depth x length per budget), with the plots."""
from __future__ import annotations

from pathlib import Path

from .scoring import accuracy
from .summary import budget_name, has_length, lines


def budget_table(rows: list[dict]) -> list[str]:
    """Setting x length rows, one column per budget (all depths and trials pooled), full cache last."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] > 0}) + [0]
    lengths = sorted({r["length"] for r in rows})
    out = ["| setting | prompt tokens | " + " | ".join(budget_name(b) for b in budgets) + " |",
           "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
    for label, by_budget in lines(rows).values():
        for length in lengths:
            if not has_length(by_budget, length):
                continue                       # this setting was not run at this length
            cells = [str(accuracy(r for r in by_budget.get(b, ()) if r["length"] == length)) for b in budgets]
            out.append(f"| {label} | {length} | " + " | ".join(cells) + " |")
    return out


def depth_tables(rows: list[dict]) -> list[str]:
    """One table per setting: needle depth down; (budget, prompt length) across, the full cache first."""
    depths = sorted({r["depth"] for r in rows})
    out = []
    for label, by_budget in lines(rows).values():
        lengths = [n for n in sorted({r["length"] for r in rows}) if has_length(by_budget, n)]
        columns = [(b, n) for b in sorted(by_budget, key=lambda b: (b != 0, b)) for n in lengths]
        out += ["", f"{label}, by depth:", "",
                "| depth | " + " | ".join(f"{budget_name(b, short=True)} @ {n}" for b, n in columns) + " |",
                "| --- | " + " | ".join("---" for _ in columns) + " |"]
        for depth in depths:
            cells = [str(accuracy(r for r in by_budget[b] if r["depth"] == depth and r["length"] == n))
                     for b, n in columns]
            out.append(f"| {depth:g}% | " + " | ".join(cells) + " |")
    return out


def task_section(rows: list[dict], task: str) -> list[str]:
    trials = len({(r["trial"], r["seed"]) for r in rows})
    spots = {(r["length"], r["depth"], r["trial"], r["seed"]) for r in rows}
    return [f"## {task}", "",
            f"{len(rows)} cells from {len(spots)} prompts ({trials} trials per length and depth at most); "
            "cells are `accuracy (hits/answers)`.", "",
            "Accuracy by budget (all depths pooled):", "", *budget_table(rows), "",
            "By needle depth (columns: budget @ prompt tokens):", *depth_tables(rows), ""]


PROTOCOL_TITLES = {"agnostic": "the question asked after the compression (query-agnostic protocol)"}


def _by_protocol(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows of each protocol (rows written before protocols existed are "aware"), aware first."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("protocol", "aware"), []).append(r)
    return sorted(groups.items(), key=lambda item: item[0] != "aware")


def write_report(results, directory: str | Path, *, plots: bool = True, show_kept: bool = False,
                 tasks=None) -> tuple[str, list[Path]]:
    """Write report.md (and, with plots, the PNGs) into `directory`; returns the Markdown and the files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = results.model or {}
    tasks = tasks or sorted({r["task"] for r in results.rows()})
    text = [f"# sharpi eval: {model.get('name', '?')} ({model.get('target', '?')})", "",
            f"Results: `{results.path}`.", ""]
    files = []
    for task in tasks:
        for protocol, rows in _by_protocol(results.rows(task)):
            name = task if protocol == "aware" else f"{task}-{protocol}"
            text += task_section(rows, task if protocol == "aware" else f"{task}, {PROTOCOL_TITLES[protocol]}")
            if plots:
                files += _plot_task(results, rows, name, directory, show_kept)
    report = directory / "report.md"
    report.write_text("\n".join(text))
    return "\n".join(text), [report, *files]


def _plot_task(results, rows: list[dict], task: str, directory: Path, show_kept: bool) -> list[Path]:
    from . import plots
    files = plots.heatmaps(rows, task, directory) + [plots.accuracy_vs_budget(rows, task, directory)]
    if show_kept:
        files += plots.kept_strips(results, rows, task, directory)
    return files
