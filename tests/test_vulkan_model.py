"""SmolLM2 compiled for Vulkan, run through wgpu on the Vulkan device (lavapipe in CI), against the CPU artifact:
teacher-forced logits, greedy generation, SnapKV eviction, and the backend's own bookkeeping.

lavapipe is a software device (about 0.3 GFLOP/s on this project's 2-core CI machines), so each property is
shown on the smallest input that shows it; benchmarks/RESULTS.md has the full-size runs."""
from __future__ import annotations


import numpy as np
import pytest

import sharpi
from sharpi.testing.backends import greedy_agrees, snapkv_agreement
from sharpi.testing.reference import log_softmax
from vulkan_device import on_vulkan



@pytest.fixture(scope="session")
def vk(smollm2_vulkan_artifact):
    return on_vulkan(lambda: sharpi.load(smollm2_vulkan_artifact))


def test_vulkan_artifact_records_target_and_plan(smollm2_vulkan_artifact):
    from sharpi.common.manifest import Manifest
    m = Manifest.read(smollm2_vulkan_artifact)
    assert m.target["kind"] == "vulkan"
    assert set(m.functions) >= {"prefill", "prefill_logits", "decode", "prefill_snapkv", "snapkv_select",
                                "snapkv_compact"}
    assert (smollm2_vulkan_artifact / "plan.json").is_file()
    assert all((smollm2_vulkan_artifact / f"{k}.wgsl").is_file() for k in m.kernels)
    assert "plan.json" in m.files


def test_teacher_forced_logits_match_cpu(vk, smollm2, golden):
    ids = golden["teacher_forced"]["ids"]
    lv, lc = log_softmax(vk.score(ids)), log_softmax(smollm2.score(ids))
    top1 = (lv.argmax(-1) == lc.argmax(-1)).mean()
    nxt = np.arange(len(ids) - 1)
    diff = np.abs(lv[nxt, ids[1:]] - lc[nxt, ids[1:]]).max()
    assert top1 >= 0.995, top1
    assert diff <= 0.02, diff


def test_greedy_generation_matches_cpu(vk, smollm2, golden):
    """32 greedy tokens from each golden prompt: the CPU generates; Vulkan scores the CPU's sequence in one pass
    and must pick the CPU's token at every step (so its own greedy run would produce the same text), and the
    first prompt is also generated on Vulkan through the KV cache (decode kernels)."""
    for i, g in enumerate(golden["greedy"]):
        ids = g["prompt_ids"]
        cpu = smollm2.generate(ids, max_tokens=32)          # 32 tokens, or fewer when it ends its turn
        assert cpu.token_ids and (len(cpu.token_ids) == 32 or cpu.finish_reason == "stop")
        seq = ids + cpu.token_ids
        cpu_logits = smollm2.score(seq)[len(ids) - 1:-1]
        vk_logits = vk.score(seq)[len(ids) - 1:-1]
        agrees, steps = greedy_agrees(cpu_logits, vk_logits, cpu.token_ids)
        assert agrees, f"prompt {i}: Vulkan's greedy token differs at step {steps}"
        if i == 0:
            gen = vk.generate(ids, max_tokens=12)
            assert gen.token_ids == cpu.token_ids[:len(gen.token_ids)]


def test_decode_through_the_cache_matches_cpu(vk, smollm2):
    ids = vk.tokenize("The quick brown fox jumps over the lazy dog. The dog")
    with vk.session() as a, smollm2.session() as b:
        la, lb = a.prefill(ids), b.prefill(ids)
        for token in (13, 578, 1042):
            np.testing.assert_allclose(la, lb, atol=2e-3)
            la, lb = a.decode(token), b.decode(token)
        np.testing.assert_allclose(la, lb, atol=2e-3)
        assert a.kv_length == b.kv_length and a.kv_bytes == b.kv_bytes


def test_snapkv_on_vulkan_matches_cpu(vk, smollm2):
    """Eviction on Vulkan keeps what the CPU keeps: same lengths, kept positions overlapping >= 99%, and decode
    steps that agree under the near-tie rule (a 200-token prompt, budget 64: lavapipe prefills ~2 tokens/s;
    benchmarks/vulkan_check.py runs the 1040-token, budget-256 case)."""
    from sharpi.cli.bench import prompt_ids
    prompt = prompt_ids(smollm2, 200)
    r = snapkv_agreement(vk, smollm2, prompt, budget=64, snapkv_window=32, snapkv_recency=16)
    assert r["evicted"] == (True, True)
    assert r["kv_length"][0] == r["kv_length"][1] == [64] * vk.config.n_layers
    assert r["logical_length"] == (len(prompt), len(prompt))
    assert r["overlap"] >= 0.99, r["overlap"]
    assert r["decode_agrees"], f"decode after eviction differs at step {r['steps_compared']}"


def test_fork_and_compact_on_device(vk):
    ids = vk.tokenize("One two three four five six seven eight nine ten eleven twelve")
    with vk.session() as s:
        s.prefill(ids)
        with s.fork() as f:
            np.testing.assert_allclose(f.decode(5), s.decode(5), atol=1e-5)
        free = vk.engine.pool.free_count
        s.compact([0, 2, 4, 6])                                  # same count in every layer: the kernel
        assert s.kv_length == [4] * vk.config.n_layers and vk.engine.pool.free_count == free
        keep = [[0, 1, 3] if layer % 2 else [1, 2] for layer in range(vk.config.n_layers)]
        s.compact(keep)                                          # counts differ: moved through host memory
        assert s.kv_length == [3 if layer % 2 else 2 for layer in range(vk.config.n_layers)]
        assert np.isfinite(s.decode(7)).all()


def test_adapter_choice_and_reporting(smollm2_vulkan_artifact, vk):
    assert vk.backend.startswith("Vulkan: ")
    with pytest.raises(sharpi.SharpiError, match="No Vulkan adapter matches"):
        sharpi.load(smollm2_vulkan_artifact, adapter="no-such-gpu-anywhere")
