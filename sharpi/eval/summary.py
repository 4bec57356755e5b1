"""Grouping result rows the way the charts and tables show them: one line per SnapKV setting, the full cache
(budget 0) shared by every line."""
from __future__ import annotations

FULL = "full"


def budget_name(budget: int, short: bool = False) -> str:
    if budget == 0:
        return "full" if short else "full cache"
    return str(budget) if short else f"budget {budget}"


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in text)


def full_rows(rows: list[dict]) -> list[dict]:
    """Budget-0 rows, one per prompt: runs with another window or settings repeat them, and they are one
    sample each."""
    seen = {}
    for r in rows:
        if r["budget"] == 0:
            seen.setdefault((r["length"], r["depth"], r["trial"], r["seed"]), r)
    return list(seen.values())


def lines(rows: list[dict]) -> dict[str, tuple[str, dict[int, list[dict]]]]:
    """{setting key: (label, {budget: rows})}, with the full-cache rows at budget 0 of every setting. The
    window joins the key only when the rows hold more than one."""
    windows = {r["window"] for r in rows if r["budget"] > 0}
    full = full_rows(rows)
    out: dict[str, tuple[str, dict[int, list[dict]]]] = {}
    for r in sorted((r for r in rows if r["budget"] > 0), key=lambda r: (r["setting"], r["window"])):
        key, label = r["setting"], r["setting_label"]
        if len(windows) > 1:
            key, label = f"{key}/w{r['window']}", f"{label}, window {r['window']}"
        if key not in out:
            out[key] = (label, {0: full} if full else {})
        out[key][1].setdefault(r["budget"], []).append(r)
    if not out and full:
        out[FULL] = ("full cache", {0: full})
    return out


def has_length(by_budget: dict[int, list[dict]], length: int) -> bool:
    """Whether a line (a setting's rows by budget) was run at this length; the full cache alone always was."""
    evicted = [b for b in by_budget if b > 0]
    return not evicted or any(r["length"] == length for b in evicted for r in by_budget[b])
