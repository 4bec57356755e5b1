"""sharpi writes only its own files (issue: data loss). The three writers of an output folder (a compile's finalize
step, the copy of a cached compile, --emit onnx) may replace only the files an earlier sharpi manifest there lists:
every other file stays, and a folder that is not recognisably sharpi's is refused with one sentence naming it,
untouched. Compiles use the tiny llama with a stand-in LLVM build (tests/tiny_gguf.py), so each takes a second."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.cli import compile as compile_cli
from sharpi.common.manifest import content_digest
from sharpi.codegen.targets.llvm import TARGET as LLVM
from tiny_gguf import fake_llvm_build


@pytest.fixture
def home(tiny_artifact, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SHARPI_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    return tmp_path / "home"


def _snapshot(folder: Path) -> dict:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _web_app(folder: Path, gguf: Path) -> Path:
    """A folder a user might point -o at by mistake: a web app with its own manifest.json, and their GGUF."""
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"name": "My App", "start_url": "/index.html",
                                                      "files": {"index.html": "x"}}))
    (folder / "index.html").write_text("<html>mine</html>")
    shutil.copy(gguf, folder / "model.gguf")
    return folder


WRITERS = {
    "compile": lambda gguf, out: sharpi.compile(str(gguf), output=out, use_cache=False),
    "copy from the cache": lambda gguf, out: sharpi.compile(str(gguf), output=out, use_cache=True),
    "onnx export": lambda gguf, out: sharpi.export_onnx(str(gguf), out),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("folder", ["web app", "plain files", "a file", "foreign sharpi-onnx.json"])
def test_a_folder_that_is_not_sharpis_is_refused_untouched(writer, folder, tiny_gguf, home, tmp_path):
    if writer == "copy from the cache":
        sharpi.compile(str(tiny_gguf), output=tmp_path / "warm")          # the cache holds it now
    out = tmp_path / "target"
    if folder == "web app":
        _web_app(out, tiny_gguf)
    elif folder == "plain files":
        out.mkdir()
        (out / "results.csv").write_text("a,b\n1,2\n")
    elif folder == "a file":
        out.write_text("not a folder")
    else:
        out.mkdir()
        (out / "sharpi-onnx.json").write_text(json.dumps({"format": "something-else", "files": ["x"]}))
    before = _snapshot(out) if out.is_dir() else out.read_bytes()
    with pytest.raises(sharpi.ConfigError) as info:
        WRITERS[writer](tiny_gguf, out)
    assert str(out) in str(info.value) and "\n" not in str(info.value)
    assert (_snapshot(out) if out.is_dir() else out.read_bytes()) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []    # no staging left beside it


def test_the_cli_refuses_a_web_app_folder_in_one_line(tiny_gguf, home, tmp_path, capsys):
    out = _web_app(tmp_path / "site", tiny_gguf)
    before = _snapshot(out)
    assert compile_cli.main([str(tiny_gguf), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(out) in err and "Traceback" not in err
    assert _snapshot(out) == before


@pytest.mark.parametrize("writer", ["compile", "copy from the cache"])
def test_recompiling_over_an_artifact_keeps_the_users_files(writer, tiny_gguf, tiny_artifact, home, tmp_path):
    if writer == "copy from the cache":
        sharpi.compile(str(tiny_gguf), output=tmp_path / "warm")
    out = Path(shutil.copytree(tiny_artifact, tmp_path / "art"))
    (out / "results.json").write_text('{"score": 1}')
    shutil.copy(tiny_gguf, out / "tiny.gguf")
    (out / "runs").mkdir()
    (out / "runs" / "a.txt").write_text("run a")
    mine = {k: v for k, v in _snapshot(out).items() if k in ("results.json", "tiny.gguf", "runs/a.txt")}
    WRITERS[writer](tiny_gguf, out)
    after = _snapshot(out)
    assert {k: after.get(k) for k in mine} == mine
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(after) == set(manifest["files"]) | {"manifest.json"} | set(mine)     # nothing else, nothing hidden
    np.testing.assert_array_equal(sharpi.load(out).score([1, 2, 3]), sharpi.load(tiny_artifact).score([1, 2, 3]))


def test_a_file_the_earlier_artifact_does_not_list_is_never_overwritten(tiny_gguf, tiny_artifact, home, tmp_path):
    """The earlier artifact's manifest no longer lists model.so (say, the user put their own there): the new
    artifact would overwrite it, so the compile is refused before any work."""
    out = Path(shutil.copytree(tiny_artifact, tmp_path / "art"))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["files"]["model.so"]
    manifest["digest"] = content_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "model.so").write_bytes(b"the user's own library")
    before = _snapshot(out)
    with pytest.raises(sharpi.ConfigError, match=r"holds model.so, which the earlier sharpi artifact there does not"):
        sharpi.compile(str(tiny_gguf), output=out, use_cache=False)
    assert _snapshot(out) == before


def test_an_artifact_of_the_earlier_format_is_replaced_in_place(tiny_gguf, tiny_artifact, home, tmp_path):
    """Format version 1 had no marker; its manifest (format_version 1, sharpi_version, files) is sharpi's."""
    out = Path(shutil.copytree(tiny_artifact, tmp_path / "art"))
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("format", "digest"):
        del manifest[key]
    manifest["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "notes.md").write_text("mine")
    with pytest.raises(sharpi.ArtifactError, match="format version 1, but this sharpi reads version 2"):
        sharpi.load(out)
    sharpi.compile(str(tiny_gguf), output=out, use_cache=False)
    assert sharpi.load(out).manifest.format_version == 2 and (out / "notes.md").read_text() == "mine"


def test_exporting_onnx_over_an_earlier_export_keeps_the_users_files(tiny_gguf, tmp_path):
    out = sharpi.export_onnx(str(tiny_gguf), tmp_path / "onnx", snapkv="off")
    (out / "my_eval.py").write_text("print('mine')")
    first = json.loads((out / "sharpi-onnx.json").read_text())
    assert sorted(first["files"]) == sorted(p.name for p in out.iterdir() if p.name not in ("sharpi-onnx.json",
                                                                                             "my_eval.py"))
    sharpi.export_onnx(str(tiny_gguf), out)                   # now with prefill_snapkv.onnx
    names = {p.name for p in out.iterdir()}
    assert "my_eval.py" in names and "prefill_snapkv.onnx" in names
    assert names == set(json.loads((out / "sharpi-onnx.json").read_text())["files"]) | {"sharpi-onnx.json",
                                                                                           "my_eval.py"}
