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
                     sampling: dict | None = None, merges: tuple = ()) -> Path:
    """A tiny llama-family GGUF. head_dim (written as {arch}.attention.key_length/value_length) defaults to
    dim // heads; qkv_bias adds blk.N.attn_{q,k,v}.bias (qwen2), qk_norm blk.N.attn_{q,k}_norm.weight (qwen3),
    sliding_window sets {arch}.attention.sliding_window (a mistral-style llama), post_norms adds
    blk.N.post_attention_norm / post_ffw_norm.weight (gemma3), chat_template tokenizer.chat_template, sampling
    general.sampling.* fields ({"temp": 0.3, "top_k": 7}: a float is written as float32, an int as uint32), merges
    BPE merges whose tokens join the vocabulary ("a b": another vocabulary). With none of them the file is the same as before they existed."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = len(vocabulary(merges))
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
    _add_vocab(w, merges)
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
    _add_tensors(w, shapes, rng, matrix_type, override_raw)
    return _finish(w, path)


def vocabulary(merges: tuple = ()) -> list[str]:
    """The tiny models' tokens: the 256 bytes, each merge's result, <|endoftext|>."""
    return byte_level_vocab() + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]


def _add_vocab(w, merges: tuple = (), pre: str = "gpt2") -> None:
    """A byte-level vocabulary with <|endoftext|> last as EOS, no BOS (llama.cpp loads it with one merge at
    least; an empty list is not written)."""
    tokens = vocabulary(merges)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(list(merges))
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def _add_tensors(w, shapes: dict, rng, matrix_type: str = "F32", override_raw: dict | None = None,
                 scales: dict | None = None, keep_f32: tuple = ()) -> None:
    """Random tensors in the order of `shapes`: biases N(0, 0.25), norms 1 + N(0, 0.01), matrices (and stacks of
    them: experts) N(0, 1 / cols) times scales.get(name, 1), quantized to matrix_type (those whose names end
    with one of keep_f32 stay F32, as llama.cpp's converter keeps them)."""
    import gguf

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
        data = (rng.standard_normal(shape) * (scales or {}).get(name, 1.0) / np.sqrt(shape[-1])).astype(np.float32)
        qtype = gguf.GGMLQuantizationType["F32" if name.endswith(keep_f32) else matrix_type]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)


def _finish(w, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MOE_ARCHS = ("olmoe", "qwen2moe", "qwen3moe", "granitemoe")
MOE_MERGES = ("Ġ Ġ",)        # llama.cpp refuses a BPE vocabulary without merges
# Granite's multipliers in the tiny granitemoe: each far from 1, so leaving one out moves the logits
GRANITE_SCALES = {"embedding_scale": 3.0, "residual_scale": 0.5, "attention.scale": 0.2, "logit_scale": 4.0}


def write_tiny_moe(path: Path, arch: str, *, layers: int = 2, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                   experts: int = 8, used: int = 2, expert_ffn: int = 32, shared_ffn: int = 48, context: int = 256,
                   router_scale: float = 1.0, seed: int = 0, matrix_type: str = "F32",
                   override_raw: dict | None = None) -> Path:
    """A tiny mixture-of-experts GGUF of one of MOE_ARCHS, laid out as llama.cpp loads it: olmoe (q/k norms over
    the whole projection; its k norm is dim long, so kv_heads = heads), qwen2moe (q/k/v biases, a shared expert
    of shared_ffn with its sigmoid gate), qwen3moe (per-head q/k norms, head size 32 != dim / heads) and
    granitemoe (GRANITE_SCALES). The router's weights are multiplied by router_scale (larger: the top-k choice
    is further from a tie). Every model has its own output matrix. `override_raw`: name -> (GGUF bytes, type), as
    write_tiny_llama's."""
    import gguf

    assert arch in MOE_ARCHS, arch
    if arch == "olmoe":
        kv_heads = heads
    head_dim = 32 if arch == "qwen3moe" else dim // heads
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary(MOE_MERGES))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(expert_ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(expert_ffn)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(shared_ffn)
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "granitemoe":
        for key, value in GRANITE_SCALES.items():
            w.add_float32(f"{arch}.{key}", value)
    _add_vocab(w, merges=MOE_MERGES, pre="default")
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "output.weight": (vocab, dim)}
    for l in range(layers):
        p = f"blk.{l}."
        shapes.update({p + "attn_norm.weight": (dim,), p + "ffn_norm.weight": (dim,),
                       p + "attn_q.weight": (q_dim, dim), p + "attn_k.weight": (kv_dim, dim),
                       p + "attn_v.weight": (kv_dim, dim), p + "attn_output.weight": (dim, q_dim)})
        if arch == "qwen2moe":
            shapes.update({p + "attn_q.bias": (q_dim,), p + "attn_k.bias": (kv_dim,), p + "attn_v.bias": (kv_dim,)})
        if arch == "olmoe":
            shapes.update({p + "attn_q_norm.weight": (q_dim,), p + "attn_k_norm.weight": (kv_dim,)})
        if arch == "qwen3moe":
            shapes.update({p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)})
        shapes.update({p + "ffn_gate_inp.weight": (experts, dim), p + "ffn_gate_exps.weight": (experts, expert_ffn, dim),
                       p + "ffn_up_exps.weight": (experts, expert_ffn, dim),
                       p + "ffn_down_exps.weight": (experts, dim, expert_ffn)})
        if arch == "qwen2moe":
            shapes.update({p + "ffn_gate_inp_shexp.weight": (dim,), p + "ffn_gate_shexp.weight": (shared_ffn, dim),
                           p + "ffn_up_shexp.weight": (shared_ffn, dim), p + "ffn_down_shexp.weight": (dim, shared_ffn)})
    scales = {name: router_scale for name in shapes if name.endswith("ffn_gate_inp.weight")}
    _add_tensors(w, shapes, rng, matrix_type, override_raw, scales=scales)
    return _finish(w, path)


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


MOE_GOLDEN = Path(__file__).parent / "data" / "moe_golden.json"


def write_golden_moe(folder: Path, arch: str) -> Path:
    """The tiny MoE GGUF of `arch` whose llama.cpp logits tests/data/moe_golden.npz holds, checked byte for byte
    against the sha256 recorded when they were made."""
    import hashlib

    model = json.loads(MOE_GOLDEN.read_text())["models"][arch]
    path = write_tiny_moe(folder / f"{arch}.gguf", arch, seed=model["seed"], router_scale=model["router_scale"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model["sha256"], (
        "tiny_gguf.write_tiny_moe no longer writes the file the golden data was made from: run "
        "tests/data/make_moe_golden.py again")
    return path


HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# The tiny hybrids' RoPE: a quarter of each 32-wide head, whose 4 pairs the interleaved M-RoPE sections [2, 1, 1, 0]
# all give the token's position (text tokens' 4th position is 0, so a pair in the 4th section would not turn)
HYBRID_ROPE_SECTIONS = [2, 1, 1, 0]


def write_tiny_hybrid(path: Path, arch: str, *, layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                      head_dim: int = 32, rope_dim: int = 8, ffn: int = 96, ssm_state: int = 16, k_heads: int = 2,
                      v_heads: int = 4, conv_kernel: int = 4, experts: int = 8, used: int = 2, expert_ffn: int = 32,
                      shared_ffn: int = 48, mtp_layers: int = 1, interval: int | None = 2, context: int = 256,
                      router_scale: float = 1.0, seed: int = 0, matrix_type: str = "F32",
                      chat_template: str | None = None) -> Path:
    """A tiny hybrid linear-attention GGUF of one of HYBRID_ARCHS, laid out as llama.cpp 0c1e570 loads it
    (src/models/{qwen35,qwen35moe,qwen3next}.cpp): `layers` trunk blocks, Gated DeltaNet where (i + 1) % interval
    != 0 (interval None: the key is left out, llama.cpp's default 4), the others gated attention (q projection
    2 x heads x head_dim, each head's q then its gate) with per-head q/k norms and RoPE over rope_dim; then
    `mtp_layers` multi-token-prediction blocks (block_count counts them). DeltaNet: attn_qkv (q, k of k_heads and
    v of v_heads, each ssm_state wide), attn_gate, a causal conv of conv_kernel, ssm_beta and ssm_alpha (qwen3next:
    one ssm_ba, grouped per k-head), ssm_dt.bias, ssm_a (negative: -exp(A_log)), ssm_norm, ssm_out. The FFN is
    dense (qwen35) or `experts` experts with a sigmoid-gated shared expert. chat_template: tokenizer.chat_template
    (none by default)."""
    import gguf

    assert arch in HYBRID_ARCHS, arch
    moe = arch != "qwen35"
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary(MOE_MERGES))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers + mtp_layers)
    w.add_nextn_predict_layers(mtp_layers)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(rope_dim)
    if arch != "qwen3next":
        w.add_rope_dimension_sections(HYBRID_ROPE_SECTIONS)
    w.add_layer_norm_rms_eps(1e-6)
    if interval is not None:
        w.add_full_attention_interval(interval)
    w.add_ssm_conv_kernel(conv_kernel)
    w.add_ssm_inner_size(v_heads * ssm_state)
    w.add_ssm_state_size(ssm_state)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_group_count(k_heads)
    if moe:
        w.add_expert_count(experts)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(expert_ffn)
        w.add_expert_shared_feed_forward_length(shared_ffn)
    _add_vocab(w, merges=MOE_MERGES, pre="default")
    if chat_template is not None:
        w.add_chat_template(chat_template)
    recurrent = [i for i in range(layers) if (i + 1) % (interval or 4) != 0]
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    key_dim, value_dim = k_heads * ssm_state, v_heads * ssm_state
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "output.weight": (vocab, dim)}
    raw = {}
    for l in range(layers + mtp_layers):
        p = f"blk.{l}."
        shapes.update({p + "attn_norm.weight": (dim,), p + "post_attention_norm.weight": (dim,)})
        if l in recurrent:
            shapes.update({p + "attn_qkv.weight": (2 * key_dim + value_dim, dim),
                           p + "attn_gate.weight": (value_dim, dim),
                           p + "ssm_conv1d.weight": (2 * key_dim + value_dim, conv_kernel),
                           p + "ssm_dt.bias": (v_heads,), p + "ssm_a": (v_heads,)})
            if arch == "qwen3next":
                shapes[p + "ssm_ba.weight"] = (2 * v_heads, dim)
            else:
                shapes.update({p + "ssm_beta.weight": (v_heads, dim), p + "ssm_alpha.weight": (v_heads, dim)})
            shapes.update({p + "ssm_norm.weight": (ssm_state,), p + "ssm_out.weight": (dim, value_dim)})
            # decays exp(softplus(.) * a) well inside (0, 1): a = -exp(A_log), A_log ~ U(log 0.2, log 1)
            raw[p + "ssm_a"] = -np.exp(rng.uniform(np.log(0.2), 0.0, v_heads)).astype(np.float32)
        else:
            shapes.update({p + "attn_q.weight": (2 * q_dim, dim), p + "attn_k.weight": (kv_dim, dim),
                           p + "attn_v.weight": (kv_dim, dim), p + "attn_output.weight": (dim, q_dim),
                           p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)})
        if moe:
            shapes.update({p + "ffn_gate_inp.weight": (experts, dim),
                           p + "ffn_gate_exps.weight": (experts, expert_ffn, dim),
                           p + "ffn_up_exps.weight": (experts, expert_ffn, dim),
                           p + "ffn_down_exps.weight": (experts, dim, expert_ffn),
                           p + "ffn_gate_inp_shexp.weight": (dim,), p + "ffn_gate_shexp.weight": (shared_ffn, dim),
                           p + "ffn_up_shexp.weight": (shared_ffn, dim), p + "ffn_down_shexp.weight": (dim, shared_ffn)})
        else:
            shapes.update({p + "ffn_gate.weight": (ffn, dim), p + "ffn_up.weight": (ffn, dim),
                           p + "ffn_down.weight": (dim, ffn)})
        if l >= layers:
            shapes.update({p + "nextn.eh_proj.weight": (dim, 2 * dim), p + "nextn.enorm.weight": (dim,),
                           p + "nextn.hnorm.weight": (dim,)})
    scales = {name: router_scale for name in shapes if name.endswith("ffn_gate_inp.weight")}
    override = {name: (value, gguf.GGMLQuantizationType.F32) for name, value in raw.items()}
    _add_tensors(w, shapes, rng, matrix_type, override, scales=scales, keep_f32=("ssm_conv1d.weight",))
    return _finish(w, path)


HYBRID_GOLDEN = Path(__file__).parent / "data" / "hybrid_golden.json"


def write_golden_hybrid(folder: Path, arch: str) -> Path:
    """The tiny hybrid GGUF of `arch` whose llama.cpp logits tests/data/hybrid_golden.npz holds, checked byte for
    byte against the sha256 recorded when they were made."""
    import hashlib

    model = json.loads(HYBRID_GOLDEN.read_text())["models"][arch]
    path = write_tiny_hybrid(folder / f"{arch}.gguf", arch, seed=model["seed"], interval=model["interval"],
                             router_scale=model["router_scale"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model["sha256"], (
        "tiny_gguf.write_tiny_hybrid no longer writes the file the golden data was made from: run "
        "tests/data/make_hybrid_golden.py again")
    return path
