"""SnapKV: the IR, the kernels against numpy, eviction on SmolLM2, RoPE after eviction, the knobs."""
import numpy as np
import pytest
import tvm

import sharpi
from sharpi.codegen.kernels.paged_attention import make_kv_append
from sharpi.codegen.kernels.snapkv import make_snapkv_score, make_snapkv_select
from sharpi.codegen.targets.llvm import make_target
from sharpi.common import ops
from sharpi.common.snapkv_settings import SnapKVSettings, auto_budget, check_against, layer_budgets, settings_from
from sharpi.testing.snapkv import pool_reference, score_reference, select_reference, select_row
from tiny_gguf import write_tiny_llama

DEV = tvm.cpu()
TARGET = make_target(None)
SNAPKV_OPS = (ops.SNAPKV_SCORE, ops.SNAPKV_SELECT, ops.KV_COMPACT)


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _build(prim):
    return tvm.compile(tvm.IRModule({"main": prim}), target=TARGET)


# -- the IR -------------------------------------------------------------------------------------------------------
def test_dump_ir_shows_snapkv_ops_only_when_on(tmp_path):
    gguf = write_tiny_llama(tmp_path / "tiny.gguf")
    on, off = tmp_path / "on.txt", tmp_path / "off.txt"
    sharpi.compile(str(gguf), output=tmp_path / "a_on", dump_ir=on, use_cache=False)
    sharpi.compile(str(gguf), output=tmp_path / "a_off", dump_ir=off, snapkv="off", use_cache=False)
    text_on, text_off = on.read_text(), off.read_text()
    assert text_on.count(ops.SNAPKV_SCORE) == 2          # one per attention layer of the 2-layer model
    assert ops.SNAPKV_SELECT in text_on and ops.KV_COMPACT in text_on and "def prefill_snapkv" in text_on
    assert not any(op in text_off for op in SNAPKV_OPS) and "prefill_snapkv" not in text_off


# -- kernels against numpy ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("held,new,window", [(0, 37, 8), (13, 30, 64), (21, 11, 11)])
@pytest.mark.parametrize("d", [16, 12])     # vectorized (a multiple of 8 lanes) and scalar forms
@pytest.mark.parametrize("reduce", ["sum", "max"])     # a negative window: the maximum (KVzip's reduction)
def test_score_kernel(heads, kv_heads, held, new, window, d, reduce, rng):
    page, max_pages, layers, layer = 16, 5, 2, 1
    score = _build(make_snapkv_score(heads, kv_heads, d, page, max_pages, d ** -0.5))
    append = _build(make_kv_append(kv_heads, d, page))
    pool = _t(np.zeros((12, 2, kv_heads, page, d), np.float32))
    table = np.zeros((layers, max_pages), np.int32)
    table[layer] = [5, 2, 9, 1, 7]
    keys = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    lens = np.zeros(layers, np.int32)
    if held:
        append(pool, _t(keys[:held]), _t(keys[:held]), _t(table), _t(lens), layer)
        lens[layer] = held
    append(pool, _t(keys[held:]), _t(keys[held:]), _t(table), _t(lens), layer)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((kv_heads, max_pages * page), np.float32))
    signed = window if reduce == "sum" else -window
    score(_t(q), pool, _t(table), _t(lens), layer, _t(np.array([signed], np.int32)), out)
    w = min(window, new)      # a window longer than the chunk scores with every query of the chunk
    expected = score_reference(q[-w:], keys, held, d ** -0.5, reduce)
    np.testing.assert_allclose(out.numpy()[:, :held + new], expected, rtol=1e-5, atol=1e-6)
    assert not out.numpy()[:, held + new:].any()


@pytest.fixture(scope="module")
def select_kernel():
    layers, kv_heads, slots = 3, 2, 96
    return _build(make_snapkv_select(layers, kv_heads, slots)), (layers, kv_heads, slots)


@pytest.mark.parametrize("pooling,kernel", [("none", 1), ("max", 5), ("avg", 7), ("max", 15)])
@pytest.mark.parametrize("granularity", ["kv-head", "shared"])
@pytest.mark.parametrize("sinks", [0, 3])
def test_select_kernel_ties_and_pooling(select_kernel, pooling, kernel, granularity, sinks, rng):
    select, (layers, kv_heads, slots) = select_kernel
    total, budget, recency = 77, 30, 6
    scores = np.zeros((layers, kv_heads, slots), np.float32)
    scores[..., :total] = rng.integers(0, 5, (layers, kv_heads, total)) / np.float32(7)   # many exact ties
    keep = _t(np.zeros((layers, kv_heads, slots), np.int32))
    scratch = [_t(np.zeros((layers, kv_heads, slots), np.float32)) for _ in range(2)]
    params = np.array([total, budget, recency, kernel, ops.POOLING_CODES[pooling],
                       int(granularity == "shared"), sinks], np.int32)
    select(_t(scores), _t(params), keep, *scratch)
    expected = select_reference(scores[..., :total], budget, recency, pooling, kernel, granularity, sinks)
    np.testing.assert_array_equal(keep.numpy()[..., :budget], expected)
    got = keep.numpy()[..., :budget]
    assert (got[..., :sinks] == np.arange(sinks)).all() and (np.diff(got, axis=-1) > 0).all()
    assert (got[..., budget - recency:] == np.arange(total - recency, total)).all()


def test_select_reference_sinks_zero_is_plain_snapkv(rng):
    """sinks 0 is the selection as it was: the top (budget - recency) of [0, total - recency), then the tail."""
    row = rng.integers(0, 9, 200).astype(np.float32)
    for pooling, kernel in (("none", 1), ("max", 7), ("avg", 5)):
        pooled = pool_reference(row, pooling, kernel)
        order = np.lexsort((np.arange(150), -pooled[:150]))
        plain = np.concatenate([np.sort(order[:40]), np.arange(150, 200)])
        np.testing.assert_array_equal(select_row(row, 90, 50, pooling, kernel), plain)
        np.testing.assert_array_equal(select_row(row, 90, 50, pooling, kernel, sinks=0), plain)
        with_sinks = select_row(row, 90, 50, pooling, kernel, sinks=4)
        assert list(with_sinks[:4]) == [0, 1, 2, 3] and len(with_sinks) == 90
        order = np.lexsort((np.arange(4, 150), -pooled[4:150]))
        np.testing.assert_array_equal(with_sinks[4:40], np.sort(np.arange(4, 150)[order[:36]]))


# -- eviction on SmolLM2 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_prompt(smollm2):
    from sharpi.cli.bench import prompt_ids
    return prompt_ids(smollm2, 1040)


def test_eviction_on_smollm2(smollm2, long_prompt):
    layers = smollm2.config.n_layers
    pool = smollm2.engine.pool
    with smollm2.session(snapkv_budget=0) as full:
        full_logits = full.prefill(long_prompt)
        full_bytes = full.kv_bytes
    free_before = pool.free_count
    s = smollm2.session(snapkv_budget=256)
    logits = s.prefill(long_prompt)
    assert s.kv_length == [256] * layers and s.logical_length == len(long_prompt)
    assert s.kv_bytes <= 0.3 * full_bytes
    assert pool.free_count == free_before - s.kv_bytes // pool.page_bytes      # the rest went back at once
    np.testing.assert_array_equal(logits, full_logits)                          # eviction comes after the logits
    for p in s.kept_positions:
        assert p.shape == (smollm2.config.n_kv_heads, 256)
        assert (np.diff(p, axis=1) > 0).all() and p.min() >= 0 and p.max() < len(long_prompt)
        assert (p[:, -64:] == np.arange(len(long_prompt) - 64, len(long_prompt))).all()   # recency kept
    other = smollm2.session()          # a second session takes the released pages
    other.prefill(long_prompt[:700])
    token, produced = int(np.argmax(logits)), []
    for _ in range(8):
        nxt = s.decode(token)
        assert np.isfinite(nxt).all()
        token = int(np.argmax(nxt))
        produced.append(token)
    assert s.kv_length == [264] * layers and s.logical_length == len(long_prompt) + 8
    other.close()
    s.close()


def test_no_eviction_when_unset_on_cpu_or_budget_covers_prompt(smollm2, long_prompt, monkeypatch):
    monkeypatch.delenv("SHARPI_SNAPKV_BUDGET", raising=False)
    with smollm2.session() as s:
        s.prefill(long_prompt[:300])
        assert s.kv_length == [300] * smollm2.config.n_layers and not s.evicted
    with smollm2.session(snapkv_budget=0) as off, smollm2.session(snapkv_budget=512) as big:
        np.testing.assert_array_equal(off.prefill(long_prompt[:300]), big.prefill(long_prompt[:300]))
        assert not big.evicted and big.kv_length == off.kv_length


def test_rope_after_per_head_compaction_is_exact(smollm2, reference):
    ids = smollm2.tokenize("The grass is green. The sky is blue. The sun is yellow. Here we go. " * 6)[:90]
    rng = np.random.default_rng(5)
    kvh, layers = smollm2.config.n_kv_heads, smollm2.config.n_layers
    keep = [np.stack([np.sort(rng.choice(90, 40, replace=False)) for _ in range(kvh)]) for _ in range(layers)]
    with smollm2.session() as s:
        s.prefill(ids)
        s.compact(keep)
        got = s.decode(ids[0])
        kept = s.kept_positions
    prompt_kept = [k[:, :-1] for k in kept]
    expected = reference.decode_after_compaction(ids, prompt_kept, ids[0])
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)
    # a variant that RoPE'd the new token at the cache length (40) instead of its logical position (90) fails
    wrong = reference.decode_after_compaction(ids, prompt_kept, ids[0], position=40)
    assert not np.allclose(got, wrong, rtol=2e-3, atol=2e-3)


def test_kept_positions_match_reference_keep_sets(smollm2, reference, long_prompt):
    ids = long_prompt[:600]
    budget, window, recency = 128, 32, 16
    with smollm2.session(snapkv_budget=budget, snapkv_window=window, snapkv_recency=recency) as s:
        s.prefill(ids)
        kept = np.stack(s.kept_positions)                     # [L, KVH, budget]
    captured = []
    reference.forward(ids, capture=captured)
    scale = smollm2.config.head_dim ** -0.5
    scores = np.stack([score_reference(q[-window:], k, 0, scale) for q, k, _ in captured]).astype(np.float32)
    expected = select_reference(scores, budget, recency, "max", SnapKVSettings().kernel, "kv-head")
    overlap = np.mean([len(np.intersect1d(a, b)) / budget for a, b in zip(kept.reshape(-1, budget),
                                                                           expected.reshape(-1, budget))])
    assert overlap >= 0.99, overlap


def test_layer_budgets_pyramid_and_uniform():
    uniform = settings_from(env={})
    pyramid = settings_from(env={"SHARPI_SNAPKV_ALLOCATION": "pyramid"}, recency=16)
    assert layer_budgets(400, 24, uniform) == [400] * 24 and uniform.allocation == "uniform"
    pyr = layer_budgets(400, 24, pyramid)
    assert pyr[0] == 2 * 400 - 20 and pyr[-1] == 20 and pyr == sorted(pyr, reverse=True)   # PyramidKV's beta 20
    assert abs(sum(pyr) / 24 - 400) <= 0.5                           # the same memory as uniform, near enough
    # the last layer never keeps fewer than recency + sinks + 1 (each keep set holds them)
    assert layer_budgets(400, 24, settings_from(env={}, allocation="pyramid", recency=64, sinks=4))[-1] == 69
    assert "allocation" not in uniform.manifest_dict() and pyramid.manifest_dict()["allocation"] == "pyramid"
    with pytest.raises(sharpi.ConfigError, match="snapkv_allocation must be one of uniform, pyramid"):
        settings_from(env={}, allocation="adaptive")


def test_scores_allocation_follows_one_threshold():
    settings = settings_from(env={}, allocation="scores", recency=2)
    scores = np.zeros((3, 2, 100), np.float32)
    scores[0, :, :60] = 1.0                 # layer 0 has the most above any threshold, layer 2 nothing
    scores[1, :, :30] = 0.5
    # 90 = 3 x 30 slots pass (60 in layer 0, 30 in 1); layer 2 gets its floor, taken back from layer 0
    assert layer_budgets(30, 3, settings, scores) == [57, 30, 3]
    assert layer_budgets(30, 3, settings_from(env={}), scores) == [30, 30, 30]
    # the floor of an empty layer is taken back from the others: the mean stays the budget
    budgets = layer_budgets(30, 3, settings_from(env={}, allocation="scores", recency=9), scores)
    assert budgets[2] == 10 and sum(budgets) == 90 and budgets[0] > budgets[1] > 10
    with pytest.raises(sharpi.ConfigError, match="needs the prompt's scores"):
        layer_budgets(30, 3, settings)


@pytest.mark.parametrize("allocation", ["pyramid", "scores"])
def test_layer_allocation_keeps_each_layers_budget(smollm2, long_prompt, allocation):
    """Pyramid and score-allocated budgets on SmolLM2: each layer keeps its own budget, and its keep sets are the
    uniform selection's at that layer's budget (the session's own scores)."""
    ids = long_prompt[:700]
    with smollm2.session(snapkv_budget=0, snapkv_recency=16) as base:
        base.prefill(ids, keep_scores=True)
        with base.fork() as pyr:
            assert pyr.evict(256, allocation=allocation, recency=16)
            scores = smollm2.engine.backend.to_host(base._scores)[:, :, :len(ids)]
            budgets = layer_budgets(256, smollm2.config.n_layers, settings_from(env={}, allocation=allocation,
                                                                                recency=16), scores)
            assert len(set(budgets)) > 1 and 0.95 * 256 <= np.mean(budgets) <= 256
            assert pyr.kv_length == [min(b, len(ids)) for b in budgets]
            for layer, b in enumerate(budgets):
                if b >= len(ids):
                    continue
                with base.fork() as uniform:
                    uniform.evict(b, recency=16)
                    assert (uniform.kept_positions[layer] == pyr.kept_positions[layer]).all(), layer
            pyr_bytes = pyr.kv_bytes
        with base.fork() as uni:
            uni.evict(256, recency=16)
            assert abs(pyr_bytes - uni.kv_bytes) <= 0.05 * uni.kv_bytes       # about the same memory


def test_sinks_kept_on_smollm2(smollm2, long_prompt):
    """Attention sinks end to end: positions 0..3 in every layer and KV head, the tail, the budget; the keep sets
    are select_reference's on the session's own scores; sinks 0 on a fork is the plain selection."""
    ids = long_prompt[:600]
    budget, sinks, recency = 128, 4, 64
    layers, kv_heads = smollm2.config.n_layers, smollm2.config.n_kv_heads
    with smollm2.session(snapkv_budget=budget, snapkv_sinks=sinks) as s:
        s.prefill(ids)
        assert s.evicted and s.kv_length == [budget] * layers and s.snapkv.sinks == sinks
        kept = np.stack(s.kept_positions)                                      # [L, KVH, budget]
    assert kept.shape == (layers, kv_heads, budget)
    assert (kept[..., :sinks] == np.arange(sinks)).all()
    assert (kept[..., budget - recency:] == np.arange(len(ids) - recency, len(ids))).all()
    assert (np.diff(kept, axis=-1) > 0).all()
    with smollm2.session(snapkv_budget=0) as base:
        base.prefill(ids, keep_scores=True)
        scores = np.asarray(base._scores.numpy())[..., :len(ids)]
        with base.fork() as f:
            assert f.evict(budget, sinks=sinks)
            np.testing.assert_array_equal(np.stack(f.kept_positions), kept)
        with base.fork() as plain, smollm2.session(snapkv_budget=budget) as today:
            assert plain.evict(budget, sinks=0)
            today.prefill(ids)
            np.testing.assert_array_equal(np.stack(plain.kept_positions), np.stack(today.kept_positions))
            plain_kept = np.stack(plain.kept_positions)
    default_kernel = SnapKVSettings().kernel
    np.testing.assert_array_equal(kept, select_reference(scores, budget, recency, "max", default_kernel, "kv-head",
                                                           sinks))
    np.testing.assert_array_equal(plain_kept, select_reference(scores, budget, recency, "max", default_kernel,
                                                                 "kv-head"))
    assert not np.array_equal(kept, plain_kept)                                # the sinks changed something


def test_sinks_beyond_the_candidates_when_the_budget_covers_the_prompt(smollm2, long_prompt):
    """sinks + recency < budget is all that is asked: more sinks than a short prompt has candidates is fine when
    the budget covers the prompt (nothing is evicted); with a budget 0 (off) any count is accepted."""
    with smollm2.session(snapkv_budget=512, snapkv_recency=64, snapkv_sinks=440) as s:
        s.prefill(long_prompt[:300])                                           # 300 - 64 < 440 sinks
        assert not s.evicted and s.kv_length == [300] * smollm2.config.n_layers
    with smollm2.session(snapkv_budget=0, snapkv_sinks=100000) as s:
        s.prefill(long_prompt[:100])
        assert not s.evicted
    # evicting one token past such a budget: the candidates [440, 449) still outnumber k = 7
    with smollm2.session(snapkv_budget=0) as base:
        base.prefill(long_prompt[:513], keep_scores=True)
        with base.fork() as f:
            assert f.evict(512, recency=64, sinks=441)
            kept = f.kept_positions[0]
            assert kept.shape[1] == 512 and (kept[:, :441] == np.arange(441)).all()
            assert (kept[:, -64:] == np.arange(449, 513)).all() and (np.diff(kept, axis=1) > 0).all()
        with base.fork() as f, pytest.raises(sharpi.ConfigError, match=r"recency \+ sinks \(64 \+ 448\)"):
            f.evict(512, recency=64, sinks=448)


def test_artifact_compiled_before_sinks(smollm2, monkeypatch):
    """An artifact whose snapkv_select takes 6 params (compiled before sinks) keeps working with sinks 0 and says
    to recompile for sinks > 0."""
    assert smollm2.manifest.snapkv["select_params"] == ops.SELECT_PARAMS
    monkeypatch.delitem(smollm2.manifest.snapkv, "select_params")
    assert smollm2.engine.select_params == 6
    settings, budget = smollm2.snapkv_settings(budget=128)
    assert settings.sinks == 0 and budget == 128
    assert smollm2.snapkv_settings(budget=0, sinks=4)[1] == 0                 # no eviction: nothing to refuse
    with pytest.raises(sharpi.ArtifactError, match="compiled before SnapKV sinks existed.*compile it again"):
        smollm2.session(snapkv_budget=128, snapkv_sinks=4)


# -- knobs --------------------------------------------------------------------------------------------------------
def test_auto_budget_edges():
    mib = 2 ** 20
    assert auto_budget(2048, 40 * mib, "cuda") == 0
    assert auto_budget(4096, 512 * mib, "cuda") == 1024
    assert auto_budget(8192, 512 * mib, "vulkan") == 2048
    assert auto_budget(16384, 512 * mib, "cuda") == 4096
    assert auto_budget(65536, 4096 * mib, "cuda") == 4096
    assert auto_budget(65536, 4096 * mib, "llvm") == 0
    # a hybrid's attention cache: on any target past 256 MiB (Qwen3.5-0.8B's 12 KiB a token: 16k tokens stay off)
    assert auto_budget(65536, 768 * mib, "llvm", hybrid=True) == 4096
    assert auto_budget(16384, 192 * mib, "llvm", hybrid=True) == 0
    assert auto_budget(2048, 300 * mib, "llvm", hybrid=True) == 1024


def test_env_budget_tristate():
    assert settings_from(env={}).budget is None                               # unset: auto
    assert settings_from(env={"SHARPI_SNAPKV_BUDGET": "0"}).budget == 0       # off
    assert settings_from(env={"SHARPI_SNAPKV_BUDGET": "1024"}).budget == 1024
    assert settings_from(env={"SHARPI_SNAPKV_BUDGET": "1024"}, budget=256).budget == 256   # argument wins
    assert settings_from({"budget": 512}, env={}).budget == 512                # artifact default last


@pytest.mark.parametrize("env,message", [
    ({"SHARPI_SNAPKV_BUDGET": "-1"}, "SHARPI_SNAPKV_BUDGET"), ({"SHARPI_SNAPKV_BUDGET": "lots"}, "SHARPI_SNAPKV_BUDGET"),
    ({"SHARPI_SNAPKV_WINDOW": "0"}, "SHARPI_SNAPKV_WINDOW"), ({"SHARPI_SNAPKV_KERNEL": "4"}, "odd"),
    ({"SHARPI_SNAPKV_POOLING": "median"}, "max, avg, none"),
    ({"SHARPI_SNAPKV_GRANULARITY": "per-token"}, "kv-head, shared"),
    ({"SHARPI_SNAPKV_RECENCY": "x"}, "SHARPI_SNAPKV_RECENCY")])
def test_bad_env_values(env, message):
    with pytest.raises(sharpi.ConfigError, match=message):
        settings_from(env=env)


def test_sinks_setting_parsing_and_precedence():
    assert settings_from(env={}).sinks == 0
    assert settings_from(env={"SHARPI_SNAPKV_SINKS": "4"}).sinks == 4
    assert settings_from(env={"SHARPI_SNAPKV_SINKS": "4"}, sinks=2).sinks == 2             # argument wins
    assert settings_from(env={"SHARPI_SNAPKV_SINKS": "4"}, sinks=0).sinks == 0
    assert settings_from({"sinks": 8}, env={}).sinks == 8                                 # artifact default last
    assert settings_from({"sinks": 8}, env={"SHARPI_SNAPKV_SINKS": "1"}).sinks == 1
    assert "sinks" in settings_from(env={}).to_dict()
    assert settings_from({"budget": 256, "recency": 64}, env={}).sinks == 0                # defaults of older artifacts
    for value, message in ((-1, r"snapkv_sinks must be an integer in \[0, "), ("x", "snapkv_sinks must be an integer")):
        with pytest.raises(sharpi.ConfigError, match=message):
            settings_from(env={}, sinks=value)
    with pytest.raises(sharpi.ConfigError, match="SHARPI_SNAPKV_SINKS must be an integer in \\[0, "):
        settings_from(env={"SHARPI_SNAPKV_SINKS": "-3"})
    # recency + sinks < budget whenever a budget is set; no budget, no limit
    check_against(settings_from(env={}, recency=64, sinks=63), 128, 64)
    check_against(settings_from(env={}, recency=64, sinks=10**6), 0, 64)
    for recency, sinks in ((64, 64), (0, 128), (100, 50)):
        with pytest.raises(sharpi.ConfigError, match=r"recency \+ sinks .* must be smaller than the budget \(128\)"):
            check_against(settings_from(env={}, recency=recency, sinks=sinks), 128, 64)


def test_bad_run_time_values(smollm2):
    with pytest.raises(sharpi.ConfigError, match="recency .* smaller than the budget"):
        smollm2.session(snapkv_budget=64, snapkv_recency=64)
    with pytest.raises(sharpi.ConfigError, match=r"recency \+ sinks \(32 \+ 32\) must be smaller than the budget"):
        smollm2.session(snapkv_budget=64, snapkv_recency=32, snapkv_sinks=32)
    with pytest.raises(sharpi.ConfigError, match="snapkv_sinks must be an integer in \\[0, "):
        smollm2.generate("hi", max_tokens=1, snapkv_sinks=-1)
    with pytest.raises(sharpi.ConfigError, match="exceeds the window this artifact was compiled for"):
        smollm2.session(snapkv_budget=256, snapkv_window=65)
    with pytest.raises(sharpi.ConfigError, match="odd"):
        smollm2.generate("hi", max_tokens=1, snapkv_kernel=2)


def test_cli_snapkv_flags(smollm2_artifact, capsys):
    from sharpi.cli import main as main_cli
    code = main_cli.main(["run", str(smollm2_artifact), "-p", "hi", "-n", "1", "--snapkv-pooling", "median"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "max, avg, none" in err
    code = main_cli.main(["run", str(smollm2_artifact), "-p", "The grass is green. " * 40, "-n", "2",
                          "--snapkv-budget", "100", "--snapkv-recency", "16", "--verbose"])
    assert code == 0
    capsys.readouterr()
    code = main_cli.main(["run", str(smollm2_artifact), "-p", "The grass is green. " * 40, "-n", "2",
                          "--snapkv-budget", "100", "--snapkv-recency", "16", "--snapkv-sinks", "4", "--verbose"])
    err = capsys.readouterr().err
    assert code == 0 and "100 slots" in err and "SnapKV evicted" in err, err
    code = main_cli.main(["run", str(smollm2_artifact), "-p", "hi", "-n", "1", "--snapkv-budget", "100",
                          "--snapkv-recency", "64", "--snapkv-sinks", "40"])
    err = capsys.readouterr().err
    assert code == 2 and "recency + sinks (64 + 40)" in err and "Traceback" not in err, err


def test_compile_records_sinks_default(tmp_path):
    """--snapkv-sinks on sharpi-compile is an artifact default (manifest), like the other knobs; sessions take it."""
    from sharpi.cli import compile as compile_cli
    gguf = write_tiny_llama(tmp_path / "tiny.gguf")
    assert compile_cli.main([str(gguf), "-o", str(tmp_path / "a"), "--quiet", "--snapkv-budget", "48",
                             "--snapkv-recency", "8", "--snapkv-sinks", "2", "--snapkv-window", "8"]) == 0
    model = sharpi.load(tmp_path / "a")
    assert model.manifest.snapkv["defaults"]["sinks"] == 2
    assert model.manifest.snapkv["select_params"] == ops.SELECT_PARAMS
    ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 100))
    with model.session() as s:
        s.prefill(ids)
        assert s.evicted and s.kv_length == [48] * model.config.n_layers
        for p in s.kept_positions:
            assert (p[:, :2] == [0, 1]).all() and (p[:, -8:] == np.arange(92, 100)).all()
