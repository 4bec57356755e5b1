"""benchmarks/chat_quality.py's questions and judging, which its answer-quality numbers rest on: the question file is
well formed, each question's patterns accept the right answer in the forms models write it and refuse a wrong one or
an echo of the question, output is cut at the first end-of-generation id, and the paired discordance pairs the
right questions. (The benchmark itself runs models and is not part of the suite.)"""
import importlib.util
import re
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "chat_quality.py"
_spec = importlib.util.spec_from_file_location("chat_quality", _PATH)
chat_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_quality)

QUESTIONS = chat_quality.load_questions()


def test_the_question_file_holds_about_fifty_distinct_questions():
    assert 45 <= len(QUESTIONS) <= 60
    assert len({q["question"] for q in QUESTIONS}) == len(QUESTIONS)


@pytest.mark.parametrize("q", QUESTIONS, ids=[q["id"] for q in QUESTIONS])
def test_an_echo_of_the_question_is_not_an_answer(q):
    assert not chat_quality.is_right(q["question"], q["answers"])


@pytest.mark.parametrize("text, answers, right", [
    ("The capital of France is Paris.", [r"\bparis\b"], True),
    ("PARIS", [r"\bparis\b"], True),                       # case-insensitive
    ("Parisian food is good.", [r"\bparis\b"], False),     # a word, not a prefix
    ("7 + 5 = 12", [r"\b12\b", r"\btwelve\b"], True),
    ("Seven plus five is twelve.", [r"\b12\b", r"\btwelve\b"], True),
    ("7 + 5 = 125", [r"\b12\b", r"\btwelve\b"], False),
    ("There are 1,000 grams in a kilogram.", [r"\b1,?000\b", r"\bthousand\b"], True),
    ("", [r"\bblue\b"], False),
])
def test_is_right(text, answers, right):
    assert chat_quality.is_right(text, answers) is right


def test_every_question_accepts_its_answer_said_plainly():
    """Each question's first pattern, turned back into the words it stands for, is accepted in a sentence (the
    first patterns are plain words or numbers with optional parts)."""
    for q in QUESTIONS:
        words = re.sub(r"\\b|,?\?", "", q["answers"][0])      # r"\b1,?000\b" -> "1000", r"\blions?\b" -> "lion"
        assert chat_quality.is_right(f"The answer is {words}.", q["answers"]), q["id"]


def test_load_questions_refuses_a_duplicate_id_and_a_bad_pattern(tmp_path):
    path = tmp_path / "q.json"
    path.write_text('{"questions": [{"id": "a", "question": "Q?", "answers": ["x"]},'
                    ' {"id": "a", "question": "R?", "answers": ["y"]}]}')
    with pytest.raises(ValueError, match="twice"):
        chat_quality.load_questions(path)
    path.write_text('{"questions": [{"id": "a", "question": "Q?", "answers": ["(unclosed"]}]}')
    with pytest.raises(re.error):
        chat_quality.load_questions(path)
    path.write_text('{"questions": [{"id": "a", "question": "Q?", "answers": []}]}')
    with pytest.raises(ValueError, match="at least one"):
        chat_quality.load_questions(path)


def test_cut_at_stop_keeps_what_comes_before_the_first_stop_id():
    assert chat_quality.cut_at_stop([5, 6, 2, 7, 0], {0, 2}) == [5, 6]
    assert chat_quality.cut_at_stop([5, 6, 7], {0, 2}) == [5, 6, 7]
    assert chat_quality.cut_at_stop([0, 5], [0]) == []


def test_discordant_pairs_right_under_one_engine_with_wrong_under_the_other():
    def row(engine, qid, right):
        return {"engine": engine, "id": qid, "right": right}
    rows = [row("llama.cpp", "a", True), row("sharpi-int8", "a", False),
            row("llama.cpp", "b", True), row("sharpi-int8", "b", True),
            row("llama.cpp", "c", False), row("sharpi-int8", "c", True),
            row("llama.cpp", "d", False), row("sharpi-int8", "d", False)]
    lost = chat_quality.discordant(rows, "llama.cpp", "sharpi-int8")
    won = chat_quality.discordant(rows, "sharpi-int8", "llama.cpp")
    assert [(a["id"], a["engine"], b["engine"]) for a, b in lost] == [("a", "llama.cpp", "sharpi-int8")]
    assert [a["id"] for a, _ in won] == ["c"]


def test_a_completion_is_judged_on_its_first_line_a_chat_answer_whole():
    output = " Paris\n\nQ: What is the capital of Germany?\nA: Berlin"
    assert chat_quality.answer_part(output, "completion") == "Paris"
    assert chat_quality.answer_part(output, "chat") == output
    assert not chat_quality.is_right(chat_quality.answer_part(" Lyon\nA: Berlin", "completion"), [r"\bberlin\b"])


@pytest.mark.parametrize("lost, won, p", [(0, 0, 1.0), (2, 2, 1.0), (3, 1, 0.625), (5, 0, 0.0625), (0, 6, 0.03125)])
def test_the_sign_test_matches_the_binomial_tail(lost, won, p):
    assert chat_quality.sign_test_p(lost, won) == pytest.approx(p)
