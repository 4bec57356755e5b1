"""A session: one sequence's KV cache and the forward calls that feed it, on a model's engine."""
from __future__ import annotations

import numpy as np

from ..common import ops
from ..common.errors import ConfigError, ContextLengthError
from ..common.snapkv_settings import SnapKVSettings, layer_budgets
from .engine import Engine
from .kv_cache import PoolExhaustedError, SequenceCache
from .scorers import ContextScorer


class Session:
    """prefill(ids) -> logits of the last token; decode(token) -> logits of that token.

    With a SnapKV budget, a fresh prefill of more than `budget` (and `window`) tokens is followed by eviction:
    the last window of queries scores every prompt position, the keep sets are selected, and the cache is
    compacted to `budget` slots per layer and KV head. A continuation prefill never evicts.

    Threads: sessions of one model may be driven from different threads. Every call that runs the model or
    touches the page pool (a forward, eviction, compaction, fork, close) holds the engine's lock, because the VM
    and the pool are not thread-safe; so forwards of different sessions run one at a time, interleaved at forward
    (prefill chunk or decode step) granularity. One session is used by one thread at a time."""

    def __init__(self, engine: Engine, snapkv: SnapKVSettings | None = None, budget: int = 0,
                 cache: SequenceCache | None = None, scorer: ContextScorer | None = None):
        """A new sequence on `engine` (or one continuing `cache`, which fork() copied); `snapkv` the resolved
        settings and `budget` the effective budget (Engine.resolve_snapkv); `scorer` ranks the prompt's
        positions after its prefill (sharpi.runtime.scorers; None: SnapKV's last-window queries, inside it)."""
        self._engine = engine
        self.scorer = scorer
        self._cache = cache if cache is not None else engine.new_cache()
        self.snapkv = snapkv or SnapKVSettings()
        self.snapkv_budget = budget
        self.evicted = False
        self._scores = None           # SnapKV scores of the fresh prompt, kept for evict()
        self._scored_length = 0       # the tokens those scores cover
        self._adopted = 0             # prompt tokens taken from other sequences' pages (adopt_prefix)
        self._before_verify = None    # the cache's tail pages before the last verify(), for rollback()
        self._closed = False

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def kv_length(self) -> list[int]:
        return list(self._cache.length)

    @property
    def logical_length(self) -> int:
        return self._cache.logical_length

    @property
    def kv_bytes(self) -> int:
        return self._cache.kv_bytes

    @property
    def kept_positions(self) -> list[np.ndarray]:
        """Per layer: int array [kv_heads, length[l]], the logical position each held slot came from."""
        return [p.copy() for p in self._cache.positions]

    @property
    def context_left(self) -> int:
        """Tokens that can still be fed: bounded by the slots left and by the logical positions left (RoPE
        positions never go past the context, even when eviction freed slots)."""
        cache = self._cache
        return min(cache.capacity - max(cache.length), cache.capacity - cache.logical_length)

    # -- feeding tokens ---------------------------------------------------------------------------------------
    def prefill(self, ids, *, keep_scores: bool = False) -> np.ndarray:
        """Feed a prompt (or a continuation of the conversation); returns float32 [vocab] for its last token.

        A fresh prompt longer than the SnapKV budget and window is evicted (see the class doc). With
        keep_scores, a fresh prompt is scored but not evicted, so evict() can later apply any budget, e.g. on
        forks of this session (one prefill, many budgets)."""
        job = self.start_prefill(ids, keep_scores=keep_scores)
        while not job.step():
            pass
        return job.logits

    def start_prefill(self, ids, *, keep_scores: bool = False, on_fed=None, chunk: int | None = None) -> "PrefillJob":
        """The same prefill, fed one chunk per PrefillJob.step() (a server interleaves the chunks of several
        prompts with decode steps of running sequences, and checks cancellations between them). on_fed(), if
        given, runs once every token is in the cache, before any eviction (a prefix cache indexes the whole prompt
        then). chunk: tokens a step, at most the artifact's prefill chunk (the default)."""
        return PrefillJob(self, self._check_ids(ids), keep_scores, on_fed, chunk)

    def adopt_prefix(self, pages: list[list[int]], tokens: int, state: int | None = None) -> None:
        """Start this new session from `tokens` tokens whose keys and values other sequences computed (`pages`
        per layer: full pages, shared until written; a hybrid model's recurrent state after them in slot
        `state`). The prompt that follows is still this session's first: a prefill of the rest scores and evicts
        the whole prompt as a fresh one would."""
        self._check_open()
        with self._engine.lock:
            self._cache.adopt(pages, tokens, state)
        self._adopted = tokens

    @property
    def fresh(self) -> bool:
        """Whether the next prefill is this session's first prompt (nothing fed beyond an adopted prefix)."""
        return self._cache.logical_length == self._adopted and not self.evicted

    @property
    def cache(self) -> SequenceCache:
        """The session's pages and their bookkeeping (the server's prefix cache reads and shares them)."""
        return self._cache

    def evicts(self, n: int) -> bool:
        """Whether a first prompt of n tokens (an adopted prefix included) is compressed after its prefill."""
        return self._should_evict(n, self.snapkv_budget)

    def _should_evict(self, n: int, budget: int) -> bool:
        return bool(budget) and n > budget and n > self.snapkv.window

    def evict(self, budget: int | None = None, **knobs) -> bool:
        """Select and compact with the scores of this session's prompt (budget, recency, pooling, kernel,
        granularity, sinks may differ from the session's); returns whether anything was evicted."""
        scores = self._scores
        if scores is None:
            raise ConfigError("evict() needs the scores of a fresh prefill: prefill(ids, keep_scores=True) first.")
        if knobs.get("window") not in (None, self.snapkv.window):
            raise ConfigError("evict() cannot change the window: the prompt was scored at prefill with window "
                              f"{self.snapkv.window}.")
        if budget is None and not knobs:
            settings, budget = self.snapkv, self.snapkv_budget
        else:
            settings, budget = self._engine.resolve_snapkv(budget=budget, **knobs)
        cache = self._cache
        total = cache.logical_length
        if total != self._scored_length:
            raise ConfigError(f"evict() applies to the prompt as it was scored ({self._scored_length} tokens), and "
                              f"this session has been fed {total - self._scored_length} more since: evict first, "
                              f"or on a fork made right after the prefill.")
        full = all(cache.length[l] == total for l in range(cache.n_layers) if not cache.is_local(l))
        if self.evicted or not self._should_evict(total, budget) or not full:
            return False
        # The rule for sliding-window layers: they keep their last window (they hold nothing else), so only
        # the global layers get keep sets; the local layers' scores are not used.
        global_layers = [l for l in range(cache.n_layers) if not cache.is_local(l)]
        ranked = None
        if settings.allocation == "scores":
            host = scores if isinstance(scores, np.ndarray) else self._engine.backend.to_host(scores)
            ranked = host[global_layers, :, :total]
        budgets = dict(zip(global_layers, layer_budgets(budget, len(global_layers), settings, ranked)))
        with self._engine.lock:
            rows: list[np.ndarray | None] = [None] * cache.n_layers
            # One select per distinct budget (one when uniform); a layer whose budget holds the whole prompt is
            # left as it is.
            for b in sorted({b for b in budgets.values() if b < total}):
                params = np.array(ops.select_params(total, b, settings, self._engine.select_params), np.int32)
                keep, keep_numpy = self._engine.select(scores, params)
                for l, layer_budget in budgets.items():
                    if layer_budget == b:
                        rows[l] = keep_numpy[l, :, :b].astype(np.int64)
            if settings.allocation == "uniform":
                self._compact_on_device(keep, rows)         # the select's own table, already on the device
            else:
                self._compact_rows(rows)
        self.evicted = True
        return True

    def cached_keys(self) -> list[np.ndarray | None]:
        """Per layer the keys it holds, [kv_heads, length, head_dim] as float32 (RoPE'd, as stored, quantized
        ones dequantized); None for sliding-window layers (SnapKV leaves them alone)."""
        self._check_open()
        cache, keys = self._cache, []
        for layer in range(cache.n_layers):
            if cache.is_local(layer) or not cache.pages[layer]:
                keys.append(None)
                continue
            data = cache.pool.kv_format.decode(cache.pool.read_pages(cache.pages[layer]), 0)   # [pages, kvh, page, d]
            slots = data.transpose(1, 0, 2, 3).reshape(data.shape[1], -1, data.shape[3])
            keys.append(slots[:, :cache.length[layer]])
            if self._engine.key_offsets is not None:     # stored minus it (common.kv_format.KEY_OFFSET)
                keys[-1] = keys[-1] + self._engine.key_offsets[layer][:, None, :]
        return keys

    def rescore(self, scorer: ContextScorer, ids) -> None:
        """Rank this session's fresh prompt again, by `scorer` (Model.scorer), so that evict() keeps what it
        ranks first: one prefill, several scorers (each on a fork). `ids` are the prompt as it was prefilled; the
        cache is left exactly as it was (a scorer works on forks of it)."""
        self._check_open()
        ids = np.asarray(ids)
        if self._scores is None or self.evicted or self._adopted or \
                not len(ids) == self._scored_length == self._cache.logical_length:
            raise ConfigError("rescore() needs a session right after prefill(ids, keep_scores=True) of these ids "
                              "(whole, not evicted, nothing fed since).")
        self._scores = scorer.scores(self, ids)
        self.scorer = scorer

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; returns its logits, float32 [vocab]."""
        ids = self._check_ids([token])
        return self._forward("decode", ids)[0]

    def verify(self, ids) -> np.ndarray:
        """Feed a few tokens at once (speculative decoding's check of drafted ones) and return the logits of every
        one, float32 [len(ids), vocab]: row i is what decode(ids[i]) would return after ids[:i]. rollback(n)
        then forgets the last n of them. One token is a decode step; more are one prefill chunk at most."""
        ids = self._check_ids(ids)
        if self.fresh:
            raise ConfigError("verify() continues a sequence; prefill its prompt first.")
        if len(ids) > self._engine.prefill_chunk:
            raise ConfigError(f"verify() takes at most one prefill chunk ({self._engine.prefill_chunk} tokens), "
                              f"got {len(ids)}.")
        cache = self._cache
        with self._engine.lock:
            cache.slack = max(cache.slack, len(ids))     # sliding-window layers keep what a rollback needs
            before = cache.tail_snapshot()
        logits = self._forward("decode" if len(ids) == 1 else "prefill_logits", ids)
        self._before_verify = before
        return logits

    def rollback(self, n: int) -> None:
        """Forget the last n tokens fed (rejected drafts): their slots and the pages that held only them go back,
        and the next token takes the first one's position. Right after verify() the cache is as if only the kept
        tokens had been verified; otherwise as truncated (SequenceCache.truncate). n may reach back to the last
        compaction, and in a sliding-window layer to the last verify's length."""
        self._check_open()
        with self._engine.lock:
            self._cache.truncate(n, self._before_verify)
        self._before_verify = None

    def score_continuation(self, ids, window: int) -> np.ndarray:
        """The score op's scores [layers, kv_heads, slots] of every slot held after `ids` are fed on a fork of
        this session (closed again: this session is untouched), scored by the last |window| of them (summed, or
        with a negative window their maximum, where the artifact has it: Engine.score_max)."""
        ids = self._check_ids(ids)
        if len(ids) > self._engine.prefill_chunk or not 0 < abs(window) <= len(ids):
            raise ConfigError(f"A scored continuation is one prefill chunk ({self._engine.prefill_chunk} tokens) "
                              f"with a window of 1 to its length (negative: the maximum over those queries); "
                              f"got {len(ids)} tokens, window {window}.")
        with self.fork() as fork:
            _, scores = fork._forward("prefill_snapkv", ids, extra=(np.array([window], np.int32),))
            return self._engine.backend.to_host(scores)

    def score_logits(self, ids) -> np.ndarray:
        """Logits of every fed token, float32 [len(ids), vocab] (teacher forcing)."""
        ids = self._check_ids(ids)
        return np.concatenate([self._forward("prefill_logits", chunk) for chunk in self._chunks(ids)])

    def compact(self, keep) -> None:
        """Keep only the listed slots: one list, or per layer one list or one [kv_heads, k] array. The freed
        pages return to the pool at once; raises KeepSetError for a list that is too long, out of range or not
        strictly increasing."""
        self._check_open()
        rows = self._cache.keep_rows(keep)
        with self._engine.lock:
            self._compact_rows(rows)

    def _compact_rows(self, rows: list[np.ndarray | None]) -> None:
        if self._engine.has("snapkv_compact"):
            cache = self._cache
            keep_table = np.zeros((cache.n_layers, cache.kv_heads, cache.capacity), np.int32)
            for layer, r in enumerate(rows):
                if r is not None:
                    keep_table[layer, :, :r.shape[1]] = r
            self._compact_on_device(keep_table, rows)
        else:                 # an artifact without the SnapKV ops: moved through host memory
            for layer, r in enumerate(rows):
                if r is not None:
                    self._cache.own_pages(layer, len(self._cache.pages[layer]))
            self._cache.move_slots(rows)
            self._cache.record_compaction(rows)

    def _compact_on_device(self, keep, rows: list[np.ndarray | None]) -> None:
        """Gather keep[l, h, :count[l]] to the front with the compiled snapkv_compact (count 0 for layers left
        alone: rows[l] None), then the bookkeeping."""
        counts = np.array([0 if r is None else r.shape[1] for r in rows], np.int32)
        for layer, count in enumerate(counts):     # the pages the gather writes: this sequence's alone first
            if count:
                self._cache.own_pages(layer, -(-int(count) // self._cache.pool.page_size))
        self._engine.compact(self._cache, keep, counts)
        self._cache.record_compaction(rows)

    def fork(self) -> "Session":
        """An independent copy of this session: one prefill, many continuations. The copy shares the pages until
        either side writes one (copy-on-write), so a fork costs at most a page a layer."""
        self._check_open()
        with self._engine.lock:
            other = Session(self._engine, self.snapkv, self.snapkv_budget, cache=self._cache.fork(),
                            scorer=self.scorer)
        other.evicted, other._scores, other._scored_length = self.evicted, self._scores, self._scored_length
        return other

    def close(self) -> None:
        """Return all pages to the pool. The session cannot be used afterwards."""
        if not self._closed:
            with self._engine.lock:
                self._cache.release()
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- internals -------------------------------------------------------------------------------------------
    def _chunks(self, ids: np.ndarray):
        step = self._engine.prefill_chunk
        for start in range(0, len(ids), step):
            yield ids[start:start + step]

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("This session was closed; start a new one with model.session().")

    def _check_ids(self, ids) -> np.ndarray:
        self._check_open()
        array = np.asarray(ids)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ConfigError("Token ids must be a non-empty 1-D sequence of integers.")
        vocab = self._engine.config.vocab_size
        if array.min() < 0 or array.max() >= vocab:
            raise ConfigError(f"Token ids must be in [0, {vocab}).")
        if len(array) > self.context_left:
            raise ContextLengthError(f"{len(array)} tokens do not fit: the context holds {self._cache.capacity} "
                                     f"and {self.context_left} slots are left.")
        return array.astype(np.int32)

    def _forward(self, function: str, ids: np.ndarray, extra: tuple = ()):
        self._before_verify = None
        return self._engine.forward(function, ids, self._cache, extra)


class PrefillJob:
    """One prefill, chunk by chunk: step() feeds the next chunk and returns True once the prompt is all fed; then
    .logits holds its last token's logits, and a fresh prompt over the SnapKV budget has been evicted.

    The chunks are `chunk` tokens (the artifact's prefill chunk unless given; it may change between steps); a
    scored prompt's last chunk holds the whole scoring window (prefill_snapkv scores every held position with
    those queries). A fresh prompt whose chunk finds the pool full leaves the session empty, as it was."""

    def __init__(self, session: Session, ids: np.ndarray, keep_scores: bool, on_fed=None, chunk: int | None = None):
        self.session, self.ids, self.on_fed = session, ids, on_fed
        # a position (of the sequence) a chunk must end at, and what to call there: a hybrid's server keeps the
        # recurrent state at the prompt's last full page
        self.boundary: int | None = None
        self.on_boundary = None
        self.fresh = session.fresh
        total = session.logical_length + len(ids)
        self.evict = self.fresh and session._should_evict(total, session.snapkv_budget)
        scored = self.evict or (keep_scores and self.fresh)
        if scored and not session._engine.has("prefill_snapkv"):
            raise ConfigError("This artifact was compiled with --snapkv off; recompile with --snapkv on to score.")
        # a scorer of its own runs after the prefill, over the whole prompt (which it must then have been given)
        self.rescore = scored and session.scorer is not None
        if self.rescore and session._adopted:
            raise ConfigError(f"The {session.scorer.name} scorer needs the whole prompt; this session starts from "
                              f"an adopted prefix.")
        self.window = min(session.snapkv.window, total) if scored and not self.rescore else 0
        if self.window > len(ids):
            raise ConfigError(f"Scoring a prompt needs its last {self.window} tokens computed here; only "
                              f"{len(ids)} follow the adopted prefix.")
        self.chunk = session._engine.prefill_chunk if chunk is None else chunk
        self._fed = 0                 # tokens of ids fed so far
        self.logits: np.ndarray | None = None

    @property
    def chunk(self) -> int:
        """The tokens a step feeds (the last, scored step at least the window); may change between steps (a
        server sizes each step's share of prefill by what it costs)."""
        return self._chunk

    @chunk.setter
    def chunk(self, tokens: int) -> None:
        self._chunk = max(1, min(int(tokens), self.session._engine.prefill_chunk))

    def _next(self) -> tuple[int, int, bool]:
        """(start, end, scored) of the next step: chunks of `chunk` tokens, and for a scored prompt a last one
        holding at least the window (the tokens before it leave it that many)."""
        start, n = self._fed, len(self.ids)
        rest = n - start
        cut = n if self.boundary is None else self.boundary - (self.session.logical_length - start)
        if start < cut < n and cut <= n - self.window:
            n, rest = cut, cut - start                # the part up to the boundary: never the scored chunk
            return start, start + min(self.chunk, rest), False
        if not self.window:
            return start, start + min(self.chunk, rest), False
        if rest <= max(self.chunk, self.window):
            return start, n, True
        return start, start + min(self.chunk, rest - self.window), False

    @property
    def done(self) -> bool:
        return self._fed == len(self.ids)

    @property
    def next_tokens(self) -> int:
        """The tokens the next step() feeds."""
        start, end, _ = self._next()
        return end - start

    def next_plain(self) -> np.ndarray | None:
        """The next chunk's ids where another forward may feed them (a server's decode step, with its running
        sequences' tokens): not the scored chunk nor the prompt's last, which finish the job in step() (its
        logits, scoring, eviction); None where the next chunk is one of those. fed_elsewhere() records them."""
        start, end, scored = self._next()
        if scored or end == len(self.ids):
            return None
        return self.ids[start:end]

    def fed_elsewhere(self, n: int) -> None:
        self._fed += n
        self._at_boundary()

    def _at_boundary(self) -> None:
        if self.on_boundary is not None and self.session.logical_length == self.boundary:
            self.on_boundary()

    def pages_needed(self) -> int:
        """The pages the next step() takes from the pool."""
        return self.session._cache.pages_needed(self.next_tokens)

    def step(self) -> bool:
        if self.done:
            return True
        session = self.session
        start, end, scored = self._next()
        try:
            if scored:
                session._scored_length = session.logical_length + end - start
                out, session._scores = session._forward("prefill_snapkv", self.ids[start:end],
                                                        extra=(np.array([self.window], np.int32),))
            else:
                out = session._forward("prefill", self.ids[start:end])
        except PoolExhaustedError:
            if self.fresh:
                with session._engine.lock:
                    session._cache.release()
                session._adopted = 0
            raise
        self._fed = end
        self._at_boundary()
        if self.done:
            self.logits = out[-1]
            if self.on_fed is not None:
                self.on_fed()
            if self.rescore:
                session._scores = session.scorer.scores(session, self.ids)
                session._scored_length = session.logical_length
            if self.evict:
                session.evict()
        return self.done


def decode_batch(sessions: list[Session], tokens) -> np.ndarray:
    """Feed one token to each of several sessions of one model at once (one decode_batch call: the weights are
    read once for all of them); returns their logits, float32 [len(sessions), vocab], row i for sessions[i]."""
    if not sessions:
        return np.zeros((0, 0), np.float32)
    engine = sessions[0]._engine
    if any(s._engine is not engine for s in sessions):
        raise ConfigError("decode_batch takes sessions of one model.")
    if len({id(s) for s in sessions}) != len(sessions):
        raise ConfigError("decode_batch takes each session once.")
    ids = np.concatenate([s._check_ids([t]) for s, t in zip(sessions, tokens, strict=True)])
    for s in sessions:
        s._before_verify = None
    return engine.forward_batch(ids, [s._cache for s in sessions])


def feed_batch(sessions: list[Session], ids) -> list[np.ndarray]:
    """Feed each of several sessions of one model its own tokens, any count, in one decode_batch call (an entry a
    token: Engine.forward_ragged): a server's decode step, each sequence's token and the drafts it verifies, and a
    prompt's chunk being prefilled beside them. The logits of every token per session; rollback() then applies
    to each as after a verify(). One token each is the decode step (decode_batch); where the artifact lacks
    decode_batch or its keys are page-scaled (a page of those is encoded whole, not by an entry), each session
    is verified on its own (Session.verify: not for a prompt being prefilled)."""
    engine = sessions[0]._engine
    if any(s._engine is not engine for s in sessions) or len({id(s) for s in sessions}) != len(sessions):
        raise ConfigError("feed_batch takes sessions of one model, each once.")
    if all(len(t) == 1 for t in ids):      # one decode each below batch_from
        return list(decode_batch(sessions, [t[0] for t in ids])[:, None])
    if not engine.has("decode_batch") or engine.pool.kv_format.page_scaled_keys:
        return [s.verify(t) for s, t in zip(sessions, ids, strict=True)]
    checked = [s._check_ids(t) for s, t in zip(sessions, ids, strict=True)]
    for s, tokens in zip(sessions, checked):
        s._before_verify = None
        s._cache.slack = max(s._cache.slack, len(tokens))     # a rollback of drafts finds the windows' slots
    return engine.forward_ragged(checked, [s._cache for s in sessions])
