"""`sharpi check ART [ART2 ...]`: the conformance suite from the CLI, without pytest: exit code 0 when every check
passed, 1 when one failed, 2 (one `error:` line) for bad input. And no message or README line claims a published
`sharpi` package (issue #46: there is none; installs are from the clone)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


from sharpi.cli.main import main
from sharpi.common.manifest import content_digest
from sharpi.testing import conformance

ROOT = Path(__file__).resolve().parents[1]
CHECKS = len(conformance.CHECKS)


def _copy_with_manifest(source: Path, destination: Path, change) -> Path:
    """A copy of the artifact (its big files hard links, falling back to copies) whose manifest.json, a real copy,
    has `change(manifest)` applied and its digest recomputed, so it still reads."""
    destination.mkdir()
    for item in source.iterdir():
        if item.name != "manifest.json":
            try:
                os.link(item, destination / item.name)
            except OSError:
                shutil.copy2(item, destination / item.name)
    manifest = json.loads((source / "manifest.json").read_text())
    change(manifest)
    manifest["digest"] = content_digest(manifest)
    (destination / "manifest.json").write_text(json.dumps(manifest))
    return destination


def _wrong_tokenizer_hash(manifest):
    manifest["files"]["tokenizer.json"] = "0" * 64


def test_check_passes_on_the_llvm_artifact(smollm2_artifact, capsys):
    assert main(["check", str(smollm2_artifact)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"sharpi conformance: {smollm2_artifact} (llvm, float32 KV, from "
                      f"SmolLM2-135M-Instruct.Q4_1.gguf) against the numpy reference")
    assert [line.split()[:2] for line in out[1:-1]] == [["PASS", name] for name in conformance.CHECKS]
    assert out[-1] == f"{CHECKS} checks: {CHECKS} passed, 0 failed, 0 skipped"


def test_check_fails_with_exit_1_and_a_table_per_artifact(smollm2_artifact, tmp_path, capsys):
    """Two artifacts whose files do not match their manifests: each table says `loads` failed (the other checks
    skip), and the exit code is 1."""
    first = _copy_with_manifest(smollm2_artifact, tmp_path / "first", _wrong_tokenizer_hash)
    second = _copy_with_manifest(smollm2_artifact, tmp_path / "second", _wrong_tokenizer_hash)
    assert main(["check", str(first), str(second)]) == 1
    out = capsys.readouterr().out
    for artifact in (first, second):
        assert f"sharpi conformance: {artifact} (llvm," in out
    assert out.count("FAIL  loads                           tokenizer.json does not match the hash") == 2, out
    assert out.count(f"{CHECKS} checks: 0 passed, 1 failed, {CHECKS - 1} skipped") == 2, out


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: "), captured
    return lines[0]


def test_bad_input_exits_2_with_one_line(smollm2_artifact, tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope")]) == 2
    assert "is not a sharpi artifact, a GGUF file or a known model name" in _one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty")]) == 2
    assert "is not a sharpi artifact" in _one_error_line(capsys)
    # a good artifact first does not run before the bad one is found
    assert main(["check", str(smollm2_artifact), str(tmp_path / "empty")]) == 2
    _one_error_line(capsys)
    assert main(["check", str(smollm2_artifact), "--reference", "gpu"]) == 2
    assert "--reference" in _one_error_line(capsys)
    assert main(["check", str(smollm2_artifact), "--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "missing.gguf does not exist" in _one_error_line(capsys)
    assert main(["check", str(smollm2_artifact), "--decode-tokens", "0"]) == 2
    assert "--decode-tokens" in _one_error_line(capsys)
    # the source GGUF nowhere to be found: which flag to pass, before any check runs
    moved = tmp_path / "moved"
    moved.mkdir()
    manifest = json.loads((smollm2_artifact / "manifest.json").read_text())
    manifest["source"] = {**manifest["source"], "name": "elsewhere.gguf", "sha256": "0" * 64}
    manifest["digest"] = content_digest(manifest)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(["check", str(moved)]) == 2
    assert "No reference GGUF" in (line := _one_error_line(capsys)) and "--gguf PATH" in line


def test_bad_input_from_the_command_line_is_one_line_and_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sharpi.cli.main", "check", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert "is not a sharpi artifact, a GGUF file or a known model name" in done.stderr


PUBLISHED = re.compile(r"pip install sharpi\b|[\"']sharpi\[")


def test_no_message_claims_a_published_package():
    """No `pip install sharpi` or `pip install "sharpi[extra]"`: nothing named sharpi is published; the messages and
    the README say to install from the clone (`python -m pip install ".[extra]"`)."""
    files = [*sorted((ROOT / "sharpi").rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in files for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if PUBLISHED.search(line)]
    assert not found, "\n".join(found)
