"""The serving engine: one scheduler thread owns the model and runs continuous batching over its page pool.

Each step:
1. cancelled requests leave and give their pages back;
2. one decode_batch call feeds every running sequence its last sampled token (the weights read once for all of
   them), and each samples its next token with its own settings; while few run (SPECULATIVE_BATCH), a sequence
   that asked for speculative decoding feeds the drafted tokens worth verifying after its token in the same call,
   each sequence its own count (sharpi.runtime.speculative); and a plain chunk of a prompt being prefilled goes
   in the same call too (every token an entry: session.feed_batch), so a step reads the weights once;
3. prefill chunks of admitted prompts, up to the step's budget: the token budget (the artifact's prefill chunk),
   and for a prompt longer than a chunk while fewer requests wait than sequences decode, also a cost: the tokens
   whose prefill takes about `prefill_share` decode steps (both times measured as the server runs), so a long
   prompt's admission slows running streams by a bounded factor rather than by its chunks' length (at least
   MIN_PREFILL tokens a step, so it always advances), while short prompts and bursts go at full speed;
   a prompt whose prefill ends is compressed at once when its SnapKV settings say so, and the admission of the
   next waiting request, right after, sees the pages it freed.

Memory: one pool for all sequences. A waiting request is admitted when its whole prompt fits in the free pages
(and those only the prefix cache holds) with one more page a layer for every running sequence to grow into.
When a step needs pages that are not there, the prefix cache gives back its least recently used blocks, and then
the most recently admitted sequence is preempted: its pages are freed and it waits at the head of the queue; when
readmitted it is recomputed (its prompt prefilled, and compressed, again; its generated tokens fed as a
continuation), its sampler and text carried over, so its output goes on exactly where it was. Recomputation was
chosen over swapping pages to host memory because on a CPU the pool already is host memory, and over refusing
the request because a client should never see a sequence dropped for another's sake. The prefix cache makes the
recomputation of a prompt cheap while its blocks survive.

The prefix cache (sharpi.runtime.prefix_cache) indexes the prompt's full pages when its prefill ends (before any
compression: the whole prompt is then in the cache) and the conversation's when it finishes; a new prompt adopts
the longest cached prefix, leaving at least its last token (and a SnapKV-compressed prompt its scoring window)
to compute. A compressed sequence, when it finishes, goes to the conversation cache
(sharpi.runtime.conversation_cache), which serves only a prompt that continues it exactly (a chat's next turn).
Such a prompt takes the prefix cache when that still holds the compressed prompt's full pages (the whole
conversation is then compressed again, scored by the new question's queries: the faithful path), else the
compressed continuation (only the new tokens computed, as `sharpi chat` does). Under pool pressure the prefix
cache's blocks go first (they are a whole prompt's pages; the compressed entries are a budget's), so the two
complement each other: with room the faithful path, when memory is tight the compressed one.

A request may ask for its prefix to be compressed by a query-agnostic scorer (GenerationRequest.compress: probe,
keydiff, hybrid or kvzip, sharpi.runtime.scorers): the prefix is prefilled and compressed alone, a fork of it goes
to the conversation cache under the prefix's exact tokens (its full pages, before the compression, to the prefix
cache, for requests that do not compress), and the rest of the prompt follows as a continuation. Such an entry was
chosen without any question, so it serves any later prompt that starts with those tokens (another question about
the same document) with the same scorer and settings; when the request finishes, its whole conversation is kept
too. The rule for a compress request: it goes on from the longest entry (same scorer, budget and SnapKV settings)
whose tokens its prompt starts with and that leaves a token to compute, computing only the tokens after it as a
continuation (which never evicts: a chat's next turn, whose prompt holds the compressed document, the earlier
questions and answers and the new message), unless more than `budget` tokens of the request's own prefix lie past
the part that entry compressed (its `prompt_tokens`); then, or with no such entry, the request's prefix is
prefilled and compressed afresh (turn 1). So a compressed chat's prefix holds at most about twice the budget a
layer, and its document is computed once until then. cached_tokens is the entry's token count (every token the
request did not compute, compressed or not).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..common.errors import ConfigError, ContextLengthError, ServerBusyError, SharpiError
from ..common.settings import parse_positive_int
from ..runtime.conversation_cache import ConversationCache
from ..runtime.engine import exponential_average
from ..runtime.kv_cache import PoolExhaustedError
from ..runtime.model import Model
from ..runtime.prefix_cache import PrefixCache
from ..runtime.sampling import Sampler, log_softmax, top_logprobs
from ..runtime.session import PrefillJob, Session, decode_batch, feed_batch
from ..runtime.speculative import Draft, PromptLookup, Stepper
from ..runtime.text_output import TextOutput
from .metrics import ServeMetrics
from .request import Event, GenerationRequest, RequestHandle, TokenLogprob
from .shares import compression_report


@dataclass(frozen=True)
class ServeSettings:
    parallel: int = 16                  # sequences prefilling or decoding at once (the decode batch's bound)
    max_queue: int = 256                # waiting requests before submit() refuses more
    prefill_budget: int | None = None   # prompt tokens a step computes (default: the artifact's prefill chunk)
    prefix_cache: bool = True           # and the conversation cache of compressed sequences
    # while sequences decode, a step's prefill takes about this many decode steps' time (None: the token budget
    # alone): a step then lasts about 1 + prefill_share decode steps (benchmarks/serve.md: 0.5 kept 4 streams'
    # p99 gap at 2.3x their p50 beside a 4,000-token prompt, whose first token came 3x later than without it)
    prefill_share: float | None = 0.5

    def validate(self) -> None:
        parse_positive_int(self.parallel, "parallel", highest=1024)
        if self.prefill_share is not None and not (isinstance(self.prefill_share, (int, float)) and
                                                   not isinstance(self.prefill_share, bool) and
                                                   0 < self.prefill_share <= 1000):
            raise ConfigError(f"prefill_share must be a number in (0, 1000], got {self.prefill_share!r}.")
        parse_positive_int(self.max_queue, "max_queue", allow_zero=True, highest=1 << 20)
        if self.prefill_budget is not None:
            parse_positive_int(self.prefill_budget, "prefill_budget", highest=1 << 20)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be True or False, got {self.prefix_cache!r}.")


class _Sequence:
    """A request inside the engine: its session while admitted, its generated tokens, sampler and text always."""

    def __init__(self, handle: RequestHandle, model: Model, order: int):
        request = handle.request
        self.handle, self.request, self.order = handle, request, order
        self.prompt = list(request.prompt_ids)
        self.sampler = Sampler(request.sampling)
        self.text = TextOutput(model.tokenizer, list(request.stop), request.special)
        self.out: list[int] = []
        self.session: Session | None = None
        self.jobs: list[tuple[str, PrefillJob | None, list[int]]] = []  # (kind, job once started, ids) to prefill
        self.pending: int | None = None        # sampled, not yet fed
        self.cached_tokens: int | None = None  # the prefix-cache hit of the first admission
        self.arrival = time.monotonic()
        self.last_token_at: float | None = None
        self.pages_before_eviction = 0
        self.compressed_prompt = 0             # the tokens its compression covers (a continuation's: the first's)
        self.finished = False
        spec = request.speculative
        self.drafter = PromptLookup(spec.ngram_min, spec.ngram_max) if spec.on else None
        self.stepper: Stepper | None = None    # the drafter's step on the current session

    def speculation(self) -> Stepper | None:
        """The sequence's speculative step on its current session (a new one after a preemption), or None."""
        if self.drafter is None:
            return None
        if self.stepper is None or self.stepper.session is not self.session:
            self.stepper = Stepper(self.session, self.sampler, self.request.speculative, self.drafter)
        return self.stepper


class ServeEngine:
    def __init__(self, model: Model, settings: ServeSettings = ServeSettings()):
        settings.validate()
        self.model, self.settings = model, settings
        self.engine = model.engine
        self.pool = self.engine.pool
        self.n_layers = model.config.kv_layers
        self.page_size = self.pool.page_size
        self.budget = settings.prefill_budget or self.engine.prefill_chunk
        self.metrics = ServeMetrics()
        states = self.engine.states
        if states is not None and states.slots < settings.parallel:
            raise ConfigError(f"This hybrid model was loaded with {states.slots} recurrent-state slots, fewer than "
                              f"the {settings.parallel} sequences the server runs at once; load it with "
                              f"pool_sequences={settings.parallel}.")
        # A hybrid model's prefix needs its recurrent state too: the prefix cache keeps snapshots in the state
        # slots beyond the running sequences'; its compressed conversations (sessions holding slots) are not kept
        self.prefix_cache = PrefixCache(self.pool, self.n_layers, states,
                                        states.slots - settings.parallel if states else 0) \
            if settings.prefix_cache else None
        self.conversations = ConversationCache(self.pool) if settings.prefix_cache and states is None else None
        if self.prefix_cache is not None:
            self.pool.reclaim = self._reclaim
        self.metrics.prefix_cache_pages.set_function(lambda: self.pool_summary()["cached"])    # at each scrape
        self.stop_ids = set(model.tokenizer.info.stop_ids)
        self._inbox: deque[_Sequence] = deque()
        self._waiting: list[_Sequence] = []    # by arrival order (preempted ones keep theirs: they go first)
        self._active: list[_Sequence] = []     # admitted (prefilling or running), by admission
        self._cv = threading.Condition()
        self._order = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self._call_seconds: deque[float] = deque(maxlen=64)    # the latest model calls' times (chunks, steps)
        self._decode_step_s: float | None = None       # a plain decode step's time lately
        self._mixed = False                            # this step's decode call carried a prompt's chunk
        self._mixed_token_s: float | None = None       # what a prompt token adds to a decode step, lately
        self._prefill_chunks: deque[tuple[int, float]] = deque(maxlen=32)   # the latest chunks' (tokens, seconds)

    # -- the client side (any thread) ---------------------------------------------------------------------------
    def start(self) -> "ServeEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sharpi-scheduler", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: GenerationRequest, on_event) -> RequestHandle:
        """Queue a request; its events go to on_event(Event) from the scheduler thread. Raises
        ContextLengthError for a prompt that cannot fit, ServerBusyError when the queue is full."""
        self._check_fits(request.prompt_ids)
        handle = RequestHandle(request, on_event)
        with self._cv:
            if self._stopping:
                raise ServerBusyError("The server is shutting down and takes no new requests.")
            if len(self._inbox) + len(self._waiting) >= self.settings.max_queue:
                self.metrics.requests.labels("refused").inc()
                raise ServerBusyError(f"The server is busy: {self.settings.max_queue} requests are already "
                                      f"waiting; try again later.")
            self._order += 1
            self._inbox.append(_Sequence(handle, self.model, self._order))
            self._cv.notify()
        return handle

    def wake(self) -> None:
        """Make the scheduler look at cancellations now."""
        with self._cv:
            self._cv.notify()

    def stop_intake(self) -> None:
        """Refuse new requests (ServerBusyError); those in flight go on."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def cancel_all(self) -> None:
        """Cancel every request in flight or waiting (each finishes with finish_reason "cancelled")."""
        with self._cv:
            for seq in [*self._inbox, *self._waiting, *self._active]:
                seq.handle.cancel()
            self._cv.notify()

    def shutdown(self, cancel: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; cancel the ones in flight (or, cancel=False, let them finish), stop the thread,
        and give every page back."""
        self.stop_intake()
        if cancel:
            self.cancel_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.prefix_cache is not None:
            with self.engine.lock:
                self.prefix_cache.clear()
                if self.conversations is not None:
                    self.conversations.clear()
                self.pool.reclaim = None
        self._update_gauges()

    def step_seconds(self) -> float:
        """The longest of the latest model calls (a prefill chunk or a decode step): how long a cancellation may
        wait for the call in flight to end."""
        return max(self._call_seconds, default=0.0)

    @property
    def idle(self) -> bool:
        with self._cv:
            return not (self._inbox or self._waiting or self._active)

    def pool_summary(self) -> dict:
        with self.engine.lock:
            summary = {"pages": self.pool.num_pages, "free": self.pool.free_count, "used": self.pool.used_count,
                       "cached": self._cached_pages()}
            if self.engine.states is not None:      # a hybrid's recurrent states: the sequences' and snapshots'
                summary["state_bytes"] = self.engine.states.used_count * self.engine.states.slot_bytes
            return summary

    def _cached_pages(self) -> int:
        """Pages the prefix and conversation caches hold (each page once)."""
        if self.prefix_cache is None:
            return 0
        cached = self.prefix_cache.page_set()
        return len(cached | self.conversations.page_set() if self.conversations is not None else cached)

    def _check_fits(self, ids: list[int]) -> None:
        context = self.model.max_context
        if not ids:
            raise ConfigError("The prompt is empty.")
        if len(ids) >= context:
            raise ContextLengthError(f"The prompt has {len(ids)} tokens; the context holds {context} (one more is "
                                     f"needed for the first generated token).")
        if self._peak_pages(len(ids)) + self.n_layers > self.pool.num_pages:
            raise ContextLengthError(f"The prompt has {len(ids)} tokens, more than the server's KV pool holds "
                                     f"({self.pool.num_pages // self.n_layers * self.page_size} tokens a layer); "
                                     f"start it with more --kv-memory.")

    def _peak_pages(self, tokens: int, held: int = 0) -> int:
        """Pages a prefill of `tokens` more tokens holds at most, on top of `held` tokens already held (a
        sliding-window layer holds about its window and a chunk)."""
        total = 0
        cfg = self.model.config
        for layer in range(self.n_layers):
            need = -(-(held + tokens) // self.page_size) - held // self.page_size
            if cfg.is_local(layer):
                need = min(need, -(-(cfg.sliding_window + self.budget) // self.page_size) + 1)
            total += need
        return total

    # -- the scheduler thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._waiting or self._active or self._stopping):
                        self._cv.wait()
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    if self._stopping and not (self._waiting or self._active):
                        return
                if not self._step():
                    with self._cv:                # nothing could run (the queue waits for pages): do not spin
                        self._cv.wait(0.01)
        except BaseException as error:  # noqa: BLE001 -- a bug must not leave clients waiting forever
            self.fatal = error
            for seq in [*self._waiting, *self._active, *self._inbox]:
                try:
                    self._finish(seq, "error", f"The server's engine failed: {error}")
                except Exception:  # noqa: BLE001 -- the pool may be what broke: still tell the others
                    seq.finished = True
                    seq.handle.emit(Event("finish", finish_reason="error", message=f"The server's engine failed: "
                                                                                    f"{error}"))
            raise

    def _step(self) -> bool:
        """One scheduler step; returns whether it ran the model."""
        self._drop_cancelled()
        self._mixed = False
        decoded = self._decode_step()
        prefilled = False if self._mixed else self._prefill_step()     # a chunk went with the decode step
        self._update_gauges()
        return decoded or prefilled

    def _drop_cancelled(self) -> None:
        for seq in [s for s in [*self._waiting, *self._active] if s.handle.cancelled]:
            self._finish(seq, "cancelled")

    def _decode_step(self) -> None:
        running = [s for s in self._active if s.pending is not None and not s.jobs]
        if not running:
            return False
        while running and not self._have_pages(self._pages_for_decode(running)):
            victim = self._active[-1]
            if len(self._active) == 1:        # alone and still no room: the pool is its context
                self._finish(victim, "length")
            else:
                self._preempt(victim)
            running = [s for s in running if s is not victim]
        if not running:
            return True
        chunk = self._mixed_chunk(running)
        if chunk is not None or (len(running) <= SPECULATIVE_BATCH and any(s.drafter is not None for s in running)):
            self._feed_step(running, chunk)
            return True
        tokens = [s.pending for s in running]
        started = time.monotonic()
        with self.engine.lock:
            logits = decode_batch([s.session for s in running], tokens)
        self._call_seconds.append(time.monotonic() - started)
        self._decode_step_s = exponential_average(self._decode_step_s, self._call_seconds[-1])
        self.metrics.decode_steps.inc()
        self.metrics.decode_batch_size.observe(len(running))
        for seq, row in zip(running, logits):
            seq.pending = None
            self._next_token(seq, row)
        return True

    def _mixed_chunk(self, running: list[_Sequence]) -> tuple[_Sequence, PrefillJob, np.ndarray] | None:
        """A chunk of the first prompt being prefilled that can go with this decode step (the weights then read
        once for both): a plain chunk (not the scored or last one), its size the tokens that add about
        prefill_share decode steps at what a token added to the latest such steps (MIN_MIXED at first and at
        least); None where there is none, or the artifact cannot (no decode_batch, or page-scaled keys)."""
        if not self.engine.has("decode_batch") or self.pool.kv_format.page_scaled_keys:
            return None
        seq = next((s for s in self._active if s.jobs and s.jobs[0][1] is not None), None)
        if seq is None or seq.handle.cancelled or self._decode_step_s is None or not self._prefill_chunks:
            return None
        share = self._share(seq)
        if share is None:
            return None
        job = seq.jobs[0][1]
        per_token = self._mixed_token_s
        job.chunk = MIN_MIXED if per_token is None else \
            max(MIN_MIXED, min(self.budget, int(share * self._decode_step_s / max(per_token, 1e-6))))
        ids = job.next_plain()
        pages = job.pages_needed() + self._pages_for_decode(running)
        return None if ids is None or not self._have_pages(pages) else (seq, job, ids)

    def _feed_step(self, running: list[_Sequence], chunk) -> None:
        """One decode_batch call (runtime.session.feed_batch: an entry a token) for the running sequences, each
        its pending token and, while few run (SPECULATIVE_BATCH), a speculative one the drafts worth verifying
        after it, each its own count; and `chunk`, a prompt's plain chunk, if given. Then every token that came of
        it. Drafts wait where the pool has no room for them."""
        plans = []
        for seq in running:
            stepper = seq.speculation() if len(running) <= SPECULATIVE_BATCH else None
            draft = stepper.plan(seq.prompt + seq.out, seq.request.max_tokens - len(seq.out)) if stepper else Draft([])
            plans.append((seq, stepper, draft))
        if not self._have_pages(sum(seq.session.cache.pages_needed(1 + len(d.tokens)) for seq, _, d in plans)
                                + (chunk[1].pages_needed() if chunk else 0)):
            plans = [(seq, stepper, Draft([])) for seq, stepper, _ in plans]
        drafting = any(d.tokens for _, _, d in plans)
        sessions = [seq.session for seq, _, _ in plans] + ([chunk[0].session] if chunk else [])
        ids = [[seq.pending] + d.tokens for seq, _, d in plans] + ([chunk[2]] if chunk else [])
        started = time.monotonic()
        with self.engine.lock:
            rows = feed_batch(sessions, ids)
        self._call_seconds.append(time.monotonic() - started)
        if chunk:
            seq, job, tokens = chunk
            job.fed_elsewhere(len(tokens))
            self._mixed = True
            if not drafting:                      # what a prompt token adds to a decode step
                added = max(0.0, self._call_seconds[-1] - self._decode_step_s) / len(tokens)
                self._mixed_token_s = exponential_average(self._mixed_token_s, added)
            self.metrics.prefill_tokens.labels("recompute" if seq.jobs[0][0] == "resume" or seq.out
                                               else "prompt").inc(len(tokens))
        elif not drafting:
            self._decode_step_s = exponential_average(self._decode_step_s, self._call_seconds[-1])
        self.metrics.decode_steps.inc()
        self.metrics.decode_batch_size.observe(len(running))
        for (seq, stepper, draft), logits in zip(plans, rows):
            seq.pending = None
            if stepper is None:
                self._next_token(seq, logits[0])
                continue
            steps = stepper.settle(draft, logits, seq.prompt + seq.out, seq.out)
            self.metrics.drafted_tokens.inc(len(draft.tokens))
            self.metrics.accepted_tokens.inc(len(steps) - 1)
            for token, row in steps:
                self._take_token(seq, token, row)
                if seq.finished:
                    break

    def _pages_for_decode(self, running: list[_Sequence]) -> int:
        return sum(s.session.cache.pages_needed(1) for s in running)

    def _available(self) -> int:
        """Free pages and those only the caches hold."""
        if self.prefix_cache is None:
            return self.pool.free_count
        conversations = self.conversations.reclaimable() if self.conversations is not None else 0
        return self.pool.free_count + self.prefix_cache.reclaimable() + conversations

    def _reclaim(self, wanted: int) -> int:
        """The pool's reclaim hook: the prefix cache's blocks first, then compressed conversations (see the
        module doc); returns the pages freed."""
        freed = self.prefix_cache.reclaim(wanted)
        if freed < wanted and self.conversations is not None:
            freed += self.conversations.reclaim(wanted - freed)
        return freed

    def _have_pages(self, pages: int) -> bool:
        return pages <= self.pool.free_count or pages <= self._available()

    def _prefill_limit(self, seq: _Sequence) -> int:
        """The prompt tokens this step computes for `seq`'s prompt: the token budget, or while its prefill is
        shared (_share) those that take about prefill_share decode steps (MIN_PREFILL at least)."""
        share = self._share(seq)
        if share is None or self._decode_step_s is None or not self._prefill_chunks:
            return self.budget
        fixed, per_token = self._prefill_cost()
        tokens = int((share * self._decode_step_s - fixed) / per_token)
        # a line through short chunks' times says little of long ones: grow past what was measured gradually
        tokens = min(tokens, 2 * max(n for n, _ in self._prefill_chunks))
        return max(MIN_PREFILL, min(self.budget, tokens))

    def _share(self, seq: _Sequence) -> float | None:
        """The decode steps' worth of time a step gives `seq`'s prompt (None: the token budget): prefill_share
        for a prompt longer than a chunk while fewer requests wait for their prompts than sequences decode (a long
        prompt beside running streams slows them by about 1 + prefill_share); a prompt of a chunk or less, or a
        burst of requests, goes at full speed in whole chunks (small chunks read the weights once each: on a CPU
        16 prompts of 512 tokens arriving at once, throttled, then ran 9-11 at once, not 16, and decoded 30%
        slower)."""
        decoding = sum(1 for s in self._active if s.pending is not None and not s.jobs)
        waiting = len(self._waiting) + sum(1 for s in self._active if s.jobs)
        prompt = sum(len(ids) for _, _, ids in seq.jobs)
        if self.settings.prefill_share is None or waiting >= decoding or prompt <= self.budget:
            return None
        return self.settings.prefill_share

    def _prefill_cost(self) -> tuple[float, float]:
        """(seconds, seconds a token) of a prefill chunk, a line through the latest chunks' times: a chunk reads
        every weight once whatever its length (on a CPU about a decode step's time), then costs about the same
        for each token. One length alone: the mean time a token, nothing fixed."""
        tokens, seconds = (np.array(column, np.float64) for column in zip(*self._prefill_chunks))
        mean = float((seconds / tokens).mean())
        if np.ptp(tokens) == 0:
            return 0.0, mean
        per_token, fixed = np.polyfit(tokens, seconds, 1)
        if per_token <= 0:
            return 0.0, mean
        return max(0.0, float(fixed)), float(per_token)

    def _prefill_step(self) -> bool:
        spent = 0
        while True:
            seq = next((s for s in self._active if s.jobs), None) or self._admit()
            if seq is None:
                break
            limit = self._prefill_limit(seq)
            if spent >= limit:
                break
            if seq.handle.cancelled:              # between two chunks: a drain or a disconnect waits no longer
                self._finish(seq, "cancelled")
                continue
            if not seq.jobs:                      # compress_only, its prefix found compressed: nothing to compute
                self._finish(seq, "stop")
                continue
            kind, job, ids = seq.jobs[0]
            if job is None:
                job = seq.session.start_prefill(ids, chunk=self.budget)
                job.on_fed = lambda seq=seq, kind=kind, job=job: self._prompt_fed(seq, kind, job)
                if kind == "prompt":
                    self._snapshot_at_last_page(seq, job)
                seq.jobs[0] = (kind, job, ids)
            job.chunk = max(MIN_PREFILL, limit - spent)
            if not self._make_room(job.pages_needed(), seq):
                continue                          # seq itself was preempted; the next one may fit
            n = job.next_tokens
            started = time.monotonic()
            with self.engine.lock:
                try:
                    done = job.step()
                except PoolExhaustedError:        # pages went elsewhere after all: wait and recompute
                    self._preempt(seq)
                    continue
            self._call_seconds.append(time.monotonic() - started)
            self._prefill_chunks.append((n, self._call_seconds[-1]))
            spent += n
            self.metrics.prefill_tokens.labels("recompute" if kind == "resume" or seq.out else "prompt").inc(n)
            if done:
                seq.jobs.pop(0)
                self._prefill_done(seq, kind, job)
        return spent > 0

    def _admit(self) -> _Sequence | None:
        """Take the first waiting request into a session if the pool and the parallel bound allow."""
        if not self._waiting or len(self._active) >= self.settings.parallel:
            return None
        seq = self._waiting[0]
        session, hit, jobs = self._start_session(seq)
        tokens = len(seq.prompt) + max(0, len(seq.out) - 1)
        need = self._peak_pages(tokens - hit, hit) + self.n_layers       # the prefill and a first decode page
        # with others running: room for each to grow a page, and for the compaction's copies of shared pages
        comfort = need + self.n_layers * len(self._active)
        if session.fresh and session.evicts(len(seq.prompt)) and self.prefix_cache is not None:
            comfort += -(-session.snapkv_budget // self.page_size) * self.n_layers
        if session.fresh and session.scorer is not None:      # its scoring forks: a prompt and a chunk more
            comfort += (-(-self.engine.prefill_chunk // self.page_size) + 1) * self.n_layers
        available = self.pool.free_count if comfort <= self.pool.free_count else self._available()
        if comfort > available and (self._active or need > available):
            session.close()
            if not self._active:              # alone and it cannot fit: generated past what the pool holds
                self._waiting.pop(0)
                self._finish(seq, "length")
            return None
        self._waiting.pop(0)
        seq.session = session
        if seq.cached_tokens is None:                 # the first admission (not a recomputation)
            seq.cached_tokens = hit
            if self.prefix_cache is not None:
                self.metrics.prefix_cache_queries.inc()
                self.metrics.prefix_cache_hits.inc(hit > 0)
                self.metrics.prefix_cache_hit_tokens.inc(hit)
                self.metrics.conversation_cache_hits.inc(not session.fresh)
        seq.jobs = jobs
        if len(seq.out) > 1:
            seq.jobs.append(("resume", None, seq.out[:-1]))
        self._active.append(seq)
        return seq

    def _start_session(self, seq: _Sequence) -> tuple[Session, int, list]:
        """A session for the sequence's prompt, started from what the caches hold of it (see the module doc);
        returns it, the prompt tokens it already holds and the prefill jobs for the rest."""
        if seq.request.compress is not None:
            return self._start_compressed(seq)
        # SnapKV's scorer whatever SHARPI_COMPRESS says: the query-agnostic ones run on request (compress)
        session = self.model.session(snapkv=seq.request.snapkv, compress="snapkv")
        session, hit = self._start_from_caches(seq, session)
        return session, hit, [("prompt", None, seq.prompt[hit:])]

    def _start_compressed(self, seq: _Sequence) -> tuple[Session, int, list]:
        """A prompt whose prefix is compressed by a query-agnostic scorer (the rule in the module doc): it goes on
        from the longest compressed entry its tokens start with (a compressed prefix, or a finished conversation
        that continued one) unless more than a budget of its own prefix lies past what that entry compressed;
        else its prefix is prefilled and compressed first."""
        scorer, n = seq.request.compress
        session = self.model.session(snapkv=seq.request.snapkv, compress=scorer)
        seq.compressed_prompt = n
        if seq.request.compress_only:
            return self._start_compression_only(seq, session, n)
        if self.conversations is not None:
            with self.engine.lock:
                entry = self.conversations.lookup(seq.prompt, session)
                if entry is not None and n - entry.prompt_tokens <= session.snapkv_budget:
                    session.close()
                    seq.compressed_prompt = entry.prompt_tokens
                    hit = len(entry.tokens)
                    return entry.session.fork(), hit, [("prompt", None, seq.prompt[hit:])]
        return session, 0, [("prefix", None, seq.prompt[:n]), ("prompt", None, seq.prompt[n:])]

    def _start_compression_only(self, seq: _Sequence, session: Session, n: int) -> tuple[Session, int, list]:
        """A request for the compression of its n-token prefix alone (its prompt: the prefix and one token more):
        the prefix's own entry if the cache holds it (nothing to compute), else the prefix compressed."""
        if self.conversations is not None:
            with self.engine.lock:
                entry = self.conversations.lookup(seq.prompt[:n + 1], session)
                if entry is not None and len(entry.tokens) == n:
                    session.close()
                    return entry.session.fork(), n, []
        return session, 0, [("prefix", None, seq.prompt[:n])]

    def _start_from_caches(self, seq: _Sequence, session: Session) -> tuple[Session, int]:
        if self.prefix_cache is None:
            return session, 0
        compresses = session.evicts(len(seq.prompt))
        limit = self._lookup_limit(seq, session)
        with self.engine.lock:
            tokens, pages, state = self.prefix_cache.lookup(seq.prompt, limit)
            entry = self.conversations.lookup(seq.prompt, session) \
                if compresses and self.conversations is not None else None
            faithful = min(limit, entry.prompt_tokens) // self.page_size * self.page_size if entry else 0
            if entry is not None and tokens < faithful:          # the prefix cache lost the compressed prompt
                session.close()
                seq.compressed_prompt = entry.prompt_tokens
                return entry.session.fork(), len(entry.tokens)
            if tokens:
                session.adopt_prefix(pages, tokens, state)
        seq.compressed_prompt = len(seq.prompt)
        return session, tokens

    def _lookup_limit(self, seq: _Sequence, session: Session) -> int:
        """The most of a prompt its session may take from the caches: all but its last token (which gives the
        first logits), or all but the SnapKV window where the prompt is compressed (the window's queries score
        it, so they are computed)."""
        return len(seq.prompt) - (session.snapkv.window if session.evicts(len(seq.prompt)) else 1)

    def _make_room(self, pages: int, requester: _Sequence) -> bool:
        """Free `pages` pages: the prefix cache's first, then by preempting the latest admitted sequences (the
        requester too, when it is the latest). Returns whether the requester is still admitted."""
        while self.pool.free_count < pages:
            if self.prefix_cache is not None:
                with self.engine.lock:
                    if self._reclaim(pages - self.pool.free_count):
                        continue
            victim = self._active[-1]
            if victim is requester and len(self._active) == 1:   # alone and still no room
                self._finish(victim, "length")
                return False
            self._preempt(victim)
            if victim is requester:
                return False
        return True

    def _snapshot_at_last_page(self, seq: _Sequence, job: PrefillJob) -> None:
        """A hybrid's prompt stops at its last full page that a later lookup of it may reach (the limit of
        _start_from_caches), and the prefix cache keeps its pages and recurrent state there: the next prompt that
        starts with it (a chat's next turn, another question on the document) goes on from that page."""
        session = seq.session
        if self.prefix_cache is None or self.engine.states is None or not session.fresh:
            return
        end = self._lookup_limit(seq, session) // self.page_size * self.page_size
        if end <= session.logical_length:
            return

        def keep() -> None:             # in a prefill step, or after a decode step that fed the chunk
            copies = -(-session.snapkv_budget // self.page_size) * self.n_layers if job.evict else 0
            with self.engine.lock:
                if copies <= self.pool.free_count:     # as _prompt_fed: the compaction can copy what it shares
                    self.prefix_cache.snapshot(seq.prompt[:end], session.cache)
        job.boundary, job.on_boundary = end, keep

    def _prompt_fed(self, seq: _Sequence, kind: str, job: PrefillJob) -> None:
        """Every token of a prefill is in the cache, before any compression: index the prompt's full pages, if
        the compaction can then copy the shared pages it writes (else the prompt is not cached)."""
        session = seq.session
        seq.pages_before_eviction = self._pages_of(session)
        if kind not in ("prompt", "prefix") or self.prefix_cache is None:
            return
        copies = -(-session.snapkv_budget // self.page_size) * self.n_layers if job.evict else 0
        if copies <= self.pool.free_count:      # a compressed prefix's full pages too: a plain request adopts them
            self.prefix_cache.insert(seq.prompt[:session.logical_length], session.cache)

    def _prefill_done(self, seq: _Sequence, kind: str, job: PrefillJob) -> None:
        session = seq.session
        if job.evict:
            self.metrics.snapkv_evictions.inc()
            self.metrics.snapkv_pages_freed.inc(max(0, seq.pages_before_eviction - self._pages_of(session)))
        if kind == "prefix":
            if self.conversations is not None and session.evicted:   # kept for any prompt that starts with it
                with self.engine.lock:
                    fork = session.fork()
                    if not self.conversations.insert(seq.prompt[:len(job.ids)], fork, len(job.ids)):
                        fork.close()
            if seq.request.compress_only:
                self._finish(seq, "stop")
        elif kind == "prompt" and not seq.out:
            self._next_token(seq, job.logits)
        elif not seq.jobs:                  # recomputed: go on with the token sampled before the preemption
            seq.pending = seq.out[-1]

    def _pages_of(self, session: Session) -> int:
        return session.kv_bytes // self.pool.page_bytes

    def _next_token(self, seq: _Sequence, logits: np.ndarray) -> None:
        """Sample the sequence's next token, send its text, and finish it or leave the token to decode."""
        history = seq.prompt + seq.out if seq.request.sampling.repeat_penalty != 1.0 else seq.out
        self._take_token(seq, seq.sampler(logits, history, seq.out), logits)

    def _take_token(self, seq: _Sequence, token: int, logits: np.ndarray) -> None:
        """Send a token chosen from `logits` and its text; finish the sequence or leave the token to decode."""
        request = seq.request
        now = time.monotonic()
        if seq.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - seq.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_at)
        seq.last_token_at = now
        if token in self.stop_ids and not request.ignore_eos:
            self._finish(seq, "stop")
            return
        seq.out.append(token)
        self.metrics.generation_tokens.inc()
        logprobs = []
        if request.logprobs is not None:
            lp = log_softmax(logits)
            logprobs = [TokenLogprob(token, float(lp[token]), top_logprobs(lp, request.logprobs))]
        piece = seq.text.feed(token)
        seq.handle.emit(Event("text", text=piece, token_ids=[token], logprobs=logprobs))
        if seq.text.stopped:
            self._finish(seq, "stop")
        elif len(seq.out) >= request.max_tokens or seq.session.context_left == 0:
            self._finish(seq, "length")
        else:
            seq.pending = token

    def _preempt(self, seq: _Sequence) -> None:
        """Free the sequence's pages; it waits at the head of the queue and is recomputed when readmitted."""
        self.metrics.preemptions.inc()
        with self.engine.lock:
            seq.session.close()
        seq.session, seq.jobs, seq.pending = None, [], None
        self._active.remove(seq)
        self._waiting.append(seq)
        self._waiting.sort(key=lambda s: s.order)

    def _finish(self, seq: _Sequence, reason: str, message: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        # what a compress_only request asked for, read before its session goes to the cache or is closed
        report = compression_report(seq.session, seq.compressed_prompt) \
            if seq.request.compress_only and reason == "stop" and seq.session is not None else None
        if seq.session is not None:
            with self.engine.lock:
                kept = False
                cacheable = reason in ("stop", "length") and self.prefix_cache is not None
                ahead = seq.session.logical_length - len(seq.prompt + seq.out)
                if ahead > 0 and cacheable:      # accepted drafts past a stop: the cache keeps what was sent
                    try:
                        seq.session.rollback(ahead)
                    except ConfigError:
                        cacheable = False
                if cacheable:
                    seen = (seq.prompt + seq.out)[:seq.session.logical_length]
                    self.prefix_cache.insert(seen, seq.session.cache)
                    kept = self.conversations is not None and self.conversations.insert(
                        seen, seq.session, seq.compressed_prompt)
                if not kept:
                    seq.session.close()
        for queue in (self._active, self._waiting):
            if seq in queue:
                queue.remove(seq)
        piece = seq.text.finish() if reason in ("stop", "length") else ""
        usage = {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.out),
                 "cached_tokens": seq.cached_tokens or 0}
        if report is not None:
            usage["compression"] = report
        if reason in ("stop", "length"):
            self.metrics.prompt_tokens.inc(len(seq.prompt))
            self.metrics.request_latency.observe(time.monotonic() - seq.arrival)
        self.metrics.requests.labels({"stop": "finished", "length": "finished"}.get(reason, reason)).inc()
        seq.handle.emit(Event("finish", text=piece, finish_reason=reason, usage=usage, message=message))

    def render_metrics(self) -> bytes:
        """The Prometheus exposition of this engine's metrics, its gauges read now."""
        self._update_gauges()
        return self.metrics.render()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self._waiting) + len(self._inbox))
        m.running.set(len(self._active))
        m.pool_pages_used.set(self.pool.used_count)
        m.pool_pages_free.set(self.pool.free_count)


MIN_PREFILL = 16      # prompt tokens a step computes at least (a GEMM tile of the CPU kernels)
# and with a decode step: each token attends through the decode kernel, over the whole context (on a CPU, a
# prompt token beside four decoding ones added 1.9 ms to the step at 500 tokens of context, 7.6 ms at 3,500)
MIN_MIXED = 4
# Running sequences up to which speculative ones verify drafts in the decode step: beyond, the batch is compute-bound
# on a CPU and a drafted token costs about what a decoded one does, so drafts rarely pay (vLLM turns speculation
# off above a batch size for the same reason)
SPECULATIVE_BATCH = 4


def generate(engine: ServeEngine, request: GenerationRequest, timeout: float = 600) -> tuple[str, Event, list]:
    """Submit and wait (for tests, benchmarks and scripts): the text, the finish event and every event."""
    events: list[Event] = []
    done = threading.Event()

    def on_event(event: Event) -> None:
        events.append(event)
        if event.kind == "finish":
            done.set()

    engine.submit(request, on_event)
    if not done.wait(timeout):
        raise SharpiError(f"The request did not finish within {timeout} s.")
    return "".join(e.text for e in events), events[-1], events
