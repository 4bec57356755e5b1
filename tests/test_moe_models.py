"""Mixture-of-experts models compiled for the CPU (and Vulkan), on the tiny random GGUFs of tests/data/moe_golden.json:
`--matmuls float` against the numpy reference and llama.cpp's logits (teacher-forced, and prefill then decode
through the paged cache), the default int8 artifact within the dense tiny models' int8 bounds, and decode reading
the chosen experts only.

Tolerances as tests/test_architectures.py: the float path differs from the reference in summation order only
(~1e-6 of the logits' scale), 1e-4 is ~100x that, and tests/test_moe_reference.py shows every MoE feature moving
the logits by more than 1e-2."""
import json
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

import sharpi
from sharpi.common.errors import SharpiWarning
from sharpi.common.manifest import Manifest
from sharpi.runtime.session import decode_batch
from sharpi.testing.reference import NumpyReference, log_softmax
from tiny_gguf import MOE_ARCHS, MOE_GOLDEN, write_golden_moe, write_tiny_moe

GOLDEN = json.loads(MOE_GOLDEN.read_text())
IDS = GOLDEN["ids"]
RTOL = 1e-4


def _err(got, expected) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module", params=MOE_ARCHS)
def float_moe(request, tmp_path_factory):
    """(arch, GGUF path, the `--matmuls float` model, the reference's logits over IDS)."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    path = write_golden_moe(folder, arch)
    model = sharpi.load(sharpi.compile(str(path), target="llvm", output=folder / "art", matmuls="float"))
    return arch, path, model, NumpyReference(path).forward(IDS)


def test_teacher_forced_logits_equal_the_reference_and_llama_cpp(float_moe):
    arch, _, model, expected = float_moe
    got = model.score(IDS)
    assert _err(got, expected) < RTOL
    with np.load(Path(__file__).parent / "data" / "moe_golden.npz") as golden:
        assert _err(got, golden[arch]) < RTOL


def test_prefill_then_decode_equal_the_reference(float_moe):
    """Prefill 30 tokens, then decode 18 through the cache (the decode kernels: one token, its k experts)."""
    _, _, model, expected = float_moe
    with model.session() as s:
        assert _err(s.prefill(IDS[:30]), expected[29]) < RTOL
        for i in range(30, len(IDS)):
            assert _err(s.decode(IDS[i]), expected[i]) < RTOL, i


def test_decode_batch_equals_the_reference(float_moe):
    """Two sequences decoded together (decode_batch: two tokens routed to their own experts in one call)."""
    _, _, model, expected = float_moe
    with model.session() as a, model.session() as b:
        a.prefill(IDS[:20])
        b.prefill(IDS[:25])
        rows = decode_batch([a, b], [IDS[20], IDS[25]])
    assert _err(rows[0], expected[20]) < RTOL and _err(rows[1], expected[25]) < RTOL


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_int8_artifact_is_near_the_reference(arch, tmp_path):
    """The default CPU artifact of a Q8_0 model (int8 matmuls where the CPU has AVX2) within the conformance
    tolerance for int8 matmuls of the reference's log-probs, its top-1 never off by more than a near-tie."""
    from sharpi.testing.conformance import tolerance_for
    path = write_tiny_moe(tmp_path / f"{arch}.gguf", arch, seed=GOLDEN["models"][arch]["seed"],
                          router_scale=GOLDEN["models"][arch]["router_scale"], matrix_type="Q8_0", shared_ffn=64)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "art"))
    if model.manifest.target["matmuls"] != "int8":
        pytest.skip("this CPU has no AVX2: the default matmuls are float32 (tested above)")
    want = log_softmax(NumpyReference(path).forward(IDS))[29:40]
    with model.session() as s:
        got = log_softmax(np.stack([s.prefill(IDS[:30])] + [s.decode(IDS[i]) for i in range(30, 40)]))
    tol = tolerance_for(model.manifest)
    assert np.abs(got - want).max() <= tol.logprob_atol
    assert np.abs(got - want).max() > 1e-5                            # the int8 kernels ran
    assert (want.max(-1) - want[np.arange(len(want)), got.argmax(-1)] <= tol.near_tie).all()


def _k_quant_experts(layers: int, experts: int, dim: int, ffn: int, rng) -> dict:
    """Q4_K_M-like experts for write_tiny_moe's override_raw: Q4_K gate, Q5_K up, Q6_K down, random GGUF blocks
    (test_kquants._raw) of each expert stacked as llama.cpp stores them."""
    import test_kquants
    raw = {}
    for layer in range(layers):
        for name, qtype, (n, k) in (("gate", "Q4_K", (ffn, dim)), ("up", "Q5_K", (ffn, dim)),
                                    ("down", "Q6_K", (dim, ffn))):
            qt, blocks = test_kquants._raw(qtype, experts * n, k, rng)
            raw[f"blk.{layer}.ffn_{name}_exps.weight"] = (blocks.reshape(experts, n, -1), qt)
    return raw


@pytest.mark.parametrize("mcpu", [None, "x86-64-v3"])
def test_k_quant_experts_are_stored_near_the_gguf_size(mcpu, tmp_path, rng):
    """A qwen3moe with K-quant experts: on any CPU with integer dots the experts are stored as (qs, ks), about the
    GGUF's bytes (quant_layout: at most 1.03x), and multiplied by quant_matmul_q8k's kernels (a prompt's by
    quant_matmul_amx's where the CPU has AMX); with AVX2 alone (x86-64-v3) or AMX every K-quant is, with AVX-512
    VNNI alone the dense ones keep `s`. The logits stay within the int8 tolerance of
    the reference through prefill and decode."""
    from sharpi.testing.conformance import tolerance_for
    experts, dim, ffn = 8, 256, 256
    raw = _k_quant_experts(2, experts, dim, ffn, rng)
    path = write_tiny_moe(tmp_path / "kq.gguf", "qwen3moe", dim=dim, expert_ffn=ffn, experts=experts,
                          matrix_type="Q8_0", router_scale=4.0, override_raw=raw)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "art", use_cache=False,
                                       **({"mcpu": mcpu} if mcpu else {})))
    if model.manifest.target["matmuls"] != "int8":
        pytest.skip("this CPU has no integer dots: the default matmuls are float32")
    params = {p.name: p for p in model.manifest.params}
    for name, (blocks, _) in raw.items():
        assert f"{name}:ks" in params and f"{name}:s" not in params, name
        stored = sum(int(np.prod(params[f"{name}:{part}"].shape)) * 4 for part in ("qs", "ks"))
        assert stored <= 1.03 * blocks.nbytes, (name, stored / blocks.nbytes)
    prompt_kernel = "moe_gemm_amx" if model.manifest.target.get("int8_isa") == "amx" else "moe_gemm_q8k"
    assert any(k.startswith(prompt_kernel) for k in model.manifest.kernels)
    assert any(k.startswith("moe_gemv_q8k") for k in model.manifest.kernels)
    want = log_softmax(NumpyReference(path).forward(IDS))[29:40]
    with model.session() as s:
        got = log_softmax(np.stack([s.prefill(IDS[:30])] + [s.decode(IDS[i]) for i in range(30, 40)]))
    tol = tolerance_for(model.manifest)
    assert np.abs(got - want).max() <= tol.logprob_atol
    assert (want.max(-1) - want[np.arange(len(want)), got.argmax(-1)] <= tol.near_tie).all()


def test_decode_reads_only_the_chosen_experts(tmp_path):
    """qwen3moe with every expert that no position of the test selects (the reference's router) set to NaN:
    prefill and decode logits equal the clean model's bit for bit."""
    arch, tokens = "qwen3moe", IDS[:24]
    clean = write_golden_moe(tmp_path, arch)
    ref = NumpyReference(clean)
    ref.router_capture = []
    ref.forward(tokens)
    k = ref.config.n_experts_used
    unused = [sorted(set(range(ref.config.n_experts)) - set(np.argsort(-p, axis=-1)[:, :k].ravel().tolist()))
              for p in ref.router_capture]
    assert any(unused), "every expert is chosen somewhere: the test would poison nothing"
    poisoned = _with_nan_experts(clean, tmp_path / "poisoned.gguf", unused)
    logits = []
    for path in (clean, poisoned):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "(?s).*NaN or infinite", SharpiWarning)
            model = sharpi.load(sharpi.compile(str(path), target="llvm", output=tmp_path / f"art-{path.stem}",
                                               matmuls="float"))
        with model.session() as s:
            logits.append(np.stack([s.prefill(tokens[:16])] + [s.decode(t) for t in tokens[16:]]))
    assert np.isfinite(logits[1]).all()
    np.testing.assert_array_equal(logits[1], logits[0])


def _with_nan_experts(src: Path, dst: Path, unused: list[list[int]]) -> Path:
    """A copy of src (F32 experts) with layer l's experts unused[l] NaN in their gate, up and down matrices."""
    dst.write_bytes(src.read_bytes())
    reader = gguf.GGUFReader(dst, "r+")
    for tensor in reader.tensors:
        layer, _, rest = tensor.name.partition(".")[2].partition(".")
        if tensor.name.startswith("blk.") and rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                       "ffn_down_exps.weight"):
            for e in unused[int(layer)]:
                tensor.data[e] = np.nan
    reader.data.flush()
    poisoned = sum(int(np.isnan(t.data).any(axis=(1, 2)).sum()) for t in gguf.GGUFReader(dst).tensors
                   if t.name.endswith("_exps.weight"))
    assert poisoned == 3 * sum(map(len, unused))
    return dst


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_vulkan_artifact_equals_the_reference(arch, tmp_path):
    """A Q8_0 model compiled for Vulkan (the GPU route and gathered matmul kernels, on lavapipe in CI): teacher-forced
    logits, and prefill then decode through the paged cache, equal the reference's within the float path's bound
    (the GPU dequantizes Q8_0 to the reference's float32 values; only the summation order differs)."""
    from vulkan_device import on_vulkan
    path = write_tiny_moe(tmp_path / f"{arch}.gguf", arch, seed=GOLDEN["models"][arch]["seed"],
                          router_scale=GOLDEN["models"][arch]["router_scale"], matrix_type="Q8_0", shared_ffn=64)
    artifact = sharpi.compile(str(path), target="vulkan", output=tmp_path / "vk")
    assert any(k.startswith("gpu_moe_matmul_q8_0") for k in Manifest.read(artifact).kernels)
    model = on_vulkan(lambda: sharpi.load(artifact))
    expected = NumpyReference(path).forward(IDS[:40])
    assert _err(model.score(IDS[:40]), expected) < RTOL
    with model.session() as s:
        assert _err(s.prefill(IDS[:30]), expected[29]) < RTOL
        for i in range(30, 40):
            assert _err(s.decode(IDS[i]), expected[i]) < RTOL, i


@pytest.mark.parametrize("kind", ["Q8_0", "F32", "Q4_K", "Q4_K/Q5_K"])
def test_gate_and_up_experts_of_one_type_are_stacked(kind, tmp_path, rng):
    """A layer's gate and up experts of one type become one ffn_gate_up_exps tensor [E * 2F, K] (one matmul reads
    the chosen experts' rows of both): expert e's rows are gate_e's then up_e's, in every part of the layout (each
    along its own row axis: a quantized type's scale planes lead with theirs). Of two types (Q4_K gate, Q5_K up, as
    in the K-quant model above) they stay two tensors."""
    from sharpi.common.quant_layout import dequantize_layout
    from sharpi.frontend.gguf_file import GGUFFile
    from sharpi.frontend.weights import WeightTable, load_weights
    experts, dim, ffn = 4, 256, 64
    gate_type, _, up_type = kind.partition("/")
    raw = {}
    if gate_type.endswith("_K"):
        import test_kquants
        for name, qtype in (("gate", gate_type), ("up", up_type or gate_type)):
            qt, blocks = test_kquants._raw(qtype, experts * ffn, dim, rng)
            raw[f"blk.0.ffn_{name}_exps.weight"] = (blocks.reshape(experts, ffn, -1), qt)
    path = write_tiny_moe(tmp_path / "m.gguf", "qwen3moe", layers=1, dim=dim, expert_ffn=ffn, experts=experts,
                          matrix_type=gate_type if not raw else "Q8_0", override_raw=raw)
    gguf_file = GGUFFile(path)
    gate, up = "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"
    table = load_weights(gguf_file, [gate, up], [], False)
    if up_type:
        assert set(table.tensors) == {gate, up} and not table.stacked
        return
    assert list(table.tensors) == ["blk.0.ffn_gate_up_exps.weight"]
    qtype, _ = table.tensors["blk.0.ffn_gate_up_exps.weight"]
    stacked = dequantize_layout(qtype, table.repacked("blk.0.ffn_gate_up_exps.weight"))
    apart = WeightTable()
    for name in (gate, up):
        apart.add_matrix(gguf_file, name)
    g, u = (dequantize_layout(qtype, apart.repacked(name)).reshape(experts, ffn, dim) for name in (gate, up))
    assert stacked.shape == (experts * 2 * ffn, dim)
    np.testing.assert_array_equal(stacked.reshape(experts, 2 * ffn, dim), np.concatenate([g, u], axis=1))
