"""The loaded model: tokenizer, weights, page pool, VM; scoring and generation on top of sessions."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..common.chat import render_chat
from ..common.config import ModelConfig
from ..common.errors import ArtifactError, ConfigError, ContextLengthError
from ..common.manifest import KV_ITEMSIZE, Manifest
from ..common.ops import SELECT_PARAMS, SELECT_PARAMS_BEFORE_SINKS
from ..common.settings import MAX_COUNT, parse_int, parse_positive_int, resolve_threads
from ..common.tokenizer import Tokenizer, TokenizerInfo, token_ids
from .kv_cache import PagePool
from .sampling import Sampler, SamplingParams
from .session import Session

MAX_POOL_SEQUENCES = 4096


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                      # "stop" (EOS or a stop string) or "length"
    stats: dict = field(default_factory=dict)


class Model:
    def __init__(self, directory: str | Path, *, threads: int | None = None, verify: bool = True,
                 pool_sequences: int = 4, adapter: str | None = None, expect_sha256: str | None = None):
        """Load an artifact. threads: CPU threads (llvm); adapter: part of the Vulkan adapter's name to use
        (default: the highest-performance one, or $SHARPI_VULKAN_ADAPTER). verify: check every file's sha256
        (and the manifest's digest) before loading; without it, the manifest is still checked in full.
        expect_sha256: the sha256 of the manifest file (sharpi.artifact_sha256; sharpi-compile prints it) that
        this artifact must have: an artifact is code (its kernel library is loaded into this process), so pin
        one you did not build yourself; every file is then verified, whatever `verify` says, before any of it
        is loaded."""
        self.path = Path(directory)
        if not isinstance(verify, bool):
            raise ConfigError(f"verify must be True or False, got {verify!r}.")
        verify = verify or expect_sha256 is not None
        self.threads = resolve_threads(threads)
        pool_sequences = parse_positive_int(pool_sequences, "pool_sequences", highest=MAX_POOL_SEQUENCES)
        self._manifest = Manifest.read(self.path, verify_digest=verify, expect_sha256=expect_sha256)
        self._backend = _open_backend(self.path, self._manifest, self.threads, verify, adapter)
        self.config = ModelConfig.from_dict(self._manifest.config)
        self.tokenizer = Tokenizer.load(self.path, TokenizerInfo.from_dict(self._manifest.tokenizer))
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ArtifactError(f"{self.path}/tokenizer.json has {self.tokenizer.vocab_size} tokens, more than the "
                                f"model's {self.config.vocab_size}; compile it again.")
        self._pool = self._make_pool(pool_sequences)
        # Sessions may run on several threads; the VM and the page pool are not thread-safe, so every forward
        # (and every pool change) holds this lock (see Session). Reentrant: eviction runs inside a prefill.
        self._lock = threading.RLock()
        # Tokenizing without special tokens flips a flag on the shared tokenizer for the call.
        self._tokenizer_lock = threading.Lock()

    def _make_pool(self, sequences: int) -> PagePool:
        """Room for `sequences` full-context sequences (sessions and forks share it), or as many pages as the
        backend can hold in one buffer (Vulkan's storage-binding limit) if that is less."""
        cfg, m = self.config, self._manifest
        page_bytes = KV_ITEMSIZE[m.kv_dtype] * 2 * cfg.n_kv_heads * m.page_size * cfg.head_dim
        pages = sequences * cfg.n_layers * m.max_pages
        shape = (pages, 2, cfg.n_kv_heads, m.page_size, cfg.head_dim)
        pages = self._backend.allocate_pool(shape, m.kv_dtype)
        return PagePool(self._backend, pages, m.page_size, page_bytes)

    @property
    def backend(self) -> str:
        """Where this model runs, in words: the CPU and threads, or the Vulkan adapter."""
        return self._backend.description

    @property
    def _weights(self):
        return self._backend.weights

    # -- public API -------------------------------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self._manifest.max_context

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        with self._tokenizer_lock:
            return self.tokenizer.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, ids, special: bool = True) -> str:
        return self.tokenizer.detokenize(ids, special=special)

    def session(self, *, snapkv_budget=None, snapkv_window=None, snapkv_recency=None, snapkv_pooling=None,
                snapkv_kernel=None, snapkv_granularity=None, snapkv_sinks=None) -> Session:
        """A new sequence. SnapKV knobs: argument > SHARPI_SNAPKV_* env > the artifact's defaults; budget None
        means auto (off on CPU), 0 off; sinks: the first positions always kept (0)."""
        settings, budget = self.snapkv_settings(budget=snapkv_budget, window=snapkv_window, recency=snapkv_recency,
                                                pooling=snapkv_pooling, kernel=snapkv_kernel,
                                                granularity=snapkv_granularity, sinks=snapkv_sinks)
        return Session(self, settings, budget)

    def snapkv_settings(self, **arguments):
        """The resolved SnapKV settings and effective budget (0 = no eviction) for these arguments."""
        from ..common.snapkv_settings import auto_budget, check_against, settings_from

        info = self._manifest.snapkv or {}
        settings = settings_from(info.get("defaults"), **arguments)
        budget = settings.budget
        if budget is None:
            full = self._pool.page_bytes * self.config.n_layers * self._manifest.max_pages   # one full sequence
            budget = auto_budget(self.max_context, full, self._manifest.target.get("kind", "llvm"))
        if budget and not info.get("enabled"):
            raise ConfigError("This artifact was compiled with --snapkv off; recompile with --snapkv on to evict.")
        check_against(settings, budget, info.get("max_window", settings.window))
        if budget and settings.sinks and self._select_params < SELECT_PARAMS:
            raise ArtifactError(f"{self.path} was compiled before SnapKV sinks existed (its snapkv_select takes "
                                f"{self._select_params} parameters); compile it again with this sharpi to use "
                                f"sinks {settings.sinks}.")
        return settings, budget

    @property
    def _select_params(self) -> int:
        """The length of the artifact's snapkv_select params (6 in artifacts compiled before sinks)."""
        return int((self._manifest.snapkv or {}).get("select_params", SELECT_PARAMS_BEFORE_SINKS))

    def score(self, ids) -> np.ndarray:
        """Teacher-forced logits, float32 [len(ids), vocab], of a fresh sequence."""
        with Session(self) as s:
            return s.score_logits(ids)

    def generate(self, prompt, max_tokens: int = 64, **options) -> GenerationResult:
        """Generate from a prompt (text or ids). Options: temperature, top_k, top_p, min_p, repeat_penalty,
        seed (sampling); stop (strings); special (render special tokens); snapkv_budget, snapkv_window,
        snapkv_recency, snapkv_pooling, snapkv_kernel, snapkv_granularity, snapkv_sinks (as session())."""
        generation = self.stream(prompt, max_tokens, **options)
        for _ in generation:
            pass
        return generation.result

    def stream(self, prompt, max_tokens: int = 64, **options):
        """An iterator of text pieces as they are generated (same options as generate); once exhausted,
        its `.result` is the GenerationResult."""
        sampling = SamplingParams(**{k: options.pop(k) for k in list(options)
                                     if k in SamplingParams.__dataclass_fields__})
        stop, special = options.pop("stop", None), options.pop("special", False)
        snapkv = {k: options.pop(k) for k in list(options) if k.startswith("snapkv_")}
        if options:
            raise ConfigError(f"Unknown option(s): {', '.join(sorted(options))}.")
        session = self.session(**snapkv)          # validates the SnapKV knobs before any work
        return _Generation(self, session, prompt, max_tokens, sampling, stop, special)

    def chat(self, messages, max_tokens: int = 256, **kwargs) -> GenerationResult:
        info = self.tokenizer.info
        prompt = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token)
        ids = self.tokenize(prompt, special=True)
        return self.generate(ids, max_tokens, **kwargs)


class _Generation:
    """The generation loop as an iterator of text pieces; `.result` holds the GenerationResult at the end."""

    def __init__(self, model: Model, session: Session, prompt, max_tokens, params, stop, special):
        self.model, self.session = model, session
        self.max_tokens = parse_int(max_tokens, "max_tokens", 0, MAX_COUNT, text=False)
        self.sampler = Sampler(params)
        self.stop = _stop_strings(stop)
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
        emitted = ""
        finish = "length"
        stream = model.tokenizer.stream(special=self.special)
        with self.session as session:
            t0 = time.perf_counter()
            logits = session.prefill(self.prompt_ids)
            t1 = time.perf_counter()
            kv_after_prefill = (max(session.kv_length), session.kv_bytes, session.evicted)
            while len(out) < self.max_tokens:
                token = self.sampler(logits, self.prompt_ids + out)
                if token in stop_ids:
                    finish = "stop"
                    break
                out.append(token)
                stream.step(token)
                text = stream.text
                cut = _find_stop(text, self.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    if len(text) > len(emitted):
                        yield text[len(emitted):]
                    emitted = text
                    break
                safe = _safe_prefix(text, self.stop)
                if len(safe) > len(emitted):
                    yield safe[len(emitted):]
                    emitted = safe
                if len(out) >= self.max_tokens or session.context_left == 0:
                    break
                logits = session.decode(token)
            t2 = time.perf_counter()
        if finish != "stop":
            text = model.detokenize(out, special=self.special)   # once; it also shows an unfinished character
            if len(text) > len(emitted):
                yield text[len(emitted):]
            emitted = text
        n_decode = max(len(out) - 1, 0)
        self.result = GenerationResult(
            text=emitted, token_ids=out, finish_reason=finish,
            stats={"prompt_tokens": len(self.prompt_ids), "generated_tokens": len(out),
                   "prefill_s": t1 - t0, "decode_s": t2 - t1, "kv_slots_after_prefill": kv_after_prefill[0],
                   "kv_bytes_after_prefill": kv_after_prefill[1], "evicted": kv_after_prefill[2],
                   "prefill_tok_s": len(self.prompt_ids) / max(t1 - t0, 1e-9),
                   "decode_tok_s": n_decode / max(t2 - t1, 1e-9) if n_decode else 0.0})


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    return list(stops)


def _open_backend(path: Path, manifest: Manifest, threads: int, verify: bool, adapter: str | None):
    kind = manifest.target.get("kind")
    if adapter is not None and kind != "vulkan":
        raise ConfigError(f"adapter applies to Vulkan artifacts only; {path} targets {kind}.")
    if kind in ("llvm", "cuda"):
        from .tvm_backend import TVMBackend
        return TVMBackend(path, manifest, threads, verify)
    if kind == "vulkan":
        from .vulkan import VulkanBackend
        return VulkanBackend(path, manifest, verify, adapter)
    raise ArtifactError(f"{path} targets {kind}, which this runtime cannot run yet.")


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: list[str]) -> str:
    """Text that can be shown now: hold back an incomplete UTF-8 character and any tail that could start a stop."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return text[:end]
