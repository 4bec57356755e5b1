"""The CPU schedules for the functions sharpi does not write by hand (codegen/cpu_schedule.py): the fast-math
activations and the inlined, parallel, vectorized norms and gates, against numpy."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from sharpi.codegen.cpu_schedule import fast_math_legalizations, schedule_generic
from sharpi.codegen.targets.llvm import build_executable, make_target


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _rms_norm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _ffn_and_norm_module(dim: int):
    """gelu_tanh(a) * b, silu(a) * b and rms_norm(a + b) * w over [n, dim]: the shapes of the model graphs."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((n, dim), "float32"))
    b = relax.Var("b", relax.TensorType((n, dim), "float32"))
    w = relax.Var("w", relax.TensorType((dim,), "float32"))
    with bb.function("main", [a, b, w]):
        with bb.dataflow():
            gelu = bb.emit(R.multiply(R.nn.gelu_tanh(a), b))
            silu = bb.emit(R.multiply(R.nn.silu(a), b))
            norm = bb.emit(R.nn.rms_norm(R.add(a, b), w, axes=[-1], epsilon=1e-6))
            out = bb.emit_output(relax.Tuple([gelu, silu, norm]))
        bb.emit_func_output(out)
    return bb.get()


def _lower(mod, target, fast: bool, scheduled: bool):
    with target:
        mod = relax.transform.LegalizeOps(fast_math_legalizations() if fast else None)(mod)
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseOps()(mod)
        mod = relax.transform.FuseTIR()(mod)
        if scheduled:
            mod = schedule_generic(mod, target)
    return mod


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_scheduled_gates_and_norm_match_numpy(tokens):
    dim = 96
    target = make_target(None)
    lowered = _lower(_ffn_and_norm_module(dim), target, fast=True, scheduled=True)
    prims = {gv.name_hint: f for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    # every function got a parallel loop and the elementwise ones a vector loop: the schedule really applied
    assert prims and all("T.parallel" in f.script() for f in prims.values()), sorted(prims)
    assert any("T.vectorized" in f.script() for f in prims.values())
    vm = relax.VirtualMachine(build_executable(lowered, target), tvm.cpu())
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((tokens, dim)) * 4).astype(np.float32)      # GELU/SiLU's tails and middle
    a[0, :4] = [-30.0, 30.0, 0.0, 1e-4]
    b = rng.standard_normal((tokens, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    gelu, silu, norm = (o.numpy() for o in vm["main"](*(tvm.runtime.tensor(v) for v in (a, b, w))))
    x, y = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(gelu, _gelu_tanh(x) * y, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(silu, _silu(x) * y, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(norm, _rms_norm(x + y, w), rtol=2e-5, atol=2e-6)


def test_unscheduled_functions_are_what_it_replaces():
    """Without the pass the same functions have no parallel loop (so the test above can fail)."""
    lowered = _lower(_ffn_and_norm_module(96), make_target(None), fast=False, scheduled=False)
    prims = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims and not any("T.parallel" in f.script() for f in prims)


@pytest.mark.parametrize("tokens", [1, 21])
def test_scheduled_weighted_sum_of_experts_matches_numpy(tokens):
    """A mixture's output, sum_j weights[t, j] * y[t, j, :] (blocks.py): one block summing over the middle axis,
    scheduled with a parallel row loop (unless one row) and the reduction outside the width loop; as numpy's."""
    slots, dim = 8, 96
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    y = relax.Var("y", relax.TensorType((n, slots, dim), "float32"))
    w = relax.Var("w", relax.TensorType((n, slots), "float32"))
    with bb.function("main", [y, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(R.sum(R.multiply(y, R.expand_dims(w, [-1])), axis=[1])))
        bb.emit_func_output(out)
    target = make_target(None)
    lowered = _lower(bb.get(), target, fast=True, scheduled=True)
    (prim,) = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert "T.parallel" in prim.script() and "T.vectorized" in prim.script()     # the rule applied
    assert "sblock_alloc_buffer" not in prim.script()                          # no [n, k, dim] intermediate
    rng = np.random.default_rng(1)
    ys = rng.standard_normal((tokens, slots, dim)).astype(np.float32)
    ws = rng.random((tokens, slots)).astype(np.float32)
    vm = relax.VirtualMachine(build_executable(lowered, target), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(ys), tvm.runtime.tensor(ws)).numpy()
    np.testing.assert_allclose(got, np.einsum("tjd,tj->td", ys.astype(np.float64), ws), rtol=1e-5, atol=1e-6)
