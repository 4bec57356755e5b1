"""The loaded model: the tokenizer and the engine (backend, page pool); scoring and generation on sessions."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..common.chat import render_chat
from ..common.chat_sampling import chat_defaults
from ..common.errors import ConfigError, ContextLengthError
from ..common.manifest import Manifest
from ..common.settings import MAX_COUNT, parse_int, parse_positive_int, resolve_threads
from ..common.snapkv_settings import PREFIX, SnapKVSettings, knobs_from_keywords
from ..common.speculative_settings import SpeculativeSettings, check_model_can_speculate, speculative_settings
from ..common.targets import target_spec
from ..common.tokenizer import token_ids
from .backend import Backend
from .engine import Engine
from .loader import key_offsets
from .model_info import ModelInfo
from .sampling import Sampler, SamplingParams
from .scorers import (ANCHOR, CONTINUE_PROMPT, PROBE_PROMPT, REPEAT_PROMPT, SCORERS, ContextScorer,
                      HybridScorer, KeyDiffScorer, KVzipScorer, ProbeScorer)
from .session import Session
from .speculative import Stepper, check_draft_model, make_drafter
from .text_output import TextOutput, stop_strings
from .tvm_backend import TVMBackend
from .vulkan import VulkanBackend

MAX_POOL_SEQUENCES = 4096
MAX_POOL_TOKENS = 2**26


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                      # "stop" (EOS or a stop string) or "length"
    stats: dict = field(default_factory=dict)


class Model:
    def __init__(self, directory: str | Path, *, threads: int | None = None, verify: bool = True,
                 pool_sequences: int = 4, adapter: str | None = None, expect_sha256: str | None = None,
                 pool_tokens: int | None = None, state_snapshots: int = 0, lock_weights: bool = False):
        """Load an artifact. threads: CPU threads (llvm); adapter: part of the Vulkan adapter's name to use
        (default: the highest-performance one, or $SHARPI_VULKAN_ADAPTER). verify: check every file's sha256
        (and the manifest's digest) before loading; without it, the manifest is still checked in full.
        expect_sha256: the sha256 of the manifest file (sharpi.artifact_sha256; sharpi-compile prints it) that
        this artifact must have: an artifact is code (its kernel library is loaded into this process), so pin
        one you did not build yourself; every file is then verified, whatever `verify` says, before any of it
        is loaded. The KV page pool holds pool_sequences full-context sequences, or pool_tokens slots in every
        layer when given (what sequences of any lengths share: a server's pool); a hybrid model (Gated DeltaNet
        layers) runs at most pool_sequences sequences at once (its recurrent-state slots), and keeps up to
        state_snapshots copies of a state besides (a server's prefix cache: runtime.prefix_cache). lock_weights (CPU
        artifacts): read the weights in at load and lock them in memory (llama.cpp's --mlock), so that no page
        of them is dropped and read from disk again mid-generation; a SharpiWarning where the system refuses."""
        self.path = Path(directory)
        for flag, value in (("verify", verify), ("lock_weights", lock_weights)):
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be True or False, got {value!r}.")
        verify = verify or expect_sha256 is not None
        self.threads = resolve_threads(threads)
        pool_sequences = parse_positive_int(pool_sequences, "pool_sequences", highest=MAX_POOL_SEQUENCES)
        if pool_tokens is not None:
            pool_tokens = parse_positive_int(pool_tokens, "pool_tokens", highest=MAX_POOL_TOKENS)
        state_snapshots = parse_positive_int(state_snapshots, "state_snapshots", allow_zero=True,
                                             highest=MAX_POOL_SEQUENCES)
        manifest = Manifest.read(self.path, verify_digest=verify, expect_sha256=expect_sha256)
        backend = open_backend(self.path, manifest, threads=self.threads, verify=verify, adapter=adapter,
                               lock_weights=lock_weights)
        self.info = ModelInfo(self.path, manifest)
        self.config, self.tokenizer = self.info.config, self.info.tokenizer
        self.engine = Engine(backend, manifest, self.config, pool_sequences, pool_tokens, state_snapshots,
                             key_offsets=key_offsets(self.path, manifest, self.config.n_layers,
                                                     (self.config.n_kv_heads, self.config.head_dim)))
        self._drafts: dict[Path, Model] = {}     # draft models loaded for speculative decoding, by directory

    @property
    def backend(self) -> str:
        """Where this model runs, in words: the CPU and threads, or the Vulkan adapter."""
        return self.engine.backend.description

    # -- public API -------------------------------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.engine.manifest.max_context

    @property
    def manifest(self) -> Manifest:
        return self.engine.manifest

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False,
                 limit: int | None = None) -> list[int]:
        """Text to ids (sharpi.common.tokenizer.Tokenizer.tokenize: limit refuses a text of more ids)."""
        return self.info.tokenize(text, add_bos=add_bos, special=special, limit=limit)

    def detokenize(self, ids, special: bool = True) -> str:
        return self.info.detokenize(ids, special=special)

    def session(self, *, snapkv: SnapKVSettings | None = None, compress: str | None = None,
                **snapkv_knobs) -> Session:
        """A new sequence. SnapKV: the snapkv_* knobs (snapkv_budget, snapkv_window, snapkv_recency,
        snapkv_pooling, snapkv_kernel, snapkv_granularity, snapkv_sinks, snapkv_allocation: argument >
        SHARPI_SNAPKV_* env > the artifact's defaults; budget None means auto (off on CPU), 0 off; sinks: the first
        positions always kept; allocation uniform or pyramid over the layers; a budget too small for the default
        recency shrinks the recency to half the budget, with a SharpiNote, while a recency given that does not fit
        is a ConfigError), or `snapkv`, SnapKVSettings made once (the CLI's way). `compress` (else
        SHARPI_COMPRESS, else "snapkv") picks what ranks the prompt's positions: "snapkv" (its last window of
        queries), or for questions asked after the compression "kvzip"
        (how much the model needs each to repeat the context), "probe" (a generic instruction's queries),
        "keydiff" (how unlike the mean key each key is: no pass at all) or "hybrid" (the better of the probe's and
        keydiff's ranks); every knob applies to each."""
        settings, budget = self._resolve_snapkv(snapkv, snapkv_knobs)
        return Session(self.engine, settings, budget, scorer=self.scorer(compress))

    def scorer(self, compress: str | None = None) -> ContextScorer | None:
        """The scorer `compress` names (None: SHARPI_COMPRESS, else snapkv), for Session.rescore; None for
        snapkv, whose scores come from the prefill itself."""
        source = "compress" if compress is not None else "SHARPI_COMPRESS"
        given = compress if compress is not None else os.environ.get("SHARPI_COMPRESS", "snapkv")
        name = given.strip().lower() if isinstance(given, str) else None
        if name not in SCORERS:
            raise ConfigError(f"{source} must be one of {', '.join(SCORERS)}, got {given!r}.")
        if name == "snapkv":
            return None
        window = int((self.manifest.snapkv or {}).get("max_window", 0))
        if not window:
            raise ConfigError("This artifact was compiled with --snapkv off; recompile with --snapkv on to score.")
        if name == "keydiff":
            return KeyDiffScorer(self.max_context)
        probe = ProbeScorer(self.tokenize(PROBE_PROMPT, add_bos=False)[:window])
        if name == "probe":
            return probe
        if name == "hybrid":
            return HybridScorer(probe, KeyDiffScorer(self.max_context))
        repeat = self.tokenize(REPEAT_PROMPT, add_bos=False)
        again = self.tokenize(CONTINUE_PROMPT, add_bos=False)
        longest = max(len(repeat), len(again) + ANCHOR)
        return KVzipScorer(repeat, again, min(window, self.engine.prefill_chunk - longest), self.engine.score_max)

    def snapkv_settings(self, **knobs) -> tuple[SnapKVSettings, int]:
        """The resolved SnapKV settings and effective budget (0 = no eviction) for these knobs (budget=...,
        window=..., ...: Engine.resolve_snapkv)."""
        return self.engine.resolve_snapkv(**knobs)

    def _resolve_snapkv(self, settings: SnapKVSettings | None, keywords: dict) -> tuple[SnapKVSettings, int]:
        knobs = knobs_from_keywords(keywords)
        if settings is not None:
            if not isinstance(settings, SnapKVSettings):
                raise ConfigError(f"snapkv must be a SnapKVSettings, got {type(settings).__name__}.")
            if knobs:
                raise ConfigError("Give the SnapKV settings as snapkv=... or as snapkv_* options, not both.")
            knobs = settings.to_dict()
        return self.engine.resolve_snapkv(**knobs)

    def score(self, ids) -> np.ndarray:
        """Teacher-forced logits, float32 [len(ids), vocab], of a fresh sequence."""
        with Session(self.engine) as s:
            return s.score_logits(ids)

    def generate(self, prompt, max_tokens: int = 64, **options) -> GenerationResult:
        """Generate from a prompt (text or ids). Options: temperature, top_k, top_p, min_p, repeat_penalty,
        seed (sampling); stop (strings); special (render special tokens); snapkv or the snapkv_* knobs, compress (as
        session()); speculative ("lookup": drafts copied from the prompt and output; "draft" with draft=DIR or a
        Model: a smaller model's; a dict or SpeculativeSettings for max_draft, ngram_min/max, adaptive) and
        draft. Speculation changes the speed only: greedy output is plain decoding's (on rounded caches and int8
        matmuls, wherever plain decoding's top two differ by more than the conformance tolerance), sampled output
        follows the same distribution."""
        generation = self.stream(prompt, max_tokens, **options)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt, max_tokens: int = 64, **options):
        """An iterator of text pieces as they are generated (same options as generate); once exhausted,
        its `.result` is the GenerationResult."""
        sampling = SamplingParams(**{k: options.pop(k) for k in list(options)
                                     if k in SamplingParams.__dataclass_fields__})
        stop, special, snapkv = options.pop("stop", None), options.pop("special", False), options.pop("snapkv", None)
        compress = options.pop("compress", None)
        draft = options.pop("draft", None)
        speculation = check_model_can_speculate(
            speculative_settings(options.pop("speculative", None), draft=draft is not None), self.config)
        knobs = {k: options.pop(k) for k in list(options) if k.startswith(PREFIX)}
        if options:
            raise ConfigError(f"Unknown option(s): {', '.join(sorted(options))}.")
        draft_model = self.draft_model(draft) if draft is not None else None
        session = self.session(snapkv=snapkv, compress=compress, **knobs)    # checks the knobs before any work
        return _Generation(self, session, prompt, max_tokens, sampling, stop, special, speculation, draft_model)

    def draft_model(self, draft) -> "Model":
        """A draft model for speculative decoding: a loaded Model, or an artifact's directory (loaded once, with
        this model's threads, and kept); a ConfigError unless its vocabulary is this model's."""
        if isinstance(draft, Model):
            model = draft
        elif isinstance(draft, (str, Path)):
            path = Path(draft).resolve()
            if path not in self._drafts:
                if not path.is_dir():
                    raise ConfigError(f"The draft model {draft} is not a directory (a compiled artifact).")
                self._drafts[path] = Model(path, threads=self.threads, pool_sequences=1)
            model = self._drafts[path]
        else:
            raise ConfigError(f"draft must be an artifact's directory or a loaded Model, got {type(draft).__name__}.")
        check_draft_model(self, model)
        return model

    def chat(self, messages, max_tokens: int = 256, **kwargs) -> GenerationResult:
        """Generate the assistant's reply to `messages` (OpenAI-style dicts), rendered by the GGUF's chat template;
        options as generate() (greedy unless given: `sampling_defaults` holds what `sharpi chat` samples with)."""
        return self.generate(self.chat_prompt(messages), max_tokens, **kwargs)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.info.chat_template)

    def chat_prompt(self, messages) -> list[int]:
        """The token ids of `messages` rendered by the chat template, ending where the assistant's turn starts."""
        info = self.tokenizer.info
        prompt = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token)
        return self.tokenize(prompt, special=True)

    @property
    def sampling_defaults(self) -> dict:
        """The sampling a chat starts from (temperature, top_k, top_p, min_p, repeat_penalty): the GGUF's
        recommendation where it has one, else llama.cpp's defaults (sharpi.common.chat_sampling)."""
        return chat_defaults(self.manifest.sampling)[0]


class _Generation:
    """The generation loop as an iterator of text pieces; `.result` holds the GenerationResult at the end."""

    def __init__(self, model: Model, session: Session, prompt, max_tokens, params, stop, special,
                 speculation: SpeculativeSettings | None = None, draft_model: Model | None = None):
        self.model, self.session = model, session
        self.speculation, self.draft_model = speculation or SpeculativeSettings(), draft_model
        self.max_tokens = parse_int(max_tokens, "max_tokens", 0, MAX_COUNT, text=False)
        self.sampler = Sampler(params)
        self.stop = stop_strings(stop)
        if not isinstance(special, bool):
            raise ConfigError(f"special must be True or False, got {special!r}.")
        self.special = special
        if isinstance(prompt, str):
            self.prompt_ids = model.tokenize(prompt)
        else:
            self.prompt_ids = token_ids(prompt, "The prompt (a str, or token ids)")
        if not self.prompt_ids:
            raise ConfigError("The prompt is empty.")
        if len(self.prompt_ids) > model.max_context:
            raise ContextLengthError(f"The prompt has {len(self.prompt_ids)} tokens, more than the context of "
                                     f"{model.max_context}.")
        self.result: GenerationResult | None = None

    def __iter__(self):
        model = self.model
        stop_ids = set(model.tokenizer.info.stop_ids)
        out: list[int] = []
        finish = "length"
        text = TextOutput(model.tokenizer, self.stop, self.special)
        with self.session as session:
            stepper = Stepper(session, self.sampler, self.speculation,
                              make_drafter(self.speculation, self.sampler.params, self.draft_model))
            t0 = time.perf_counter()
            logits = session.prefill(self.prompt_ids)
            t1 = time.perf_counter()
            kv_after_prefill = (session.kv_length, session.kv_bytes, session.evicted)
            pending = [self.sampler(logits, self.prompt_ids, out)] if self.max_tokens else []
            try:
                while pending:
                    token = pending.pop(0)
                    if token in stop_ids:
                        finish = "stop"
                        break
                    out.append(token)
                    piece = text.feed(token)
                    if piece:
                        yield piece
                    if text.stopped:
                        finish = "stop"
                        break
                    if len(out) >= self.max_tokens or (not pending and session.context_left == 0):
                        break
                    if not pending:           # the accepted drafts that follow `token` are fed already
                        pending = [t for t, _ in stepper.step(token, self.prompt_ids + out, out,
                                                              self.max_tokens - len(out))]
            finally:
                stepper.close()
            t2 = time.perf_counter()
        piece = text.finish()
        if piece:
            yield piece
        emitted = text.emitted
        n_decode = max(len(out) - 1, 0)
        self.result = GenerationResult(
            text=emitted, token_ids=out, finish_reason=finish,
            stats={"prompt_tokens": len(self.prompt_ids), "generated_tokens": len(out),
                   "prefill_s": t1 - t0, "decode_s": t2 - t1, "kv_slots_after_prefill": max(kv_after_prefill[0]),
                   "kv_bytes_after_prefill": kv_after_prefill[1], "evicted": kv_after_prefill[2],
                   "kv_slots_per_layer_after_prefill": kv_after_prefill[0],
                   "scorer": self.session.scorer.name if self.session.scorer is not None else "snapkv",
                   "snapkv_budget": self.session.snapkv_budget,
                   "prefill_tok_s": len(self.prompt_ids) / max(t1 - t0, 1e-9),
                   "speculative": self.speculation.method, **stepper.stats.to_dict(),
                   "decode_tok_s": n_decode / max(t2 - t1, 1e-9) if n_decode else 0.0})


def open_backend(path: Path, manifest: Manifest, *, threads: int, verify: bool, adapter: str | None,
                 lock_weights: bool = False) -> Backend:
    """The backend of the artifact's target's runtime (sharpi.common.targets): TVM's Relax VM, or the wgpu plan."""
    spec = target_spec(manifest.target["kind"])
    if lock_weights and spec.is_gpu:
        raise ConfigError(f"lock_weights (--mlock) applies to CPU artifacts; {path}'s weights live in the GPU's "
                          f"memory.")
    backend = RUNTIMES[spec.runtime]
    locked = {"lock_weights": True} if lock_weights else {}     # a CPU artifact's option: TVMBackend's alone
    return backend(path, manifest, threads=threads, verify=verify, adapter=adapter, **locked)


RUNTIMES = {"tvm-vm": TVMBackend, "wgpu-plan": VulkanBackend}
