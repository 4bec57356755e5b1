"""Repacking GGUF tensors into the layouts of sharpi.common.quant_layout (numpy, at compile time)."""
from __future__ import annotations

import warnings

import numpy as np

from ..common.errors import UnsupportedTensorTypeError
from ..common.quant_layout import BLOCK, EXPANDED_TYPE, NATIVE_TYPES
from .gguf_file import GGUFTensor

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}


def layout_of(t: GGUFTensor) -> str:
    """The sharpi layout a GGUF tensor gets; warns when it has to be expanded."""
    if t.type_name in NATIVE_TYPES:
        return NATIVE_TYPES[t.type_name]
    _check_dequantizable(t)
    warnings.warn(f"{t.name}: GGUF type {t.type_name} has no fused kernel in sharpi yet; "
                  f"it is expanded to {EXPANDED_TYPE} at load.", stacklevel=2)
    return EXPANDED_TYPE


def _check_dequantizable(t: GGUFTensor) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # registry of types the gguf package can dequantize

    if GGMLQuantizationType(t.type_id) not in _type_traits:
        raise UnsupportedTensorTypeError(
            f"Tensor {t.name} has type {t.type_name}, which neither sharpi nor the gguf package can dequantize.")


def repack(t: GGUFTensor) -> dict[str, np.ndarray]:
    """GGUF tensor (2-D: [N, K]) -> the parts of its sharpi layout."""
    qtype = layout_of(t)
    n, k = t.shape
    if qtype in ("q4_0", "q4_1", "q5_0", "q8_0"):
        if k % BLOCK:
            raise UnsupportedTensorTypeError(f"{t.name}: K={k} is not a multiple of {BLOCK}.")
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(n, k // BLOCK, _BLOCK_BYTES[t.type_name])
        return _REPACKERS[qtype](blocks)
    if qtype == "f32":
        return {"w": np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(n, k))}
    if qtype == "f16":
        if t.type_name == "F16":
            return {"w": np.ascontiguousarray(np.asarray(t.data, dtype=np.float16).reshape(n, k))}
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        return {"w": dequantize(t.data, GGMLQuantizationType(t.type_id)).reshape(n, k).astype(np.float16)}
    if qtype == "bf16":
        return {"w": np.ascontiguousarray(np.asarray(t.data).view(np.uint16).reshape(n, k))}
    raise AssertionError(qtype)


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


def _repack_q8_0(b):
    n, nb, _ = b.shape
    quants = np.ascontiguousarray(b[..., 2:34]).reshape(n, nb * BLOCK)   # int8 bytes, in element order
    return {"qs": quants.view("<u4"), "s": _scales(_f16_scale(b, 0))}


_REPACKERS = {"q4_0": _repack_q4_0, "q4_1": _repack_q4_1, "q5_0": _repack_q5_0, "q8_0": _repack_q8_0}


def dequantize_layout(qtype: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """numpy dequantization of a sharpi layout: the reference the kernel tests compare against."""
    if qtype in ("f32", "f16"):
        return parts["w"].astype(np.float32)
    if qtype == "bf16":
        return (parts["w"].astype(np.uint32) << 16).view(np.float32)
    s = parts["s"]
    d = s[0][..., None]
    if qtype == "q8_0":
        quants = np.ascontiguousarray(parts["qs"]).view(np.int8)
        n, k = quants.shape
        return (quants.astype(np.float32).reshape(n, k // BLOCK, BLOCK) * d).reshape(n, k)
    words = parts["qs"]
    n = words.shape[0]
    q = ((words[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF).reshape(n, -1, BLOCK).astype(np.float32)
    if qtype == "q4_0":
        w = (q - 8) * d
    elif qtype == "q4_1":
        w = q * d + s[1][..., None]
    elif qtype == "q5_0":
        qh = np.ascontiguousarray(s[1]).view(np.uint32)
        hi = ((qh[..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.float32)
        w = (q + 16 * hi - 16) * d
    else:
        raise AssertionError(qtype)
    return w.reshape(n, -1)
