"""The model configuration every layer shares (frontend fills it, codegen and the runtime read it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import schema

# The largest size or context a model may declare: positions and page tables are int32 on the device, and a
# context this long already needs a page table of 1M pages per layer.
MAX_SIZE = 1 << 24
ROPE_LAYOUTS = ("norm", "neox")
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
# fields added after artifacts of format version 2 were first written: a manifest may lack them (their defaults)
LATER_FIELDS = ("post_norms", "ffn_activation", "n_experts", "n_experts_used", "expert_ffn_dim",
                "shared_expert_ffn_dim", "expert_weights_norm", "qk_norm_full", "residual_scale", "logit_scale",
                "recurrent_layers", "ssm_conv_kernel", "ssm_state_size", "ssm_k_heads", "ssm_v_heads",
                "ssm_head_map", "ssm_fused_ba", "attn_q_gate", "rope_dim", "n_mtp_layers")
SSM_HEAD_MAPS = ("tiled", "grouped")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                  # GGUF general.architecture
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int                   # embedding length
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    rope_layout: str = "norm"  # "norm": adjacent pairs (llama.cpp NORM); "neox": halves
    tied_embeddings: bool = True
    qkv_bias: bool = False     # qwen2: q, k and v projections add a bias (blk.N.attn_{q,k,v}.bias)
    qk_norm: bool = False      # qwen3, gemma3: q and k RMS-normed per head (attn_{q,k}_norm.weight) before RoPE
    # Sliding-window layers: with swa_pattern 0 every layer is local (a mistral-style llama); gemma3: layers whose
    # index % swa_pattern != swa_pattern - 1 are local (sliding window, their own RoPE base)
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_theta_local: float = 0.0
    attn_scale: float = 0.0    # query scale; 0 means 1/sqrt(head_dim)
    embed_scale: float = 1.0   # embeddings are multiplied by this (gemma: sqrt(dim))
    post_norms: bool = False   # gemma3: each sublayer's output RMS-normed before its residual add
    ffn_activation: str = "silu"   # the gated FFN's activation: silu (SwiGLU) or gelu_tanh (gemma3's GeGLU)
    # Mixture of experts (olmoe, qwen2moe, qwen3moe, granitemoe): with n_experts > 0 the FFN is a router
    # (blk.N.ffn_gate_inp) choosing n_experts_used of n_experts gated FFNs of expert_ffn_dim; their weights are the
    # router's softmax at the chosen experts, divided by their sum where expert_weights_norm (qwen3moe,
    # granitemoe). shared_expert_ffn_dim > 0 (qwen2moe): a shared gated FFN (blk.N.ffn_*_shexp) joins them, scaled
    # by sigmoid(blk.N.ffn_gate_inp_shexp . x)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_expert_ffn_dim: int = 0
    expert_weights_norm: bool = False
    qk_norm_full: bool = False     # olmoe: the q and k norms span the whole projection, not each head
    residual_scale: float = 1.0    # granite: each sublayer's output is multiplied by this before its residual add
    logit_scale: float = 1.0       # granite: the logits are divided by this
    # Hybrid linear-attention models (qwen35, qwen35moe, qwen3next): the layers of recurrent_layers are Gated
    # DeltaNet layers (a fixed-size state per sequence, no KV cache), the others gated attention (attn_q_gate: the
    # q projection holds, per head, the queries then a gate; the attention's output times sigmoid(gate)). DeltaNet
    # q and k have ssm_k_heads heads, v ssm_v_heads, all ssm_state_size wide; v-head h reads k-head h % ssm_k_heads
    # ("tiled", qwen35) or h // (ssm_v_heads / ssm_k_heads) ("grouped", qwen3next, whose beta and alpha come from
    # one projection grouped per k-head: ssm_fused_ba). The pre-FFN norm is blk.N.post_attention_norm.
    recurrent_layers: tuple = ()
    ssm_conv_kernel: int = 0
    ssm_state_size: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_map: str = "tiled"
    ssm_fused_ba: bool = False
    attn_q_gate: bool = False
    rope_dim: int = 0              # RoPE turns the first rope_dim of each head (0: all of it)
    n_mtp_layers: int = 0          # multi-token-prediction blocks after the n_layers trunk blocks: read, not run

    def __post_init__(self):
        object.__setattr__(self, "recurrent_layers", tuple(int(l) for l in self.recurrent_layers))

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within a sliding window (every layer of a mistral-style llama, gemma3's local
        ones)."""
        if not self.sliding_window:
            return False
        return not self.swa_pattern or layer % self.swa_pattern != self.swa_pattern - 1

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    def is_recurrent(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet layer (no KV cache)."""
        return layer in self.recurrent_layers

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep a KV cache."""
        return [l for l in range(self.n_layers) if l not in self.recurrent_layers]

    @property
    def kv_layers(self) -> int:
        """The layers with a KV cache (the KV pool's page tables and lengths cover these, in order)."""
        return self.n_layers - len(self.recurrent_layers)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def ssm_conv_channels(self) -> int:
        """The DeltaNet conv's channels: q, k and v side by side."""
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_state_size

    @property
    def ssm_conv_floats(self) -> int:
        """A sequence's conv window in one DeltaNet layer: its last K - 1 inputs (where its matrices start)."""
        return (self.ssm_conv_kernel - 1) * self.ssm_conv_channels

    @property
    def ssm_state_width(self) -> int:
        """Floats of a sequence's state in one DeltaNet layer: the conv window, then the matrices [H_v, d, d]."""
        return self.ssm_conv_floats + self.ssm_v_heads * self.ssm_state_size ** 2

    @property
    def state_bytes(self) -> int:
        """A sequence's recurrent state in every DeltaNet layer, f32 (0 for a model without them)."""
        return 4 * self.ssm_state_width * len(self.recurrent_layers)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recurrent_layers"] = list(self.recurrent_layers)      # JSON's form, as a manifest reads it back
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)

    @staticmethod
    def check_dict(d, path: str = "config") -> None:
        """A schema.SchemaError unless `d` is a config sharpi could have written: every field of its type and in
        range (so nothing downstream divides by zero or sizes a buffer from a hostile number)."""
        size, count = schema.integer(1, MAX_SIZE), schema.integer(1, 4096)
        positive = schema.number(0, 1e30, lo_open=True)
        schema.record({
            "arch": schema.text(64, r"[a-z0-9_]+"), "n_layers": count, "n_heads": count, "n_kv_heads": count,
            "head_dim": count, "dim": size, "ffn_dim": size, "vocab_size": size, "context_length": size,
            "rope_theta": positive, "rms_eps": schema.number(0, 1, lo_open=True),
            "rope_layout": schema.one_of(*ROPE_LAYOUTS), "tied_embeddings": schema.boolean,
            "qkv_bias": schema.boolean, "qk_norm": schema.boolean, "sliding_window": schema.integer(0, MAX_SIZE),
            "swa_pattern": schema.integer(0, 4096), "rope_theta_local": schema.number(0, 1e30),
            "attn_scale": schema.number(0, 1e6), "embed_scale": positive, "post_norms": schema.boolean,
            "ffn_activation": schema.one_of(*FFN_ACTIVATIONS), "n_experts": schema.integer(0, 4096),
            "n_experts_used": schema.integer(0, 4096), "expert_ffn_dim": schema.integer(0, MAX_SIZE),
            "shared_expert_ffn_dim": schema.integer(0, MAX_SIZE), "expert_weights_norm": schema.boolean,
            "qk_norm_full": schema.boolean, "residual_scale": positive, "logit_scale": positive,
            "recurrent_layers": schema.array(schema.integer(0, 4095), 4096, unique=True),
            "ssm_conv_kernel": schema.integer(0, 64), "ssm_state_size": schema.integer(0, 4096),
            "ssm_k_heads": schema.integer(0, 4096), "ssm_v_heads": schema.integer(0, 4096),
            "ssm_head_map": schema.one_of(*SSM_HEAD_MAPS), "ssm_fused_ba": schema.boolean,
            "attn_q_gate": schema.boolean, "rope_dim": schema.integer(0, 4096), "n_mtp_layers": schema.integer(0, 64)},
            optional_keys=LATER_FIELDS)(d, path)
        if d.get("n_experts", 0) and not 1 <= d.get("n_experts_used", 0) <= d["n_experts"]:
            raise schema.SchemaError(f"{path}.n_experts_used", f"between 1 and n_experts ({d['n_experts']})",
                                     d.get("n_experts_used"))
        if d["n_heads"] % d["n_kv_heads"]:
            raise schema.SchemaError(f"{path}.n_kv_heads", f"a divisor of n_heads ({d['n_heads']})",
                                     d["n_kv_heads"])
        if d["head_dim"] % 2:
            raise schema.SchemaError(f"{path}.head_dim", "even (RoPE rotates pairs)", d["head_dim"])
        if d.get("rope_dim", 0) % 2 or d.get("rope_dim", 0) > d["head_dim"]:
            raise schema.SchemaError(f"{path}.rope_dim", f"even and at most head_dim ({d['head_dim']})",
                                     d.get("rope_dim"))
        _check_hybrid(d, path)


def _check_hybrid(d: dict, path: str) -> None:
    """A hybrid's recurrent layers are layers of the model, its DeltaNet sizes positive, its v-heads a multiple of
    its k-heads."""
    layers = d.get("recurrent_layers") or []
    if not layers:
        return
    if max(layers) >= d["n_layers"]:
        raise schema.SchemaError(f"{path}.recurrent_layers", f"layers below n_layers ({d['n_layers']})", layers)
    for key in ("ssm_conv_kernel", "ssm_state_size", "ssm_k_heads", "ssm_v_heads"):
        if not d.get(key):
            raise schema.SchemaError(f"{path}.{key}", "positive in a model with recurrent layers", d.get(key))
    if d["ssm_conv_kernel"] < 2:
        raise schema.SchemaError(f"{path}.ssm_conv_kernel", "at least 2 (the conv's window holds K - 1 inputs)",
                                 d["ssm_conv_kernel"])
    if d["ssm_v_heads"] % d["ssm_k_heads"]:
        raise schema.SchemaError(f"{path}.ssm_v_heads", f"a multiple of ssm_k_heads ({d['ssm_k_heads']})",
                                 d["ssm_v_heads"])
