"""ONNX export (issue #9): the lowered Relax module translated to ONNX, run with ONNX Runtime (onnx.reference where
onnxruntime is not installed; the SmolLM2 checks then skip, the reference evaluator being far too slow for them).

- SmolLM2 (exported once for this module, f32 weights): prefill logits of a 64-token prompt within 1e-3 (relative
  to the largest logit) of the CPU artifact's, a decode step through decode.onnx with the exported cache, and with
  SnapKV (budget 32, window 16, recency 8; prompt 128) the same keep set per layer and KV head as the artifact's
  session (with 0 and with 4 attention sinks), and a decode step on the compacted cache equal to the session's.
- Tiny random GGUFs (tests/tiny_gguf.py): qwen2 (biases, NEOX RoPE), qwen3 (q/k norms, head_dim != dim/heads) and a
  mistral-style llama (sliding window 12 < the prompt) against the exact float32 numpy reference, a continuation
  prefill on a past cache, f16 weights, and SnapKV's avg pooling and shared granularity against
  sharpi.testing.snapkv's numpy selection.
- The generic Relax op table (concat, softmax, reductions, astype, gelu, ...) against TVM's own build.
- Errors: an architecture sharpi does not know, an op without an ONNX translation, bad options.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import (CompileError, ConfigError, SharpiError, UnsupportedArchitectureError,
                                  UnsupportedTensorTypeError)
from tiny_gguf import MOE_ARCHS, MOE_GOLDEN, write_golden_moe, write_tiny_llama

onnx = pytest.importorskip("onnx")
try:
    import onnxruntime as ort
except ImportError:              # onnx.reference runs the tiny models; the SmolLM2 checks skip
    ort = None

LOGITS_RTOL = 1e-3               # the f32 export against the CPU artifact (measured ~2e-6)
TINY_RTOL = 1e-4                 # against the numpy reference, as tests/test_architectures.py (measured ~1e-6)
BUDGET, WINDOW, RECENCY, SINKS = 32, 16, 8, 4


def _session(path: Path):
    """A callable feeds -> {output name: array}, with ONNX Runtime or onnx's reference evaluator."""
    if ort is not None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        return lambda feeds: dict(zip(names, sess.run(None, feeds)))
    from onnx.reference import ReferenceEvaluator
    ev = ReferenceEvaluator(str(path))
    return lambda feeds: dict(zip(ev.output_names, ev.run(None, feeds)))


def _empty_cache(cfg) -> dict:
    return {f"past_{what}.{l}": np.zeros((cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
            for l in range(cfg.n_layers) for what in ("key", "value")}


def _next_cache(out: dict) -> dict:
    return {name.replace("present_", "past_"): v for name, v in out.items() if name.startswith("present_")}


def _feeds(ids, start: int, cache: dict, **snapkv) -> dict:
    ids = np.asarray(ids, np.int32)
    feeds = {"ids": ids, "pos": np.arange(start, start + len(ids), dtype=np.int32), **cache}
    feeds.update({f"snapkv_{k}": np.array([v], np.int64) for k, v in snapkv.items()})
    return feeds


def _rel(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# -- SmolLM2 -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_onnx(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "smollm2"
    return sharpi.export_onnx(str(smollm2_gguf), out, snapkv_budget=BUDGET, snapkv_window=WINDOW,
                              snapkv_recency=RECENCY)


@pytest.fixture(scope="module")
def smollm2_graphs(smollm2_onnx):
    if ort is None:
        pytest.skip("onnxruntime is not installed (pip install onnxruntime): onnx.reference is too slow for SmolLM2")
    cache = {}

    def graph(name):
        if name not in cache:
            cache[name] = _session(smollm2_onnx / f"{name}.onnx")
        return cache[name]
    return graph


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    text = (Path(sharpi.__file__).parent / "eval" / "data" / "alice.txt").read_text()
    ids = smollm2.tokenize(text)
    assert len(ids) > 2 * 128
    return np.asarray(ids[:129], np.int32)


def test_export_files_and_signature(smollm2_onnx, smollm2):
    cfg = smollm2.config
    manifest = json.loads((smollm2_onnx / "sharpi-onnx.json").read_text())
    assert manifest["opset"] == 18 and manifest["ir_version"] == 8 and manifest["weights_dtype"] == "f32"
    assert set(manifest["functions"]) == {"prefill", "decode", "prefill_snapkv"}
    assert manifest["snapkv"]["defaults"]["budget"] == BUDGET
    assert (smollm2_onnx / "tokenizer.json").is_file()
    # every weight once, f32, in the shared file: the GGUF's parameters (the tied embedding stored once)
    params = cfg.vocab_size * cfg.dim + cfg.n_layers * (cfg.dim * (2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn_dim)
                                                         + 2 * cfg.dim) + cfg.dim
    assert (smollm2_onnx / "weights.onnx.data").stat().st_size == pytest.approx(4 * params, rel=0.01)
    for name, entry in manifest["functions"].items():
        path = smollm2_onnx / entry["file"]
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        assert model.ir_version == 8
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
        assert {n.domain for n in model.graph.node} == {""}            # standard ONNX ops only
        inputs = [i.name for i in model.graph.input]
        outputs = [o.name for o in model.graph.output]
        caches = [f"past_{w}.{l}" for l in range(cfg.n_layers) for w in ("key", "value")]
        snapkv = ["snapkv_window", "snapkv_budget", "snapkv_recency", "snapkv_sinks"] if name == "prefill_snapkv" \
            else []
        assert inputs == ["ids", "pos"] + caches + snapkv
        assert outputs == ["logits"] + [c.replace("past_", "present_") for c in caches] + (
            ["snapkv_keep", "snapkv_scores"] if snapkv else [])
        assert [i["name"] for i in entry["inputs"]] == inputs
        ops = {n.op_type for n in model.graph.node}
        assert {"MatMul", "Softmax", "Concat", "Cos", "Sin"} <= ops
        if snapkv:
            assert {"TopK", "MaxPool", "ReduceSum", "ReduceMean", "GatherElements"} <= ops


def test_prefill_and_decode_logits_match_cpu_artifact(smollm2, smollm2_graphs, prompt_ids):
    ids = prompt_ids[:65]
    want = smollm2.score(ids)                             # teacher-forced [65, vocab]
    out = smollm2_graphs("prefill")(_feeds(ids[:64], 0, _empty_cache(smollm2.config)))
    assert out["logits"].shape == (1, smollm2.config.vocab_size)
    assert _rel(out["logits"][0], want[63]) < LOGITS_RTOL
    assert int(out["logits"][0].argmax()) == int(want[63].argmax())
    assert out["present_key.0"].shape == (smollm2.config.n_kv_heads, 64, smollm2.config.head_dim)
    step = smollm2_graphs("decode")(_feeds(ids[64:65], 64, _next_cache(out)))
    assert _rel(step["logits"][0], want[64]) < LOGITS_RTOL
    assert step["present_value.29"].shape[1] == 65


def test_snapkv_keep_set_and_decode_match_session(smollm2, smollm2_graphs, prompt_ids):
    cfg = smollm2.config
    ids = prompt_ids[:128]
    with smollm2.session(snapkv_budget=BUDGET, snapkv_window=WINDOW, snapkv_recency=RECENCY) as s:
        last = s.prefill(ids)
        kept = s.kept_positions
        assert s.kv_length == [BUDGET] * cfg.n_layers
        token = int(last.argmax())
        after = s.decode(token)
    out = smollm2_graphs("prefill_snapkv")(_feeds(ids, 0, _empty_cache(cfg), window=WINDOW, budget=BUDGET,
                                                  recency=RECENCY))
    assert _rel(out["logits"][0], last) < LOGITS_RTOL
    keep = out["snapkv_keep"]
    assert keep.shape == (cfg.n_layers, cfg.n_kv_heads, BUDGET)
    for l in range(cfg.n_layers):                         # a fresh prompt: kept slots are kept positions
        assert np.array_equal(keep[l], kept[l]), f"layer {l}: {keep[l]} != {kept[l]}"
    assert np.array_equal(keep[:, :, BUDGET - RECENCY:],
                          np.broadcast_to(np.arange(128 - RECENCY, 128), (cfg.n_layers, cfg.n_kv_heads, RECENCY)))
    assert out["snapkv_scores"].shape == (cfg.n_layers, cfg.n_kv_heads, 128)
    assert out["present_key.3"].shape == (cfg.n_kv_heads, BUDGET, cfg.head_dim)
    step = smollm2_graphs("decode")(_feeds([token], 128, _next_cache(out)))      # RoPE'd at its true position
    assert _rel(step["logits"][0], after) < LOGITS_RTOL
    # attention sinks: the same keep sets as the artifact's session with the same sinks
    with smollm2.session(snapkv_budget=BUDGET, snapkv_window=WINDOW, snapkv_recency=RECENCY, snapkv_sinks=SINKS) as s:
        s.prefill(ids)
        kept = s.kept_positions
    keep = smollm2_graphs("prefill_snapkv")(_feeds(ids, 0, _empty_cache(cfg), window=WINDOW, budget=BUDGET,
                                                   recency=RECENCY, sinks=SINKS))["snapkv_keep"]
    assert (keep[..., :SINKS] == np.arange(SINKS)).all()
    for l in range(cfg.n_layers):
        assert np.array_equal(keep[l], kept[l]), f"layer {l} with sinks: {keep[l]} != {kept[l]}"


# -- tiny models --------------------------------------------------------------------------------------------------
TINY = {
    "qwen2": dict(arch="qwen2", qkv_bias=True, rope_base=1e6),
    "qwen3": dict(arch="qwen3", qk_norm=True, head_dim=32, rope_base=1e6),
    "mistral": dict(arch="llama", sliding_window=12),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    from sharpi.testing.reference import NumpyReference
    d = tmp_path_factory.mktemp(f"onnx-{request.param}")
    path = write_tiny_llama(d / "tiny.gguf", layers=2, dim=64, heads=4, kv_heads=2, matrix_type="Q8_0",
                            **TINY[request.param])
    out = sharpi.export_onnx(str(path), d / "onnx", functions=["prefill_logits", "decode"], snapkv="off")
    ref = NumpyReference(path)
    ids = np.random.default_rng(0).integers(0, ref.config.vocab_size, 40).astype(np.int32)
    return ref, out, ids, ref.forward(ids)


def test_tiny_architectures_match_reference(tiny):
    ref, out, ids, want = tiny
    cfg = ref.config
    prefill, decode = _session(out / "prefill_logits.onnx"), _session(out / "decode.onnx")
    got = prefill(_feeds(ids, 0, _empty_cache(cfg)))
    assert _rel(got["logits"], want) < TINY_RTOL
    part = prefill(_feeds(ids[:30], 0, _empty_cache(cfg)))              # a continuation on a past cache
    rest = prefill(_feeds(ids[30:37], 30, _next_cache(part)))
    assert _rel(rest["logits"], want[30:37]) < TINY_RTOL
    cache = _next_cache(rest)
    for t in range(37, 40):                                             # decode steps (the window slides past 12)
        step = decode(_feeds(ids[t:t + 1], t, cache))
        assert _rel(step["logits"][0], want[t]) < TINY_RTOL
        cache = _next_cache(step)
    assert cache["past_key.1"].shape == (cfg.n_kv_heads, 40, cfg.head_dim)


@pytest.mark.parametrize("pooling,granularity", [("avg", "shared"), ("max", "kv-head"), ("none", "kv-head")])
def test_tiny_snapkv_selection_matches_numpy(pooling, granularity, tmp_path):
    from sharpi.testing.reference import NumpyReference
    from sharpi.testing.snapkv import score_reference, select_reference
    path = write_tiny_llama(tmp_path / "tiny.gguf", layers=2, dim=64, heads=4, kv_heads=2)
    kernel = 1 if pooling == "none" else 5
    out = sharpi.export_onnx(str(path), tmp_path / "onnx", functions=["prefill_snapkv"], weights="f16",
                             snapkv_pooling=pooling, snapkv_kernel=kernel, snapkv_granularity=granularity)
    ref = NumpyReference(path)
    cfg = ref.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 48).astype(np.int32)
    capture = []
    want = ref.forward(ids, capture=capture)
    graph = _session(out / "prefill_snapkv.onnx")
    got = graph(_feeds(ids, 0, _empty_cache(cfg), window=8, budget=20, recency=4))    # snapkv_sinks not fed: 0
    assert _rel(got["logits"][0], want[-1]) < 5e-3                     # f16 weights
    scores = np.stack([score_reference(q[-8:], k, 0, cfg.head_dim ** -0.5) for q, k, _ in capture])
    assert np.abs(got["snapkv_scores"] - scores).max() < 1e-2          # probabilities summed over 8 queries
    expected = select_reference(got["snapkv_scores"], 20, 4, pooling, kernel, granularity)
    assert np.array_equal(got["snapkv_keep"], expected)
    k = got["present_key.1"]
    assert k.shape == (cfg.n_kv_heads, 20, cfg.head_dim)
    if granularity == "shared":
        assert (got["snapkv_keep"] == got["snapkv_keep"][0, 0]).all()
    sinks = graph(_feeds(ids, 0, _empty_cache(cfg), window=8, budget=20, recency=4, sinks=3))
    np.testing.assert_array_equal(sinks["snapkv_scores"], got["snapkv_scores"])
    expected = select_reference(got["snapkv_scores"], 20, 4, pooling, kernel, granularity, sinks=3)
    assert np.array_equal(sinks["snapkv_keep"], expected) and (expected[..., :3] == [0, 1, 2]).all()
    assert np.array_equal(graph(_feeds(ids, 0, _empty_cache(cfg), window=8, budget=20, recency=4,
                                       sinks=0))["snapkv_keep"], got["snapkv_keep"])


def test_relax_op_table_matches_tvm(tmp_path):
    """The generic Relax ops the frontends do not all emit yet, through the translator, against TVM's own build."""
    import tvm
    from tvm import relax
    from tvm.relax import op as R

    from sharpi.export.onnx.export import GraphBuilder, Translator, WeightStore
    from sharpi.frontend.weights import WeightTable
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 6), "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            a = bb.emit(R.concat([x, R.nn.gelu(x)], axis=1))                                # [4, 12]
            c = bb.emit(R.squeeze(R.expand_dims(R.nn.softmax(a, axis=-1), axis=[0]), axis=[0]))
            d = bb.emit(R.subtract(R.divide(c, R.sum(c, axis=[1], keepdims=True)), R.mean(c, axis=[0])))
            e = bb.emit(R.add(R.max(d, axis=[1], keepdims=True), R.astype(R.astype(d, "float16"), "float32")))
            f = bb.emit(R.power(R.sigmoid(R.tanh(e)), relax.const(2.0, "float32")))
            y = bb.emit_output(R.nn.gelu_tanh(R.negative(R.exp(f))))
        bb.emit_func_output(y)
    mod = bb.get()
    store = WeightStore(tmp_path / "w.bin")
    gb = GraphBuilder("ops", store)
    out = Translator(gb, WeightTable()).run(mod["f"], "f", {"x": gb.input("x", "float32", [4, 6])})
    gb.output("y", out, "float32", [4, 12])
    store.close()
    (tmp_path / "ops.onnx").write_bytes(gb.model("ops", {}).SerializeToString())
    onnx.checker.check_model(str(tmp_path / "ops.onnx"), full_check=True)
    xv = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    got = _session(tmp_path / "ops.onnx")({"x": xv})["y"]
    want = relax.VirtualMachine(relax.build(mod, "llvm"), tvm.cpu())["f"](tvm.runtime.tensor(xv)).numpy()
    assert np.abs(got - want).max() < 1e-5


# -- errors and entry points --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixtures_of_experts_match_reference(arch, tmp_path):
    """Each MoE architecture's tiny golden GGUF (F32), exported: the router as Softmax and TopK, the chosen experts
    gathered and multiplied; prefill logits and a decode step on its cache equal the numpy reference's."""
    from sharpi.testing.reference import NumpyReference
    path = write_golden_moe(tmp_path, arch)
    out = sharpi.export_onnx(str(path), tmp_path / "onnx", functions=["prefill_logits", "decode"], snapkv="off")
    ref = NumpyReference(path)
    ids = np.array(json.loads(MOE_GOLDEN.read_text())["ids"][:24], np.int32)
    want = ref.forward(ids)
    prefill, decode = _session(out / "prefill_logits.onnx"), _session(out / "decode.onnx")
    part = prefill(_feeds(ids[:23], 0, _empty_cache(ref.config)))
    assert _rel(part["logits"], want[:23]) < TINY_RTOL
    step = decode(_feeds(ids[23:], 23, _next_cache(part)))
    assert _rel(step["logits"][0], want[23]) < TINY_RTOL


def test_unexportable_models_are_sharpi_errors(tmp_path, capsys):
    import gguf

    from sharpi.cli.compile import main
    path = write_tiny_llama(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        sharpi.export_onnx(str(path), tmp_path / "out")
    # Q8_1: a tensor type neither sharpi nor the gguf package dequantizes
    raw = np.zeros((32, 64 // 32 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]), np.uint8)
    path = write_tiny_llama(tmp_path / "q81.gguf", heads=4, kv_heads=2,
                            override_raw={"blk.0.attn_k.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(UnsupportedTensorTypeError, match="Q8_1"):
        sharpi.export_onnx(str(path), tmp_path / "out")
    assert main([str(path), "--emit", "onnx", "-o", str(tmp_path / "out")]) == 2
    assert "Q8_1" in capsys.readouterr().err


def test_op_without_translation_names_it(tmp_path):
    from tvm import relax
    from tvm.relax import op as R

    from sharpi.export.onnx.export import GraphBuilder, Translator, WeightStore
    from sharpi.frontend.weights import WeightTable
    bb = relax.BlockBuilder()
    x = relax.Var("ids", relax.TensorType((4,), "float32"))
    with bb.function("prefill", [x]):
        with bb.dataflow():
            y = bb.emit_output(R.cumsum(x, axis=0))
        bb.emit_func_output(y)
    store = WeightStore(tmp_path / "w.bin")
    try:
        with pytest.raises(CompileError, match=r"prefill uses relax\.cumsum, which has no ONNX translation"):
            Translator(GraphBuilder("g", store), WeightTable()).run(bb.get()["prefill"], "prefill", {"ids": "ids"})
    finally:
        store.close()


def test_bad_options_and_cli(tmp_path, capsys):
    from sharpi.cli.compile import main
    path = write_tiny_llama(tmp_path / "tiny.gguf", layers=1)
    with pytest.raises(ConfigError, match="f32, f16"):
        sharpi.export_onnx(str(path), tmp_path / "a", weights="int4")
    with pytest.raises(ConfigError, match="emit"):
        sharpi.compile(str(path), output=tmp_path / "b", emit="tflite")
    with pytest.raises(ConfigError, match="target does not apply to emit='onnx'"):
        sharpi.compile(str(path), target="vulkan", output=tmp_path / "b", emit="onnx")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("not an export")
    with pytest.raises(SharpiError, match="not a sharpi ONNX export"):
        sharpi.export_onnx(str(path), tmp_path / "c")
    assert main([str(path), "--emit", "onnx", "-o", str(tmp_path / "d"), "--mcpu", "znver3"]) == 2
    assert "--mcpu does not apply" in capsys.readouterr().err
    assert main([str(path), "--emit", "onnx", "-o", str(tmp_path / "d"), "--quiet", "--snapkv", "off"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "decode.onnx", "prefill.onnx", "sharpi-onnx.json", "tokenizer.json", "weights.onnx.data"]
    again = sharpi.compile(str(path), output=tmp_path / "d", emit="onnx", snapkv_budget=16, snapkv_recency=4)
    assert (again / "prefill_snapkv.onnx").is_file()                   # an earlier export is replaced
