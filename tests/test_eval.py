"""sharpi eval: prompts built in tokens, string-match scoring, resumable sweeps, plots and the CLI's errors."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from sharpi.common.errors import ConfigError, ContextLengthError
from sharpi.eval.report import budget_table, write_report
from sharpi.eval.scoring import accuracy, is_hit, match_score, paired_gap
from sharpi.eval.sweep import (Results, Setting, SweepConfig, answer_steps, greedy, plan, resolve_settings,
                               run_sweep)
from sharpi.eval.tasks import CONTENT, build_prompt, trial_rng

TIMING = ("prefill_s", "scoring_s", "answer_s")
DEFAULT = Setting("kv-head", "max", 15, 16)
SEED = Setting("shared", "none", 1, 16)


# -- a fake model: a word tokenizer and a "session" that decodes the prompt's first number unless a small
# budget evicted it, so sweeps run in milliseconds and hits and misses both occur ----------------------------
class FakeTokenizer:
    def __init__(self):
        self.vocab, self.words = {}, []

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in re.findall(r"\w+|[^\w\s]", text):
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def detokenize(self, ids) -> str:
        return "".join(" " + self.words[i] for i in ids)


class FakeSession:
    def __init__(self, model, ids=None, budget=0):
        self.model, self.ids, self.budget = model, ids, budget

    def prefill(self, ids, keep_scores=False):
        self.model.prefills += 1
        self.ids = list(ids)
        return self._logits(self.model.tok.vocab["."])      # like the real one: the first answer token comes
                                                            # from the full prefill, before any eviction

    def _answer(self) -> int:
        numbers = [i for i in self.ids if self.model.tok.words[i].isdigit()]
        small = 0 < self.budget < 48
        return self.model.tok.vocab["."] if small or not numbers else numbers[0]

    def _logits(self, token: int) -> np.ndarray:
        logits = np.zeros(len(self.model.tok.words) + 1, np.float32)
        logits[token] = 1.0
        return logits

    def fork(self):
        self.model.forks += 1
        return FakeSession(self.model, self.ids, self.budget)

    def evict(self, budget, **knobs):
        self.budget = budget
        return len(self.ids) > budget

    def rescore(self, scorer, ids):
        assert list(ids) == self.ids
        self.model.rescored.append(scorer)

    def decode(self, token):
        return self._logits(self._answer())

    @property
    def logical_length(self):
        return len(self.ids)

    @property
    def kv_length(self):
        n = self.budget if self.budget else len(self.ids)
        return [min(n, len(self.ids))] * 2

    @property
    def kept_positions(self):
        n = self.kv_length[0]
        return [np.stack([np.arange(len(self.ids) - n, len(self.ids))] * 2) for _ in range(2)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class FakeModel:
    max_context = 4096

    def __init__(self):
        self.tok = FakeTokenizer()
        self.tokenize, self.detokenize = self.tok.tokenize, self.tok.detokenize
        self.manifest = SimpleNamespace(source={"name": "fake.gguf", "sha256": "0" * 64}, target={"kind": "fake"})
        self.prefills = self.forks = 0
        self.rescored = []

    def session(self, **knobs):
        return FakeSession(self)

    def scorer(self, name):
        return name


def _config(**changes) -> SweepConfig:
    base = dict(task="passkey", lengths=[120, 200], depths=[0, 50, 100], budgets=[0, 32, 64], trials=2, seed=3,
                settings=[DEFAULT, SEED], window=16)
    return SweepConfig(**{**base, **changes})


def _untimed(results: Results) -> dict:
    return {k: {f: v for f, v in row.items() if f not in TIMING} for k, row in results.cells.items()}


# -- prompts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["passkey", "needle", "multikey", "multivalue", "multiquery", "vartrack"])
def test_prompt_hits_length_and_depth_in_tokens(smollm2, task):
    tokenize = smollm2.tokenize
    for length in (400, 1500):
        ends = [build_prompt(task, tokenize, length, d, seed=1, trial=2).needle[0] for d in (0, 100)]
        for depth in (0, 30, 75, 100):
            p = build_prompt(task, tokenize, length, depth, seed=1, trial=2)
            assert p.ids == tokenize(p.text)
            assert length - (6 if task == "passkey" else 1) <= p.tokens <= length
            start, end = p.needle
            assert p.answers[0] in smollm2.detokenize(p.ids[start:end])
            if task != "vartrack":              # a chain's names appear twice: assigned, then assigned from
                for answer in p.answers:
                    assert p.text.count(answer) == 1 + (task == "passkey")   # llama.cpp's needle says it twice
            target = ends[0] + depth / 100 * (ends[1] - ends[0])
            # within one filler sentence (passkey), or a few percent of the span, or half of what a step to the
            # next boundary can cross in a short prompt: a long sentence of prose (Alice's run to 60 tokens) and
            # another needle (25) placed there
            tolerance = 6 if task == "passkey" else max(0.05 * (ends[1] - ends[0]), 45)
            assert abs(start - target) <= tolerance, (depth, p.needle)
            assert p.needle_depth == pytest.approx(100 * (start - ends[0]) / (ends[1] - ends[0]), abs=0.01)
            assert end <= p.tokens - 10                                          # the question follows
            # the context and the question the agnostic protocol feeds apart: the prompt's own tokens
            assert p.context_ids + p.question_ids == p.ids and end <= p.question_start
            assert smollm2.detokenize(p.question_ids).strip() == CONTENT[task](trial_rng(1, task, 2)).question
        if task in ("multivalue", "multiquery", "vartrack"):        # every expected string is in a needle
            needles = [smollm2.detokenize(p.ids[a:b]) for a, b in [p.needle, *p.distractors]]
            assert all(any(answer in n for n in needles) for answer in p.answers) and len(p.answers) >= 4
        if task == "multikey":
            assert len(p.distractors) == 3
            assert all(str(smollm2.detokenize(p.ids[s:e])).strip().startswith("One of the special magic numbers")
                       for s, e in p.distractors)


@pytest.mark.parametrize("task, asked", [("multikey", 4), ("multiquery", 5), ("needle", 1)])
def test_follow_up_questions_continue_the_same_context(smollm2, task, asked):
    """A follow-up's tokens are what follows the context when that question ends the prompt; its answers are
    the needles' values (each key of a multikey or multiquery prompt in turn)."""
    p = build_prompt(task, smollm2.tokenize, 600, 40, seed=2, trial=1)
    content = CONTENT[task](trial_rng(2, task, 1))
    assert len(p.questions) == asked and p.questions[0] == (p.question_ids, p.answers)
    context = p.text[:len(p.text) - len(content.question)]
    for (ids, answers), (question, expected) in zip(p.questions, content.questions):
        assert p.context_ids + ids == smollm2.tokenize(context + question)
        assert smollm2.detokenize(ids).strip() == question and answers == expected
    needles = " ".join(smollm2.detokenize(p.ids[a:b]) for a, b in [p.needle, *p.distractors])
    assert all(a in needles for _, answers in p.questions for a in answers)


def test_vartrack_chain_resolves_to_the_value(smollm2):
    p = build_prompt("vartrack", smollm2.tokenize, 800, 30, seed=0, trial=3)
    value = re.search(r"assigned the value (\d+)", smollm2.detokenize(p.question_ids)).group(1)
    assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", p.text))
    resolve = lambda name: assigned[name] if assigned[name].isdigit() else resolve(assigned[name][4:])
    assert sorted(n for n in assigned if resolve(n) == value) == sorted(p.answers) and len(p.answers) == 5


@pytest.mark.parametrize("length", [300, 1200])
def test_commonwords_list_has_the_answers_most_often(smollm2, length):
    p = build_prompt("commonwords", smollm2.tokenize, length, 50, seed=0, trial=0)
    assert length - 20 <= p.tokens <= length and p.ids == smollm2.tokenize(p.text)   # a rare word is 3 items
    words = re.findall(r"\d+\. ([a-z]+)", smollm2.detokenize(p.context_ids))
    counts = {w: words.count(w) for w in set(words)}
    common = {counts[a] for a in p.answers}
    assert len(p.answers) == 10 and len(common) == 1                # each common word equally often
    assert min(common) > max(c for w, c in counts.items() if w not in p.answers) == 3
    # twice as many rare words as common ones where the length allows (a short list lowers the common count)
    assert len(counts) - 10 >= (20 if length >= 1200 else 1)
    other = build_prompt("commonwords", smollm2.tokenize, length, 25, seed=0, trial=0)
    assert other.answers != p.answers         # no needle: another depth is another prompt
    with pytest.raises(ConfigError, match="commonwords prompt needs at least"):
        build_prompt("commonwords", smollm2.tokenize, 60, 50)


def test_prompt_content_is_fixed_per_trial_and_differs_across_trials(smollm2):
    a = build_prompt("needle", smollm2.tokenize, 500, 20, seed=0, trial=0)
    b = build_prompt("needle", smollm2.tokenize, 900, 80, seed=0, trial=0)
    c = build_prompt("needle", smollm2.tokenize, 500, 20, seed=0, trial=1)
    assert a.answer == b.answer and a.answer != c.answer


def test_prompt_refuses_bad_length_and_depth():
    tok = FakeTokenizer()
    with pytest.raises(ConfigError, match="at least"):
        build_prompt("passkey", tok.tokenize, 10, 50)
    with pytest.raises(ConfigError, match="between 0 and 100"):
        build_prompt("passkey", tok.tokenize, 200, 150)


# -- scoring -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("output, answer, hit", [
    (" 60494. Remember", "60494", True),
    ("The pass key is 60494", "60494", True),
    (" 604941.", "60494", False),          # a longer number is not the key
    (" 160494", "60494", False),
    (" the pass key.", "60494", False),
    ("", "60494", False),
    (" Cardamom, of course", "cardamom", True),
    (" cardamoms", "cardamom", False),
    (" 4311683.", "4311683", True),
])
def test_string_match(output, answer, hit):
    assert is_hit(output, answer) is hit


def test_accuracy_counts():
    acc = accuracy([{"hit": True}, {"hit": False}, {"hit": True}])
    assert (acc.hits, acc.total, str(acc)) == (2, 3, "67% (2/3)")
    assert str(accuracy([])) == "-"
    assert str(accuracy([{"hit": False, "score": 0.75}, {"hit": True, "score": 1.0}])) == "88% (1.75/2)"


def test_match_score_is_the_share_of_expected_strings():
    assert match_score(" 123, 456 and 789", ["123", "456", "789", "101"]) == 0.75
    assert match_score(" ABCDE, FGHIJ", ["abcde"]) == 1.0 and match_score("", ["1"]) == 0.0


def test_paired_gap_bootstrap():
    same = paired_gap({"a": [(1.0, 1.0), (0.0, 0.0)] * 10})
    assert (same.points, same.low, same.high, same.prompts) == (0.0, 0.0, 0.0, 20)
    # a line that loses one prompt in four on task a and nothing on b: the suite's gap is the mean over tasks
    few = paired_gap({"a": [(0.0, 1.0)] + [(1.0, 1.0)] * 3, "b": [(1.0, 1.0)] * 4})
    many = paired_gap({"a": ([(0.0, 1.0)] + [(1.0, 1.0)] * 3) * 25, "b": [(1.0, 1.0)] * 100})
    assert few.points == many.points == -12.5
    for gap in (few, many):
        assert gap.low <= gap.points <= gap.high <= 0
    assert many.high - many.low < (few.high - few.low) / 3       # 25x the prompts: about a fifth the width
    assert str(many).startswith("-12.5 [") and str(paired_gap({})) == "-"


# -- sweeps --------------------------------------------------------------------------------------------------
def test_sweep_forks_one_prefill_per_prompt(tmp_path):
    model = FakeModel()
    results = run_sweep(model, _config(), Results(tmp_path / "r.json", {"name": "fake"}), progress=False)
    assert len(results.cells) == len(plan(_config())) == 2 * 2 * 3 * (1 + 2 * 2)
    # one fork ranks each prompt (one scorer here), then one per cell
    assert model.prefills == 2 * 2 * 3 and model.forks == 2 * 2 * 3 + len(results.cells)
    rows = results.rows()
    assert all(r["hit"] for r in rows if r["budget"] in (0, 64))          # the fake keeps the key at 64
    assert not any(r["hit"] for r in rows if r["budget"] == 32)
    assert {r["setting"] for r in rows} == {"full", DEFAULT.key, SEED.key}
    assert json.loads((tmp_path / "r.json").read_text())["cells"].keys() == results.cells.keys()


def test_interrupted_sweep_resumes_without_recomputing(tmp_path):
    whole = run_sweep(FakeModel(), _config(), Results(tmp_path / "whole.json", {"name": "fake"}), progress=False)

    class Stop(Exception):
        pass

    def stop_after(n):
        done = []

        def hook(cell, row):
            done.append(cell.key)
            if len(done) == n:
                raise Stop
        return hook, done

    path = tmp_path / "part.json"
    hook, first = stop_after(7)
    with pytest.raises(Stop):
        run_sweep(FakeModel(), _config(), Results(path, {"name": "fake"}), progress=False, on_cell=hook)
    assert len(Results(path).cells) == 7                                  # saved as each cell finished

    hook, second = stop_after(10**9)
    resumed = run_sweep(FakeModel(), _config(), Results(path, {"name": "fake"}), progress=False, on_cell=hook)
    assert not set(first) & set(second) and len(first) + len(second) == len(whole.cells)
    assert _untimed(resumed) == _untimed(whole)
    assert _untimed(Results(path)) == _untimed(whole)                     # and so is the file

    third = []
    run_sweep(FakeModel(), _config(), Results(path, {"name": "fake"}), progress=False,
              on_cell=lambda cell, row: third.append(cell))
    assert third == []                                                    # a finished sweep runs nothing


def test_setting_keys_with_and_without_sinks():
    """sinks 0 keeps the keys and labels results files were written with before sinks existed; sinks > 0 is
    another line."""
    assert DEFAULT.sinks == 0 and DEFAULT == Setting("kv-head", "max", 15, 16, 0)
    assert DEFAULT.key == "kv-head/max/k15/r16" and DEFAULT.label == "kv-head, max-pool 15"
    assert SEED.key == "shared/none/k1/r16" and SEED.label == "shared, no pooling"
    sinks = Setting("kv-head", "max", 15, 16, 4)
    assert sinks.key == "kv-head/max/k15/r16/s4" and sinks.key != DEFAULT.key
    assert sinks.label == "kv-head, max-pool 15, 4 sinks" and Setting("shared", "none", 1, 16, 1).label.endswith(
        ", 1 sink")
    assert sinks.knobs()["sinks"] == 4 and DEFAULT.knobs()["sinks"] == 0
    pyramid = Setting("kv-head", "max", 15, 16, 4, "pyramid")              # another line, older keys unchanged
    assert pyramid.key == "kv-head/max/k15/r16/s4/pyramid" and pyramid.label.endswith(", pyramid layers")
    assert pyramid.knobs()["allocation"] == "pyramid" and DEFAULT.knobs()["allocation"] == "uniform"


def test_resolve_settings_one_line_per_allocation(smollm2):
    _, settings = resolve_settings(smollm2, allocations=("uniform", "pyramid"), budgets=[128])
    assert [s.allocation for s in settings] == ["uniform", "pyramid"] and settings[0].key != settings[1].key


class KnobsModel(FakeModel):
    """A fake model whose forks record the knobs each eviction was given."""

    def __init__(self):
        super().__init__()
        self.evictions = []

    def session(self, **knobs):
        model = self

        class Recording(FakeSession):
            def fork(self):
                model.forks += 1
                return Recording(model, self.ids, self.budget)

            def evict(self, budget, **knobs):
                model.evictions.append(knobs)
                return super().evict(budget, **knobs)
        return Recording(self)


def test_results_written_before_sinks_resume_and_sinks_add_lines(tmp_path):
    path = tmp_path / "r.json"
    config = _config(lengths=[120], depths=[0], trials=1, settings=[DEFAULT])
    run_sweep(FakeModel(), config, Results(path, {"name": "fake"}), progress=False)
    raw = json.loads(path.read_text())
    # the cell keys and rows of a file written before sinks existed: no sinks anywhere
    assert "passkey|L120|D0|T0|S3|B32|kv-head/max/k15/r16|w16" in raw["cells"]
    assert not any("sinks" in row or "/s" in row["setting"] for row in raw["cells"].values())
    model = KnobsModel()
    run_sweep(model, config, Results(path, {"name": "fake"}), progress=False)
    assert model.prefills == 0 and model.evictions == []                  # resumed: nothing recomputed
    with_sinks = Setting("kv-head", "max", 15, 16, 4)
    results = run_sweep(model, _config(lengths=[120], depths=[0], trials=1, settings=[DEFAULT, with_sinks]),
                        Results(path, {"name": "fake"}), progress=False)
    assert model.evictions == [with_sinks.knobs()] * 2                    # budgets 32 and 64, the new line only
    assert {r["setting"] for r in results.rows()} == {"full", DEFAULT.key, with_sinks.key}
    assert {r["setting_label"] for r in results.rows()} >= {DEFAULT.label, "kv-head, max-pool 15, 4 sinks"}
    text = "\n".join(budget_table(results.rows()))
    assert "| kv-head, max-pool 15 | 120 |" in text and "| kv-head, max-pool 15, 4 sinks | 120 |" in text


def test_results_file_of_another_model_is_refused(tmp_path):
    path = tmp_path / "r.json"
    Results(path, {"name": "a.gguf", "target": "llvm"}).save()
    with pytest.raises(ConfigError, match="another --out"):
        Results(path, {"name": "b.gguf", "target": "llvm"})
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable results file"):
        Results(path)


def test_sweep_checks_lengths_against_the_context(tmp_path):
    with pytest.raises(ContextLengthError, match="no room for the 4-token answer"):
        run_sweep(FakeModel(), _config(lengths=[4096]), Results(tmp_path / "r.json"), progress=False)


def test_real_model_tiny_sweep(smollm2, tmp_path):
    window, settings = resolve_settings(smollm2, budgets=[128])
    config = SweepConfig(task="passkey", lengths=[300], depths=[0], budgets=[0, 128], trials=1, settings=settings,
                         window=window, show_kept=True)
    results = run_sweep(smollm2, config, Results(tmp_path / "real.json", {"name": "smollm2"}), progress=False)
    full, evicted = sorted(results.rows(), key=lambda r: r["budget"])
    assert full["hit"], full["output"]                        # a 300-token passkey with its needle up front
    assert evicted["evicted"] and evicted["kv_slots"] == 128 == evicted["kv_mean"] and not full["evicted"]
    kept = np.load(results.kept_dir / evicted["kept"])
    assert len(kept.files) == smollm2.config.n_layers
    assert kept["arr_0"].shape == (smollm2.config.n_kv_heads, 128)
    assert (kept["arr_0"][:, -64:] == np.arange(full["prompt_tokens"] - 64, full["prompt_tokens"])).all()


def test_real_model_agnostic_protocol_with_two_scorers(smollm2, tmp_path):
    """The context compressed, the question fed after: the full cache answers as the aware protocol's does; each
    scorer's cells are lines of their own; the report has a section for the protocol."""
    window, settings = resolve_settings(smollm2, budgets=[96], recency=16)
    config = SweepConfig(task="passkey", lengths=[300], depths=[50], budgets=[0, 96], trials=1, settings=settings,
                         window=window, scorers=["snapkv", "kvzip"], protocol="agnostic")
    results = run_sweep(smollm2, config, Results(tmp_path / "agnostic.json", {"name": "smollm2"}), progress=False)
    rows = {(r["budget"], r["scorer"]): r for r in results.rows()}
    assert set(rows) == {(0, None), (96, "snapkv"), (96, "kvzip")} and len(results.cells) == 3
    assert all(r["protocol"] == "agnostic" for r in rows.values())
    prompt = build_prompt("passkey", smollm2.tokenize, 300, 50)
    with smollm2.session(snapkv_budget=0) as s:                 # the context, then the question, uncompressed
        s.prefill(prompt.context_ids)
        tokens = greedy(s, s.prefill(prompt.question_ids), answer_steps(smollm2, "passkey", 0),
                        set(smollm2.tokenizer.info.stop_ids))
    assert rows[(0, None)]["output"] == smollm2.detokenize(tokens) and rows[(0, None)]["hit"]
    for scorer in ("snapkv", "kvzip"):
        assert rows[(96, scorer)]["evicted"] and rows[(96, scorer)]["kv_slots"] == 96
        assert rows[(96, scorer)]["prompt_tokens"] == prompt.tokens
    assert rows[(96, "kvzip")]["setting"].endswith("/kvzip") and "kvzip" in rows[(96, "kvzip")]["setting_label"]
    assert all("|pagnostic" in key for key in results.cells)
    text, _ = write_report(results, tmp_path / "report", plots=False)
    assert "## passkey, the question asked after the compression" in text and "| kvzip, " in text
    with pytest.raises(ConfigError, match="--scorers"):
        run_sweep(smollm2, replace(config, scorers=["zip"]), Results(tmp_path / "x.json"), progress=False)


def test_ratio_budgets_follow_each_prompt(tmp_path):
    config = _config(budgets=[0], ratios=[50, 75], lengths=[120, 200], depths=[50], trials=1, settings=[DEFAULT])
    results = run_sweep(FakeModel(), config, Results(tmp_path / "r.json", {"name": "fake"}), progress=False)
    rows = [r for r in results.rows() if r["ratio"]]
    assert len(rows) == 4 and all(r["budget"] == round(r["compressed_tokens"] * (100 - r["ratio"]) / 100)
                                  for r in rows)
    assert {(r["length"], r["ratio"]) for r in rows} == {(120, 50), (120, 75), (200, 50), (200, 75)}
    assert all("|R50|" in k or "|R75|" in k or "|B0|" in k for k in results.cells)
    text, _ = write_report(results, tmp_path / "report", plots=False)
    assert "| setting | prompt tokens | 50% compression | 75% compression | full cache |" in text


def test_all_questions_share_one_compression(tmp_path):
    """--questions all: every follow-up on a fork of the one compressed fork; the full cache answers each too."""
    model = FakeModel()
    config = _config(task="multikey", lengths=[300], depths=[50], budgets=[0, 64], trials=1, settings=[DEFAULT],
                     protocol="agnostic", questions="all")
    results = run_sweep(model, config, Results(tmp_path / "r.json", {"name": "fake"}), progress=False)
    assert len(results.cells) == 2 * 4 and model.prefills == 1 + 2 * 4       # the context once, each question
    # one ranked fork; per budget the compression's fork, then one a question
    assert model.forks == 1 + 2 * (1 + 4)
    scorers = FakeModel()
    run_sweep(scorers, replace(config, scorers=["snapkv", "kvzip", "probe"], questions="first"),
              Results(tmp_path / "s.json", {"name": "fake"}), progress=False)
    assert scorers.prefills == 1 + 4 and scorers.rescored == ["kvzip", "probe"]   # one prefill, ranked thrice
    assert sorted(r["question"] for r in results.rows()) == [0, 0, 1, 1, 2, 2, 3, 3]
    answers = {r["question"]: r["answers"] for r in results.rows()}
    assert len({a[0] for a in answers.values()}) == 4                   # each asks another key
    text, _ = write_report(results, tmp_path / "report", plots=False)
    assert "| setting | budget | question 1 | question 2 | question 3 | question 4 |" in text
    assert plan(replace(config, protocol="aware")) == [c for c in plan(replace(config, protocol="aware"))
                                                       if c.question == 0]   # aware: the prompt's own only


def test_suite_report_scores_the_mean_over_tasks(tmp_path):
    results = Results(tmp_path / "r.json", {"name": "fake"})
    for task in ("needle", "vartrack"):
        run_sweep(FakeModel(), _config(task=task, lengths=[200], depths=[0, 50], trials=2, settings=[DEFAULT]),
                  results, progress=False)
    text, files = write_report(results, tmp_path / "report", plots=True)
    assert "## RULER-style suite, aware protocol" in text and "budget-suite-aware.png" in {f.name for f in files}
    line = next(l for l in text.splitlines() if l.startswith("| kv-head, max-pool 15 |") and "n=" in l)
    assert "n=8)" in line and "[" in line


def test_real_model_follow_up_questions_on_one_compression(smollm2, tmp_path):
    """Each follow-up is answered from the one compressed cache exactly as a compression of its own answers it
    (a fork of the scored context evicted again per question); the ratio's budget is half the context."""
    window, settings = resolve_settings(smollm2, budgets=[96], recency=16)
    config = SweepConfig(task="multikey", lengths=[320], depths=[40], budgets=[0], ratios=[50], trials=1,
                         settings=settings, window=window, scorers=["probe"], protocol="agnostic", questions="all")
    results = run_sweep(smollm2, config, Results(tmp_path / "r.json", {"name": "smollm2"}), progress=False)
    rows = {(r["budget"] > 0, r["question"]): r for r in results.rows()}
    assert len(rows) == len(results.cells) == 8
    prompt = build_prompt("multikey", smollm2.tokenize, 320, 40)
    budget = round(len(prompt.context_ids) / 2)
    steps, stops = answer_steps(smollm2, "multikey", 0), set(smollm2.tokenizer.info.stop_ids)
    with smollm2.session(snapkv_budget=0, compress="probe") as scored:
        scored.prefill(prompt.context_ids, keep_scores=True)
        for q, (ids, answers) in enumerate(prompt.questions):
            assert rows[(True, q)]["budget"] == budget and rows[(True, q)]["kv_slots"] == budget
            with scored.fork() as s:
                assert s.evict(budget, **settings[0].knobs())
                expected = smollm2.detokenize(greedy(s, s.prefill(ids), steps, stops))
            assert rows[(True, q)]["output"] == expected and rows[(True, q)]["answers"] == list(answers)
    # the full cache, asked each key after the context: SmolLM2-135M finds most of them (a check that the
    # follow-ups' tokens are questions it can answer, not a figure)
    assert sum(rows[(False, q)]["hit"] for q in range(4)) >= 2, [r["output"] for r in rows.values()]


# -- plots and report ----------------------------------------------------------------------------------------
def test_report_and_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    config = _config(lengths=[120], depths=[0, 50], show_kept=True)
    results = run_sweep(FakeModel(), config, Results(tmp_path / "r.json", {"name": "fake"}), progress=False)
    text, files = write_report(results, tmp_path / "report", show_kept=True)
    names = {f.name for f in files}
    assert {"report.md", "budget-passkey.png", f"heatmap-passkey-{DEFAULT.key.replace('/', '_')}.png",
            "kept-passkey-L120-D50.png"} <= names
    for f in files:
        assert f.is_file() and f.stat().st_size > (5000 if f.suffix == ".png" else 100)
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| setting | prompt tokens | budget 32 | budget 64 | full cache |" in text
    assert "| kv-head, max-pool 15 | 120 | 0% (0/4) | 100% (4/4) | 100% (4/4) |" in text


# -- the CLI -------------------------------------------------------------------------------------------------
def _cli(capsys, *argv) -> tuple[int, list[str]]:
    from sharpi.cli.main import main
    try:
        code = main(["eval", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, words", [
    (["passkey"], "required"),
    (["sorting", "art"], "invalid choice"),
    (["passkey", "art", "--lengths", "2k"], "--lengths"),
    (["passkey", "art", "--depths", "-5"], "--depths"),
    (["report", "/nonexistent/results.json"], "not a results file"),
    (["passkey", "/nonexistent/artifact"], "artifact"),
])
def test_cli_bad_arguments_exit_2_with_one_line(capsys, argv, words):
    code, err = _cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0], err


@pytest.mark.parametrize("flags, words", [
    (["--lengths", "9000"], "context"),
    (["--snapkv-pooling", "max,bogus"], "pooling"),
    (["--budgets", "0,32"], "recency"),
    (["--snapkv-budget", "256"], "--budgets"),
    (["--budgets", "0,128", "--snapkv-sinks", "0,64"], "recency + sinks (64 + 64)"),
    (["--snapkv-sinks", "2,-1"], "snapkv_sinks must be an integer in [0, "),
    (["--ratios", "100"], "in [0, 100)"),
    (["--ratios", "90", "--lengths", "400"], "90% compression of a 400-token prompt leaves 40 slots"),
])
def test_cli_bad_sweeps_exit_2_with_one_line(capsys, smollm2_artifact, tmp_path, flags, words):
    code, err = _cli(capsys, "passkey", str(smollm2_artifact), "--out", str(tmp_path / "r.json"), "--quiet", *flags)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0], err


def test_cli_ruler_refuses_unknown_tasks_before_any_work(capsys, smollm2_artifact, tmp_path):
    code, err = _cli(capsys, "ruler", str(smollm2_artifact), "--tasks", "needle,sorting", "--quiet",
                     "--out", str(tmp_path / "r.json"))
    assert code == 2 and len(err) == 1 and "--tasks" in err[0] and "sorting" in err[0], err
    code, err = _cli(capsys, "ruler", str(smollm2_artifact), "--tasks", "needle,commonwords", "--lengths", "100",
                     "--quiet", "--out", str(tmp_path / "r.json"))
    assert code == 2 and "commonwords prompt needs at least" in err[0] and not (tmp_path / "r.json").exists(), err
