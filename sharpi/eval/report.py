"""The Markdown report of a results file (accuracy by budget, and depth x length per budget), with the plots."""
from __future__ import annotations

from pathlib import Path

from .scoring import Gap, accuracy, paired_gap, row_score
from .summary import budget_name, column, column_order, first_questions, full_rows, has_length, lines, prompt_key


def budget_table(rows: list[dict]) -> list[str]:
    """Setting x length rows, one column per budget (all depths and trials pooled), full cache last."""
    budgets = sorted({column(r) for r in rows if column(r) != 0}, key=column_order) + [0]
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
        columns = [(b, n) for b in sorted(by_budget, key=lambda b: (b != 0, column_order(b))) for n in lengths]
        out += ["", f"{label}, by depth:", "",
                "| depth | " + " | ".join(f"{budget_name(b, short=True)} @ {n}" for b, n in columns) + " |",
                "| --- | " + " | ".join("---" for _ in columns) + " |"]
        for depth in depths:
            cells = [str(accuracy(r for r in by_budget[b] if r["depth"] == depth and r["length"] == n))
                     for b, n in columns]
            out.append(f"| {depth:g}% | " + " | ".join(cells) + " |")
    return out


def suite_score(rows: list[dict]) -> float:
    """Mean over tasks of the mean score over each task's prompts, in points."""
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(row_score(r))
    return 100 * sum(sum(v) / len(v) for v in by_task.values()) / len(by_task) if by_task else float("nan")


def gap_to_full(cell_rows, full_score: dict) -> Gap:
    """A cell's paired gap to the full cache: each row against the full cache's score of the same prompt_key
    (`full_score`), paired within its task."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for r in cell_rows:
        if prompt_key(r) in full_score:
            pairs.setdefault(r["task"], []).append((row_score(r), full_score[prompt_key(r)]))
    return paired_gap(pairs)


def gap_table(rows: list[dict]) -> list[str]:
    """Each line's score (mean over tasks of the mean over prompts, points) per column and its gap to the full
    cache on the same prompts, with the paired bootstrap 95% interval; the full cache's own score last."""
    columns = sorted({column(r) for r in rows if column(r) != 0}, key=column_order)
    full = full_rows(rows)
    full_score = {prompt_key(r): row_score(r) for r in full}
    out = ["| setting | " + " | ".join(budget_name(c) for c in columns) + " |",
           "| --- | " + " | ".join("---" for _ in columns) + " |"]
    for label, by_column in lines(rows).values():
        cells = []
        for c in columns:
            gap = gap_to_full(by_column.get(c, ()), full_score)
            cells.append(f"{suite_score(by_column[c]):.1f} ({gap}, n={gap.prompts})" if gap.prompts else "-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append(f"| full cache | {suite_score(full):.1f} (n={len(full)}) |" + " |" * (len(columns) - 1))
    return out


def questions_table(rows: list[dict]) -> list[str]:
    """Per-question accuracy after one compression: the prompt's own question (1) and each follow-up, per line
    and column, the full cache first."""
    asked = sorted({r.get("question", 0) for r in rows})
    out = ["| setting | budget | " + " | ".join(f"question {q + 1}" for q in asked) + " |",
           "| --- | --- | " + " | ".join("---" for _ in asked) + " |"]
    full = full_rows(rows)
    entries = [("full cache", 0, full)] if full else []
    entries += [(label, c, by_column[c]) for label, by_column in lines(rows).values()
                for c in sorted(by_column, key=column_order) if c != 0]
    for label, c, cell_rows in entries:
        cells = [str(accuracy(r for r in cell_rows if r.get("question", 0) == q)) for q in asked]
        out.append(f"| {label} | {budget_name(c, short=True)} | " + " | ".join(cells) + " |")
    return out


def task_section(rows: list[dict], task: str) -> list[str]:
    followups = [r for r in rows if r.get("question")]
    rows = first_questions(rows)
    trials = len({(r["trial"], r["seed"]) for r in rows})
    spots = {(r["length"], r["depth"], r["trial"], r["seed"]) for r in rows}
    out = [f"## {task}", "",
           f"{len(rows)} cells from {len(spots)} prompts ({trials} trials per length and depth at most); "
           "cells are `score (expected strings found/prompts)`.", "",
           "Score by budget (all depths pooled):", "", *budget_table(rows), "",
           "Gap to the full cache on the same prompts (points, paired bootstrap 95% interval):", "",
           *gap_table(rows), "",
           "By needle depth (columns: budget @ prompt tokens):", *depth_tables(rows), ""]
    if followups:
        out += ["Several questions after one compression (question 1 is the prompt's own; each asked on its own "
                "fork of the one compressed cache):", "", *questions_table(rows + followups), ""]
    return out


def suite_section(rows: list[dict], title: str) -> list[str]:
    """The suite's score over every task in `rows` (each prompt's own question), then the follow-ups'."""
    followups, rows = rows, first_questions(rows)
    tasks = sorted({r["task"] for r in rows})
    return [f"## RULER-style suite, {title}", "",
            f"Tasks: {', '.join(tasks)}. A cell is the mean over tasks of the mean score over prompts (points), "
            "then its gap to the full cache on the same prompts with the paired bootstrap 95% interval and the "
            "number of prompts.", "", *gap_table(rows), "", *followup_lines(followups)]


def followup_lines(followups: list[dict]) -> list[str]:
    """The suite's follow-up questions (asked after one compression) beside each prompt's own question."""
    if not any(r.get("question") for r in followups):
        return []
    tasks = sorted({r["task"] for r in followups if r.get("question")})
    rows = [r for r in followups if r["task"] in tasks]
    own, later = first_questions(rows), [r for r in rows if r.get("question")]
    return [f"Follow-up questions after one compression ({', '.join(tasks)}): the prompts' own questions, then "
            "every follow-up pooled:", "", "| setting | budget | own question | follow-ups |",
            "| --- | --- | --- | --- |",
            *(f"| {label} | {budget_name(c, short=True)} | {own_acc} | {later_acc} |"
              for label, c, own_acc, later_acc in _paired_accuracy(own, later)), ""]


def _paired_accuracy(own: list[dict], later: list[dict]):
    own_lines, later_lines = lines(own), lines(later)
    full = full_rows(own)
    if full:
        yield "full cache", 0, accuracy(full), accuracy(full_rows(later))
    for key, (label, by_column) in own_lines.items():
        for c in sorted((c for c in by_column if c != 0), key=column_order):
            yield label, c, accuracy(by_column[c]), accuracy(later_lines.get(key, ("", {}))[1].get(c, []))


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
    if len(tasks) > 1:
        for protocol, rows in _by_protocol([r for r in results.rows() if r["task"] in tasks]):
            title = "aware protocol" if protocol == "aware" else PROTOCOL_TITLES[protocol]
            text += suite_section(rows, title)
            if plots:
                from . import plots as charts
                files.append(charts.accuracy_vs_budget(first_questions(rows), f"suite-{protocol}", directory))
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
    rows = first_questions(rows)
    files = plots.heatmaps(rows, task, directory) + [plots.accuracy_vs_budget(rows, task, directory)]
    if show_kept:
        files += plots.kept_strips(results, rows, task, directory)
    return files
