"""What a compressed prefix kept, token by token: for each position of the prefix, the share of the (layer, KV head)
slots that still hold it after the compression (0: every head dropped it, 1: every head kept it). The engine reads
it from the session when a compress_only request ends (compression_report, in its finish's usage); the route
/v1/compress/shares answers it with the prefix's text pieces (shares_body), and the chat page shades the document
by it.

Only the layers the compression acts on count: a sliding-window layer keeps its last window whatever the scorer
says (SnapKV leaves it alone), so it is left out of the shares and of the ratio (its pages are in the KV bytes).
"""
from __future__ import annotations

import numpy as np

from ..common.tokenizer import Tokenizer


def compression_report(session, prefix_tokens: int) -> dict:
    """The shares of the prefix's positions in `session` (a runtime Session holding the compressed prefix), the
    slots each compressed layer kept of it, and the KV bytes the session holds against those of the uncompressed
    prefix (every layer's pages for all its tokens; a sliding-window layer's as held)."""
    cache, n = session.cache, prefix_tokens
    layers = [layer for layer in range(cache.n_layers) if not cache.is_local(layer)]
    counts = np.zeros(n, np.int64)
    kept = []
    for layer in layers:
        positions = cache.positions[layer]                  # [kv_heads, slots]: the position each slot holds
        counts += np.bincount(positions[positions < n], minlength=n)
        kept.append(int((positions[0] < n).sum()))          # every head of a layer keeps the same count
    slots = len(layers) * cache.kv_heads
    shares = counts / slots if slots else np.ones(n)
    page = cache.pool.page_size
    full_pages = sum(-(-n // page) if layer in layers else len(cache.pages[layer]) for layer in range(cache.n_layers))
    return {"prefix_tokens": n, "layers": len(layers), "kv_heads": cache.kv_heads, "kept_slots": kept,
            "shares": shares.tolist(), "kv_bytes": session.kv_bytes,
            "full_kv_bytes": full_pages * cache.pool.page_bytes}


def token_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each id's text, special tokens shown, so that the pieces join to the ids' text; a token that ends inside a
    UTF-8 character has an empty piece and the one that completes the character shows it."""
    stream = tokenizer.stream(special=True)
    return [stream.step(token) for token in ids]


def shares_body(model_name: str, tokenizer: Tokenizer, ids: list[int], report: dict, scorer: str, budget: int,
                cached_tokens: int) -> dict:
    """The /v1/compress/shares answer (its fields: docs/serving.md's route list)."""
    n, kept = report["prefix_tokens"], report["kept_slots"]
    ratio = n * len(kept) / sum(kept) if kept and sum(kept) else 1.0
    return {"object": "compression.shares", "model": model_name, "scorer": scorer, "budget": budget,
            "prefix_tokens": n, "cached_tokens": cached_tokens, "token_ids": ids[:n],
            "tokens": token_pieces(tokenizer, ids[:n]), "shares": report["shares"], "layers": report["layers"],
            "kv_heads": report["kv_heads"], "kept_slots": kept, "ratio": ratio, "kv_bytes": report["kv_bytes"],
            "full_kv_bytes": report["full_kv_bytes"]}
