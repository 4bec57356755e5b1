"""Grouping result rows the way the charts and tables show them: one line per SnapKV setting, the full cache
(budget 0) shared by every line. A column is a budget in slots (an int) or a compression ratio ("50%")."""
from __future__ import annotations

FULL = "full"


def column(row: dict) -> int | str:
    """The column a row belongs to: its budget, or its compression ratio when the sweep gave one."""
    return f"{row['ratio']}%" if row.get("ratio") else row["budget"]


def column_order(col: int | str) -> tuple:
    """Budgets ascending, then ratios ascending."""
    return (1, float(col.rstrip("%"))) if isinstance(col, str) else (0, col)


def budget_name(budget: int | str, short: bool = False) -> str:
    if budget == 0:
        return "full" if short else "full cache"
    if isinstance(budget, str):
        return budget if short else f"{budget} compression"
    return str(budget) if short else f"budget {budget}"


def prompt_key(row: dict) -> tuple:
    """The prompt and question a row answers: rows of one key are paired across lines."""
    return row["task"], row["length"], row["depth"], row["trial"], row["seed"], row.get("question", 0)


def first_questions(rows: list[dict]) -> list[dict]:
    """Rows of each prompt's own question (follow-ups have their own table)."""
    return [r for r in rows if not r.get("question")]


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text)


def full_rows(rows: list[dict]) -> list[dict]:
    """Budget-0 rows, one per prompt: runs with another window or settings repeat them, and they are one
    sample each."""
    seen = {}
    for r in rows:
        if column(r) == 0:
            seen.setdefault(prompt_key(r), r)
    return list(seen.values())


def lines(rows: list[dict]) -> dict[str, tuple[str, dict[int | str, list[dict]]]]:
    """{setting key: (label, {column: rows})}, with the full-cache rows at column 0 of every setting. The
    window joins the key only when the rows hold more than one."""
    windows = {r["window"] for r in rows if column(r) != 0}
    named = len({r.get("scorer") or "snapkv" for r in rows if column(r) != 0}) > 1   # say which is SnapKV's
    full = full_rows(rows)
    out: dict[str, tuple[str, dict[int | str, list[dict]]]] = {}
    for r in sorted((r for r in rows if column(r) != 0), key=lambda r: (r["setting"], r["window"])):
        key, label = r["setting"], r["setting_label"]
        if named and (r.get("scorer") or "snapkv") == "snapkv":
            label = f"snapkv, {label}"
        if len(windows) > 1:
            key, label = f"{key}/w{r['window']}", f"{label}, window {r['window']}"
        if key not in out:
            out[key] = (label, {0: full} if full else {})
        out[key][1].setdefault(column(r), []).append(r)
    if not out and full:
        out[FULL] = ("full cache", {0: full})
    return out


def has_length(by_budget: dict[int, list[dict]], length: int) -> bool:
    """Whether a line (a setting's rows by budget) was run at this length; the full cache alone always was."""
    evicted = [b for b in by_budget if b != 0]
    return not evicted or any(r["length"] == length for b in evicted for r in by_budget[b])
