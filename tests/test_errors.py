"""Bad input: one clear sentence as a SharpiError in the API, exit code 2 and no traceback in the CLIs."""
import json
import shutil

import numpy as np
import pytest

import sharpi
from sharpi.common.manifest import content_digest
from sharpi.cli import compile as compile_cli
from sharpi.cli import main as main_cli
from tiny_gguf import write_tiny_llama


def _cli(entry, argv, capsys):
    code = entry.main(argv)
    err = capsys.readouterr().err
    return code, err


def _assert_clean_failure(code, err, fragment):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], err


def test_not_a_gguf(tmp_path, capsys):
    bad = tmp_path / "notes.gguf"
    bad.write_text("just some text, not a model")
    with pytest.raises(sharpi.GGUFError, match="not a GGUF file"):
        sharpi.compile(str(bad), output=tmp_path / "out")
    _assert_clean_failure(*_cli(compile_cli, [str(bad), "-o", str(tmp_path / "o")], capsys), "not a GGUF file")
    _assert_clean_failure(*_cli(main_cli, ["inspect", str(bad)], capsys), "not a GGUF file")


def test_truncated_gguf(smollm2_gguf, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:200_000])
    with pytest.raises(sharpi.GGUFError, match="truncated or malformed"):
        sharpi.compile(str(cut), output=tmp_path / "out")
    _assert_clean_failure(*_cli(compile_cli, [str(cut), "-o", str(tmp_path / "o")], capsys), "truncated")


def test_unknown_architecture(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "mystery.gguf", arch="mystery")
    with pytest.raises(sharpi.UnsupportedArchitectureError, match="'mystery' is not supported"):
        sharpi.compile(str(path), output=tmp_path / "out")
    _assert_clean_failure(*_cli(compile_cli, [str(path), "-o", str(tmp_path / "o")], capsys), "not supported")


def test_tensor_type_gguf_cannot_dequantize(tmp_path, capsys):
    import gguf
    # Q8_1: a ggml type with no dequantizer in the gguf package (and no kernel in sharpi)
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]
    raw = np.zeros((32, 64 // 32 * block_bytes), np.uint8)
    path = write_tiny_llama(tmp_path / "q81.gguf", heads=4, kv_heads=2,
                            override_raw={"blk.0.attn_k.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(sharpi.UnsupportedTensorTypeError, match="Q8_1"):
        sharpi.compile(str(path), output=tmp_path / "out")
    _assert_clean_failure(*_cli(compile_cli, [str(path), "-o", str(tmp_path / "o")], capsys), "Q8_1")


def test_unknown_model_name(capsys, tmp_path):
    with pytest.raises(sharpi.ModelNotFoundError, match="known models are"):
        sharpi.compile("llama-9000b", output=tmp_path / "out")
    _assert_clean_failure(*_cli(main_cli, ["fetch", "llama-9000b"], capsys), "known models are")
    _assert_clean_failure(*_cli(compile_cli, ["llama-9000b"], capsys), "known models are")


def test_prompt_longer_than_context(smollm2, smollm2_artifact, capsys):
    too_long = list(range(100, 100 + smollm2.max_context + 1))
    with pytest.raises(sharpi.ContextLengthError, match="more than the context"):
        smollm2.generate(too_long, max_tokens=1)
    with pytest.raises(sharpi.ContextLengthError):
        smollm2.session().prefill(too_long)
    prompt = "hello " * (smollm2.max_context + 10)
    _assert_clean_failure(*_cli(main_cli, ["run", str(smollm2_artifact), "-p", prompt, "-n", "1"], capsys),
                          "more than the context")


def _copy_artifact(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_artifact_of_another_format_version(smollm2_artifact, tmp_path, capsys):
    art = _copy_artifact(smollm2_artifact, tmp_path / "old")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["format_version"] = 0
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sharpi.ArtifactError, match="format version 0"):
        sharpi.load(art)
    _assert_clean_failure(*_cli(main_cli, ["run", str(art), "-p", "hi"], capsys), "format version 0")


def test_artifact_for_missing_cpu_features(smollm2_artifact, tmp_path, capsys):
    art = _copy_artifact(smollm2_artifact, tmp_path / "future")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["target"]["cpu_features"] = manifest["target"]["cpu_features"] + ["avx10_2_512"]
    manifest["digest"] = content_digest(manifest)         # as if compiled for that CPU
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sharpi.ArtifactError, match="avx10_2_512, which this CPU lacks"):
        sharpi.load(art)
    _assert_clean_failure(*_cli(main_cli, ["run", str(art), "-p", "hi"], capsys), "which this CPU lacks")


def test_amx_counts_only_where_the_os_grants_it(smollm2_artifact, tmp_path, monkeypatch):
    """An artifact needing AMX loads only where arch_prctl grants the tile state, whatever /proc/cpuinfo lists."""
    from sharpi.common import cpu

    art = _copy_artifact(smollm2_artifact, tmp_path / "amx")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["target"]["cpu_features"] = sorted(set(manifest["target"]["cpu_features"]) | {"amx_int8", "amx_tile"})
    manifest["digest"] = content_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    listed = cpu.host_cpu_flags() | {"amx_int8", "amx_tile"}
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: listed)
    monkeypatch.setattr(cpu, "amx_granted", lambda: False)
    with pytest.raises(sharpi.ArtifactError, match="amx_int8, amx_tile, which this CPU lacks or the operating "
                                                   "system does not grant"):
        sharpi.load(art)
    monkeypatch.setattr(cpu, "amx_granted", lambda: True)
    assert {"amx_int8", "amx_tile"} <= cpu.usable_cpu_flags()


def test_the_amx_probe_asks_the_kernel():
    """Where /proc/cpuinfo lists no AMX the kernel refuses the request (EOPNOTSUPP here), so the probe says no;
    it never raises, whatever the platform."""
    from sharpi.common import cpu

    granted = cpu.amx_granted()
    assert isinstance(granted, bool)
    if not cpu.host_cpu_flags() & cpu.AMX_FLAGS:
        assert not granted and not cpu.usable_cpu_flags() & cpu.AMX_FLAGS


def test_corrupted_weights_are_detected(smollm2_artifact, tmp_path):
    art = _copy_artifact(smollm2_artifact, tmp_path / "bad")
    with open(art / "weights.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 16)
    with pytest.raises(sharpi.ArtifactError, match="does not match the hash"):
        sharpi.load(art)


def test_bad_sampling_and_thread_values(smollm2, monkeypatch):
    with pytest.raises(sharpi.ConfigError, match="top_p"):
        smollm2.generate("hi", max_tokens=1, temperature=1.0, top_p=0.0)
    with pytest.raises(sharpi.ConfigError, match="temperature"):
        smollm2.generate("hi", max_tokens=1, temperature=-1.0)
    from sharpi.common.settings import resolve_threads
    monkeypatch.setenv("SHARPI_NUM_THREADS", "many")
    with pytest.raises(sharpi.ConfigError, match="SHARPI_NUM_THREADS must be an integer"):
        resolve_threads(None)
    monkeypatch.setenv("SHARPI_NUM_THREADS", "0")
    with pytest.raises(sharpi.ConfigError, match=r"SHARPI_NUM_THREADS must be an integer in \[1, 1024\]"):
        resolve_threads(None)


def test_unknown_mcpu(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with pytest.raises(sharpi.ConfigError, match="not a CPU LLVM knows"):
        sharpi.compile(str(path), output=tmp_path / "out", mcpu="x86-64-v9")
    _assert_clean_failure(*_cli(compile_cli, [str(path), "-o", str(tmp_path / "o"), "--mcpu", "bogus"], capsys),
                          "not a CPU LLVM knows")


def test_portable_mcpu_records_its_features_and_runs(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", matrix_type="Q8_0")
    art = sharpi.compile(str(path), output=tmp_path / "v2", mcpu="x86-64-v2", use_cache=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["mcpu"] == "x86-64-v2"
    assert "avx2" not in manifest["target"]["cpu_features"] and "sse4_2" in manifest["target"]["cpu_features"]
    model = sharpi.load(art)
    assert np.isfinite(model.score([1, 2, 3])).all()


def test_target_errors(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    _assert_clean_failure(*_cli(compile_cli, [str(path), "--target", "metal", "-o", str(tmp_path / "m")], capsys),
                          "Unknown target")
    _assert_clean_failure(*_cli(compile_cli, [str(path), "--target", "vulkan", "--mcpu", "znver3", "-o",
                                              str(tmp_path / "v")], capsys), "--mcpu applies to the llvm target")
    bf16 = write_tiny_llama(tmp_path / "bf16.gguf", matrix_type="BF16")
    with pytest.raises(sharpi.CompileError, match="bf16 have no GPU kernel yet"):
        sharpi.compile(str(bf16), target="vulkan", output=tmp_path / "b")
    _assert_clean_failure(*_cli(compile_cli, [str(bf16), "--target", "vulkan", "-o", str(tmp_path / "b")], capsys),
                          "kernel yet")


def test_vulkan_adapter_errors(tmp_path, capsys):
    from sharpi.runtime.vulkan import VulkanUnavailableError, list_adapters
    try:
        list_adapters()
    except VulkanUnavailableError:
        pytest.skip("no wgpu here")
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    artifact = sharpi.compile(str(path), target="vulkan", output=tmp_path / "vk")
    with pytest.raises(sharpi.SharpiError, match="No Vulkan (adapter matches|device found)"):
        sharpi.load(artifact, adapter="no-such-gpu-anywhere")
    _assert_clean_failure(*_cli(main_cli, ["run", str(artifact), "-p", "hi", "--adapter", "no-such-gpu-anywhere"],
                                capsys), "No Vulkan")
