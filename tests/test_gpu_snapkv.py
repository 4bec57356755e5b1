"""SnapKV's GPU kernels (sharpi.codegen.kernels.gpu.snapkv), built to WGSL and run on Vulkan (lavapipe in CI)
through the plan runner, against numpy and the CPU kernels. Sizes stay small: lavapipe runs shaders at CPU speed."""

import numpy as np
import pytest
import tvm
from tvm import relax

from sharpi.codegen.kernels.gpu.snapkv import (make_gpu_kv_compact, make_gpu_snapkv_row_stats,
                                               make_gpu_snapkv_score, make_gpu_snapkv_select)
from sharpi.codegen.kernels.snapkv import make_snapkv_select
from sharpi.codegen.targets.llvm import make_target
from sharpi.common import ops
from sharpi.common.ops import SELECT_PARAMS
from sharpi.testing.snapkv import score_reference, select_reference
from vulkan_device import plan_runner

D, PAGE, MAX_PAGES, LAYERS, LAYER, POOL_PAGES = 16, 16, 5, 2, 1, 12


def _tensor(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


def _layer():
    return relax.prim_value(tvm.tirx.IntImm("int64", LAYER))


# -- score ----------------------------------------------------------------------------------------------------
def _score_module(heads, kv_heads):
    """`stats` (the first kernel alone) and `score` (both kernels, as the lead's pipeline emits them)."""
    n = tvm.tirx.Var("n", "int64")
    scale = D ** -0.5
    bb = relax.BlockBuilder()
    gv_stats = bb.add_func(make_gpu_snapkv_row_stats(heads, kv_heads, D, PAGE, MAX_PAGES, scale), "row_stats")
    gv_score = bb.add_func(make_gpu_snapkv_score(heads, kv_heads, D, PAGE, MAX_PAGES, scale), "score_gpu")
    for name in ("stats", "score"):
        q = relax.Var("q", _tensor((n, heads, D)))
        pool = relax.Var("pool", _tensor((POOL_PAGES, 2, kv_heads, PAGE, D)))
        table = relax.Var("table", _tensor((LAYERS, MAX_PAGES), "int32"))
        lens = relax.Var("lens", _tensor((LAYERS,), "int32"))
        window = relax.Var("window", _tensor((1,), "int32"))
        common = [q, pool, table, lens, _layer(), window]
        with bb.function(name, [q, pool, table, lens, window]):
            with bb.dataflow():
                stats = relax.call_tir(gv_stats, common, _tensor((n, heads, 2)))
                if name == "stats":
                    out = bb.emit_output(stats)
                else:
                    stats = bb.emit(stats)
                    out = bb.emit_output(relax.call_tir(gv_score, [*common, stats],
                                                        _tensor((kv_heads, MAX_PAGES * PAGE))))
            bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def score_runners(tmp_path_factory):
    cache = {}

    def get(heads, kv_heads):
        if (heads, kv_heads) not in cache:
            directory = tmp_path_factory.mktemp(f"score{heads}_{kv_heads}")
            cache[heads, kv_heads] = plan_runner(_score_module(heads, kv_heads), directory)
        return cache[heads, kv_heads]
    return get


def _paged_keys(keys, kv_heads, rng):
    """A pool holding keys [total, KVH, D] at slots 0.. of LAYER through a scattered page table."""
    pool = rng.standard_normal((POOL_PAGES, 2, kv_heads, PAGE, D)).astype(np.float32)   # garbage elsewhere
    table = np.zeros((LAYERS, MAX_PAGES), np.int32)
    table[LAYER] = [5, 2, 9, 1, 7]
    for s, key in enumerate(keys):
        pool[table[LAYER, s // PAGE], 0, :, s % PAGE] = key
    return pool, table


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("held,new,window", [(0, 37, 8), (13, 30, 64), (21, 11, 11)])
@pytest.mark.parametrize("reduce", ["sum", "max"])     # a negative window: the maximum (KVzip's reduction)
def test_score_kernels(score_runners, heads, kv_heads, held, new, window, reduce, rng):
    runner = score_runners(heads, kv_heads)
    keys = rng.standard_normal((held + new, kv_heads, D)).astype(np.float32)
    pool, table = _paged_keys(keys, kv_heads, rng)
    lens = np.zeros(LAYERS, np.int32)
    lens[LAYER] = held
    q = rng.standard_normal((new, heads, D)).astype(np.float32)
    args = (q, pool, table, lens, np.array([window if reduce == "sum" else -window], np.int32))
    w = min(window, new)
    # the stats: max logit and sum of exp for the last w queries, zero for the others
    stats = runner.run("stats", *args)
    k = np.repeat(keys, heads // kv_heads, axis=1).astype(np.float64)
    for t in range(new - w, new):
        logits = np.einsum("hd,shd->hs", q[t].astype(np.float64), k[:held + t + 1]) * D ** -0.5
        m = logits.max(-1)
        np.testing.assert_allclose(stats[t, :, 0], m, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats[t, :, 1], np.exp(logits - m[:, None]).sum(-1), rtol=1e-4)
    assert not stats[:new - w].any()
    out = runner.run("score", *args)
    expected = score_reference(q[-w:], keys, held, D ** -0.5, reduce)
    np.testing.assert_allclose(out[:, :held + new], expected, rtol=1e-4, atol=1e-6)
    assert not out[:, held + new:].any()


# -- select ---------------------------------------------------------------------------------------------------
SELECT_LAYERS, SELECT_KV_HEADS = 3, 2


def _select_module(slots):
    ty = _tensor((SELECT_LAYERS, SELECT_KV_HEADS, slots))
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_gpu_snapkv_select(SELECT_LAYERS, SELECT_KV_HEADS, slots), "select_gpu")
    scores = relax.Var("scores", ty)
    params = relax.Var("params", _tensor((SELECT_PARAMS,), "int32"))
    with bb.function("select", [scores, params]):
        with bb.dataflow():
            outputs = bb.emit(relax.call_tir(gv, [scores, params],
                                             [_tensor(ty.shape, "int32"), ty, ty]))   # keep, base, pooled
            keep = bb.emit_output(relax.TupleGetItem(outputs, 0))
        bb.emit_func_output(keep)
    return bb.get()


@pytest.fixture(scope="module")
def select_runners(tmp_path_factory):
    cache = {}

    def get(slots):
        if slots not in cache:
            directory = tmp_path_factory.mktemp(f"select{slots}")
            runner = plan_runner(_select_module(slots), directory)
            cpu = tvm.compile(tvm.IRModule({"main": make_snapkv_select(SELECT_LAYERS, SELECT_KV_HEADS, slots)}),
                              target=make_target(None))
            cache[slots] = (runner, cpu)
        return cache[slots]
    return get


def _cpu_select(cpu, scores, params):
    t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu())   # noqa: E731
    keep = t(np.zeros(scores.shape, np.int32))
    cpu(t(scores), t(params), keep, t(np.zeros(scores.shape, np.float32)), t(np.zeros(scores.shape, np.float32)))
    return keep.numpy()


def _check_select(select_runners, scores, total, budget, recency, pooling, kernel, granularity, sinks=0):
    runner, cpu = select_runners(scores.shape[-1])
    params = np.array([total, budget, recency, kernel, ops.POOLING_CODES[pooling],
                       int(granularity == "shared"), sinks], np.int32)
    keep = runner.run("select", scores, params)[..., :budget]
    expected = select_reference(scores[..., :total], budget, recency, pooling, kernel, granularity, sinks)
    np.testing.assert_array_equal(keep, expected)
    np.testing.assert_array_equal(keep, _cpu_select(cpu, scores, params)[..., :budget])


@pytest.mark.parametrize("pooling,kernel", [("none", 1), ("max", 5), ("avg", 7), ("max", 15), ("avg", 3)])
@pytest.mark.parametrize("granularity", ["kv-head", "shared"])
@pytest.mark.parametrize("slots,total,budget,recency", [(160, 77, 30, 6), (160, 160, 100, 0), (400, 389, 64, 16),
                                                        (400, 300, 299, 1)])
def test_select_ties_and_pooling(select_runners, pooling, kernel, granularity, slots, total, budget, recency, rng):
    scores = np.zeros((SELECT_LAYERS, SELECT_KV_HEADS, slots), np.float32)
    # few distinct values: many exact ties, including across the threads' chunks
    scores[..., :total] = rng.integers(0, 5, (SELECT_LAYERS, SELECT_KV_HEADS, total)) / np.float32(7)
    _check_select(select_runners, scores, total, budget, recency, pooling, kernel, granularity)


@pytest.mark.parametrize("granularity", ["kv-head", "shared"])
def test_select_continuous_and_constant_scores(select_runners, granularity, rng):
    slots, total = 400, 397
    scores = np.zeros((SELECT_LAYERS, SELECT_KV_HEADS, slots), np.float32)
    scores[..., :total] = rng.random((SELECT_LAYERS, SELECT_KV_HEADS, total), np.float32) ** 4   # wide range
    _check_select(select_runners, scores, total, 90, 10, "avg", 7, granularity)
    scores[..., :total] = 0.25                                                  # every candidate ties
    _check_select(select_runners, scores, total, 90, 10, "none", 1, granularity)
    scores[..., :total] = 0                                                     # all zero bits
    _check_select(select_runners, scores, total, 90, 10, "max", 5, granularity)


@pytest.mark.parametrize("granularity", ["kv-head", "shared"])
@pytest.mark.parametrize("slots,total,budget,recency,sinks", [(160, 77, 30, 6, 3), (400, 389, 64, 16, 4),
                                                              (400, 389, 300, 16, 283), (400, 300, 299, 1, 297)])
def test_select_with_sinks(select_runners, granularity, slots, total, budget, recency, sinks, rng):
    """Attention sinks: positions 0 .. sinks-1 first, the top-k over [sinks, total - recency) after them (the
    candidates start past the sinks in every thread's chunk), then the tail; the sinks' own high scores must not
    crowd out a candidate. The last two cases leave one candidate to pick among few (k = 1)."""
    scores = np.zeros((SELECT_LAYERS, SELECT_KV_HEADS, slots), np.float32)
    scores[..., :total] = rng.integers(0, 5, (SELECT_LAYERS, SELECT_KV_HEADS, total)) / np.float32(7)
    scores[..., :sinks] = 1.0                                                   # sinks score highest
    for pooling, kernel in (("max", 5), ("none", 1)):
        _check_select(select_runners, scores, total, budget, recency, pooling, kernel, granularity, sinks)


# -- compact --------------------------------------------------------------------------------------------------
COMPACT_KV_HEADS, COMPACT_PAGES = 2, 10


def _compact_module():
    slots = MAX_PAGES * PAGE
    pool_ty = _tensor((COMPACT_PAGES * LAYERS, 2, COMPACT_KV_HEADS, PAGE, D))
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_gpu_kv_compact(LAYERS, COMPACT_KV_HEADS, D, PAGE, MAX_PAGES), "compact_gpu")
    pool = relax.Var("pool", pool_ty)
    table = relax.Var("table", _tensor((LAYERS, MAX_PAGES), "int32"))
    keep = relax.Var("keep", _tensor((LAYERS, COMPACT_KV_HEADS, slots), "int32"))
    count = relax.Var("count", _tensor((LAYERS,), "int32"))
    with bb.function("compact", [pool, table, keep, count], pure=False):
        out = bb.emit(relax.call_tir_inplace(gv, [pool, table, keep, count], [0], pool_ty))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("total,count", [(80, 33), (57, 57), (80, 1)])
def test_compact_gathers_kept_slots_in_place(tmp_path, total, count, rng):
    """Per-layer counts: the last layer keeps 0 slots (a sliding-window layer SnapKV leaves alone) and must be
    untouched."""
    runner = plan_runner(_compact_module(), tmp_path)
    slots = MAX_PAGES * PAGE
    pool = rng.standard_normal((COMPACT_PAGES * LAYERS, 2, COMPACT_KV_HEADS, PAGE, D)).astype(np.float32)
    table = rng.permutation(COMPACT_PAGES * LAYERS)[:LAYERS * MAX_PAGES].reshape(LAYERS, MAX_PAGES).astype(np.int32)
    counts = np.full(LAYERS, count, np.int32)
    counts[-1] = 0
    keep = np.zeros((LAYERS, COMPACT_KV_HEADS, slots), np.int32)
    for l in range(LAYERS):
        for h in range(COMPACT_KV_HEADS):
            keep[l, h, :count] = np.sort(rng.choice(total, count, replace=False))
    got = runner.run("compact", pool, table, keep, counts)
    np.testing.assert_array_equal(got, compacted(pool, table, keep, counts))


def compacted(pool, table, keep, counts):
    """numpy's snapkv_compact: slot keep[l, h, i] -> slot i of layer l for i < counts[l], a slot's whole row (both
    planes of the plain layout, the one row of bytes of the packed one)."""
    expected = pool.copy()
    for l, n in enumerate(counts):
        for h in range(pool.shape[2]):
            src = keep[l, h, :n]
            expected[table[l, np.arange(n) // PAGE], :, h, np.arange(n) % PAGE] = \
                pool[table[l, src // PAGE], :, h, src % PAGE]
    return expected
