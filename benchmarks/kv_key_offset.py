"""What a quantized key cache should store for a model with a key bias (Qwen2.5): the float32 numpy forward's
perplexity with its keys rounded through q4_0 (or q8_0) blocks after each candidate transform, values in f16. The
table behind sharpi.common.kv_format.KEY_OFFSET (benchmarks/kv_quant.md).

    python benchmarks/kv_key_offset.py [--model qwen2.5-coder-0.5b] [--tokens 0 (the golden text) | N (Alice)]
        [--key-type q4_0] [--variants plain,bias,low-bias,mean,rope-mean,bias-hadamard,hadamard]

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
}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Hadamard matrix (n a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


class TransformedKeys(NumpyReference):
    """The reference whose cache stores R(k - c_l) rounded through `key_type` blocks, read back as R^T(.) + c_l;
    values as f16."""

    def __init__(self, gguf: str, key_type: str):
        super().__init__(gguf)
        self.key_type, self.offsets, self.rotation = key_type, None, None

    def _as_cached(self, l, k, v):
        c = self.offsets[l] if self.offsets is not None else np.float32(0)
        r = self.rotation if self.rotation is not None else np.eye(k.shape[-1], dtype=np.float32)
        return kv_roundtrip(self.key_type, (k - c) @ r) @ r.T + c, kv_roundtrip("float16", v)


def offsets_for(ref: TransformedKeys, variant: str, keys: list[np.ndarray]) -> list | None:
    cfg = ref.config
    bias = [ref.weights[f"blk.{l}.attn_k.bias"].reshape(cfg.n_kv_heads, cfg.head_dim) for l in range(cfg.n_layers)]
    if variant in ("bias", "bias-hadamard"):
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=0, help="0: the golden text; N: the first N tokens of Alice")
    p.add_argument("--key-type", default="q4_0", choices=("q4_0", "q8_0"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    gguf = str(fetch(args.model, show_progress=False))
    ref = TransformedKeys(gguf, args.key_type)
    if not ref.config.qkv_bias:
        raise SystemExit(f"{args.model} has no key bias: nothing to offset.")
    texts = texts_for(args.model, args.tokens or 1)
    ids = texts[f"alice {args.tokens}"] if args.tokens else texts["golden"]
    captured = []
    ref.key_type = "float16"
    print(f"| keys stored as ({args.key_type}, {len(ids)} tokens) | perplexity |\n| --- | ---: |")
    print(f"| f16 (no quantization) | {perplexity(ref.forward(ids, capture=captured), ids):.3f} |", flush=True)
    keys = [k for _, k, _ in captured]
    ref.key_type = args.key_type
    for variant in args.variants.split(","):
        ref.offsets = offsets_for(ref, variant, keys)
        ref.rotation = hadamard(ref.config.head_dim) if "hadamard" in variant else None
        print(f"| {VARIANTS[variant]} | {perplexity(ref.forward(ids), ids):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
