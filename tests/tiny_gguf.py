"""Small GGUF files written with the `gguf` package, for tests of bad input and of architectures without a public
small model. Random weights, real metadata layout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np


def byte_level_vocab() -> list[str]:
    """GPT-2's byte-to-unicode table: 256 single-character tokens, enough for any text."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_llama(path: Path, *, arch: str = "llama", layers: int = 2, dim: int = 64, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128, context: int = 256, seed: int = 0,
                     matrix_type: str = "F32", override_raw: dict | None = None, head_dim: int | None = None,
                     qkv_bias: bool = False, qk_norm: bool = False, sliding_window: int = 0,
                     rope_base: float = 10000.0, post_norms: bool = False, chat_template: str | None = None,
                     sampling: dict | None = None) -> Path:
    """A tiny llama-family GGUF. head_dim (written as {arch}.attention.key_length/value_length) defaults to
    dim // heads; qkv_bias adds blk.N.attn_{q,k,v}.bias (qwen2), qk_norm blk.N.attn_{q,k}_norm.weight (qwen3),
    sliding_window sets {arch}.attention.sliding_window (a mistral-style llama), post_norms adds
    blk.N.post_attention_norm / post_ffw_norm.weight (gemma3), chat_template tokenizer.chat_template, sampling
    general.sampling.* fields ({"temp": 0.3, "top_k": 7}: a float is written as float32, an int as uint32). With
    none of them the file is the same as before they existed."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = byte_level_vocab() + ["<|endoftext|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_base)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges([])
    w.add_eos_token_id(vocab - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (sampling or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"general.sampling.{key}", value)
    head_dim = head_dim or dim // heads
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    for l in range(layers):
        p = f"blk.{l}."
        shapes.update({p + "attn_norm.weight": (dim,), p + "ffn_norm.weight": (dim,),
                       p + "attn_q.weight": (heads * head_dim, dim), p + "attn_k.weight": (kv_heads * head_dim, dim),
                       p + "attn_v.weight": (kv_heads * head_dim, dim), p + "attn_output.weight": (dim, heads * head_dim),
                       p + "ffn_gate.weight": (ffn, dim), p + "ffn_up.weight": (ffn, dim),
                       p + "ffn_down.weight": (dim, ffn)})
        if qkv_bias:
            shapes.update({p + "attn_q.bias": (heads * head_dim,), p + "attn_k.bias": (kv_heads * head_dim,),
                           p + "attn_v.bias": (kv_heads * head_dim,)})
        if qk_norm:
            shapes.update({p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)})
        if post_norms:
            shapes.update({p + "post_attention_norm.weight": (dim,), p + "post_ffw_norm.weight": (dim,)})
    override_raw = override_raw or {}
    for name, shape in shapes.items():
        if name in override_raw:
            raw, qtype = override_raw[name]
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            continue
        if name.endswith(".bias"):
            w.add_tensor(name, (0.5 * rng.standard_normal(shape)).astype(np.float32))
            continue
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[matrix_type]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fake_llvm_build(tiny_artifact: Path, then=None):
    """Stands in for the llvm target's build (seconds of TVM; monkeypatch.setattr(LLVM, "build", ...) with
    sharpi.codegen.targets.llvm.TARGET) when compiling the tiny llama: copies `tiny_artifact`'s
    library (whose kernel contract matches only a compile with the same options) into the staging folder;
    `then(staging)` may interrupt after that."""
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())

    def build(mod, cfg, options, staging, bar, contract):
        shutil.copy(tiny_artifact / "model.so", staging / "model.so")
        if then is not None:
            then(staging)
        return manifest["kernels"]
    return build
