"""Corrupted, partial and half-written artifacts (issue #10): loading one is an ArtifactError with one clear
sentence, never a crash or a model that runs on damaged bytes; an interrupted compile leaves nothing at the
output path that loads, and no staging folder behind; a full disk is one sentence and keeps the earlier artifact.
Uses the tiny llama of conftest (compiled once a session); tests/test_errors.py covers a
flipped weight byte, another format version and missing CPU features on SmolLM2."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.cli import main as main_cli
from sharpi.codegen.artifact import WEIGHTS
from sharpi.common.manifest import content_digest
from sharpi.codegen.targets.llvm import TARGET as LLVM
from tiny_gguf import fake_llvm_build, write_tiny_llama


@pytest.fixture(scope="module")
def tiny_logits(tiny_artifact) -> np.ndarray:
    return sharpi.load(tiny_artifact).score([1, 2, 3])


@pytest.fixture
def copy(tiny_artifact, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_artifact, tmp_path / "copy"))


def _edit_manifest(art: Path, change, digest: bool = True) -> None:
    """Change the manifest; with `digest`, recompute its digest as a deliberate edit would."""
    manifest = json.loads((art / "manifest.json").read_text())
    change(manifest)
    if digest:
        manifest["digest"] = content_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))


def _truncate(name: str, keep: float = 0.5):
    def damage(art: Path):
        data = (art / name).read_bytes()
        (art / name).write_bytes(data[:int(len(data) * keep)])
    return damage


def _flip(name: str, at: int = 100):
    def damage(art: Path):
        data = bytearray((art / name).read_bytes())
        data[at] ^= 0xFF
        (art / name).write_bytes(bytes(data))
    return damage


def _remove(name: str):
    return lambda art: (art / name).unlink()


def _manifest(change, digest: bool = True):
    return lambda art: _edit_manifest(art, change, digest)


def _set_param_shape(manifest):
    manifest["params"][0]["shape"] = [manifest["params"][0]["shape"][0] + 1, 1]


# (damage, verify, fragment of the ArtifactError)
DAMAGE = {
    "truncated weights": (_truncate("weights.bin"), True, "weights.bin does not match the hash"),
    "truncated weights, unverified": (_truncate("weights.bin"), False, "weights.bin is truncated"),
    "empty weights, unverified": (_truncate("weights.bin", 0), False, "weights.bin is empty"),
    "missing weights": (_remove("weights.bin"), True, "incomplete: weights.bin is missing"),
    "missing kernel library": (_remove("model.so"), True, "incomplete: model.so is missing"),
    "missing kernel library, unverified": (_remove("model.so"), False, "incomplete: model.so is missing"),
    "missing tokenizer": (_remove("tokenizer.json"), False, "incomplete: tokenizer.json is missing"),
    "kernel library changed": (_flip("model.so", 5000), True, "model.so does not match the hash"),
    "kernel library garbage, unverified": (lambda art: (art / "model.so").write_bytes(b"\x7fELF garbage"), False,
                                           "model.so could not be loaded"),
    "tokenizer changed": (_flip("tokenizer.json", 10), True, "tokenizer.json does not match the hash"),
    "missing manifest": (_remove("manifest.json"), True, "not a sharpi artifact"),
    "half-written manifest": (_truncate("manifest.json"), True, "is not valid JSON"),
    "manifest edited, digest not updated": (_manifest(lambda m: m.update(prefill_chunk=256), digest=False), True,
                                            "manifest.json does not match its own digest"),
    "hash of weights dropped": (_manifest(lambda m: m["files"].pop("weights.bin")), True,
                                "has no hash for weights.bin"),
    "parameter entry inconsistent": (_manifest(_set_param_shape), True, "params[0].nbytes should be the bytes"),
    "parameter past the end, unverified": (_manifest(lambda m: m["params"][-1].update(offset=10**9)), False,
                                           ".offset should be"),
    "field of the wrong type": (_manifest(lambda m: m.update(page_size="16")), True,
                                "page_size should be an integer in [1, 4096], got '16'"),
    "unknown KV cache type": (_manifest(lambda m: m.update(kv_dtype="float8")), True, "kv_dtype should be one of"),
    "file name with a path": (_manifest(lambda m: m["files"].update({"../escape": "0" * 64})), True,
                              "files key should be a plain file name"),
    "weights of another model size": (_manifest(lambda m: m["config"].update(vocab_size=300)), False,
                                      "config.vocab_size is 300 there but 257 in model.so"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_artifact_is_a_clear_artifact_error(case, copy):
    damage, verify, fragment = DAMAGE[case]
    damage(copy)
    with pytest.raises(sharpi.ArtifactError) as info:
        sharpi.load(copy, verify=verify)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_truncated_weights_in_the_cli_is_one_line_and_exit_2(copy, capsys):
    _truncate("weights.bin")(copy)
    code = main_cli.main(["run", str(copy), "-p", "hi", "-n", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == [line for line in err.splitlines()
                                                                    if line.startswith("error:")]
    assert "does not match the hash" in err


def test_intact_copy_loads_and_matches(copy, tiny_logits):
    np.testing.assert_array_equal(sharpi.load(copy).score([1, 2, 3]), tiny_logits)


def test_missing_vulkan_kernel_is_detected_before_any_device(tiny_gguf, tmp_path):
    art = sharpi.compile(str(tiny_gguf), target="vulkan", output=tmp_path / "vk")
    kernel = sorted(art.glob("*.wgsl"))[0]
    kernel.unlink()
    for verify in (True, False):
        with pytest.raises(sharpi.ArtifactError, match=f"incomplete: {kernel.name} is missing"):
            sharpi.load(art, verify=verify)


# -- interrupted compiles ---------------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty SHARPI_HOME, so the compile cache starts empty and leftovers in it can be seen."""
    monkeypatch.setenv("SHARPI_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _half_written_weights(weights, path):
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(next(iter(weights))[1]).tobytes()[:100])
    raise KeyboardInterrupt


def _leftovers(*directories: Path) -> list[str]:
    return sorted(p.name for d in directories if d.exists() for p in d.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("where", ["codegen", "weights"])
def test_interrupted_compile_leaves_no_artifact_and_no_staging(where, use_cache, tiny_gguf, tiny_artifact, home,
                                                              tmp_path, monkeypatch):
    from sharpi.codegen import artifact

    if where == "codegen":       # mid-build: the library half there
        monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact, then=_interrupt))
    else:                        # the library built, the weights half written
        monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
        monkeypatch.setattr(artifact, "write_weights", _half_written_weights)
    output = tmp_path / "out" / "tiny"
    with pytest.raises(KeyboardInterrupt):
        sharpi.compile(str(tiny_gguf), output=output, use_cache=use_cache)
    assert not output.exists()
    with pytest.raises(sharpi.ArtifactError, match="not a sharpi artifact"):
        sharpi.load(output)
    cache = home / "cache"
    assert _leftovers(output.parent, cache) == []
    assert not cache.exists() or list(cache.iterdir()) == []         # nothing a later compile would reuse


def test_interrupted_recompile_keeps_the_earlier_artifact(tiny_gguf, tiny_artifact, tiny_logits, home, tmp_path,
                                                         monkeypatch):
    from sharpi.codegen import artifact

    output = Path(shutil.copytree(tiny_artifact, tmp_path / "out" / "tiny"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    monkeypatch.setattr(artifact, "write_weights", _half_written_weights)
    with pytest.raises(KeyboardInterrupt):
        sharpi.compile(str(tiny_gguf), output=output, use_cache=False)
    np.testing.assert_array_equal(sharpi.load(output).score([1, 2, 3]), tiny_logits)
    assert _leftovers(output.parent) == []


@pytest.mark.parametrize("interrupted_at", [1, 4, 6])
def test_interrupted_move_into_place_restores_the_earlier_artifact(interrupted_at, tiny_gguf, tiny_artifact,
                                                                  tiny_logits, home, tmp_path, monkeypatch):
    """Over an earlier artifact, its files are moved aside (the manifest first) and the new ones in (the
    manifest last); interrupted after any move, the earlier artifact is put back, the user's file untouched."""
    from sharpi.common import output_dir

    output = Path(shutil.copytree(tiny_artifact, tmp_path / "out" / "tiny"))
    (output / "notes.txt").write_text("mine")
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    real_rename, calls = os.rename, []

    def rename(source, target):
        calls.append(source)
        if len(calls) == interrupted_at:
            raise KeyboardInterrupt
        return real_rename(source, target)
    monkeypatch.setattr(output_dir.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        sharpi.compile(str(tiny_gguf), output=output, use_cache=False)
    monkeypatch.undo()
    np.testing.assert_array_equal(sharpi.load(output).score([1, 2, 3]), tiny_logits)
    assert (output / "notes.txt").read_text() == "mine"
    assert _leftovers(output.parent, output) == []


def test_killed_compile_leaves_nothing_that_loads(tiny_gguf, tiny_artifact, home, tmp_path):
    """SIGKILL (the OOM killer, a power cut) gives no chance to clean up: a hidden staging folder may stay, but
    the output path holds nothing, so nothing half-written loads."""
    output = tmp_path / "out" / "tiny"
    started = tmp_path / "started"
    script = textwrap.dedent(f"""
        import shutil, time
        from pathlib import Path
        import sharpi
        from sharpi.codegen.targets import llvm

        def build(mod, cfg, options, staging, bar, contract):
            shutil.copy({str(tiny_artifact / "model.so")!r}, staging / "model.so")
            Path({str(started)!r}).touch()
            time.sleep(60)
        llvm.TARGET.build = build
        sharpi.compile({str(tiny_gguf)!r}, output={str(output)!r}, use_cache=False)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "SHARPI_HOME": str(home)})
    try:
        deadline = time.time() + 60
        while not started.exists() and time.time() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert started.exists(), "the compile never reached the build"
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
    assert not output.exists()
    with pytest.raises(sharpi.ArtifactError, match="not a sharpi artifact"):
        sharpi.load(output)
    assert all(name.startswith(".tiny.partial-") for name in _leftovers(output.parent))


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _cross_device(*args, **kwargs):
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
def test_full_disk_is_one_sentence_and_keeps_the_earlier_artifact(use_cache, tiny_gguf, tiny_artifact, tiny_logits,
                                                                  home, tmp_path, monkeypatch, capsys):
    from sharpi.cli import compile as compile_cli
    from sharpi.codegen import artifact

    output = Path(shutil.copytree(tiny_artifact, tmp_path / "out" / "tiny"))
    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    monkeypatch.setattr(artifact, "write_weights", _disk_full)
    with pytest.raises(sharpi.ConfigError, match="cannot be written to .*: No space left on device"):
        sharpi.compile(str(tiny_gguf), output=output, use_cache=use_cache)
    args = [str(tiny_gguf), "-o", str(output), "--quiet"] + ([] if use_cache else ["--no-cache"])
    assert compile_cli.main(args) == 2
    assert capsys.readouterr().err.count("\n") == 1                 # one `error:` line, no traceback
    np.testing.assert_array_equal(sharpi.load(output).score([1, 2, 3]), tiny_logits)
    assert _leftovers(output.parent, home / "cache") == []
    assert not (home / "cache").exists() or list((home / "cache").iterdir()) == []


def test_full_disk_while_copying_from_the_cache_keeps_the_earlier_artifact(tiny_gguf, tiny_artifact, tiny_logits,
                                                                         home, tmp_path, monkeypatch):
    """The output folder on a file system without reflinks and apart from the cache's (no hard link either), so
    the cached weights are copied, and the disk fills meanwhile."""
    from sharpi.common import file_share

    monkeypatch.setattr(LLVM, "build", fake_llvm_build(tiny_artifact))
    sharpi.compile(str(tiny_gguf), output=tmp_path / "first")               # fills the cache
    output = Path(shutil.copytree(tiny_artifact, tmp_path / "out" / "tiny"))
    monkeypatch.setattr(file_share, "_reflink", lambda source, target: False)
    monkeypatch.setattr(file_share.os, "link", lambda source, target: _cross_device())
    real_copy2 = shutil.copy2

    def copy_then_fill(source, target):                                     # the disk fills mid-copy
        if Path(source).name == WEIGHTS:
            Path(target).write_bytes(b"half")
            _disk_full()
        return real_copy2(source, target)
    monkeypatch.setattr(shutil, "copy2", copy_then_fill)
    with pytest.raises(sharpi.ConfigError, match=r"cannot be written to .*: No space left on device \("):
        sharpi.compile(str(tiny_gguf), output=output)
    monkeypatch.undo()
    np.testing.assert_array_equal(sharpi.load(output).score([1, 2, 3]), tiny_logits)
    assert _leftovers(output.parent) == []


def test_full_disk_during_onnx_export_is_one_sentence(tiny_gguf, tmp_path, monkeypatch):
    import sharpi.export.onnx as onnx_export

    monkeypatch.setattr(onnx_export, "export_module", _disk_full)
    output = tmp_path / "onnx"
    with pytest.raises(sharpi.ConfigError, match="cannot be written to .*No space left on device"):
        sharpi.export_onnx(str(tiny_gguf), output)
    assert not output.exists() and _leftovers(tmp_path) == []


def test_artifact_compiled_again_into_the_same_folder_runs_its_own_kernels(tmp_path):
    """dlopen hands back an already loaded library for a path it has opened before: loading a model compiled again
    into the same folder (another weight type, other kernels) ran the first library's kernels, which refused the
    new weights' shapes."""
    from sharpi.testing.reference import NumpyReference
    output = tmp_path / "art"
    for matrix_type in ("Q4_0", "Q8_0"):
        path = write_tiny_llama(tmp_path / f"tiny-{matrix_type}.gguf", matrix_type=matrix_type)
        model = sharpi.load(sharpi.compile(str(path), output=output, matmuls="float"))
        np.testing.assert_allclose(model.score([1, 2, 3]), NumpyReference(path).forward([1, 2, 3]), rtol=1e-3,
                                   atol=1e-3)
