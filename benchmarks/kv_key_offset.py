"""What a quantized key cache should store (first for a model with a key bias, Qwen2.5; a model without one has a
zero offset): the float32 numpy forward's perplexity with its keys rounded through q4_0 (or q8_0) blocks after
each candidate transform, or through 4 bits per channel over groups of tokens (KIVI's grouping), values in f16.
The tables behind sharpi.common.kv_format.KEY_OFFSET and the q4_0 keys' next layout (benchmarks/kv_quant.md).

    python benchmarks/kv_key_offset.py [--model qwen2.5-coder-0.5b] [--tokens 0 (the golden text) | N (Alice)]
        [--key-type q4_0] [--variants plain,bias,low-bias,mean,rope-mean,bias-hadamard,hadamard,
                               bias-smooth-text,bias-smooth-weights,bias-layer0-q8,
                               bias-channel-16,bias-channel-16-asym,bias-channel-32-asym] [--layers]

Each variant is one forward of the reference over the whole text (about 15 s at 309 tokens, 2 minutes at 2048 on
two cores).
"""
from __future__ import annotations

import argparse

import numpy as np

from sharpi.frontend.fetch import fetch
from sharpi.testing.reference import NumpyReference, kv_roundtrip, rope_neox

from kv_quant_perplexity import perplexity, texts_for     # the same texts (the script beside this one)

VARIANTS = {
    "plain": "q4_0 blocks of the keys",
    "bias": "keys minus the key bias (sharpi's)",
    "low-bias": "keys minus the bias's low-frequency pairs only (under 1 rad in 32k positions)",
    "mean": "keys minus the mean of these keys (calibrated on the text itself)",
    "rope-mean": "keys minus the bias's mean over positions 0-32k, RoPE'd",
    "bias-hadamard": "keys minus the bias, then a Hadamard rotation of the head",
    "hadamard": "a Hadamard rotation of the head (QuaRot's), no offset",
    "bias-smooth-text": "keys minus the bias, divided per RoPE pair by its RMS on the golden text",
    "bias-smooth-weights": "keys minus the bias, divided per RoPE pair by its weight rows' norm (no data)",
    "bias-layer0-q8": "keys minus the bias, layer 0's as q8_0 (its bias rotates: pairs at 1 rad a token)",
    "bias-channel-16": "keys minus the bias, 4 bits per channel over each page's 16 tokens (KIVI's grouping), "
                       "an f16 scale a channel (40 bytes a 64-element key, q4_0's 36)",
    "bias-channel-16-asym": "keys minus the bias, 4 bits per channel over each page's 16 tokens, an f16 scale and "
                            "minimum a channel (KIVI's; 48 bytes a 64-element key)",
    "bias-channel-32-asym": "keys minus the bias, 4 bits per channel over 32 tokens, an f16 scale and minimum "
                            "a channel (40 bytes a 64-element key)",
}

GROUP = 16      # tokens a channel's scale covers: a page's


def channel_roundtrip(x: np.ndarray, asymmetric: bool, group: int = GROUP) -> np.ndarray:
    """x [T, KVH, D] rounded through 4 bits per channel over groups of `group` tokens (f16 scales; symmetric as q4_0's
    rule, or asymmetric with an f16 minimum: 15 steps from the group's min to its max)."""
    T = x.shape[0]
    pad = -T % group
    g = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]).reshape(-1, group, *x.shape[1:])
    if asymmetric:
        lo, hi = g.min(1, keepdims=True), g.max(1, keepdims=True)
        d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
        lo = lo.astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((g - lo) / np.where(d == 0, 1, d)), 0, 15)
        out = q * d + lo
    else:
        idx = np.abs(g).argmax(1)[:, None]
        m = np.take_along_axis(g, idx, 1)
        d = (m / -8).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(g / np.where(d == 0, 1, d)) + 8, 0, 15)
        out = (q - 8) * d
    return out.reshape(-1, *x.shape[1:])[:T].astype(np.float32)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Hadamard matrix (n a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


class TransformedKeys(NumpyReference):
    """The reference whose cache stores R((k - c_l) / s_l) rounded through `key_type` blocks (layer 0's through
    q8_0 with first_layer_q8), read back as R^T(.) * s_l + c_l; or, with per_channel = (asymmetric, group),
    k - c_l rounded through 4 bits a channel over groups of tokens (channel_roundtrip); values as f16."""

    def __init__(self, gguf: str, key_type: str):
        super().__init__(gguf)
        self.key_type, self.offsets, self.rotation, self.scales = key_type, None, None, None
        self.first_layer_q8, self.per_channel = False, None

    def _as_cached(self, l, k, v):
        c = self.offsets[l] if self.offsets is not None else np.float32(0)
        values = kv_roundtrip("float16", v)
        if self.per_channel is not None:
            return channel_roundtrip(k - c, *self.per_channel) + c, values
        r = self.rotation if self.rotation is not None else np.eye(k.shape[-1], dtype=np.float32)
        s = self.scales[l] if self.scales is not None else np.float32(1)
        key_type = "q8_0" if l == 0 and self.first_layer_q8 else self.key_type
        return kv_roundtrip(key_type, ((k - c) / s) @ r) @ r.T * s + c, values


def offsets_for(ref: TransformedKeys, variant: str, keys: list[np.ndarray]) -> list | None:
    cfg = ref.config
    zero = np.zeros((cfg.n_kv_heads, cfg.head_dim), np.float32)        # a model without a key bias: no offset
    bias = [ref.weights[f"blk.{l}.attn_k.bias"].reshape(zero.shape) if cfg.qkv_bias else zero
            for l in range(cfg.n_layers)]
    if variant.startswith("bias"):
        return bias
    if variant == "low-bias":
        inv = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
        return [b * np.tile(inv * 32768 < 1.0, 2) for b in bias]
    if variant == "mean":
        return [k.mean(0) for k in keys]
    if variant == "rope-mean":
        pos = np.arange(0, 32768, 8)
        return [rope_neox(np.repeat(b[None], len(pos), 0), pos, cfg.rope_theta).mean(0) for b in bias]
    return None


def pair_rms(x: np.ndarray) -> np.ndarray:
    """[..., head_dim] -> the RMS of each RoPE pair (i, i + head_dim/2) over the leading axes, on both of its
    channels (a rotation within a pair keeps the pair's norm, so one scale per pair commutes with RoPE)."""
    half = x.shape[-1] // 2
    ms = np.mean(np.reshape(x ** 2, (-1,) + x.shape[-2:]), axis=0)
    pair = np.sqrt((ms[..., :half] + ms[..., half:]) / 2)
    return np.concatenate([pair, pair], -1).astype(np.float32)


def scales_for(ref: TransformedKeys, variant: str, keys: list[np.ndarray], bias: list) -> list | None:
    cfg = ref.config
    if variant == "bias-smooth-text":
        s = [pair_rms(k - b) for k, b in zip(keys, bias)]
    elif variant == "bias-smooth-weights":
        s = []
        for l in range(cfg.n_layers):
            w = ref.weights[f"blk.{l}.attn_k.weight"] * ref.weights[f"blk.{l}.attn_norm.weight"]
            rows = np.sqrt(np.sum(w ** 2, 1)).reshape(cfg.n_kv_heads, cfg.head_dim)
            s.append(pair_rms(rows[None]))
    else:
        return None
    return [x / np.exp(np.mean(np.log(x), -1, keepdims=True)) for x in s]    # geometric mean 1 per head


def layer_report(ref: TransformedKeys, captured: list, bias: list) -> str:
    """Per layer, of the keys minus the bias: the largest channel's max |k - b| over the text beside the median
    channel's, and how far the key type moves the attention logits (mean |q.k - q.k'| over the mean deviation of
    q.k from its row's mean, every query head)."""
    cfg = ref.config
    rep = cfg.n_heads // cfg.n_kv_heads
    lines = [f"| layer | max channel | median channel | logit error, {ref.key_type} keys | 4 bits a channel over "
             f"{GROUP} tokens, scale and minimum |", "| ---: | ---: | ---: | ---: | ---: |"]
    for l, (q, k, _) in enumerate(captured):
        spread = np.abs(k - bias[l]).max(0)
        errors = []
        for rounded in (kv_roundtrip(ref.key_type, k - bias[l]) + bias[l], channel_roundtrip(k - bias[l], True)
                        + bias[l]):
            errors.append(np.mean([logit_error(q[:, h], k[:, h // rep], rounded[:, h // rep])
                                   for h in range(cfg.n_heads)]))
        lines.append(f"| {l} | {spread.max():.1f} | {np.median(spread):.2f} | {100 * errors[0]:.1f}% | "
                     f"{100 * errors[1]:.1f}% |")
    rng = np.random.default_rng(0)                   # what the same blocks do to Gaussian keys and queries
    q, k = (rng.standard_normal((len(captured[0][0]), cfg.head_dim)).astype(np.float32) for _ in range(2))
    lines.append(f"| Gaussian | | | {100 * logit_error(q, k, kv_roundtrip(ref.key_type, k[:, None])[:, 0]):.1f}% | "
                 f"{100 * logit_error(q, k, channel_roundtrip(k[:, None], True)[:, 0]):.1f}% |")
    return "\n".join(lines)


def logit_error(q: np.ndarray, k: np.ndarray, rounded: np.ndarray) -> float:
    """mean |q.k - q.k'| over the mean deviation of q.k from its row's mean (q [T, D], k and k' [T, D])."""
    exact, moved = q @ k.T, q @ rounded.T
    return float(np.abs(exact - moved).mean() / np.abs(exact - exact.mean(1, keepdims=True)).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=0, help="0: the golden text; N: the first N tokens of Alice")
    p.add_argument("--key-type", default="q4_0", choices=("q4_0", "q8_0"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", action="store_true", help="also a table per layer of the keys' channels and the "
                                                          "logit error (layer_report)")
    args = p.parse_args(argv)
    gguf = str(fetch(args.model, show_progress=False))
    ref = TransformedKeys(gguf, args.key_type)
    texts = texts_for(args.model, args.tokens or 1)
    ids = texts[f"alice {args.tokens}"] if args.tokens else texts["golden"]
    captured = []
    ref.key_type = "float16"
    print(f"| keys stored as ({args.key_type}, {len(ids)} tokens) | perplexity |\n| --- | ---: |")
    print(f"| f16 (no quantization) | {perplexity(ref.forward(ids, capture=captured), ids):.3f} |", flush=True)
    keys = [k for _, k, _ in captured]
    calib, bias = keys, offsets_for(ref, "bias", keys)
    if args.tokens and any("smooth-text" in v for v in args.variants.split(",")):   # calibrated on the golden text
        golden = []
        ref.forward(texts_for(args.model, 1)["golden"], capture=golden)
        calib = [k for _, k, _ in golden]
    ref.key_type = args.key_type
    if args.layers:
        print(layer_report(ref, captured, bias), flush=True)
    for variant in args.variants.split(","):
        ref.offsets = offsets_for(ref, variant, keys)
        ref.rotation = hadamard(ref.config.head_dim) if "hadamard" in variant else None
        ref.scales = scales_for(ref, variant, calib, bias)
        ref.first_layer_q8 = variant == "bias-layer0-q8"
        ref.per_channel = ((variant.endswith("asym"), int(variant.split("-")[2])) if "-channel-" in variant
                           else None)
        print(f"| {VARIANTS[variant]} | {perplexity(ref.forward(ids), ids):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
