"""The sweep runner: one prefill per prompt and scorer (scored, not evicted), forked once per budget and SnapKV
setting, greedy answers string-matched, every cell written to a resumable JSON file as soon as it is done.

Two protocols: "aware" compresses the whole prompt, the question included (SnapKV's home: its last queries are
the question's); "agnostic" compresses the context alone and feeds the question after the compression (a chat's
follow-up, a second question about one document, a compressed prefix another request reuses).

The agnostic protocol may also ask each prompt's follow-up questions (other keys of the same document) on forks of
one compressed cache: the prefix-cache case, where one compression serves several questions.

A budget is slots per layer and KV head, or a compression ratio (percent of the compressed tokens evicted, so the
budget follows each prompt's length). A cell is (task, length, depth, trial, seed, budget or ratio, setting,
window, scorer, protocol, question); its key names all of them (the scorer, protocol, ratio and question only
when not the defaults, so files written before they existed resume), so a rerun with the same --out skips the
cells it holds, and runs with other settings or seeds add to the same file.
Trials are the outer loop: an interrupted sweep has whole depth x length grids for the trials it finished.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..common.errors import ConfigError, ContextLengthError
from ..common.progress import progress_bar
from .scoring import accuracy, match_score
from .summary import FULL
from ..runtime.scorers import SCORERS
from .tasks import CONTENT, TASKS, build_prompt, minimum_length, trial_rng

PROTOCOLS = ("aware", "agnostic")
QUESTIONS = ("first", "all")      # the agnostic protocol's questions per compression: the prompt's own, or all

FORMAT = "sharpi-eval/1"
ANSWER_SLACK = 3              # decode steps beyond the answer's own tokens (a leading space, punctuation)
LIST_SLACK = 2                # and per expected string beyond the first ("and", a line break, numbering)


@dataclass(frozen=True)
class Setting:
    """The evict-time SnapKV knobs one line of the charts stands for. With sinks 0 the key and label are those
    of results files written before sinks existed, so they resume and report as they did."""
    granularity: str
    pooling: str
    kernel: int
    recency: int
    sinks: int = 0
    allocation: str = "uniform"

    @property
    def key(self) -> str:
        key = f"{self.granularity}/{self.pooling}/k{self.kernel}/r{self.recency}"
        key = f"{key}/s{self.sinks}" if self.sinks else key
        return key if self.allocation == "uniform" else f"{key}/{self.allocation}"

    @property
    def label(self) -> str:
        pool = "no pooling" if self.pooling == "none" else f"{self.pooling}-pool {self.kernel}"
        sinks = f", {self.sinks} sink{'s' if self.sinks != 1 else ''}" if self.sinks else ""
        allocation = "" if self.allocation == "uniform" else f", {self.allocation} layers"
        return f"{self.granularity}, {pool}{sinks}{allocation}"

    def knobs(self) -> dict:
        return dict(granularity=self.granularity, pooling=self.pooling, kernel=self.kernel, recency=self.recency,
                    sinks=self.sinks, allocation=self.allocation)


@dataclass
class SweepConfig:
    task: str
    lengths: list[int]
    depths: list[float]
    budgets: list[int]
    trials: int
    seed: int = 0
    settings: list[Setting] = field(default_factory=list)   # one per line; used for every budget > 0
    window: int = 64                                        # scoring queries, fixed at prefill
    show_kept: bool = False                                 # save each layer's kept positions (first trial)
    scorers: list[str] = field(default_factory=lambda: ["snapkv"])     # one prefill each; lines of their own
    protocol: str = "aware"
    ratios: list[int] = field(default_factory=list)         # compression in percent, beside the budgets
    questions: str = "first"                                # "all": follow-ups too (agnostic protocol)


def question_count(task: str, seed: int = 0) -> int:
    """Questions a prompt of `task` has: its own and the follow-ups (the same for every trial)."""
    return len(CONTENT[task](trial_rng(seed, task, 0)).questions)


@dataclass(frozen=True)
class Cell:
    task: str
    length: int
    depth: float
    trial: int
    seed: int
    budget: int
    setting: Setting | None       # None with budget 0
    window: int
    scorer: str = "snapkv"
    protocol: str = "aware"
    ratio: int = 0                # compression percent; with it, budget is 0 until the prompt's length is known
    question: int = 0             # 0: the prompt's own question; i: its i-th follow-up

    @property
    def evicts(self) -> bool:
        return bool(self.budget or self.ratio)

    @property
    def key(self) -> str:
        setting = self.setting.key if self.setting else FULL
        scorer = f"|c{self.scorer}" if self.evicts and self.scorer != "snapkv" else ""
        protocol = f"|p{self.protocol}" if self.protocol != "aware" else ""
        size = f"R{self.ratio}" if self.ratio else f"B{self.budget}"
        question = f"|q{self.question}" if self.question else ""
        return (f"{self.task}|L{self.length}|D{self.depth:g}|T{self.trial}|S{self.seed}|{size}|{setting}"
                f"|w{self.window}{scorer}{protocol}{question}")

    def budget_for(self, tokens: int) -> int:
        """Slots per layer and KV head for a compressed cache of `tokens` tokens."""
        return self.budget or max(1, round(tokens * (100 - self.ratio) / 100))

    @property
    def line(self) -> tuple[str, str]:
        """The (key, label) of the chart line this cell is a point of."""
        if not self.setting:
            return FULL, "full cache"
        if self.scorer == "snapkv":
            return self.setting.key, self.setting.label
        return f"{self.setting.key}/{self.scorer}", f"{self.scorer}, {self.setting.label}"

    @property
    def spot(self) -> tuple:
        """The prompt this cell is answered from: cells of one spot share its prefill (every scorer ranks it on
        a fork of that one prefill)."""
        return self.length, self.depth, self.trial


def plan(config: SweepConfig) -> list[Cell]:
    """Every cell of the sweep, trials outermost, then length, depth, scorer, budget (then ratio), setting and
    question."""
    sizes = [(b, 0) for b in config.budgets] + [(0, r) for r in config.ratios if r]
    asked = question_count(config.task, config.seed) if _all_questions(config) else 1
    cells = []
    for trial, length, depth in itertools.product(range(config.trials), config.lengths, config.depths):
        for i, scorer in enumerate(config.scorers):
            for budget, ratio in sizes:
                full = not (budget or ratio)
                if full and i > 0:
                    continue                  # the full cache is one cell per prompt, whatever scores
                for setting, question in itertools.product([None] if full else config.settings, range(asked)):
                    cells.append(Cell(config.task, length, depth, trial, config.seed, budget, setting,
                                      config.window, scorer, config.protocol, ratio, question))
    return cells


def _all_questions(config: SweepConfig) -> bool:
    return config.questions == "all" and config.protocol == "agnostic"


# -- the results file ----------------------------------------------------------------------------------------
def model_identity(model) -> dict:
    """The GGUF (name and sha256) and target an artifact was built from: results of one model per file."""
    manifest = model.manifest
    return {"name": manifest.source.get("name"), "sha256": manifest.source.get("sha256"),
            "target": manifest.target.get("kind")}


class Results:
    """The JSON results file: {"format", "model", "cells": {key: row}}; written atomically after each cell."""

    def __init__(self, path: str | Path, model: dict | None = None):
        self.path = Path(path)
        self.model, self.cells = model, {}
        if self.path.exists():
            self._load()
        if model is not None and self.model not in (None, model):
            raise ConfigError(f"{self.path} holds results of {self.model['name']} ({self.model['target']}), "
                              f"not of this artifact's {model['name']} ({model['target']}); give another --out.")
        self.model = self.model or model

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path} is not a readable results file: {exc}.") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ConfigError(f"{self.path} is not a sharpi eval results file (format {FORMAT}).")
        self.model, self.cells = raw.get("model"), raw.get("cells", {})

    @property
    def kept_dir(self) -> Path:
        return self.path.with_suffix(".kept")

    def __contains__(self, key: str) -> bool:
        return key in self.cells

    def rows(self, task: str | None = None) -> list[dict]:
        return [r for r in self.cells.values() if task is None or r["task"] == task]

    def add(self, key: str, row: dict) -> None:
        self.cells[key] = row
        self.save()

    def save(self) -> None:
        # Write a sibling and rename it over: an interrupt never leaves a half-written file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "model": self.model, "cells": self.cells}, indent=1))
        os.replace(tmp, self.path)


# -- checks before any work ----------------------------------------------------------------------------------
def answer_steps(model, task: str, seed: int) -> int:
    """Greedy steps that leave room for the answer: its tokens (after a space; a list's joined with commas) plus
    a little slack, more for a list."""
    answers = CONTENT[task](trial_rng(seed, task, 0)).answers
    return len(model.tokenize(" " + ", ".join(answers))) + ANSWER_SLACK + LIST_SLACK * (len(answers) - 1)


MAX_TRIALS = 100_000      # prompts per cell; every one is a prefill, so more would run for weeks


def check_config(model, config: SweepConfig) -> None:
    """Clear errors for a sweep that cannot run: unknown task, empty lists, lengths that do not fit."""
    if config.task not in TASKS:
        raise ConfigError(f"Unknown eval task {config.task!r}; tasks are {', '.join(TASKS)}.")
    if not 1 <= config.trials <= MAX_TRIALS:
        raise ConfigError(f"--trials must be an integer in [1, {MAX_TRIALS}], got {config.trials}.")
    for name in ("lengths", "depths", "budgets"):
        if not getattr(config, name):
            raise ConfigError(f"--{name} must list at least one value.")
    bad_depth = [d for d in config.depths if not 0 <= d <= 100]
    if bad_depth:
        raise ConfigError(f"Depths are percentages between 0 and 100, got {bad_depth[0]:g}.")
    steps = answer_steps(model, config.task, config.seed)
    room = model.max_context - steps
    too_long = [n for n in config.lengths if n > room]
    if too_long:
        raise ContextLengthError(f"A {too_long[0]}-token prompt leaves no room for the {steps}-token answer in "
                                 f"this model's {model.max_context}-token context; use lengths up to {room}.")
    floor = minimum_length(config.task, model.tokenize, config.seed)
    too_short = [n for n in config.lengths if n < floor]
    if too_short:
        raise ConfigError(f"A {config.task} prompt needs at least {floor} tokens (intro, needles and question); "
                          f"{too_short[0]} is too short.")
    if any(b > 0 for b in config.budgets) and not config.settings:
        raise ConfigError("Budgets above 0 need at least one SnapKV setting.")
    unknown = [s for s in config.scorers if s not in SCORERS]
    if unknown or not config.scorers:
        raise ConfigError(f"--scorers takes a comma list of {', '.join(SCORERS)}, got {unknown or 'none'}.")
    if config.protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {config.protocol!r}.")
    if config.questions not in QUESTIONS:
        raise ConfigError(f"--questions must be one of {', '.join(QUESTIONS)}, got {config.questions!r}.")
    _check_ratios(model, config, floor)


def _check_ratios(model, config: SweepConfig, floor: int) -> None:
    """Every ratio must leave the shortest prompt a budget the settings accept (above recency and sinks)."""
    bad = [r for r in config.ratios if not 0 <= r < 100]
    if bad:
        raise ConfigError(f"--ratios are percentages of the tokens evicted, in [0, 100), got {bad[0]:g}.")
    if not config.ratios or not config.settings:
        if config.ratios and not config.settings:
            raise ConfigError("Ratios above 0 need at least one SnapKV setting.")
        return
    shortest = min(config.lengths)
    for ratio in (r for r in config.ratios if r):
        budget = Cell("", shortest, 0, 0, 0, 0, None, 0, ratio=ratio).budget_for(shortest)
        for setting in config.settings:
            if budget <= setting.recency + setting.sinks:
                raise ConfigError(f"{ratio}% compression of a {shortest}-token prompt leaves {budget} slots, not "
                                  f"more than recency {setting.recency} + sinks {setting.sinks}; use a lower "
                                  f"ratio or longer prompts.")


def resolve_settings(model, *, window=None, recency=None, poolings=(None,), kernels=(None,),
                     granularities=(None,), sinks=(None,), allocations=(None,),
                     budgets=()) -> tuple[int, list[Setting]]:
    """The scoring window and one Setting per (granularity, pooling, kernel, sinks, allocation), each resolved
    as a session would (argument > SHARPI_SNAPKV_* env > the artifact's defaults) and validated against every
    budget > 0. With pooling none the kernel is 1 (pooling over one position is no pooling)."""
    settings = []
    for granularity, pooling, kernel, sink, allocation in itertools.product(granularities, poolings, kernels,
                                                                            sinks, allocations):
        resolved, _ = model.snapkv_settings(budget=None, window=window, recency=recency, pooling=pooling,
                                            kernel=1 if pooling == "none" else kernel, granularity=granularity,
                                            sinks=sink, allocation=allocation)
        for budget in budgets:
            if budget > 0:
                model.snapkv_settings(budget=budget, window=window, recency=resolved.recency,
                                      pooling=resolved.pooling, kernel=resolved.kernel,
                                      granularity=resolved.granularity, sinks=resolved.sinks,
                                      allocation=resolved.allocation)
        setting = Setting(resolved.granularity, resolved.pooling, resolved.kernel, resolved.recency,
                          resolved.sinks, resolved.allocation)
        if setting not in settings:
            settings.append(setting)
    resolved_window = model.snapkv_settings(budget=None, window=window)[0].window
    return resolved_window, settings


# -- running -------------------------------------------------------------------------------------------------
def greedy(session, logits, steps: int, stop_ids=()) -> list[int]:
    """Greedy tokens from the prompt's last logits: `steps` of them, or up to a stop token."""
    token, out = int(np.argmax(logits)), []
    while True:
        out.append(token)
        if token in stop_ids or len(out) == steps:
            return out
        token = int(np.argmax(session.decode(token)))


def run_sweep(model, config: SweepConfig, results: Results, *, progress: bool = True,
              on_cell: Callable[[Cell, dict], None] | None = None) -> Results:
    """Run the cells `results` does not hold yet, saving after each; `on_cell(cell, row)` is called after
    each save (a progress hook; an exception there stops the sweep, and a rerun resumes after that cell)."""
    check_config(model, config)
    cells = plan(config)
    todo = [c for c in cells if c.key not in results]
    steps = answer_steps(model, config.task, config.seed)
    stop_ids = _stop_ids(model)
    with progress_bar(len(cells), f"{config.task}", enabled=progress, unit="cell") as bar:
        bar.update(len(cells) - len(todo))
        for _, group in itertools.groupby(todo, key=lambda c: c.spot):
            _run_spot(model, config, results, list(group), steps, stop_ids, bar, on_cell)
    return results


def _stop_ids(model) -> set[int]:
    tokenizer = getattr(model, "tokenizer", None)
    return set(tokenizer.info.stop_ids) if tokenizer is not None else set()


def _run_spot(model, config: SweepConfig, results: Results, cells: list[Cell], steps: int, stop_ids, bar,
              on_cell) -> None:
    """One prompt: build it, prefill it once (scored when a cell evicts: the whole prompt, or with the agnostic
    protocol its context), rank it again on a fork for each other scorer, then each budget and setting on a fork
    of that, and each question on a fork of the compressed one."""
    length, depth, trial = cells[0].spot
    prompt = build_prompt(config.task, model.tokenize, length, depth, seed=config.seed, trial=trial)
    ids = prompt.ids if config.protocol == "aware" else prompt.context_ids
    start = time.perf_counter()
    with model.session(snapkv_budget=0, snapkv_window=config.window, compress="snapkv") as base:
        scored = any(c.evicts for c in cells) and len(ids) > config.window
        logits = base.prefill(ids, keep_scores=scored)
        prefill_s = time.perf_counter() - start
        for scorer, scorer_cells in itertools.groupby(cells, key=lambda c: c.scorer if c.evicts else "snapkv"):
            with base.fork() as ranked:
                start = time.perf_counter()
                if scored and scorer != "snapkv":
                    ranked.rescore(model.scorer(scorer), ids)
                scoring_s = time.perf_counter() - start
                for _, group in itertools.groupby(scorer_cells, key=lambda c: (c.budget, c.ratio, c.setting)):
                    for cell, row in _run_compression(model, ranked, logits, list(group), prompt, steps, stop_ids,
                                                      config, results):
                        row["prefill_s"], row["scoring_s"] = round(prefill_s, 2), round(scoring_s, 2)
                        results.add(cell.key, row)
                        bar.update(1)
                        done = accuracy(r for r in results.rows(config.task) if not r.get("question"))
                        bar.set_postfix_str(f"score {done.hits:g}/{done.total}")
                        if on_cell is not None:
                            on_cell(cell, row)


def _run_compression(model, base, logits, cells: list[Cell], prompt, steps: int, stop_ids, config: SweepConfig,
                     results: Results):
    """Cells of one budget and setting (one per question): compress a fork once, answer each question on a fork
    of it; yields (cell, row) as each is done."""
    first = cells[0]
    with base.fork() as fork:
        start = time.perf_counter()
        compressed = fork.logical_length
        budget = first.budget_for(compressed) if first.evicts else 0
        # A prompt no longer than the scoring window is never evicted (and was not scored).
        evicted = bool(budget) and fork.logical_length > first.window and fork.evict(budget,
                                                                                     **first.setting.knobs())
        kv_slots = max(fork.kv_length)          # after eviction, before the question's or the answer's tokens
        kv_mean = round(float(np.mean(fork.kv_length)), 1)      # the memory, when layers keep different counts
        kept = _save_kept(fork, first, results) if config.show_kept and evicted and first.trial == 0 else None
        evict_s = time.perf_counter() - start
        for cell in cells:
            start = time.perf_counter()
            question_ids, answers = prompt.questions[cell.question]
            if cell.protocol == "agnostic":
                with fork.fork() as asked:                  # asked after the compression, the cache kept for the next
                    tokens = greedy(asked, asked.prefill(question_ids), steps, stop_ids)
            else:
                tokens = greedy(fork, logits, steps, stop_ids)
            output = model.detokenize(tokens)
            score = match_score(output, answers)
            yield cell, {
                "task": cell.task, "length": cell.length, "depth": cell.depth, "trial": cell.trial,
                "seed": cell.seed, "budget": budget, "ratio": cell.ratio, "question": cell.question,
                "setting": cell.line[0], "setting_label": cell.line[1], "window": cell.window,
                "scorer": cell.scorer if cell.evicts else None, "protocol": cell.protocol,
                "prompt_tokens": prompt.tokens, "compressed_tokens": compressed,
                "needle": list(prompt.needle), "needle_depth": prompt.needle_depth,
                "distractors": [list(d) for d in prompt.distractors], "answer": ", ".join(answers),
                "answers": list(answers), "output": output, "score": score, "hit": score == 1.0,
                "evicted": evicted, "kv_slots": kv_slots, "kv_mean": kv_mean, "kept": kept,
                "answer_s": round(time.perf_counter() - start + evict_s, 2)}
            evict_s = 0.0


def _save_kept(session, cell: Cell, results: Results) -> str:
    """Each layer's kept logical positions ([kv_heads, k]) in one .npz beside the results; returns its name."""
    results.kept_dir.mkdir(parents=True, exist_ok=True)
    name = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in cell.key) + ".npz"
    np.savez_compressed(results.kept_dir / name, *session.kept_positions)
    return name


def load_kept(results: Results, row: dict) -> list[np.ndarray]:
    with np.load(results.kept_dir / row["kept"]) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]
