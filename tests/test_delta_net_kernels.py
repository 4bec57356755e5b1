"""The Gated DeltaNet CPU kernels (sharpi.codegen.kernels.delta_net) against the numpy reference's functions
(sharpi.testing.reference.causal_conv, delta_rule), on calls mixing sequences: a prompt's run of tokens of one slot,
then runs of other slots (a ragged decode batch), each from its own state."""
import numpy as np
import pytest
import tvm

from sharpi.codegen.kernels.delta_net import make_delta_conv, make_delta_rule, make_state_copy
from sharpi.codegen.targets.llvm import make_target
from sharpi.testing.reference import causal_conv, delta_rule, l2_norm

DEV = tvm.cpu()
K, HK, HV, D = 4, 2, 4, 16
SLOTS = [1, 1, 1, 1, 1, 2, 2, 3]          # a 5-token run of slot 1, two tokens of slot 2, one of slot 3


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _build(prim):
    return tvm.compile(tvm.IRModule({"main": prim}), target=make_target(None))


def _runs(slots):
    """(slot, first token, end) of each run of one slot."""
    out, start = [], 0
    for t in range(1, len(slots) + 1):
        if t == len(slots) or slots[t] != slots[start]:
            out.append((slots[start], start, t))
            start = t
    return out


@pytest.mark.parametrize("channels", [48, 128])           # a channel at a time, and blocks of 64 in vectors
@pytest.mark.parametrize("tokens", [None, "static"])
def test_conv_reads_each_runs_window_and_moves_it_on(channels, tokens, rng):
    width = (K - 1) * channels + 8
    states = rng.standard_normal((4, 2, width)).astype(np.float32)
    mixed = rng.standard_normal((len(SLOTS), channels)).astype(np.float32)
    weight = rng.standard_normal((channels, K)).astype(np.float32)
    kernel = _build(make_delta_conv(channels, K, 2, width, len(SLOTS) if tokens else None))
    pool, out = _t(states), _t(np.zeros_like(mixed))
    kernel(pool, _t(mixed), _t(weight), _t(np.array(SLOTS, np.int32)), 1, out)
    want = states.copy()
    for slot, a, b in _runs(SLOTS):
        window = np.concatenate([states[slot, 1, :(K - 1) * channels].reshape(K - 1, channels), mixed[a:b]])
        np.testing.assert_allclose(out.numpy()[a:b], causal_conv(window, weight), rtol=1e-5, atol=1e-5)
        want[slot, 1, :(K - 1) * channels] = window[-(K - 1):].reshape(-1)
    np.testing.assert_array_equal(pool.numpy(), want)          # layer 0 and slot 0 untouched


@pytest.mark.parametrize("grouped", [False, True])
def test_delta_rule_per_run_and_head_map(grouped, rng):
    offset = 24
    width = offset + HV * D * D
    states = (0.1 * rng.standard_normal((4, 1, width))).astype(np.float32)
    n = len(SLOTS)
    q = l2_norm(rng.standard_normal((n, HK, D)).astype(np.float32), 1e-6)
    k = l2_norm(rng.standard_normal((n, HK, D)).astype(np.float32), 1e-6)
    v = rng.standard_normal((n, HV, D)).astype(np.float32)
    g = -rng.uniform(0, 1, (n, HV)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, HV)).astype(np.float32)
    kernel = _build(make_delta_rule(HK, HV, D, 1, width, offset, grouped))
    pool, out = _t(states), _t(np.zeros((n, HV, D), np.float32))
    kernel(pool, _t(q), _t(k), _t(v), _t(g), _t(beta), _t(np.array(SLOTS, np.int32)), 0, out)
    heads = np.arange(HV) // (HV // HK) if grouped else np.arange(HV) % HK
    for slot, a, b in _runs(SLOTS):
        matrix = states[slot, 0, offset:].reshape(HV, D, D)
        want, after = delta_rule(q[a:b, heads], k[a:b, heads], v[a:b], g[a:b], beta[a:b], matrix)
        np.testing.assert_allclose(out.numpy()[a:b], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pool.numpy()[slot, 0, offset:].reshape(HV, D, D), after, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pool.numpy()[:, 0, :offset], states[:, 0, :offset])   # the conv's part stays


def test_state_copy_and_clamped_slots(rng):
    states = rng.standard_normal((3, 2, 10)).astype(np.float32)
    pool = _t(states)
    copy = _build(make_state_copy(2, 10))
    copy(pool, _t(np.array([1, 2], np.int32)))
    np.testing.assert_array_equal(pool.numpy()[2], states[1])
    copy(pool, _t(np.array([0, 99], np.int32)))               # out of range: clamped to the last slot
    np.testing.assert_array_equal(pool.numpy()[2], states[0])
    np.testing.assert_array_equal(pool.numpy()[:2], states[:2])
