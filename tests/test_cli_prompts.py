"""The CLI for long prompts (issue #46): `sharpi run` reads the prompt from -p, --file or stdin, `sharpi chat
--file` puts a document before the first question, --compress picks the scorer (over SHARPI_COMPRESS), --verbose
says what the compression kept, and a SnapKV budget below the default recency shrinks the recency with a note.
On the tiny random-weight llama (byte-level vocabulary: a token a byte; context 256; SnapKV window 64)."""
from __future__ import annotations

import io
import sys

import pytest

import sharpi
from sharpi.cli import main as main_cli
from sharpi.common.snapkv_settings import ENV, SnapKVSettings, fit_recency
from sharpi.runtime.model import GenerationResult, Model

SHORT = "The quick brown fox jumps over the lazy dog."
LONG = "The grass is green and the sky is blue. " * 3 + "The code is 4721. " + "Birds sing. " * 3 + "Code?"


def _run(capsys, *argv) -> tuple[int, str, list[str]]:
    code = main_cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.splitlines()


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch):
    """The defaults these tests expect, whatever the environment says."""
    for name in (*ENV.values(), "SHARPI_COMPRESS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny(tiny_artifact):
    return sharpi.load(tiny_artifact)


def test_file_and_stdin_give_the_same_prompt_as_p(tiny_artifact, tmp_path, capsys, monkeypatch):
    code, expected, _ = _run(capsys, "run", tiny_artifact, "-p", SHORT, "-n", 6)
    assert code == 0
    path = tmp_path / "prompt.txt"
    path.write_text(SHORT + "\n", encoding="utf-8")          # an editor's trailing newline is dropped
    assert _run(capsys, "run", tiny_artifact, "--file", path, "-n", 6)[:2] == (0, expected)
    path.write_bytes(b"\xef\xbb\xbf" + SHORT.encode() + b"\r\n")   # a byte-order mark and CRLF too
    assert _run(capsys, "run", tiny_artifact, "--file", path, "-n", 6)[:2] == (0, expected)
    for flags in (["-p", "-"], ["--file", "-"]):
        _stdin(monkeypatch, SHORT.encode() + b"\n")
        assert _run(capsys, "run", tiny_artifact, *flags, "-n", 6)[:2] == (0, expected), flags


def test_a_file_and_a_question_make_one_prompt(tiny, tiny_artifact, tmp_path, capsys, monkeypatch):
    path = tmp_path / "doc.txt"
    path.write_text(LONG + "\n", encoding="utf-8")
    code, out, _ = _run(capsys, "run", tiny_artifact, "--file", path, "-p", SHORT, "-n", 6)
    assert code == 0 and out == tiny.generate(f"{LONG}\n\n{SHORT}", max_tokens=6).text + "\n"
    _stdin(monkeypatch, SHORT.encode())
    assert _run(capsys, "run", tiny_artifact, "--file", path, "-p", "-", "-n", 6)[:2] == (0, out)


@pytest.mark.parametrize("argv, stdin, words", [
    (["run", "{art}", "--file", "{tmp}/missing.txt"], None, "missing.txt does not exist"),
    (["run", "{art}", "--file", "{tmp}"], None, "is a directory"),
    (["run", "{art}", "--file", "{tmp}/latin1.txt"], None, "is not UTF-8 text (byte 0xe9 at offset 3)"),
    (["run", "{art}", "--file", "{tmp}/empty.txt"], None, "empty.txt is empty"),
    (["run", "{art}", "-p", "-"], b"\xff\xfe", "stdin is not UTF-8 text"),
    (["run", "{art}", "--file", "-"], b"", "stdin is empty"),
    (["run", "{art}"], None, "Give the prompt with -p TEXT or --file PATH"),
    (["run", "{art}", "-p", "-", "--file", "-"], None, "would both read stdin"),
    (["run", "{art}", "-p", "hi", "--file", "{tmp}/latin1.txt"], None, "is not UTF-8 text"),
    (["chat", "{art}", "--file", "-"], None, "give the document's path"),
    (["chat", "{art}", "--file", "{tmp}/missing.txt"], None, "missing.txt does not exist"),
    (["chat", "{art}", "--file", "{tmp}/long.txt"], None, "leaves no room for a question in the context of 256"),
    (["run", "{art}", "-p", "hi", "--compress", "bogus"], None,
     "--compress must be one of snapkv, kvzip, probe, keydiff, hybrid, got 'bogus'"),
    (["chat", "{art}", "--compress", "Nope"], None, "--compress must be one of snapkv, kvzip, probe, keydiff, hybrid"),
    (["run", "{art}", "-p", "hi", "--snapkv-budget", "32", "--snapkv-recency", "32"], None,
     "SnapKV recency (32) must be smaller than the budget (32)"),
])
def test_bad_prompts_and_flags_exit_2_with_one_line(tiny_artifact, tmp_path, capsys, monkeypatch, argv, stdin, words):
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"\n")
    (tmp_path / "long.txt").write_text("x" * 300, encoding="utf-8")
    if stdin is not None:
        _stdin(monkeypatch, stdin)
    code, _, err = _run(capsys, *[a.format(art=tiny_artifact, tmp=tmp_path) for a in argv])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_compress_flag_wins_over_the_env_and_verbose_says_what_was_kept(tiny, tiny_artifact, tmp_path, capsys,
                                                                        monkeypatch):
    path = tmp_path / "doc.txt"
    path.write_text(LONG, encoding="utf-8")
    knobs = ["--snapkv-budget", 48, "--snapkv-recency", 8]
    monkeypatch.setenv("SHARPI_COMPRESS", "probe")
    code, out, err = _run(capsys, "run", tiny_artifact, "--file", path, "-n", 4, *knobs, "--compress", "keydiff",
                          "--verbose")
    assert code == 0, err
    assert f"[compression: scorer keydiff, budget 48 (recency 8, window 64, pooling max/31, kv-head, uniform); " \
           f"kept 48 of the prompt's {len(LONG)} slots in each of 2 layers]" in err, err
    api = tiny.generate(LONG, max_tokens=4, snapkv_budget=48, snapkv_recency=8, compress="keydiff")
    assert api.stats["evicted"] and out == api.text + "\n"
    code, _, err = _run(capsys, "run", tiny_artifact, "--file", path, "-n", 1, *knobs, "--verbose")
    assert code == 0 and any("scorer probe" in line for line in err), err          # the env var, without the flag
    code, _, err = _run(capsys, "run", tiny_artifact, "-p", SHORT, "-n", 1, *knobs, "--compress", "kvzip",
                        "--verbose")
    assert code == 0 and not any("compression" in line for line in err), err     # not evicted: nothing more said
    code, _, err = _run(capsys, "run", tiny_artifact, "-p", SHORT, "-n", 1, "--compress", "probe")
    assert code == 0 and err == ["warning: --compress probe changes nothing while SnapKV's budget is 0 (eviction "
                                 "off, the default on CPU): give --snapkv-budget N."], err


def test_a_budget_below_the_default_recency_shrinks_it_with_a_note(tiny, tiny_artifact, capsys, monkeypatch):
    assert tiny.snapkv_settings()[0].recency == 64 and tiny.manifest.snapkv["max_window"] == 64
    code, out, err = _run(capsys, "run", tiny_artifact, "-p", LONG, "-n", 4, "--snapkv-budget", 32, "--verbose")
    assert code == 0, err
    assert err[0] == ("note: SnapKV budget 32 is too small for the default recency (64); using recency 16, half of "
                      "the budget (snapkv_recency / --snapkv-recency chooses another)."), err
    assert sum(line.startswith("note:") for line in err) == 1
    assert any("budget 32 (recency 16," in line and "kept 32 of" in line for line in err), err
    with pytest.warns(sharpi.SharpiNote, match="using recency 16"):
        expected = tiny.generate(LONG, max_tokens=4, snapkv_budget=32)
    assert out == expected.text + "\n" and expected.stats["evicted"]
    assert tiny.generate(LONG, max_tokens=4, snapkv_budget=32, snapkv_recency=16).token_ids == expected.token_ids
    with pytest.warns(sharpi.SharpiWarning, match="using recency 14, half of the room the sinks leave"):
        with tiny.session(snapkv_budget=32, snapkv_sinks=4) as s:
            assert (s.snapkv.recency, s.snapkv.sinks) == (14, 4)
    # a recency that was asked for is never changed: argument, flag or SHARPI_SNAPKV_RECENCY
    with pytest.raises(sharpi.ConfigError, match=r"recency \(40\) must be smaller than the budget \(32\)"):
        tiny.session(snapkv_budget=32, snapkv_recency=40)
    monkeypatch.setenv("SHARPI_SNAPKV_RECENCY", "64")
    code, _, err = _run(capsys, "run", tiny_artifact, "-p", "hi", "-n", 1, "--snapkv-budget", 32)
    assert code == 2 and err == ["error: SnapKV recency (64) must be smaller than the budget (32)."], err


@pytest.mark.parametrize("budget, sinks, given, recency", [
    (32, 0, False, 16), (64, 0, False, 32), (1, 0, False, 0), (32, 4, False, 14),
    (100, 0, False, 64),                    # fits: unchanged
    (32, 0, True, 64),                      # given: unchanged (check_against refuses it)
    (0, 0, False, 64),                      # off
    (4, 4, False, 64),                      # the sinks fill the budget: no recency helps
])
def test_fit_recency(budget, sinks, given, recency):
    settings, note = fit_recency(SnapKVSettings(recency=64, sinks=sinks), budget, given)
    assert settings.recency == recency and (note is not None) == (recency != 64)


def test_compile_shrinks_the_default_recency_too():
    from sharpi.compiler import _snapkv_fields
    with pytest.warns(sharpi.SharpiNote, match="using recency 24"):
        assert _snapkv_fields(None, {"snapkv_budget": 48})["snapkv_defaults"].recency == 24
    with pytest.raises(sharpi.ConfigError, match="must be smaller than the budget"):
        from sharpi.common.compile_options import CompileOptions
        CompileOptions(**_snapkv_fields(None, {"snapkv_budget": 48, "snapkv_recency": 64})).validate()


def test_chat_file_opens_the_first_user_message(tiny_artifact, tmp_path, capsys, monkeypatch):
    """The document is the start of the first user turn (every chat template takes a user turn; a system message
    is refused by some), the question after it, and it stays in the conversation for the next questions."""
    seen = []

    def chat(self, messages, max_tokens=256, **options):
        seen.append(([dict(m) for m in messages], options))
        return GenerationResult(text=f"answer {len(seen)}", token_ids=[], finish_reason="stop")

    monkeypatch.setattr(Model, "chat", chat)
    path = tmp_path / "doc.txt"
    path.write_text("A long document.\nIts second line.\n", encoding="utf-8")
    _stdin(monkeypatch, b"First question?\nSecond question?\n")
    code, out, err = _run(capsys, "chat", tiny_artifact, "--file", path, "--compress", "probe",
                          "--snapkv-budget", 32)
    assert code == 0, err
    assert [m for m, _ in seen] == [
        [{"role": "user", "content": "A long document.\nIts second line.\n\nFirst question?"}],
        [{"role": "user", "content": "A long document.\nIts second line.\n\nFirst question?"},
         {"role": "assistant", "content": "answer 1"}, {"role": "user", "content": "Second question?"}]]
    assert all(o["compress"] == "probe" and o["snapkv"].recency == 16 for _, o in seen)
    assert "answer 1" in out and "answer 2" in out
    assert any("doc.txt (33 tokens) goes before your first question" in line for line in err), err
