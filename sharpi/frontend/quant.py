"""Repacking GGUF tensors into the layouts of sharpi.common.quant_layout (numpy, at compile time)."""
from __future__ import annotations

import warnings

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import _type_traits  # the registry of types the gguf package can dequantize
from gguf.quants import dequantize

from ..common.errors import SharpiWarning, UnsupportedTensorTypeError
from ..common.quant_layout import BLOCK, EXPANDED_TYPE, K_QUANTS, NATIVE_TYPES, SUPER_BLOCK
from .gguf_file import GGUFTensor

# bytes of one GGUF block (32 weights; 256 for the K-quants)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176,
                "Q6_K": 210}


def layout_of(t: GGUFTensor) -> str:
    """The sharpi layout a GGUF tensor gets; warns when it has to be expanded."""
    if t.type_name in NATIVE_TYPES:
        return NATIVE_TYPES[t.type_name]
    _check_dequantizable(t)
    warnings.warn(f"{t.name}: GGUF type {t.type_name} has no fused kernel in sharpi yet; "
                  f"it is expanded to {EXPANDED_TYPE} at load.", SharpiWarning, stacklevel=2)
    return EXPANDED_TYPE


def _check_dequantizable(t: GGUFTensor) -> None:

    if GGMLQuantizationType(t.type_id) not in _type_traits:
        raise UnsupportedTensorTypeError(
            f"Tensor {t.name} has type {t.type_name}, which neither sharpi nor the gguf package can dequantize.")


def check_repackable(t: GGUFTensor, qtype: str) -> None:
    """What repack would refuse, found from the tensor's info alone (before anything is repacked)."""
    width = SUPER_BLOCK if qtype in K_QUANTS else BLOCK
    if qtype in _REPACKERS and t.shape[1] % width:
        raise UnsupportedTensorTypeError(f"{t.name}: K={t.shape[1]} is not a multiple of {width}.")


def repack(t: GGUFTensor) -> dict[str, np.ndarray]:
    """GGUF tensor (2-D: [N, K]) -> the parts of its sharpi layout."""
    qtype = layout_of(t)
    n, k = t.shape
    if qtype in _REPACKERS:
        check_repackable(t, qtype)
        width = SUPER_BLOCK if qtype in K_QUANTS else BLOCK
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(n, k // width, _BLOCK_BYTES[t.type_name])
        return _repack_by_rows(_REPACKERS[qtype], blocks)
    if qtype == "f32":
        return {"w": np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(n, k))}
    if qtype == "f16":
        if t.type_name == "F16":
            return {"w": np.ascontiguousarray(np.asarray(t.data, dtype=np.float16).reshape(n, k))}
        return {"w": dequantize(t.data, GGMLQuantizationType(t.type_id)).reshape(n, k).astype(np.float16)}
    if qtype == "bf16":
        return {"w": np.ascontiguousarray(np.asarray(t.data).view(np.uint16).reshape(n, k))}
    raise AssertionError(qtype)


CHUNK_BYTES = 8 << 20   # GGUF bytes repacked in one step: its numpy temporaries are ~10x that (u32 per nibble)


def _repack_by_rows(repacker, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """repacker(blocks), a chunk of rows at a time into the finished parts (rows are axis 0 of qs and w, axis 1 of
    the [S, N, K/32] scales), so a 200 MB embedding never expands into gigabytes of temporaries at once."""
    rows = max(1, CHUNK_BYTES // max(1, blocks[0].nbytes))
    if rows >= len(blocks):
        return repacker(blocks)
    out = {}
    for r0 in range(0, len(blocks), rows):
        for name, part in repacker(blocks[r0:r0 + rows]).items():
            axis = 1 if name == "s" else 0
            if name not in out:
                shape = list(part.shape)
                shape[axis] = len(blocks)
                out[name] = np.empty(shape, part.dtype)
            index = (slice(None), slice(r0, r0 + rows)) if axis else slice(r0, r0 + rows)
            out[name][index] = part
    return out


def _f16_scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs16: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of a 4-bit block (element i low nibble, element i+16 high nibble) -> [.., 32] values."""
    return np.concatenate([qs16 & 0x0F, qs16 >> 4], axis=-1).astype(np.uint32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[N, NB, 32] values < 16 -> uint32 [N, NB*4], element 8w+j at nibble j of word w."""
    n, nb, _ = q.shape
    q = (q & 0xF).astype(np.uint32).reshape(n, nb * 4, 8)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def _scales(*fields: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.stack(fields, axis=0).astype(np.float32))    # [S, N, K/32]


def _repack_q4_0(b):
    return {"qs": _pack_nibbles(_nibbles(b[..., 2:18])), "s": _scales(_f16_scale(b, 0))}


def _repack_q4_1(b):
    return {"qs": _pack_nibbles(_nibbles(b[..., 4:20])), "s": _scales(_f16_scale(b, 0), _f16_scale(b, 2))}


def _repack_q5_0(b):
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0].astype(np.uint32)
    return {"qs": _pack_nibbles(_nibbles(b[..., 6:22])), "s": _scales(_f16_scale(b, 0), qh.view(np.float32))}


def _qh_field(b, offset):
    """A block's 32 fifth bits (little-endian u32 at `offset`) as the bits of an f32 scale field."""
    return np.ascontiguousarray(b[..., offset:offset + 4]).view("<u4")[..., 0].astype(np.uint32).view(np.float32)


def _repack_q5_1(b):
    return {"qs": _pack_nibbles(_nibbles(b[..., 8:24])),
            "s": _scales(_f16_scale(b, 0), _f16_scale(b, 2), _qh_field(b, 4))}


def _repack_q8_0(b):
    n, nb, _ = b.shape
    quants = np.ascontiguousarray(b[..., 2:34]).reshape(n, nb * BLOCK)   # int8 bytes, in element order
    return {"qs": quants.view("<u4"), "s": _scales(_f16_scale(b, 0))}


def _k_scale_min(scales12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's 12 bytes of 6-bit scales and mins of a Q4_K/Q5_K super-block (get_scale_min_k4) -> [.., 8] each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of
    bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, m, md = scales12[..., 0:4], scales12[..., 4:8], scales12[..., 8:12]
    sc = np.concatenate([a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_scales(b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-32-block (d, m) of Q4_K/Q5_K super-blocks [N, NS, bytes] -> [N, NS*8] each (products exact in f32),
    and the super-blocks' `ks` words (quant_layout)."""
    n, ns, _ = b.shape
    sc, mn = _k_scale_min(b[..., 4:16])
    d_super, dmin = _f16_scale(b, 0), _f16_scale(b, 2)
    d = d_super[..., None] * sc
    m = -(dmin[..., None] * mn)
    ints = np.concatenate([sc, mn], axis=-1).astype(np.uint8).view("<u4")         # [N, NS, 4]
    halves = np.ascontiguousarray(b[..., 0:4]).view("<u4")                         # d | dmin << 16, as stored
    ks = np.concatenate([halves, ints], axis=-1)
    return d.reshape(n, ns * 8), m.reshape(n, ns * 8), ks                        # ks [N, NS, 5]


def _k_nibbles(qs128: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes of low nibbles [N, NS, 128] -> [N, NS*8, 32] values: sub-block 2j is the low nibbles
    of bytes 32j..32j+31, sub-block 2j+1 their high nibbles."""
    n, ns, _ = qs128.shape
    q = qs128.reshape(n, ns, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (q & 0x0F).reshape(n, ns * 8, BLOCK)


def _bits_to_words(bits: np.ndarray, width: int) -> np.ndarray:
    """[.., 32 / width] values of `width` bits -> uint32 [..], value i at bits width*i."""
    shifts = (np.arange(bits.shape[-1], dtype=np.uint32) * width)
    return np.bitwise_or.reduce(bits.astype(np.uint32) << shifts, axis=-1).astype(np.uint32)


def _repack_q4_k(b):
    n, ns, _ = b.shape
    d, m, ks = _k_scales(b)
    return {"qs": _pack_nibbles(_k_nibbles(b[..., 16:144])), "s": _scales(d, m), "ks": ks.reshape(n, ns * 5)}


def _repack_q5_k(b):
    n, ns, _ = b.shape
    d, m, ks = _k_scales(b)
    # fifth bit of element l of sub-block i: bit i of qh byte l
    qh = b[..., 16:48].reshape(n, ns, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = _bits_to_words(qh & 1, 1)                                                   # [N, NS, 8]
    ks = np.concatenate([ks, qh], axis=-1).reshape(n, ns * 13)
    qh = qh.reshape(n, ns * 8)
    return {"qs": _pack_nibbles(_k_nibbles(b[..., 48:176])), "s": _scales(d, m, qh.view(np.float32)), "ks": ks}


def _repack_q6_k(b):
    """Q6_K super-block: ql[128], qh[64], int8 scales[16], f16 d. Element 128h + 32t + l (half h, quarter t)
    has low 4 bits in ql[64h + 32(t%2) + l] (nibble t//2) and high 2 bits in qh[32h + l] >> 2t; scale
    scales[e // 16]."""
    n, ns, _ = b.shape
    lo = b[..., 0:128].reshape(n, ns, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    lo = (lo & 0x0F).reshape(n, ns * 8, BLOCK)
    hi = b[..., 128:192].reshape(n, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    hi = _bits_to_words((hi & 3).reshape(n, ns * 8, 2, 16), 2)                     # [N, K/32, 2]
    sc_bytes = np.ascontiguousarray(b[..., 192:208])                                # [N, NS, 16] int8
    d_super = _f16_scale(b, 208)
    d = (d_super[..., None] * sc_bytes.view(np.int8).astype(np.float32)).reshape(n, ns * 8, 2)
    ks = np.concatenate([d_super[..., None].view(np.uint32), sc_bytes.view("<u4"), hi.reshape(n, ns, 16)],
                        axis=-1).reshape(n, ns * 21)
    return {"qs": _pack_nibbles(lo),
            "s": _scales(d[..., 0], d[..., 1], hi[..., 0].view(np.float32), hi[..., 1].view(np.float32)), "ks": ks}


_REPACKERS = {"q4_0": _repack_q4_0, "q4_1": _repack_q4_1, "q5_0": _repack_q5_0, "q5_1": _repack_q5_1,
              "q8_0": _repack_q8_0, "q4_k": _repack_q4_k, "q5_k": _repack_q5_k, "q6_k": _repack_q6_k}

