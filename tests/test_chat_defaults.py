"""What a first command and a first chat do by default (issue #46): `sharpi run` sends the prompt as a user
message through the GGUF's chat template (`--raw` continues the text instead), greedy; `sharpi chat` samples with
the GGUF's `general.sampling.*` where it has them, else llama.cpp's defaults. On tiny random-weight llamas whose
library is the suite's tiny artifact's (tests/tiny_gguf.py: the manifest differs, the kernels do not)."""
from __future__ import annotations

import io
import sys

import pytest

import sharpi
from sharpi.cli import main as main_cli
from sharpi.codegen.targets.llvm import TARGET as LLVM
from sharpi.common.chat_sampling import LLAMA_CPP_DEFAULTS, chat_defaults, from_gguf_metadata
from tiny_gguf import fake_llvm_build, write_tiny_llama

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
QUESTION = "Which colour is the sky?"


@pytest.fixture(scope="module")
def templated(tiny_artifact, tmp_path_factory):
    """A tiny llama with a chat template and the sampling its author recommends."""
    folder = tmp_path_factory.mktemp("templated")
    gguf = write_tiny_llama(folder / "chat.gguf", chat_template=TEMPLATE, sampling={"temp": 0.3, "top_k": 7})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
        return sharpi.load(sharpi.compile(str(gguf), output=folder / "art"))


def _cli(capsys, monkeypatch, *argv, stdin: str | None = None) -> tuple[int, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main_cli.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def test_the_gguf_sampling_fields_are_read_and_bad_ones_left_to_llama_cpp():
    meta = {"general.sampling.temp": 0.30000001192092896, "general.sampling.top_k": 7,
            "general.sampling.top_p": 1.5, "general.sampling.min_p": float("nan"), "general.name": "x"}
    assert from_gguf_metadata(meta) == {"temperature": 0.3, "top_k": 7}
    assert from_gguf_metadata({"general.name": "x"}) is None
    assert chat_defaults(None) == (LLAMA_CPP_DEFAULTS, "llama.cpp's defaults (the GGUF recommends none)")
    assert chat_defaults({"top_k": 7})[0] == {**LLAMA_CPP_DEFAULTS, "top_k": 7}


def test_the_manifest_carries_the_recommendation_to_the_model(templated, tiny_artifact):
    assert templated.manifest.sampling == {"temperature": 0.3, "top_k": 7}
    assert templated.sampling_defaults == {**LLAMA_CPP_DEFAULTS, "temperature": 0.3, "top_k": 7}
    assert sharpi.load(tiny_artifact).sampling_defaults == LLAMA_CPP_DEFAULTS


def test_run_answers_a_message_unless_raw(templated, capsys, monkeypatch):
    code, out = _cli(capsys, monkeypatch, "run", templated.path, "-p", QUESTION, "-n", 6)
    assert code == 0
    message = [{"role": "user", "content": QUESTION}]
    assert templated.chat_prompt(message) == templated.tokenize(f"<user>{QUESTION}\n<assistant>", special=True)
    assert out == templated.chat(message, max_tokens=6).text + "\n"        # greedy: chat()'s default too
    code, raw = _cli(capsys, monkeypatch, "run", templated.path, "-p", QUESTION, "-n", 6, "--raw")
    assert code == 0 and raw == templated.generate(QUESTION, max_tokens=6).text + "\n"
    assert raw != out


def test_run_without_a_template_continues_the_text(tiny_artifact, capsys, monkeypatch):
    model = sharpi.load(tiny_artifact)
    assert not model.has_chat_template
    code, out = _cli(capsys, monkeypatch, "run", tiny_artifact, "-p", QUESTION, "-n", 6)
    assert code == 0 and out == model.generate(QUESTION, max_tokens=6).text + "\n"


def test_chat_samples_with_the_models_defaults_and_flags_win(templated, capsys, monkeypatch):
    message = [{"role": "user", "content": QUESTION}]
    code, out = _cli(capsys, monkeypatch, "chat", templated.path, "-n", 8, "--seed", 11, stdin=QUESTION + "\n")
    assert code == 0
    sampled = templated.chat(message, max_tokens=8, seed=11, **templated.sampling_defaults).text
    greedy = templated.chat(message, max_tokens=8).text
    assert sampled != greedy and out == f"> {sampled}\n> "          # input()'s prompts, the answer between
    code, out = _cli(capsys, monkeypatch, "chat", templated.path, "-n", 8, "--temperature", 0, stdin=QUESTION + "\n")
    assert code == 0 and out == f"> {greedy}\n> "
