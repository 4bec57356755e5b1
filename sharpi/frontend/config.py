"""Model configuration from GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from ..common.config import MAX_SIZE, ModelConfig
from ..common.errors import GGUFError, UnsupportedArchitectureError
from ..common.schema import SchemaError
from .gguf_file import GGUFFile

# gemma3 facts llama.cpp hard-codes rather than reading from the GGUF (src/llama-model.cpp)
GEMMA3_SWA_PATTERN = 6             # every 6th layer (index % 6 == 5) is global, the others local
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(f"Architecture {arch!r} is not supported by sharpi (supported: {known}).")
    field = _FieldReader(gguf, arch)
    get, get_float = field.integer, field.number
    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = get("attention.key_length", dim // n_heads)
    embd = gguf.tensor("token_embd.weight")
    vocab = get("vocab_size", embd.shape[0] if embd.shape else 0)      # the tensor's shape is checked below
    cfg = ModelConfig(
        arch=arch, n_layers=get("block_count"), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        dim=dim, ffn_dim=get("feed_forward_length"), vocab_size=vocab,
        context_length=get("context_length"), rope_theta=get_float("rope.freq_base", 10000.0),
        rms_eps=get_float("attention.layer_norm_rms_epsilon"), rope_layout=ARCHITECTURES[arch].rope_layout,
        tied_embeddings="output.weight" not in gguf.tensors)
    _check_sizes(cfg, gguf.path.name)
    if get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError(f"{gguf.path.name}: key and value head sizes differ, which sharpi does "
                                           f"not implement.")
    for tname in ("output.bias", "blk.0.attn_output.bias"):
        if tname in gguf.tensors:
            raise UnsupportedArchitectureError(f"{gguf.path.name} has a {tname} tensor, which sharpi does not "
                                               f"implement yet.")
    cfg = ARCHITECTURES[arch].configure(cfg, field, gguf)
    _validate(cfg, gguf)
    return cfg


# -- the architectures: each GGUF architecture of the llama family as configuration of one graph (models/llama.py)
@dataclass(frozen=True)
class Architecture:
    rope_layout: str               # llama.cpp's llama_model_rope_type: "norm" (adjacent pairs) or "neox" (halves)
    configure: Callable            # (cfg, fields, gguf) -> cfg with the architecture's flags and constants


def _llama(cfg: ModelConfig, field, gguf: GGUFFile) -> ModelConfig:
    # Mistral GGUFs are llama ones; llama.cpp reads no window for them, but a GGUF that sets one (Mistral 7B
    # v0.1's 4096) gets it on every layer: a query at position p sees keys p - window + 1 .. p.
    return replace(cfg, sliding_window=field.integer("attention.sliding_window", 0, lowest=0))


def _gemma3(cfg: ModelConfig, field, gguf: GGUFFile) -> ModelConfig:
    """llama.cpp's gemma3 graph: embeddings times sqrt(dim); q/k norms; local layers (index % 6 != 5) in a
    sliding window with RoPE base 10000; queries scaled by 1/sqrt(head_dim); post-attention and post-FFN norms;
    GeGLU. RMSNorm weights are used as stored (the converter folded Gemma's +1 into them)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope.scaling.factor"):
        if f"gemma3.{key}" in gguf.metadata:
            raise UnsupportedArchitectureError(f"{gguf.path.name} sets gemma3.{key}, which sharpi does not "
                                               f"implement yet.")
    return replace(cfg, sliding_window=field.integer("attention.sliding_window"), swa_pattern=GEMMA3_SWA_PATTERN,
                   qk_norm=True, rope_theta_local=GEMMA3_LOCAL_ROPE_BASE, attn_scale=1.0 / math.sqrt(cfg.head_dim),
                   embed_scale=math.sqrt(cfg.dim), rope_theta=field.number("rope.freq_base", 1000000.0),
                   post_norms=True, ffn_activation="gelu_tanh")


def _experts(cfg: ModelConfig, field, *, expert_ffn_default: int, weights_norm: bool, shared: bool = False,
             **flags) -> ModelConfig:
    """A mixture-of-experts FFN (llama.cpp's build_moe_ffn): {arch}.expert_count experts, expert_used_count of
    them a token. Whether the chosen experts' weights are divided by their sum is not in the GGUF: llama.cpp
    hard-codes it per architecture (`weights_norm`)."""
    n_experts = field.integer("expert_count")
    cfg = replace(cfg, n_experts=n_experts, n_experts_used=field.integer("expert_used_count"),
                  expert_ffn_dim=field.integer("expert_feed_forward_length", expert_ffn_default),
                  expert_weights_norm=weights_norm, **flags)
    if shared:
        cfg = replace(cfg, shared_expert_ffn_dim=field.integer("expert_shared_feed_forward_length", cfg.ffn_dim))
    return cfg


def _qwen2moe(cfg: ModelConfig, field, gguf: GGUFFile) -> ModelConfig:
    """qwen2 attention; experts of expert_feed_forward_length (else feed_forward_length / expert_used_count),
    weights not renormalized; a shared expert gated by a sigmoid."""
    used = field.integer("expert_used_count")
    return _experts(cfg, field, expert_ffn_default=max(1, cfg.ffn_dim // used), weights_norm=False, shared=True,
                    qkv_bias=True)


def _granitemoe(cfg: ModelConfig, field, gguf: GGUFFile) -> ModelConfig:
    """llama attention and RoPE with Granite's four multipliers (embeddings, attention scores, each sublayer's
    output before its residual add, logits divided by logit_scale); experts of feed_forward_length, weights
    renormalized."""
    if f"{cfg.arch}.expert_shared_feed_forward_length" in gguf.metadata:
        raise UnsupportedArchitectureError(f"{gguf.path.name} has Granite's shared expert, which sharpi does not "
                                           f"implement yet.")
    has_scale = f"{cfg.arch}.attention.scale" in gguf.metadata
    attn_scale = field.number("attention.scale") if has_scale else 0.0     # 0: 1/sqrt(head_dim)
    return _experts(cfg, field, expert_ffn_default=cfg.ffn_dim, weights_norm=True,
                    embed_scale=field.number("embedding_scale", 1.0), attn_scale=attn_scale,
                    residual_scale=field.number("residual_scale", 1.0), logit_scale=field.number("logit_scale"))


def _hybrid(cfg: ModelConfig, field, gguf: GGUFFile, *, head_map: str, fused_ba: bool, moe: bool,
            sections: bool) -> ModelConfig:
    """llama.cpp's qwen35, qwen35moe and qwen3next (src/models/<arch>.cpp, llama-hparams.cpp): block_count counts
    nextn_predict_layers multi-token-prediction blocks after the trunk; layer i is a Gated DeltaNet layer where
    attention.recurrent_layers says so, else where (i + 1) % full_attention_interval (default 4) != 0; the
    attention layers gate their output by the q projection's second half per head, norm q and k per head and turn
    the first rope.dimension_count of each head (NEOX; qwen35's interleaved M-RoPE sections give text tokens'
    pairs the same position, as NEOX does, where the sections cover them all)."""
    name = gguf.path.name
    n_mtp = field.integer("nextn_predict_layers", 0, lowest=0)
    if n_mtp >= cfg.n_layers:
        raise GGUFError(f"{name}: nextn_predict_layers {n_mtp} leaves no trunk layer of block_count {cfg.n_layers}.")
    n_layers = cfg.n_layers - n_mtp
    marks = gguf.metadata.get(f"{cfg.arch}.attention.recurrent_layers")
    if marks is not None:
        if not isinstance(marks, list) or len(marks) != cfg.n_layers:
            raise GGUFError(f"{name}: {cfg.arch}.attention.recurrent_layers must list all {cfg.n_layers} blocks.")
        recurrent = [i for i in range(n_layers) if marks[i]]
    else:
        interval = field.integer("full_attention_interval", 4)
        recurrent = [i for i in range(n_layers) if (i + 1) % interval != 0]
    rope_dim = field.integer("rope.dimension_count", cfg.head_dim)
    if sections:
        _check_text_rope_sections(gguf, cfg.arch, rope_dim)
    state = field.integer("ssm.state_size")
    v_heads, k_heads = field.integer("ssm.time_step_rank"), field.integer("ssm.group_count")
    if field.integer("ssm.inner_size") != v_heads * state:
        raise UnsupportedArchitectureError(f"{name}: ssm.inner_size is not ssm.time_step_rank x ssm.state_size, "
                                           f"which sharpi does not implement.")
    if v_heads % k_heads:
        raise GGUFError(f"{name}: ssm.time_step_rank {v_heads} is not a multiple of ssm.group_count {k_heads}.")
    cfg = replace(cfg, n_layers=n_layers, n_mtp_layers=n_mtp, recurrent_layers=tuple(recurrent), rope_dim=rope_dim,
                  qk_norm=True, attn_q_gate=True, ssm_conv_kernel=field.integer("ssm.conv_kernel", lowest=2),
                  ssm_state_size=state, ssm_k_heads=k_heads, ssm_v_heads=v_heads, ssm_head_map=head_map,
                  ssm_fused_ba=fused_ba)
    if not moe:
        return cfg
    used = field.integer("expert_used_count")
    return _experts(cfg, field, expert_ffn_default=max(1, cfg.ffn_dim // used), weights_norm=True, shared=True)


def _check_text_rope_sections(gguf: GGUFFile, arch: str, rope_dim: int) -> None:
    """ggml's interleaved M-RoPE gives pair i the position of section (i % sum) % 3 while that section has pairs
    left, else the 4th position, which is 0 for text: sharpi's NEOX RoPE equals it where no pair falls there."""
    sections = gguf.metadata.get(f"{arch}.rope.dimension_sections")
    if sections is None:
        return
    ok = isinstance(sections, list) and len(sections) == 4 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sections) and sum(sections) > 0
    if ok:
        total = sum(sections)
        ok = all(i % total < 3 * sections[i % total % 3] for i in range(rope_dim // 2))
    if not ok:
        raise UnsupportedArchitectureError(f"{gguf.path.name}: {arch}.rope.dimension_sections {sections!r} leaves "
                                           f"pairs of the rotary dims unturned for text, which sharpi does not "
                                           f"implement.")


# llama.cpp's src/models/*.cpp: qwen2 is llama plus biases on q, k and v; qwen3 llama plus per-head RMSNorm of q
# and k before RoPE (its head size from key_length); both NEOX RoPE. The mixtures of experts: olmoe is llama
# attention with q and k RMS-normed over their whole width and NEOX RoPE; qwen3moe is qwen3's attention; neither
# has a shared expert, and only qwen3moe renormalizes the chosen experts' weights.
ARCHITECTURES = {
    "llama": Architecture("norm", _llama),
    "qwen2": Architecture("neox", lambda cfg, field, gguf: replace(cfg, qkv_bias=True)),
    "qwen3": Architecture("neox", lambda cfg, field, gguf: replace(cfg, qk_norm=True)),
    "gemma3": Architecture("neox", _gemma3),
    "olmoe": Architecture("neox", lambda cfg, field, gguf: _experts(
        cfg, field, expert_ffn_default=cfg.ffn_dim, weights_norm=False, qk_norm=True, qk_norm_full=True)),
    "qwen2moe": Architecture("neox", _qwen2moe),
    "qwen3moe": Architecture("neox", lambda cfg, field, gguf: _experts(
        cfg, field, expert_ffn_default=cfg.ffn_dim, weights_norm=True, qk_norm=True)),
    "granitemoe": Architecture("norm", _granitemoe),
    "qwen35": Architecture("neox", lambda cfg, field, gguf: _hybrid(
        cfg, field, gguf, head_map="tiled", fused_ba=False, moe=False, sections=True)),
    "qwen35moe": Architecture("neox", lambda cfg, field, gguf: _hybrid(
        cfg, field, gguf, head_map="tiled", fused_ba=False, moe=True, sections=True)),
    "qwen3next": Architecture("neox", lambda cfg, field, gguf: _hybrid(
        cfg, field, gguf, head_map="grouped", fused_ba=True, moe=True, sections=False)),
}


class _FieldReader:
    """The architecture's metadata fields, type-checked: sizes are positive integers (not bools, strings or
    floats), the others finite numbers, so a hostile file fails here with one sentence, not deep inside."""

    def __init__(self, gguf: GGUFFile, arch: str):
        self.gguf, self.arch = gguf, arch

    def _raw(self, key: str, default):
        """(full key, value, whether the file holds it)."""
        full = f"{self.arch}.{key}"
        if full in self.gguf.metadata:
            return full, self.gguf.metadata[full], True
        if default is None:
            raise GGUFError(f"{self.gguf.path.name} lacks the metadata field {full}.")
        return full, default, False

    def integer(self, key: str, default=None, *, lowest: int = 1) -> int:
        """A size from the file; a default (derived from sizes already read) is checked with the config."""
        full, value, in_file = self._raw(key, default)
        if not in_file:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.gguf.path.name}: metadata field {full} must be an integer, got {value!r}.")
        if not lowest <= value <= MAX_SIZE:
            raise GGUFError(f"{self.gguf.path.name}: metadata field {full} is {value}, outside [{lowest}, {MAX_SIZE}].")
        return value

    def number(self, key: str, default=None) -> float:
        full, value, _ = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise GGUFError(f"{self.gguf.path.name}: metadata field {full} must be a positive finite number, "
                            f"got {value!r}.")
        return float(value)


def _check_sizes(cfg: ModelConfig, name: str) -> None:
    """Before anything divides by a size or takes its square root."""
    if min(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.vocab_size, cfg.context_length) <= 0:
        raise GGUFError(f"{name} has a non-positive size in its model metadata.")


def _validate(cfg: ModelConfig, gguf: GGUFFile) -> None:
    name = gguf.path.name
    if cfg.n_heads % cfg.n_kv_heads:
        raise GGUFError(f"{name}: head_count {cfg.n_heads} is not a multiple of head_count_kv {cfg.n_kv_heads}.")
    if cfg.head_dim % 2:
        raise GGUFError(f"{name}: head dimension {cfg.head_dim} is odd, so RoPE cannot pair it.")
    try:
        ModelConfig.check_dict(cfg.to_dict())      # the ranges an artifact's manifest is held to at load
    except SchemaError as exc:
        raise GGUFError(f"{name}: the model's {exc}.") from None
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != cfg.vocab_size:
        raise GGUFError(f"{name} has {len(tokens)} tokens in its vocabulary but {cfg.vocab_size} rows of "
                        f"embeddings (token_embd.weight, {cfg.arch}.vocab_size); they must agree.")
    # Checked tensor by tensor, so a huge block_count stops at the first layer the file lacks.
    for tname, shape in _expected_shapes(cfg):
        t = gguf.tensor(tname)
        if tuple(t.shape) != shape:
            raise GGUFError(f"{name}: tensor {tname} has shape {list(t.shape)}, expected {list(shape)}.")


def _expected_shapes(cfg: ModelConfig):
    yield "token_embd.weight", (cfg.vocab_size, cfg.dim)
    if cfg.is_hybrid:
        yield from _hybrid_shapes(cfg)
        return
    for l in range(cfg.n_layers):
        p = f"blk.{l}."
        yield from {p + "attn_q.weight": (cfg.q_dim, cfg.dim), p + "attn_k.weight": (cfg.kv_dim, cfg.dim),
                    p + "attn_v.weight": (cfg.kv_dim, cfg.dim), p + "attn_output.weight": (cfg.dim, cfg.q_dim),
                    p + "attn_norm.weight": (cfg.dim,), p + "ffn_norm.weight": (cfg.dim,)}.items()
        yield from _ffn_shapes(cfg, p)
        if cfg.qkv_bias:
            yield from {p + "attn_q.bias": (cfg.q_dim,), p + "attn_k.bias": (cfg.kv_dim,),
                        p + "attn_v.bias": (cfg.kv_dim,)}.items()
        if cfg.qk_norm:
            q_norm, k_norm = (cfg.q_dim, cfg.kv_dim) if cfg.qk_norm_full else (cfg.head_dim, cfg.head_dim)
            yield from {p + "attn_q_norm.weight": (q_norm,), p + "attn_k_norm.weight": (k_norm,)}.items()
        if cfg.post_norms:
            yield from {p + "post_attention_norm.weight": (cfg.dim,), p + "post_ffw_norm.weight": (cfg.dim,)}.items()
    yield "output_norm.weight", (cfg.dim,)
    if not cfg.tied_embeddings:
        yield "output.weight", (cfg.vocab_size, cfg.dim)


def _hybrid_shapes(cfg: ModelConfig):
    """A hybrid's trunk: DeltaNet or gated attention, the FFN after post_attention_norm; the MTP blocks are not read."""
    value_dim, conv = cfg.ssm_v_heads * cfg.ssm_state_size, cfg.ssm_conv_channels
    for l in range(cfg.n_layers):
        p = f"blk.{l}."
        yield from {p + "attn_norm.weight": (cfg.dim,), p + "post_attention_norm.weight": (cfg.dim,)}.items()
        if cfg.is_recurrent(l):
            yield from {p + "attn_qkv.weight": (conv, cfg.dim), p + "attn_gate.weight": (value_dim, cfg.dim),
                        p + "ssm_conv1d.weight": (conv, cfg.ssm_conv_kernel), p + "ssm_dt.bias": (cfg.ssm_v_heads,),
                        p + "ssm_a": (cfg.ssm_v_heads,), p + "ssm_norm.weight": (cfg.ssm_state_size,),
                        p + "ssm_out.weight": (cfg.dim, value_dim)}.items()
            if cfg.ssm_fused_ba:
                yield p + "ssm_ba.weight", (2 * cfg.ssm_v_heads, cfg.dim)
            else:
                yield from {p + "ssm_beta.weight": (cfg.ssm_v_heads, cfg.dim),
                            p + "ssm_alpha.weight": (cfg.ssm_v_heads, cfg.dim)}.items()
        else:
            yield from {p + "attn_q.weight": (2 * cfg.q_dim, cfg.dim), p + "attn_k.weight": (cfg.kv_dim, cfg.dim),
                        p + "attn_v.weight": (cfg.kv_dim, cfg.dim), p + "attn_output.weight": (cfg.dim, cfg.q_dim),
                        p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)}.items()
        yield from _ffn_shapes(cfg, p)
    yield "output_norm.weight", (cfg.dim,)
    if not cfg.tied_embeddings:
        yield "output.weight", (cfg.vocab_size, cfg.dim)


def _ffn_shapes(cfg: ModelConfig, p: str):
    """Layer p's FFN tensors: the dense gated FFN, or the router, the experts [E, rows, cols] and a shared expert."""
    if not cfg.is_moe:
        yield from {p + "ffn_gate.weight": (cfg.ffn_dim, cfg.dim), p + "ffn_up.weight": (cfg.ffn_dim, cfg.dim),
                    p + "ffn_down.weight": (cfg.dim, cfg.ffn_dim)}.items()
        return
    E, F, S = cfg.n_experts, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim
    yield from {p + "ffn_gate_inp.weight": (E, cfg.dim), p + "ffn_gate_exps.weight": (E, F, cfg.dim),
                p + "ffn_up_exps.weight": (E, F, cfg.dim), p + "ffn_down_exps.weight": (E, cfg.dim, F)}.items()
    if S:
        yield from {p + "ffn_gate_inp_shexp.weight": (cfg.dim,), p + "ffn_gate_shexp.weight": (S, cfg.dim),
                    p + "ffn_up_shexp.weight": (S, cfg.dim), p + "ffn_down_shexp.weight": (cfg.dim, S)}.items()
