"""The integer-dot matmuls (quant_matmul_int8, quant_matmul_vnni512 and quant_matmul_amx: the decode GEMV and the
prefill GEMM, on each instruction set this CPU has) against numpy: the same weights multiplied by the activations
quantized as ggml does (sharpi.testing.reference.quantize_activations_q8), for every quantized layout, with block
counts that take each accumulator split, token counts that cut a tile, q8_0's -128, zero blocks and the largest
quants."""
import numpy as np
import pytest

from sharpi.codegen.kernels import quant_matmul_amx, quant_matmul_vnni512
from sharpi.codegen.kernels.quant_matmul_amx import make_gemm_amx
from sharpi.codegen.kernels.quant_matmul_int8 import (INT8_DOT_TYPES, GEMM_TILE, element_lane, lane_element,
                                                      make_gemm_int8, make_gemv_int8)
from sharpi.codegen.kernels.quant_matmul_vnni512 import make_gemm_vnni512
from sharpi.codegen.targets.llvm import int8_dot_available, int8_dot_isa, make_target
from sharpi.common.errors import ConfigError
from sharpi.common.quant_layout import dequantize_layout
from sharpi.testing.reference import quantize_activations_q8
import test_kernels
import test_kquants
from test_kernels import TARGET, _as_cpu_kernel_takes, _build, _t, workspace_requests

pytestmark = pytest.mark.skipif(not int8_dot_available(TARGET), reason="the integer-dot GEMV needs x86 AVX2")

# every kernel variant this CPU can run: (GEMV maker, GEMM maker, GEMM tile)
_HOST_ISA = int8_dot_isa(TARGET)
VARIANTS = {"avx2": (make_gemv_int8, make_gemm_int8, GEMM_TILE)}
if _HOST_ISA in ("avx-vnni", "avx512-vnni", "amx"):
    VARIANTS["avx-vnni"] = (lambda q, n, k: make_gemv_int8(q, n, k, "avx-vnni"),
                            lambda q, n, k: make_gemm_int8(q, n, k, "avx-vnni"), GEMM_TILE)
if _HOST_ISA in ("avx512-vnni", "amx"):
    VARIANTS["avx512-vnni"] = (lambda q, n, k: make_gemv_int8(q, n, k, "avx512-vnni"), make_gemm_vnni512,
                               quant_matmul_vnni512.GEMM_TILE)
if _HOST_ISA == "amx":      # TARGET is this CPU's: AMX only where the OS granted the tiles (make_target)
    VARIANTS["amx"] = (VARIANTS["avx512-vnni"][0], make_gemm_amx, quant_matmul_amx.TILE)
GEMVS = [isa for isa in VARIANTS if isa != "amx"]    # AMX's GEMV is AVX-512 VNNI's


def _weight(qtype, n, k, rng):
    if qtype in ("q4_k", "q5_k", "q6_k", "q5_1"):
        return test_kquants._weight(qtype.upper(), n, k, rng)
    return test_kernels._weight(qtype.upper(), n, k, rng)


def _expected(q, parts, x, block=32):
    """y [len(x), N] (or [N] for one row) of the int8-quantized rows of x (scales per `block` activations)."""
    xq, d = quantize_activations_q8(x, block)
    x_seen = (xq.reshape(-1, block).astype(np.float64) * d.reshape(-1, 1)).reshape(x.shape)
    y = x_seen @ dequantize_layout(q, parts).astype(np.float64).T
    return y[0] if len(x) == 1 else y


def _run_gemm(q, parts, n, k, x, isa="avx2"):
    y = _t(np.zeros((len(x), n), np.float32))
    _build(VARIANTS[isa][1](q, n, k))(_t(x), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, n, k)], y)
    return y.numpy()


def _run(q, parts, n, k, x, isa="avx2"):
    y = _t(np.zeros((1, n), np.float32))
    _build(VARIANTS[isa][0](q, n, k))(_t(x), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, n, k)], y)
    return y.numpy()[0]


def test_lane_order_is_a_permutation():
    for qtype in INT8_DOT_TYPES:
        assert sorted(lane_element(l, qtype) for l in range(32)) == list(range(32))
        assert all(lane_element(element_lane(e, qtype), qtype) == e for e in range(32))


@pytest.mark.parametrize("isa", GEMVS)
@pytest.mark.parametrize("qtype", INT8_DOT_TYPES)
@pytest.mark.parametrize("n,k", [(70, 256), (33, 768), (128, 512)])   # 8, 24 and 16 blocks: 4 chains; 70, 33 rows
def test_gemv_int8_matches_numpy(isa, qtype, n, k, rng):
    q, parts = _weight(qtype, n, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    x[0, 32:64] = 0                                   # a zero block: d = 0
    x[0, 64] = 40.0                                   # an outlier: its block quantizes coarsely, as in ggml
    got, want = _run(q, parts, n, k, x, isa), _expected(q, parts, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    # and it is the activation rounding, not something larger, that separates it from the float product
    exact = dequantize_layout(q, parts) @ x[0]
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("isa", GEMVS)
@pytest.mark.parametrize("k", [32 * 9, 32 * 18, 32 * 36])   # 1, 2 and 4 chains of blocks (the 512-bit kernels:
def test_gemv_int8_accumulator_splits(isa, k, rng):        # 9 pairs (one chain), 18 (two); 9 blocks do not fit
    if isa == "avx512-vnni" and not quant_matmul_vnni512.vnni512_fits(k):
        k *= 2
    q, parts = _weight("q4_1", 17, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    np.testing.assert_allclose(_run(q, parts, 17, k, x, isa), _expected(q, parts, x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("isa", VARIANTS)
def test_q8_0_extremes(isa, rng):
    """Raw int8 weights -128..127 (ggml's quantizer never writes -128; a GGUF may) against x at +-127 after
    quantization: the sign trick's |w| = 128 and the pair sums (up to 2 * 128 * 127) must not saturate."""
    n, k = 8, 64
    words = rng.integers(-128, 128, (n, k), dtype=np.int8)
    words[0] = -128
    words[1] = 127
    parts = {"qs": words.view(np.uint32).reshape(n, k // 4), "s": np.full((1, n, k // 32), 0.5, np.float32)}
    x = np.where(rng.random((1, k)) < 0.5, -1.0, 1.0).astype(np.float32) * 3
    np.testing.assert_allclose(_run("q8_0", parts, n, k, x, isa), _expected("q8_0", parts, x), rtol=1e-6)
    y = _run_gemm("q8_0", parts, n, k, np.concatenate([x, -x]), isa)
    np.testing.assert_allclose(y, _expected("q8_0", parts, np.concatenate([x, -x])), rtol=1e-6)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("qtype", INT8_DOT_TYPES)
@pytest.mark.parametrize("tiles,cut,n,k", [(1, 5, 70, 256), (1, 0, 33, 512), (0, 1, 64, 256), (1, 3, 24, 2560)])
def test_gemm_int8_matches_numpy(isa, qtype, tiles, cut, n, k, rng):
    """Prefill: a tile and a cut one (the padding rows must not reach y), a whole tile, one token; rows that do
    not divide into the tasks evenly."""
    tokens = tiles * VARIANTS[isa][2] + cut
    q, parts = _weight(qtype, n, k, rng)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[0, 32:64] = 0                                   # a zero block
    x[-1, 5] = 40.0                                   # an outlier in the last token
    if tokens > 2:
        x[tokens // 2] *= 1e-3                        # a token of small activations: its own scales
    got, want = _run_gemm(q, parts, n, k, x, isa), _expected(q, parts, x).reshape(tokens, n)
    err = np.abs(got - want).max(-1) / np.abs(want).max(-1)          # per token: each has its own scales
    assert err.max() <= 2e-5, err
    exact = x @ dequantize_layout(q, parts).T                         # and the rounding is all that separates them
    assert (np.abs(got - exact).max(-1) <= 0.05 * np.abs(exact).max(-1)).all()


@pytest.mark.parametrize("isa", VARIANTS)
def test_gemm_int8_rows_agree_with_the_gemv(isa, rng):
    """A token's row quantizes the same in prefill and decode, so the two kernels give it the same products."""
    q, parts = _weight("q5_0", 40, 256, rng)
    x = rng.standard_normal((19, 256)).astype(np.float32)
    got = _run_gemm(q, parts, 40, 256, x, isa)
    for t in (0, 7, 18):
        np.testing.assert_allclose(got[t], _run(q, parts, 40, 256, x[t:t + 1], isa), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif("avx512-vnni" not in VARIANTS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype", ["q4_k", "q8_0", "q5_0"])
def test_wide_gemm_in_row_blocks_and_spans_of_k(qtype, rng, monkeypatch):
    """The 512-bit GEMM's loop blocking: 7 rows a task in blocks of 3 (the last one short), K in two spans (the
    second short), two tiles and a cut one."""
    n, k = 64 * 7, 64 * (quant_matmul_vnni512.K_SPAN + 8)
    q, parts = _weight(qtype, n, k, rng)
    row_bytes = sum(p[:1].nbytes if p.ndim == 2 else p[:, :1].nbytes for p in _as_cpu_kernel_takes(q, parts, n, k))
    monkeypatch.setattr(quant_matmul_vnni512, "ROW_BLOCK_BYTES", 3 * row_bytes)
    x = rng.standard_normal((2 * quant_matmul_vnni512.GEMM_TILE + 3, k)).astype(np.float32)
    got, want = _run_gemm(q, parts, n, k, x, "avx512-vnni"), _expected(q, parts, x)
    assert (np.abs(got - want).max(-1) / np.abs(want).max(-1)).max() <= 2e-5


@pytest.mark.skipif("avx512-vnni" not in VARIANTS, reason="needs AVX-512 VNNI")
def test_the_wide_kernels_use_512_bit_dots():
    """The 512-bit kernels run vpdpbusd on zmm registers (LLVM may split wide vectors where a CPU prefers 256)."""
    for name, make in zip(("GEMV", "GEMM"), VARIANTS["avx512-vnni"][:2]):
        asm = _build(make("q4_k", 64, 512)).mod.inspect_source("asm")
        assert "vpdpbusd" in asm and "zmm" in asm.split("vpdpbusd", 1)[1].splitlines()[0], name


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("qtype", ["q5_0", "q4_k", "q8_0"])
def test_scratch_stays_on_the_stack(isa, qtype):
    """The GEMV and GEMM ask the workspace allocator only for their per-call activation buffers (>= 1 KB or sized
    by the token count), never for per-task accumulators or per-block scalars: those were ~16,000 allocator call
    pairs in a gemma3 decode step."""
    for make in VARIANTS[isa][:2]:
        sizes = workspace_requests(make(qtype, 256, 2048))
        assert all(not isinstance(size, int) or size >= 1024 for size in sizes), (make.__name__, sizes)


@pytest.mark.parametrize("isa", GEMVS)
def test_the_gemv_prefetches_its_weights_and_computes_the_same(isa, rng):
    """The decode GEMV asks for its weights PREFETCH_BYTES ahead (prefetcht0: quants and scale planes; the speed is
    benchmarks/gemv_stream.py's), rows past the buffer's end clamped; with the distance 0 there are none, and the
    results are the same bits either way."""
    from sharpi.codegen.kernels.quant_matmul_int8 import PREFETCH_BYTES
    n, k = 40, 512
    q, parts = _weight("q6_k", n, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    outputs = []
    for distance in (PREFETCH_BYTES, 0):
        kernel = _build(make_gemv_int8(q, n, k, isa, distance))
        asm = kernel.mod.inspect_source("asm")
        assert ("prefetcht0" in asm) == (distance > 0), distance
        y = _t(np.zeros((1, n), np.float32))
        kernel(_t(x), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, n, k)], y)
        outputs.append(y.numpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])


_AMX = pytest.mark.skipif("amx" not in VARIANTS, reason="needs AMX tiles the OS grants (sharpi.common.cpu)")


@_AMX
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0"])
def test_amx_gemm_in_row_blocks(qtype, rng, monkeypatch):
    """A task's rows unpacked a few 16-row groups at a time (ROW_BLOCK_BYTES small), the last group short, tiles
    of tokens past the first: every row and token as numpy's."""
    n, k = 16 * 9 + 5, 32 * 24
    q, parts = _weight(qtype, n, k, rng)
    monkeypatch.setattr(quant_matmul_amx, "TASKS", 3)
    monkeypatch.setattr(quant_matmul_amx, "ROW_BLOCK_BYTES", 2 * 16 * k)
    x = rng.standard_normal((3 * quant_matmul_amx.TILE + 7, k)).astype(np.float32)
    got, want = _run_gemm(q, parts, n, k, x, "amx"), _expected(q, parts, x)
    assert (np.abs(got - want).max(-1) <= 2e-5 * np.abs(want).max(-1)).all()


@_AMX
@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_amx_gemm_reads_the_compact_k_quant_layout(qtype, rng, monkeypatch):
    """The AMX GEMM on a K-quant stored as (qs, ks) (the f32 scale planes never read): each task rebuilds its rows'
    per-32 scales from the integer sub-scales; rows in blocks of two 16-row groups, the last short, a cut tile."""
    n, k = 16 * 5 + 3, 768
    q, parts = _weight(qtype, n, k, rng)
    monkeypatch.setattr(quant_matmul_amx, "TASKS", 2)
    monkeypatch.setattr(quant_matmul_amx, "ROW_BLOCK_BYTES", 2 * 16 * k)
    x = rng.standard_normal((quant_matmul_amx.TILE + 9, k)).astype(np.float32)
    x[2, 256:288] = 0                                 # a zero block
    got = _run_q8k(lambda q_, n_, k_: make_gemm_amx(q_, n_, k_, sub_scales=True), q, parts, n, k, x)
    want = _expected(q, parts, x)
    assert (np.abs(got - want).max(-1) <= 2e-5 * np.abs(want).max(-1)).all()


@_AMX
def test_the_amx_gemm_runs_on_tiles():
    """The AMX GEMM configures the tiles, multiplies with tdpbusd and releases them; its per-task scratch is the
    unpacked weights alone (the accumulators stay in registers)."""
    asm = _build(make_gemm_amx("q6_k", 64, 512)).mod.inspect_source("asm")
    assert all(op in asm for op in ("ldtilecfg", "tdpbusd", "tileloadd", "tilestored", "tilerelease"))
    # the sized ones: the call's result tiles (4 tasks x 2 blocks in flight x 2 halves x 1 KB), a task's rows
    sizes = [size for size in workspace_requests(make_gemm_amx("q6_k", 64, 512)) if isinstance(size, int)]
    assert sorted(sizes) == [16 * 512, 4 * 2 * 2 * 1024], sizes


def test_amx_is_a_feature_of_the_cpu_name():
    """`--mcpu NAME+amx-tile+amx-int8` adds AMX to a CPU LLVM names without it (a virtual machine's Xeon reads as
    rocketlake), and a CPU with AMX in its name has it: both choose the AMX GEMM (compiling needs no AMX here);
    other features are refused in a sentence."""
    assert int8_dot_isa(make_target("rocketlake")) == "avx512-vnni"
    assert int8_dot_isa(make_target("rocketlake+amx-tile+amx-int8")) == "amx"
    assert int8_dot_isa(make_target("sapphirerapids")) == "amx"
    with pytest.raises(ConfigError, match="may be extended by amx-tile, amx-int8 only"):
        make_target("rocketlake+avx10.1")
    assert "tdpbusd" in _build(make_gemm_amx("q4_0", 32, 256), make_target("sapphirerapids")).mod.inspect_source("asm")


def _run_q8k(make, q, parts, n, k, x, ids=None, out_shape=None):
    """A quant_matmul_q8k kernel on the quants and `ks` (the layout without `s`; with `ids`: a MoE kernel, which
    takes them after x)."""
    taken = _as_cpu_kernel_takes(q, parts, n, k, sub_scales=True)
    y = _t(np.zeros(out_shape or (len(x), n), np.float32))
    _build(make(q, n, k))(_t(x), *([] if ids is None else [_t(ids)]), *[_t(p) for p in taken], y)
    return y.numpy()


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_q8k_matmuls_match_numpy(qtype, rng, monkeypatch):
    """The AVX2 K-quant kernels with integer sub-scales (activations quantized per 256, ggml's q8_K) against numpy:
    70 rows (row groups of 32, the last short), 3 super-blocks (K spans of 2, the last short), 11 tokens (a cut
    tile), a zero super-block, an outlier and a token of small activations; the GEMV on two of the tokens."""
    from sharpi.codegen.kernels import quant_matmul_q8k
    from sharpi.codegen.kernels.quant_matmul_q8k import make_gemm_q8k, make_gemv_q8k
    monkeypatch.setattr(quant_matmul_q8k, "SPAN_BYTES", 2 * quant_matmul_q8k.GROUP_ROWS * 256)
    n, k, tokens = 70, 768, 11
    q, parts = _weight(qtype, n, k, rng)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    x[0, 256:512] = 0
    x[-1, 5] = 40.0
    x[tokens // 2] *= 1e-3
    want = _expected(q, parts, x, block=256)
    got = _run_q8k(make_gemm_q8k, q, parts, n, k, x)
    assert (np.abs(got - want).max(-1) / np.abs(want).max(-1)).max() <= 2e-5
    for t in (0, tokens - 1):
        row = _run_q8k(make_gemv_q8k, q, parts, n, k, x[t:t + 1])[0]
        np.testing.assert_allclose(row, want[t], rtol=0, atol=2e-5 * np.abs(want[t]).max())
    exact = x @ dequantize_layout(q, parts).T       # the per-256 rounding is all that separates them
    assert (np.abs(got - exact).max(-1) <= 0.05 * np.abs(exact).max(-1)).all()


def test_q8k_extremes_do_not_saturate(rng):
    """Q6_K at its extremes: every quant 63 or 0 (u - 32 = 31 or -32), sub-scales -128 and 127, activations at
    +-127 after quantization: the pair sums (2 * 63 * 127) and their sub-scaled sums must not saturate."""
    import gguf
    from sharpi.codegen.kernels.quant_matmul_q8k import make_gemm_q8k, make_gemv_q8k
    from sharpi.frontend.gguf_file import GGUFTensor
    from sharpi.frontend.quant import repack

    n, k = 8, 512
    raw = np.zeros((n, k // 256, 210), np.uint8)
    raw[0::2, :, :192] = 0xFF                                  # quants 63 (ql 15, qh 3) in the even rows
    raw[:, :, 192:208] = np.where(rng.random((n, k // 256, 16)) < 0.5, 0x80, 0x7F)
    raw[:, :, 208:210] = np.array([1e-3], np.float16).view(np.uint8)
    t = GGUFTensor(name="w", type_name="Q6_K", type_id=int(gguf.GGMLQuantizationType.Q6_K), shape=(n, k),
                   data=raw.reshape(n, -1))
    parts = repack(t)
    x = np.where(rng.random((2, k)) < 0.5, -1.0, 1.0).astype(np.float32) * 3
    want = _expected("q6_k", parts, x, block=256)
    np.testing.assert_allclose(_run_q8k(make_gemm_q8k, "q6_k", parts, n, k, x), want, rtol=1e-6)
    # the GEMV's int32 lanes sum other products than the GEMM's (pair order) and pass 2^24 here, so they round
    # differently as they convert; the dot term and the -32 offset term then cancel to a few times less
    np.testing.assert_allclose(_run_q8k(make_gemv_q8k, "q6_k", parts, n, k, x[:1])[0], want[0], rtol=3e-6)


@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "per-slot-input"])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "q6_k"])
def test_moe_gemv_reads_the_chosen_experts_rows(qtype, per_slot, rng):
    """The MoE GEMV (ops.MOE_MATMUL with int8 activations) on every integer-dot ISA this CPU runs: 3 tokens, 2
    slots each, over 4 experts of 24 rows (expert 2 chosen by no one); each (token, slot) equals the dense GEMV of
    its expert's rows, an id out of range reads the nearest expert (clamped), not memory outside the weights."""
    from sharpi.codegen.kernels.quant_matmul_int8 import make_moe_gemv_int8
    experts, n, k, slots = 4, 24, 512, 2
    q, parts = _weight(qtype, experts * n, k, rng)
    ids = np.array([[3, 1], [0, 3], [7, -5]], np.int32)            # the last token's ids clamp to 3 and 0
    x = rng.standard_normal((3, slots, k) if per_slot else (3, k)).astype(np.float32)
    taken = [_t(p) for p in _as_cpu_kernel_takes(qtype, parts, experts * n, k)]
    for isa in [isa for isa in VARIANTS if isa != "amx"]:       # AMX's decode GEMV is AVX-512 VNNI's
        y = _t(np.zeros((3, slots, n), np.float32))
        _build(make_moe_gemv_int8(qtype, experts, n, k, slots, per_slot, isa))(_t(x), _t(ids), *taken, y)
        for t in range(3):
            for j in range(slots):
                e = min(max(ids[t, j], 0), experts - 1)
                row = x[t, j:j + 1] if per_slot else x[t:t + 1]
                want = _expected(qtype, parts, row)[e * n:(e + 1) * n]
                np.testing.assert_allclose(y.numpy()[t, j], want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                           err_msg=f"{isa} token {t} slot {j}")


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_moe_q8k_gemv_reads_the_chosen_experts_rows(qtype, rng):
    """The AVX2 K-quant MoE GEMV (integer sub-scales, activations per 256) per slot against numpy's emulation of
    the expert's rows, the f32 scale planes NaN (it reads `ks` and the bit planes only), ids clamped."""
    from sharpi.codegen.kernels.quant_matmul_q8k import make_moe_gemv_q8k
    experts, n, k, slots = 3, 16, 512, 2
    q, parts = _weight(qtype, experts * n, k, rng)
    ids = np.array([[2, 0], [9, -1]], np.int32)
    x = rng.standard_normal((2, slots, k)).astype(np.float32)
    got = _run_q8k(lambda q_, n_, k_: make_moe_gemv_q8k(q_, experts, n, k_, slots, True), q, parts, experts * n, k,
                   x, ids=ids, out_shape=(2, slots, n))
    for t in range(2):
        for j in range(slots):
            e = min(max(ids[t, j], 0), experts - 1)
            want = _expected(q, parts, x[t, j:j + 1], block=256)[e * n:(e + 1) * n]
            np.testing.assert_allclose(got[t, j], want, rtol=0, atol=2e-5 * np.abs(want).max())


def _moe_ids(rng, tokens, slots, experts):
    """Each token's `slots` distinct experts, expert 1 taken by no one, expert 0 by enough tokens to fill more than
    one tile; the last token's ids out of range (they clamp to experts - 1 and 0)."""
    ids = np.stack([rng.choice([e for e in range(experts) if e != 1], slots, replace=False) for _ in range(tokens)])
    ids[:GEMM_TILE + 3, 0] = 0
    ids[-1] = [experts + 4, -2][:slots]
    return ids.astype(np.int32)


def _check_moe_rows(got, x, ids, q, parts, n, per_slot, block=32):
    experts = len(dequantize_layout(q, parts)) // n
    for t in range(len(ids)):
        for j in range(ids.shape[1]):
            e = min(max(ids[t, j], 0), experts - 1)
            row = x[t, j:j + 1] if per_slot else x[t:t + 1]
            want = _expected(q, parts, row, block)[e * n:(e + 1) * n]
            np.testing.assert_allclose(got[t, j], want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                       err_msg=f"token {t} slot {j}")


@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "per-slot-input"])
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "q6_k"])
def test_moe_gemm_groups_the_tokens_by_expert(qtype, per_slot, rng):
    """The prompt's MoE GEMM (tokens sorted by expert, each expert's tiles past its rows): 21 tokens, 2 slots, 5
    experts of 24 rows, one expert with two tiles, one with none, cut tiles, clamped ids; each (token, slot)
    equals the GEMV of its expert's rows, on the 256-bit ISAs this CPU has."""
    from sharpi.codegen.kernels.quant_matmul_int8 import make_moe_gemm_int8
    experts, n, k, slots, tokens = 5, 24, 512, 2, 21
    q, parts = _weight(qtype, experts * n, k, rng)
    ids = _moe_ids(rng, tokens, slots, experts)
    x = rng.standard_normal((tokens, slots, k) if per_slot else (tokens, k)).astype(np.float32)
    taken = [_t(p) for p in _as_cpu_kernel_takes(qtype, parts, experts * n, k)]
    for isa in [isa for isa in ("avx2", "avx-vnni") if isa in VARIANTS]:
        y = _t(np.full((tokens, slots, n), np.nan, np.float32))
        _build(make_moe_gemm_int8(qtype, experts, n, k, slots, per_slot, isa))(_t(x), _t(ids), *taken, y)
        _check_moe_rows(y.numpy(), x, ids, qtype, parts, n, per_slot)


@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "per-slot-input"])
@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_moe_q8k_gemm_groups_the_tokens_by_expert(qtype, per_slot, rng, monkeypatch):
    """The AVX2 K-quant prompt MoE GEMM as the int8 one above, with spans of K (3 super-blocks in spans of 2) and
    row groups that cut an expert's rows (40 rows in groups of 32), the f32 scale planes NaN."""
    from sharpi.codegen.kernels import quant_matmul_q8k
    from sharpi.codegen.kernels.quant_matmul_q8k import make_moe_gemm_q8k
    monkeypatch.setattr(quant_matmul_q8k, "SPAN_BYTES", 2 * quant_matmul_q8k.GROUP_ROWS * 256)
    experts, n, k, slots, tokens = 4, 40, 768, 2, 19
    q, parts = _weight(qtype, experts * n, k, rng)
    ids = _moe_ids(rng, tokens, slots, experts)
    x = rng.standard_normal((tokens, slots, k) if per_slot else (tokens, k)).astype(np.float32)
    got = _run_q8k(lambda q_, n_, k_: make_moe_gemm_q8k(q_, experts, n, k_, slots, per_slot), q, parts,
                   experts * n, k, x, ids=ids, out_shape=(tokens, slots, n))
    _check_moe_rows(got, x, ids, q, parts, n, per_slot, block=256)


@_AMX
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-input", "per-slot-input"])
@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_moe_amx_gemm_groups_the_tokens_by_expert(qtype, per_slot, rng, monkeypatch):
    """The AMX prompt MoE GEMM on the compact K-quant layout (the quants and `ks` only, no `s` plane passed):
    activations per 32 as the dense AMX GEMM's; 40 rows an expert (16-row groups, the last short) unpacked two
    groups at a time, an expert with two tiles, one with none, cut tiles, clamped ids."""
    from sharpi.codegen.kernels.quant_matmul_amx import make_moe_gemm_amx
    monkeypatch.setattr(quant_matmul_amx, "ROW_BLOCK_BYTES", 2 * 16 * 768)
    experts, n, k, slots, tokens = 4, 40, 768, 2, 37
    q, parts = _weight(qtype, experts * n, k, rng)
    ids = _moe_ids(rng, tokens, slots, experts)
    ids[:quant_matmul_amx.TILE + 3, 0] = 0                     # expert 0's run: more than one 16-token tile
    x = rng.standard_normal((tokens, slots, k) if per_slot else (tokens, k)).astype(np.float32)
    x[1, ..., 32:64] = 0                                      # a zero block
    got = _run_q8k(lambda q_, n_, k_: make_moe_gemm_amx(q_, experts, n, k_, slots, per_slot), q, parts,
                   experts * n, k, x, ids=ids, out_shape=(tokens, slots, n))
    _check_moe_rows(got, x, ids, q, parts, n, per_slot)
