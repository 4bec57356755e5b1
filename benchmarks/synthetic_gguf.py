"""A GGUF of a real model's shape with random quantized weights, for scale checks without a large checkpoint (the
CPU issue's compile memory, load memory and speed at 1.5B and 7B).

    python benchmarks/synthetic_gguf.py SHAPE OUT.gguf [--seed N] [--vocab-from GGUF]

SHAPE is one of SHAPES: `qwen2-1.5b` (Qwen2.5-1.5B: 28 layers of 1536, 12 heads over 2 KV heads, QKV biases, tied
embeddings, vocabulary 151,936), `llama-7b` (Mistral-7B's shape: 32 layers of 4096, FFN 14336, 32 heads over 8 KV
heads, vocabulary 32,000), and two mixtures of experts: `olmoe-1b-7b` (OLMoE-1B-7B: 16 layers of 2048, 64 experts
of 1024 rows, 8 a token, 16 heads, q/k norms over the whole projection, vocabulary 50,304) and `qwen3-30b-a3b`
(Qwen3-30B-A3B: 48 layers of 2048, 128 experts of 768, 8 a token, 32 heads of 128 over 4 KV heads, per-head q/k
norms, vocabulary 151,936; an 18 GB file). Expert stacks are [E, N, K], the router F32. Weights are typed as llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output (or tied
embedding) matrix and for attn_v and ffn_down in half the layers. Each tensor's blocks are random bytes whose
f16 scales are set so that a weight's spread is about 1/sqrt(K) (a residual stream that stays finite); tensors
are generated and written one at a time (gguf's add_tensor_info, then write_tensor_data), so writing a 4 GB file
takes a tensor's memory. The text is meaningless; what runs is every kernel at the real shapes.

Two hybrids (Gated DeltaNet beside gated attention): `qwen35-0.8b` (Qwen3.5-0.8B: 24 layers of 1024, every 4th
attention with 8 heads of 256 over 2 KV heads and RoPE over 64 of them, the others DeltaNet with 16 k- and 16
v-heads of 128, FFN 3584, tied embeddings, vocabulary 248,320) and `qwen35-35b-a3b-8l` (Qwen3.5-35B-A3B's layers,
8 of its 40: 2048 wide, 16 attention heads over 2 KV heads of 256, DeltaNet 16 k- / 32 v-heads of 128, 256
experts of 512 rows, 8 a token, and a shared expert of 512).

`qwen2-draft` (2 layers of 256, 4 heads over 2 KV heads, Qwen's vocabulary) with --vocab-from a Qwen2.5 GGUF is a
draft model for speculative decoding of it (its tokenizer copied, so sharpi accepts it as a draft): what drafting
costs, measured (benchmarks/speculative.md); its random drafts are almost never accepted.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_base: float
    qkv_bias: bool
    tied: bool
    experts: int = 0           # a mixture of experts: `experts` FFNs of `ffn` rows, `used` of them a token
    used: int = 0
    head_dim: int = 0          # 0: dim / heads
    qk_norm: str = ""          # "head" (qwen3moe) or "full" (olmoe: over the whole projection)
    # a hybrid (qwen35, qwen35moe): Gated DeltaNet layers where (i + 1) % interval != 0, of k_heads / v_heads heads
    # of ssm_state, conv kernel 4; gated attention (RoPE over rope_dim) in the others; a sigmoid-gated shared expert
    interval: int = 0
    ssm_state: int = 0
    k_heads: int = 0
    v_heads: int = 0
    rope_dim: int = 0
    shared_ffn: int = 0


SHAPES = {
    "qwen2-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 151936, 32768, 1e6, qkv_bias=True, tied=True),
    "llama-7b": Shape("llama", 32, 4096, 14336, 32, 8, 32000, 32768, 1e6, qkv_bias=False, tied=False),
    "olmoe-1b-7b": Shape("olmoe", 16, 2048, 1024, 16, 16, 50304, 4096, 1e4, qkv_bias=False, tied=False,
                         experts=64, used=8, qk_norm="full"),
    "qwen2-draft": Shape("qwen2", 2, 256, 512, 4, 2, 151936, 32768, 1e6, qkv_bias=True, tied=True),
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 768, 32, 4, 151936, 40960, 1e6, qkv_bias=False, tied=False,
                           experts=128, used=8, head_dim=128, qk_norm="head"),
    "qwen35-0.8b": Shape("qwen35", 24, 1024, 3584, 8, 2, 248320, 262144, 1e7, qkv_bias=False, tied=True,
                         head_dim=256, qk_norm="head", interval=4, ssm_state=128, k_heads=16, v_heads=16,
                         rope_dim=64),
    # Qwen3.5-35B-A3B's layer, 8 of its 40 layers (the whole model, ~21 GB at Q4_K_M, does not stay resident in 24 GB)
    "qwen35-35b-a3b-8l": Shape("qwen35moe", 8, 2048, 512, 16, 2, 248320, 262144, 1e7, qkv_bias=False, tied=False,
                               experts=256, used=8, head_dim=256, qk_norm="head", interval=4, ssm_state=128,
                               k_heads=16, v_heads=32, rope_dim=64, shared_ffn=512),
}

_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
_SUPER = 256


def _random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, k / 256 * block bytes]: random quants with f16 scales giving weights of spread ~1/sqrt(k)."""
    blocks = rng.integers(0, 256, (n, k // _SUPER, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == "Q4_K":        # d, dmin (f16) then 6-bit scales and mins; w = d * sc * q - dmin * m, sc ~ 32, q ~ 7.5
        d = np.float16(1.0 / (150 * np.sqrt(k)))
        blocks[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
    else:                      # Q6_K: int8 scales at 192..207, d (f16) at 208; w = d * scale * (q - 32)
        blocks[..., 208:210] = np.frombuffer(np.float16(1.0 / (1400 * np.sqrt(k))).tobytes(), np.uint8)
    return blocks.reshape(n, -1)


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, logical shape [N, K] or [N], type) in llama.cpp's order."""
    s, head_dim = shape, shape.head_dim or shape.dim // shape.heads
    q_dim, kv_dim = s.heads * head_dim, s.kv_heads * head_dim
    out = [("token_embd.weight", (s.vocab, s.dim), "Q6_K" if s.tied else "Q4_K")]
    for layer in range(s.layers):
        p, heavy = f"blk.{layer}.", "Q6_K" if layer % 2 == 0 else "Q4_K"
        if s.interval:
            out += _hybrid_layer(s, layer, p, heavy)
            continue
        out += [(p + "attn_norm.weight", (s.dim,), "F32"),
                (p + "attn_q.weight", (q_dim, s.dim), "Q4_K"),
                (p + "attn_k.weight", (kv_dim, s.dim), "Q4_K"),
                (p + "attn_v.weight", (kv_dim, s.dim), heavy),
                (p + "attn_output.weight", (s.dim, q_dim), "Q4_K"),
                (p + "ffn_norm.weight", (s.dim,), "F32")]
        if s.qk_norm:
            norms = (q_dim, kv_dim) if s.qk_norm == "full" else (head_dim, head_dim)
            out += [(p + "attn_q_norm.weight", (norms[0],), "F32"), (p + "attn_k_norm.weight", (norms[1],), "F32")]
        if s.experts:     # llama.cpp's Q4_K_M keeps the router in F32
            out += [(p + "ffn_gate_inp.weight", (s.experts, s.dim), "F32"),
                    (p + "ffn_gate_exps.weight", (s.experts, s.ffn, s.dim), "Q4_K"),
                    (p + "ffn_up_exps.weight", (s.experts, s.ffn, s.dim), "Q4_K"),
                    (p + "ffn_down_exps.weight", (s.experts, s.dim, s.ffn), heavy)]
        else:
            out += [(p + "ffn_gate.weight", (s.ffn, s.dim), "Q4_K"),
                    (p + "ffn_up.weight", (s.ffn, s.dim), "Q4_K"),
                    (p + "ffn_down.weight", (s.dim, s.ffn), heavy)]
        if s.qkv_bias:
            out += [(p + f"attn_{x}.bias", (n,), "F32") for x, n in
                    (("q", s.heads * head_dim), ("k", s.kv_heads * head_dim), ("v", s.kv_heads * head_dim))]
    out.append(("output_norm.weight", (s.dim,), "F32"))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.dim), "Q6_K"))
    return out


def _hybrid_layer(s: Shape, layer: int, p: str, heavy: str) -> list[tuple[str, tuple[int, ...], str]]:
    """A qwen35/qwen35moe block: Gated DeltaNet or gated attention, then the FFN after post_attention_norm."""
    out = [(p + "attn_norm.weight", (s.dim,), "F32"), (p + "post_attention_norm.weight", (s.dim,), "F32")]
    if (layer + 1) % s.interval:
        key, value = s.k_heads * s.ssm_state, s.v_heads * s.ssm_state
        out += [(p + "attn_qkv.weight", (2 * key + value, s.dim), "Q4_K"),
                (p + "attn_gate.weight", (value, s.dim), "Q4_K"),
                (p + "ssm_conv1d.weight", (2 * key + value, 4), "F32"),
                (p + "ssm_dt.bias", (s.v_heads,), "F32"), (p + "ssm_a", (s.v_heads,), "F32"),
                (p + "ssm_beta.weight", (s.v_heads, s.dim), "Q4_K"),
                (p + "ssm_alpha.weight", (s.v_heads, s.dim), "Q4_K"),
                (p + "ssm_norm.weight", (s.ssm_state,), "F32"),
                (p + "ssm_out.weight", (s.dim, value), "Q4_K")]
    else:
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        out += [(p + "attn_q.weight", (2 * q_dim, s.dim), "Q4_K"), (p + "attn_k.weight", (kv_dim, s.dim), "Q4_K"),
                (p + "attn_v.weight", (kv_dim, s.dim), heavy), (p + "attn_output.weight", (s.dim, q_dim), "Q4_K"),
                (p + "attn_q_norm.weight", (s.head_dim,), "F32"), (p + "attn_k_norm.weight", (s.head_dim,), "F32")]
    if s.experts:
        out += [(p + "ffn_gate_inp.weight", (s.experts, s.dim), "F32"),
                (p + "ffn_gate_exps.weight", (s.experts, s.ffn, s.dim), "Q4_K"),
                (p + "ffn_up_exps.weight", (s.experts, s.ffn, s.dim), "Q4_K"),
                (p + "ffn_down_exps.weight", (s.experts, s.dim, s.ffn), heavy),
                (p + "ffn_gate_inp_shexp.weight", (s.dim,), "F32"),
                (p + "ffn_gate_shexp.weight", (s.shared_ffn, s.dim), "Q4_K"),
                (p + "ffn_up_shexp.weight", (s.shared_ffn, s.dim), "Q4_K"),
                (p + "ffn_down_shexp.weight", (s.dim, s.shared_ffn), heavy)]
    else:
        out += [(p + "ffn_gate.weight", (s.ffn, s.dim), "Q4_K"), (p + "ffn_up.weight", (s.ffn, s.dim), "Q4_K"),
                (p + "ffn_down.weight", (s.dim, s.ffn), heavy)]
    return out


def _array(name: str, logical: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    if name.endswith("ssm_a"):                      # -exp(A_log): decays exp(softplus(.) * a) inside (0, 1)
        return -np.exp(rng.uniform(-1.0, 1.0, logical)).astype(np.float32)
    if qtype == "F32" and len(logical) == 2:        # a router (or a conv): spread ~1/sqrt(K)
        return (rng.standard_normal(logical) / np.sqrt(logical[1])).astype(np.float32)
    if qtype == "F32":
        scale = 0.1 if name.endswith(".bias") else 0.05
        base = 0.0 if name.endswith(".bias") else 1.0
        return (base + scale * rng.standard_normal(logical)).astype(np.float32)
    *stack, n, k = logical
    return _random_blocks(qtype, int(np.prod(stack, dtype=np.int64)) * n, k, rng).reshape(*stack, n, -1)


def _vocabulary(size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): GPT-2's 256 byte tokens, their pairs as merged tokens (llama.cpp refuses a BPE vocabulary
    without merges), fillers up to the embedding's rows, the last one end-of-text."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_gguf import byte_level_vocab

    tokens = byte_level_vocab()
    pairs = [(a, b) for a in tokens for b in tokens][:max(0, min(1 << 16, size - len(tokens) - 1))]
    tokens = tokens + [a + b for a, b in pairs]
    tokens += [f"<|synthetic_{i}|>" for i in range(size - len(tokens) - 1)] + ["<|endoftext|>"]
    return tokens, [f"{a} {b}" for a, b in pairs]


def _tokenizer_of(gguf_path: Path) -> dict:
    """A GGUF's tokenizer fields (tokenizer.ggml.* and the chat template), as the writer takes them."""
    from gguf import GGUFReader

    return {name: (field.types, field.contents()) for name, field in GGUFReader(str(gguf_path)).fields.items()
            if name.startswith("tokenizer.")}


def _add_tokenizer(w, fields: dict) -> None:
    from gguf.constants import GGUFValueType
    for name, (types, value) in fields.items():
        if types[0] == GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, types[0])


def write(shape_name: str, path: Path, seed: int = 0, show_progress: bool = True,
          vocab_from: Path | None = None) -> Path:
    import gguf
    from tqdm import tqdm

    shape, rng = SHAPES[shape_name], np.random.default_rng(seed)
    tokens, merges = _vocabulary(shape.vocab)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"synthetic {shape_name}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.used)
        w.add_expert_feed_forward_length(shape.ffn)
    if shape.head_dim:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.interval:
        w.add_full_attention_interval(shape.interval)
        w.add_rope_dimension_count(shape.rope_dim)
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(shape.ssm_state)
        w.add_ssm_group_count(shape.k_heads)
        w.add_ssm_time_step_rank(shape.v_heads)
        w.add_ssm_inner_size(shape.v_heads * shape.ssm_state)
    if shape.shared_ffn:
        w.add_expert_shared_feed_forward_length(shape.shared_ffn)
    if vocab_from is not None:
        _add_tokenizer(w, _tokenizer_of(vocab_from))
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if shape.arch == "qwen2" else "default")
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 1) + [3])
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
    tensors = _tensors(shape)
    for name, logical, qtype in tensors:
        raw = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            w.add_tensor_info(name, logical, np.dtype(np.float32), int(np.prod(logical)) * 4)
        else:
            *rows, k = logical
            row_bytes = k // _SUPER * _BLOCK_BYTES[qtype]
            nbytes = int(np.prod(rows, dtype=np.int64)) * row_bytes
            w.add_tensor_info(name, (*rows, row_bytes), np.dtype(np.uint8), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, logical, qtype in tqdm(tensors, desc=f"writing {path.name}", unit="tensor", disable=not show_progress):
        w.write_tensor_data(_array(name, logical, qtype, rng))
    w.close()
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-from", type=Path, default=None,
                   help="copy this GGUF's tokenizer (a draft model of it must share its vocabulary)")
    args = p.parse_args(argv)
    write(args.shape, args.out, args.seed, vocab_from=args.vocab_from)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
