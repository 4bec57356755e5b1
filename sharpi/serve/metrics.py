"""The serving engine's Prometheus metrics (prometheus-client), in a registry of their own per engine, so two
engines in one process (tests) never mix their counts."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a few milliseconds (a decode step of a small model) to minutes (a long prompt behind a queue)
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sharpi_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("sharpi_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("sharpi_generation_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter("sharpi_prefill_tokens", "Prompt tokens computed (prefix-cache hits and "
                                      "recomputation after preemption excluded from the first, included in the "
                                      "second)", ["kind"], registry=r)
        self.time_to_first_token = Histogram("sharpi_time_to_first_token_seconds", "From arrival to the first "
                                             "token", buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("sharpi_inter_token_latency_seconds", "Between two tokens of one "
                                             "request", buckets=_LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram("sharpi_request_latency_seconds", "From arrival to the last token",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("sharpi_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("sharpi_running_sequences", "Sequences prefilling or decoding", registry=r)
        self.pool_pages_used = Gauge("sharpi_pool_pages_used", "KV pool pages held", registry=r)
        self.pool_pages_free = Gauge("sharpi_pool_pages_free", "KV pool pages free", registry=r)
        self.prefix_cache_pages = Gauge("sharpi_prefix_cache_pages", "KV pool pages the prefix and conversation "
                                        "caches hold",
                                        registry=r)
        self.prefix_cache_queries = Counter("sharpi_prefix_cache_queries", "Prompts looked up in the prefix "
                                            "cache", registry=r)
        self.prefix_cache_hits = Counter("sharpi_prefix_cache_hits", "Prompts that reused cached pages",
                                         registry=r)
        self.prefix_cache_hit_tokens = Counter("sharpi_prefix_cache_hit_tokens", "Prompt tokens reused from the "
                                               "prefix cache", registry=r)
        self.conversation_cache_hits = Counter("sharpi_conversation_cache_hits", "Prompts that continued a "
                                               "compressed conversation's cache", registry=r)
        self.snapkv_evictions = Counter("sharpi_snapkv_evictions", "Prompts compressed by SnapKV", registry=r)
        self.snapkv_pages_freed = Counter("sharpi_snapkv_pages_freed", "KV pages SnapKV compression gave back",
                                          registry=r)
        self.preemptions = Counter("sharpi_preemptions", "Sequences preempted (pages freed, recomputed later)",
                                   registry=r)
        self.drafted_tokens = Counter("sharpi_speculative_drafted_tokens", "Drafted tokens verified (speculative "
                                      "decoding)", registry=r)
        self.accepted_tokens = Counter("sharpi_speculative_accepted_tokens", "Drafted tokens the model accepted",
                                       registry=r)
        self.decode_steps = Counter("sharpi_decode_steps", "Batched decode steps", registry=r)
        self.decode_batch_size = Histogram("sharpi_decode_batch_size", "Sequences in a decode step",
                                           buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
