"""GGUF files and known model names wherever an artifact is accepted (issue #46): sharpi.load and `sharpi run`,
`serve`, ... compile them into the compile cache on first use and load the cached compile after; an output folder
written from the cache shares its weights and kernel library with the entry (a reflink, else a read-only hard
link), so the disk holds them once, and damage through either name is caught, never run on.
The tiny llama of conftest with the stand-in LLVM build (tests/tiny_gguf.py): each compile takes a second."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi import compile_cache
from sharpi.cli import main as main_cli
from sharpi.codegen.targets.llvm import TARGET as LLVM
from sharpi.common.file_share import HARDLINK, REFLINK, share_file
from tiny_gguf import fake_llvm_build

SHARED = ("weights.bin", "model.so")
IDS = [1, 2, 3]


@pytest.fixture
def home(tiny_artifact, tmp_path, monkeypatch) -> Path:
    """An empty SHARPI_HOME, and compiles that copy the tiny artifact's library instead of running TVM."""
    monkeypatch.setenv("SHARPI_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_logits(tiny_artifact) -> np.ndarray:
    return sharpi.load(tiny_artifact).score(IDS)


def _no_more_compiles(monkeypatch) -> None:
    def build(*args, **kwargs):
        raise AssertionError("compiled again: the cache should have had it")
    monkeypatch.setattr(LLVM, "build", build)


def _only_entry() -> Path:
    listed = compile_cache.entries()
    assert len(listed) == 1, listed
    return listed[0].path


def _sharing_here(folder: Path) -> str:
    """How this file system shares a file between two folders (what the compile will have done)."""
    probe = folder / "probe"
    probe.mkdir()
    (probe / "a").write_bytes(b"x" * 4096)
    return share_file(probe / "a", probe / "b")


def _bytes_on_disk(*folders: Path) -> int:
    """The disk space the files under `folders` take, each file once however many names it has."""
    seen = {}
    for folder in folders:
        for path in folder.rglob("*"):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


# -- sharpi.load of a GGUF or a name ------------------------------------------------------------------------------
def test_a_gguf_is_compiled_into_the_cache_once_and_then_loaded_from_it(tiny_gguf, home, tiny_logits, monkeypatch):
    model = sharpi.load(tiny_gguf)
    entry = _only_entry()
    assert model.path == entry and entry.parent == home / "cache"
    np.testing.assert_array_equal(model.score(IDS), tiny_logits)
    _no_more_compiles(monkeypatch)
    again = sharpi.load(str(tiny_gguf))
    assert again.path == entry
    np.testing.assert_array_equal(again.score(IDS), tiny_logits)


def test_a_known_name_is_fetched_compiled_and_cached(tiny_gguf, home, tiny_logits, monkeypatch):
    from sharpi.frontend import fetch
    fetched = []
    monkeypatch.setattr(fetch, "fetch", lambda name, show_progress=True: fetched.append(name) or tiny_gguf)
    np.testing.assert_array_equal(sharpi.load("smollm2-135m").score(IDS), tiny_logits)
    _no_more_compiles(monkeypatch)
    assert sharpi.load("smollm2-135m").path == _only_entry() and fetched == ["smollm2-135m"] * 2


@pytest.mark.parametrize("what", ["unknown name", "text file", "missing gguf"])
def test_what_is_neither_is_one_sentence_naming_the_accepted_forms(what, home, tmp_path, capsys):
    model = {"unknown name": "llama-9000", "text file": tmp_path / "notes.txt",
             "missing gguf": tmp_path / "gone.gguf"}[what]
    if what == "text file":
        model.write_text("not a model")
    with pytest.raises(sharpi.ModelNotFoundError) as info:
        sharpi.load(model)
    message = str(info.value)
    assert "is not a sharpi artifact, a GGUF file or a known model name" in message and "\n" not in message
    assert "qwen2.5-coder-0.5b" in message and "sharpi-compile MODEL -o DIR" in message
    assert ("magic bytes" if what == "text file" else "no such file or folder") in message
    assert main_cli.main(["run", str(model), "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert not (home / "cache").exists()


# -- one copy of the weights ----------------------------------------------------------------------------------------
def test_the_cache_and_an_output_folder_hold_the_weights_once(tiny_gguf, home, tmp_path, capsys):
    sharing = _sharing_here(tmp_path)
    out = sharpi.compile(str(tiny_gguf), output=tmp_path / "out")
    entry = _only_entry()
    small = sum(p.stat().st_blocks * 512 for p in out.iterdir() if p.name not in SHARED)
    if sharing == HARDLINK:
        for name in SHARED:
            ours, cached = (out / name).stat(), (entry / name).stat()
            assert (ours.st_dev, ours.st_ino) == (cached.st_dev, cached.st_ino) and ours.st_nlink == 2
            assert stat.S_IMODE(ours.st_mode) & 0o222 == 0, oct(ours.st_mode)      # read-only: both names
        assert _bytes_on_disk(entry, out) == _bytes_on_disk(entry) + small            # the weights once
    elif sharing == REFLINK:       # copy-on-write clones: separate inodes, so counting inodes cannot see it
        assert (out / "weights.bin").stat().st_ino != (entry / "weights.bin").stat().st_ino
    else:
        pytest.skip(f"this file system shares no file ({sharing}): the weights are copied")
    assert (out / "weights.bin").read_bytes() == (entry / "weights.bin").read_bytes()
    # the cache's size counts each file once, however many output folders share it
    before = compile_cache.entries()[0]
    sharpi.compile(str(tiny_gguf), output=tmp_path / "out2")
    after = compile_cache.entries()[0]
    assert after.nbytes == before.nbytes == sum(p.stat().st_size for p in entry.iterdir())
    if sharing == HARDLINK:
        assert after.shared == sum((entry / name).stat().st_size for name in SHARED)
        assert main_cli.main(["cache"]) == 0
        assert "MiB shared with output folders)" in capsys.readouterr().out


def test_a_flipped_byte_in_an_output_folder_is_refused_and_the_cache_entry_still_loads(tiny_gguf, home, tmp_path,
                                                                                       tiny_logits, monkeypatch):
    """Flipped the way a tool changes a read-only file: a changed copy renamed over it (an in-place write is
    refused to all but root, see the next test). That breaks the link; the cache's name keeps the old bytes."""
    out = sharpi.compile(str(tiny_gguf), output=tmp_path / "out")
    entry = _only_entry()
    weights = out / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    edited = out / ".weights.bin.edit"
    edited.write_bytes(bytes(data))
    os.replace(edited, weights)
    with pytest.raises(sharpi.ArtifactError, match="weights.bin does not match the hash in the manifest"):
        sharpi.load(out)
    assert compile_cache.lookup(entry)
    np.testing.assert_array_equal(sharpi.load(entry).score(IDS), tiny_logits)
    _no_more_compiles(monkeypatch)
    np.testing.assert_array_equal(sharpi.load(tiny_gguf).score(IDS), tiny_logits)
    sharpi.compile(str(tiny_gguf), output=out)                  # the cache puts the folder right
    np.testing.assert_array_equal(sharpi.load(out).score(IDS), tiny_logits)


def test_an_in_place_write_through_a_hard_link_is_caught_at_both_ends(tiny_gguf, home, tmp_path, tiny_logits):
    """Only the superuser can write the read-only shared file in place, which changes the cache's name too: the
    output folder's load refuses it, and the cache deletes the damaged entry and compiles it again rather than
    hand it out."""
    if _sharing_here(tmp_path) != HARDLINK:
        pytest.skip("the output folder's weights are not a hard link here")
    out = sharpi.compile(str(tiny_gguf), output=tmp_path / "out")
    entry = _only_entry()
    try:
        with open(out / "weights.bin", "r+b") as f:
            f.seek(100)
            byte = f.read(1)[0]
            f.seek(100)
            f.write(bytes([byte ^ 0xFF]))
    except PermissionError:
        assert os.geteuid() != 0
        return                     # a user's write is refused: nothing reached the cache
    with pytest.raises(sharpi.ArtifactError, match="weights.bin does not match the hash"):
        sharpi.load(out)
    with pytest.warns(sharpi.SharpiWarning, match="failed its check, so it was deleted and is compiled again"):
        model = sharpi.load(tiny_gguf)
    assert model.path == entry == _only_entry()
    np.testing.assert_array_equal(model.score(IDS), tiny_logits)
    sharpi.compile(str(tiny_gguf), output=out)
    np.testing.assert_array_equal(sharpi.load(out).score(IDS), tiny_logits)


def test_clearing_the_cache_leaves_output_folders_whole(tiny_gguf, home, tmp_path, tiny_logits, capsys):
    out = sharpi.compile(str(tiny_gguf), output=tmp_path / "out")
    entry = _only_entry()
    assert main_cli.main(["cache", "--clear"]) == 0                 # read-only files go too
    assert "deleted 1 cached compiles" in capsys.readouterr().out
    assert not entry.exists() and compile_cache.entries() == []
    assert (out / "weights.bin").stat().st_nlink == 1
    np.testing.assert_array_equal(sharpi.load(out).score(IDS), tiny_logits)


# -- the CLI --------------------------------------------------------------------------------------------------------
def test_sharpi_run_a_gguf_compiles_on_first_use_only(tiny_gguf, home, capsys, monkeypatch):
    run = ["run", str(tiny_gguf), "-p", "hello", "-n", "3", "--raw"]
    assert main_cli.main(run) == 0
    first = capsys.readouterr()
    assert f"sharpi: compiling {tiny_gguf.name} for this CPU (" in first.err
    assert f"(first use; cached in {home / 'cache'})" in first.err and first.out.strip()
    _no_more_compiles(monkeypatch)
    assert main_cli.main(run) == 0
    second = capsys.readouterr()
    assert "compil" not in second.err and second.out == first.out


def test_sharpi_serve_a_gguf_serves_its_cached_compile(tiny_gguf, home, capsys, monkeypatch):
    """`sharpi serve` takes the same models: the cached compile is what it loads (the HTTP server itself is
    tests/test_serve.py's: here it returns at once, once the model has loaded)."""
    pytest.importorskip("fastapi")
    from sharpi.serve import server

    monkeypatch.setattr(server, "serve", lambda state, sock, drain_seconds: sock.close())
    assert main_cli.main(["serve", str(tiny_gguf), "--port", "0", "--pool-tokens", "64"]) == 0
    out, err = capsys.readouterr()
    assert f"serves 'tiny' (loading {_only_entry()})" in out and "ready on" in out, out
    assert f"sharpi: compiling {tiny_gguf.name} for this CPU" in err


def test_loading_an_artifact_folder_still_imports_no_compiler(tiny_artifact):
    import subprocess
    code = ("import sys, sharpi; sharpi.load(sys.argv[1]); "
            "assert not {'sharpi.compiler', 'sharpi.frontend.fetch', 'tvm.relax'} & set(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_artifact)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TVM_USE_RUNTIME_LIB="1"))
    assert done.returncode == 0, done.stderr[-2000:]
