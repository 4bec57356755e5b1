"""The compile cache stays within $SHARPI_CACHE_GB: after a new entry, the least recently used ones go (a cache hit
counts as a use); compiles that were killed leave staging folders that go (a compile under way holds a lock on
its own); `sharpi cache` lists and clears both.
The tiny llama (conftest) is compiled for real once; the cached compiles under test use a stand-in for the LLVM
build."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import sharpi
from sharpi import compile_cache
from sharpi.cli import main as main_cli
from sharpi.codegen.targets.llvm import TARGET as LLVM
from tiny_gguf import fake_llvm_build


@pytest.fixture
def home(tiny_artifact, tmp_path, monkeypatch) -> Path:
    """An empty SHARPI_HOME, and compiles that copy the tiny artifact's library instead of running TVM."""
    monkeypatch.setenv("SHARPI_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    return tmp_path / "home"


def _compile(gguf: Path, out: Path, recency: int) -> Path:
    """Each recency is another cache key (a run-time default in the manifest; the same kernels)."""
    return sharpi.compile(str(gguf), output=out / f"r{recency}", snapkv_recency=recency)


def _cached_recencies() -> list[int]:
    return sorted(json.loads((e.path / "manifest.json").read_text())["snapkv"]["defaults"]["recency"]
                  for e in compile_cache.entries())


def test_least_recently_used_entries_go_when_over_the_limit(tiny_gguf, home, tmp_path, monkeypatch):
    _compile(tiny_gguf, tmp_path, 8)
    entry_bytes = compile_cache.entries()[0].nbytes
    monkeypatch.setenv("SHARPI_CACHE_GB", str(2.5 * entry_bytes / 2**30))       # room for two entries
    _compile(tiny_gguf, tmp_path, 16)
    assert _cached_recencies() == [8, 16]
    older, newer = compile_cache.entries()
    os.utime(older.path, (1, 1))                                             # make the order explicit
    os.utime(newer.path, (2, 2))
    _compile(tiny_gguf, tmp_path, 8)              # a cache hit: 8 is now the most recently used
    _compile(tiny_gguf, tmp_path, 32)             # a third entry: 16 goes
    assert _cached_recencies() == [8, 32]
    for recency in (8, 16, 32):                   # every output is whole, the deleted entry's included
        assert sharpi.load(tmp_path / f"r{recency}").manifest.snapkv["defaults"]["recency"] == recency


def test_the_new_entry_stays_even_alone_over_the_limit(tiny_gguf, home, tmp_path, monkeypatch):
    """A model larger than the limit stays as the cache's only entry (so it loads from there at once), and the
    compile says so in one warning, with what to set."""
    monkeypatch.setenv("SHARPI_CACHE_GB", "1e-9")
    said = r"limit of \S+ GiB \(SHARPI_CACHE_GB\): it is kept as the cache's only entry .* SHARPI_CACHE_GB above"
    with pytest.warns(sharpi.SharpiWarning, match=said):
        _compile(tiny_gguf, tmp_path, 8)
    with pytest.warns(sharpi.SharpiWarning, match="kept as the cache's only entry"):
        _compile(tiny_gguf, tmp_path, 16)
    assert _cached_recencies() == [16]


def _staging_folders(cache: Path) -> tuple[Path, Path, Path]:
    """A killed compile's folder (old, unlocked), one under way (old, locked: see the callers) and a fresh one."""
    dead, live, fresh = cache / ".x.partial-dead", cache / ".y.partial-live", cache / ".z.partial-fresh"
    for folder in (dead, live, fresh):
        folder.mkdir(parents=True)
        (folder / "model.so").write_bytes(b"half")
    for folder in (dead, live):
        os.utime(folder, (time.time() - 60, time.time() - 60))
    return dead, live, fresh


def test_killed_compiles_folders_go_and_live_ones_stay(tiny_gguf, home, tmp_path):
    from sharpi.common.output_dir import writing_into
    dead, live, fresh = _staging_folders(home / "cache")
    with writing_into(live):
        _compile(tiny_gguf, tmp_path, 8)
    assert not dead.exists() and live.exists() and fresh.exists()


def test_cli_lists_and_clears_killed_compiles(home, capsys):
    from sharpi.common.output_dir import writing_into
    dead, live, fresh = _staging_folders(home / "cache")
    with writing_into(live):
        assert main_cli.main(["cache"]) == 0
        listing = capsys.readouterr().out
        assert "0 cached compiles and 1 killed compiles' leftovers" in listing and dead.name in listing
        assert live.name not in listing and fresh.name not in listing
        assert main_cli.main(["cache", "--clear"]) == 0
        assert "deleted 0 cached compiles and 1 killed compiles' leftovers" in capsys.readouterr().out
    assert not dead.exists() and live.exists() and fresh.exists()


@pytest.mark.parametrize("limit", ["lots", "0", "-1", "inf", "nan", ""])
def test_bad_limit_is_one_sentence_before_any_compile(limit, tiny_gguf, home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARPI_CACHE_GB", limit)
    with pytest.raises(sharpi.ConfigError, match="SHARPI_CACHE_GB must be a positive number"):
        _compile(tiny_gguf, tmp_path, 8)
    assert not (home / "cache").exists() or compile_cache.entries() == []
    assert main_cli.main(["cache"]) == 2
    assert "SHARPI_CACHE_GB" in capsys.readouterr().err


def test_cli_lists_and_clears(tiny_gguf, home, tmp_path, capsys):
    _compile(tiny_gguf, tmp_path, 8)
    _compile(tiny_gguf, tmp_path, 16)
    assert main_cli.main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert "2 cached compiles" in listing and listing.count("tiny-llvm-") == 2
    assert main_cli.main(["cache", "--clear"]) == 0
    assert "deleted 2 cached compiles" in capsys.readouterr().out
    assert compile_cache.entries() == []
    assert sharpi.load(tmp_path / "r8").manifest.snapkv["defaults"]["recency"] == 8
