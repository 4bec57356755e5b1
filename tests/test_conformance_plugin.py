"""The conformance suite (sharpi.testing.conformance) through its pytest plugin and `sharpi-compile --check`: it
passes on the artifacts this session compiles (llvm; Vulkan, slow), and a deliberately broken artifact fails
with a message naming the check that caught it.

The plugin runs in-process (pytester): the modules it needs are imported here first, so the inner runs reuse them
(and the cached numpy reference) instead of importing tvm again."""
from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import distributions
from pathlib import Path

import numpy as np
import pytest
import wgpu  # noqa: F401  (before any inner run: pytester drops the modules a run imported, and wgpu's second
             # import fails on the logger its first one registered)

import sharpi
from sharpi.common.manifest import content_digest, file_sha256
from sharpi.common.settings import sharpi_home
from sharpi.testing import conformance, conformance_suite, pytest_plugin  # noqa: F401  (kept across inner runs)

pytest_plugins = ["pytester"]

SHARPI_HOME = sharpi_home()          # read before pytester points HOME at its temporary directory
CHECKS = len(conformance.CHECKS)


def _plugin_args() -> list[str]:
    """-p for the plugin unless pytest autoloads it from an installed pytest11 entry point (looked up the way
    pluggy does, over every distribution: an editable checkout's stale egg-info may shadow the installed one)."""
    autoloaded = not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") and any(
        ep.group == "pytest11" and ep.value == "sharpi.testing.pytest_plugin"
        for dist in distributions() for ep in dist.entry_points)
    return [] if autoloaded else ["-p", "sharpi.testing.pytest_plugin"]


@pytest.fixture
def run_plugin(pytester, monkeypatch):
    monkeypatch.setenv("SHARPI_HOME", str(SHARPI_HOME))

    def run(*args):
        return pytester.runpytest_inprocess(*_plugin_args(), "-p", "no:cacheprovider", "-rfs", *args)
    return run


@pytest.fixture(scope="module")
def warm(smollm2_artifact, smollm2_gguf):
    """Load once out here what the inner runs use: the TVM runtime, the tokenizer, the numpy reference."""
    model = sharpi.load(smollm2_artifact, pool_sequences=1)
    model.score(model.tokenize("warm up"))
    conformance.make_reference("numpy", smollm2_gguf)
    return smollm2_artifact


def _corrupt(source: Path, destination: Path, *, rehash: bool) -> Path:
    """A copy of the artifact with the sign bit of every output-norm weight flipped (so every logit is negated);
    with rehash the manifest records the new weights' hash, so the artifact still loads."""
    shutil.copytree(source, destination)
    manifest = json.loads((destination / "manifest.json").read_text())
    param = next(p for p in manifest["params"] if p["name"].startswith("output_norm.weight"))
    assert param["dtype"] == "float32"
    weights = np.memmap(destination / "weights.bin", dtype=np.uint8, mode="r+")
    weights[param["offset"] + 3:param["offset"] + param["nbytes"]:4] ^= 0x80     # little-endian: byte 3 has the sign
    weights.flush()
    del weights
    if rehash:
        manifest["files"]["weights.bin"] = file_sha256(destination / "weights.bin")
        manifest["digest"] = content_digest(manifest)
        (destination / "manifest.json").write_text(json.dumps(manifest))
    return destination


def test_suite_passes_on_the_llvm_artifact_and_fixtures_are_public(run_plugin, pytester, warm):
    pytester.makepyfile(test_mine='''
        import numpy as np

        def test_my_own_check(sharpi_artifact, sharpi_model, sharpi_reference, sharpi_prompt, sharpi_tolerance):
            assert (sharpi_artifact / "manifest.json").is_file()
            ids = sharpi_model.tokenize(sharpi_prompt)[:8]
            got, want = sharpi_model.score(ids), sharpi_reference.logits(ids)
            assert np.abs(got - want).max() <= sharpi_tolerance.logprob_atol
    ''')
    result = run_plugin("test_mine.py", "--sharpi-artifact", str(warm))
    result.assert_outcomes(passed=CHECKS + 1)
    result.stdout.fnmatch_lines([f"*{warm}*(llvm, float32 KV, from SmolLM2-135M-Instruct.Q4_1.gguf) against the "
                                 f"numpy reference", "*PASS  teacher_forced_logits*39 tokens vs numpy*",
                                 f"{CHECKS} checks: {CHECKS} passed, 0 failed, 0 skipped"])


def test_flipped_weight_bytes_fail_at_load(run_plugin, warm, tmp_path):
    broken = _corrupt(warm, tmp_path / "flipped", rehash=False)
    result = run_plugin("--sharpi-artifact", str(broken))
    result.assert_outcomes(failed=1, skipped=CHECKS - 1)
    result.stdout.fnmatch_lines(["*_ test_loads[[]flipped[]] _*",
                                 "loads: */flipped/weights.bin does not match the hash in the manifest*",
                                 "*SKIPPED*tokenizer_round_trip: the artifact did not load (see check 'loads')*"])


def test_rehashed_flipped_weights_fail_the_numerical_checks(run_plugin, warm, tmp_path):
    broken = _corrupt(warm, tmp_path / "rehashed", rehash=True)
    result = run_plugin("--sharpi-artifact", str(broken))
    result.assert_outcomes(passed=CHECKS - 2, failed=2)       # loads, tokenizer, the cache's own consistency pass
    result.stdout.fnmatch_lines([
        "teacher_forced_logits: 39 teacher-forced tokens: max |d log-prob| * > 0.001 (llvm, float32 KV)*",
        "snapkv_decode_after_compaction: prefill logits (before eviction): max |d log-prob| *",
        "FAILED *test_teacher_forced_logits[[]rehashed[]]*",
        "FAILED *test_snapkv_decode_after_compaction[[]rehashed[]]*"])


def test_missing_gguf_is_a_clear_failure(warm, tmp_path, monkeypatch):
    """An artifact whose source GGUF is nowhere to be found fails the reference checks with what to pass."""
    copy = tmp_path / "art"
    shutil.copytree(warm, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"] = {**manifest["source"], "name": "elsewhere.gguf", "sha256": "0" * 64}
    manifest["digest"] = content_digest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    suite = conformance.Suite(copy, gguf=str(tmp_path / "nope.gguf"))
    result = suite.run("teacher_forced_logits")
    assert result.status == "FAIL"
    assert "no numpy reference: No reference GGUF" in result.detail and "--sharpi-gguf PATH" in result.detail
    assert "nope.gguf (missing)" in result.detail


def test_sharpi_compile_check(smollm2_gguf, warm, tmp_path, capsys, monkeypatch):
    """--check prints one line per check and exits 0; a failing check makes it exit 1 (2 stays for bad input)."""
    from sharpi.cli import compile as compile_cli
    args = [str(smollm2_gguf), "--target", "llvm", "-o", str(tmp_path / "a"), "--quiet", "--check"]
    assert compile_cli.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(tmp_path / "a") and out[1].startswith("sharpi conformance: ")
    assert [line.split()[:2] for line in out[2:-1]] == [["PASS", name] for name in conformance.CHECKS]
    assert out[-1] == f"{CHECKS} checks: {CHECKS} passed, 0 failed, 0 skipped"

    def broken(model, strings=()):
        raise conformance.CheckFailed("tokenizer_round_trip", "'x' -> [87] -> 'y'")
    monkeypatch.setattr(conformance, "check_tokenizer_round_trip", broken)
    assert compile_cli.main(args) == 1
    out = capsys.readouterr().out
    assert "  FAIL  tokenizer_round_trip            'x' -> [87] -> 'y'" in out and "1 failed" in out
    assert compile_cli.main([str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "b"), "--check"]) == 2


@pytest.mark.slow
def test_suite_passes_on_the_vulkan_artifact(run_plugin, warm, smollm2_vulkan_artifact):
    """lavapipe takes ~40 s per prefill here, whatever its length, and ~4 s per decode step: a 5-token prompt and
    3 greedy tokens, and the SnapKV checks left to tests/test_vulkan_model.py (CI time), so the suite runs two
    forward passes (score, greedy prefill) and 3 decodes."""
    from vulkan_device import on_vulkan
    on_vulkan(lambda: sharpi.load(smollm2_vulkan_artifact, verify=False, pool_sequences=1))   # skips without a device
    result = run_plugin("--sharpi-artifact", str(smollm2_vulkan_artifact), "--sharpi-prompt",
                        "The capital of France is", "--sharpi-decode-tokens", "3",
                        "-k", "not snapkv and not kv_bytes")
    result.assert_outcomes(passed=CHECKS - 3, deselected=3)
    result.stdout.fnmatch_lines(["*(vulkan, float32 KV, from SmolLM2-135M-Instruct.Q4_1.gguf)*",
                                 "*PASS  teacher_forced_logits*7 tokens vs numpy*<= 0.02*"])
