"""What per-KV-head budgets (AdaKV, KVzip's head-level eviction) would add, measured before building them.

sharpi's cache is rectangular within a layer (every KV head of a layer holds the same number of slots), so its
kernels cannot run a cache whose heads keep different counts. This script answers the compression issue's
question "measure what each adds before keeping it" with the exact float32 numpy forward pass
(sharpi.testing.reference), whose cache can be ragged: each RULER-style prompt's context is prefilled once by
the artifact (the numpy prefill of 4,000 tokens takes minutes), its keys and values read from the cache into the
numpy forward's, scored by the artifact's scorer (--scorer: keydiff, kvzip, ...), and for each compression
ratio compacted four ways, each keeping the same number of slots in all:

- uniform: the same count in every layer and head (sharpi's default);
- layers: one threshold over every layer's scores, a layer's count the mean over its heads (sharpi's "scores"
  allocation);
- heads: the layer's uniform total shared among its KV heads by one threshold within the layer (AdaKV);
- layers+heads: one threshold over every layer and head (KVzip's own eviction);

then asked the prompt's question after the compression (the agnostic protocol) and answered greedily by the
numpy forward, scored by RULER's string match as `sharpi eval ruler` scores it. The full cache is answered the
same way, so each gap is paired. Selection is sharpi's (max pooling, kernel 31, the last 64 positions kept:
sharpi.testing.snapkv.select_row). Models with sliding-window layers are refused (Gemma-3's one KV head a layer
has nothing to share among heads anyway).

    python benchmarks/per_head_budgets.py ARTIFACT GGUF --tasks needle,multikey,... --lengths 4000 \\
        --depths 25,75 --trials 1 --ratios 50,75 --out per-head.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import sharpi
from sharpi.common.snapkv_settings import SnapKVSettings, layer_budgets
from sharpi.eval.report import gap_to_full, suite_score
from sharpi.eval.scoring import match_score, row_score
from sharpi.eval.summary import prompt_key
from sharpi.eval.sweep import answer_steps
from sharpi.eval.tasks import TASKS, build_prompt
from sharpi.testing.reference import NumpyReference, ReferenceSession
from sharpi.testing.snapkv import select_row

ALLOCATIONS = ("uniform", "layers", "heads", "layers+heads")
RECENCY, KERNEL = 64, 31


class RaggedSession(ReferenceSession):
    """ReferenceSession whose layers keep a list of per-KV-head arrays, so heads may hold different counts."""

    def __init__(self, ref):
        super().__init__(ref)
        cfg = ref.config
        heads = range(cfg.n_kv_heads)
        self.keys = [[np.zeros((0, cfg.head_dim), np.float32) for _ in heads] for _ in range(cfg.n_layers)]
        self.values = [[np.zeros((0, cfg.head_dim), np.float32) for _ in heads] for _ in range(cfg.n_layers)]
        self.positions = [[np.zeros(0, np.int64) for _ in heads] for _ in range(cfg.n_layers)]

    @classmethod
    def from_engine(cls, ref, session) -> "RaggedSession":
        """The keys (RoPE'd, key offsets added back) and values an engine session holds, every layer global."""
        out = cls(ref)
        cache = session.cache
        keys = session.cached_keys()
        if any(k is None for k in keys):
            raise SystemExit("per_head_budgets.py takes models whose every layer is global (no sliding windows).")
        for l in range(cache.n_layers):
            data = cache.pool.kv_format.decode(cache.pool.read_pages(cache.pages[l]), 1)   # [pages, kvh, page, d]
            values = data.transpose(1, 0, 2, 3).reshape(data.shape[1], -1, data.shape[3])[:, :cache.length[l]]
            out.keys[l] = list(keys[l].astype(np.float32))
            out.values[l] = list(values.astype(np.float32))
            out.positions[l] = [np.arange(cache.length[l])] * len(out.keys[l])
        out.length = cache.logical_length
        return out

    def ragged_copy(self, kept: list[list[np.ndarray]]) -> "RaggedSession":
        """A copy holding, per layer and KV head, the slots kept[l][h] (ascending)."""
        other = RaggedSession(self.ref)
        other.length = self.length
        other.keys = [[self.keys[l][h][rows] for h, rows in enumerate(layer)] for l, layer in enumerate(kept)]
        other.values = [[self.values[l][h][rows] for h, rows in enumerate(layer)] for l, layer in enumerate(kept)]
        other.positions = [[self.positions[l][h][rows] for h, rows in enumerate(layer)]
                           for l, layer in enumerate(kept)]
        return other

    def _append(self, l, k, v, pos):
        for h in range(len(k)):
            self.keys[l][h] = np.concatenate([self.keys[l][h], k[h]])
            self.values[l][h] = np.concatenate([self.values[l][h], v[h]])
            self.positions[l][h] = np.concatenate([self.positions[l][h], pos])


def expected_attention_scores(ref: NumpyReference, ids, base: "RaggedSession", n_future: int = 512,
                              sinks: int = 4, query_bias: bool = True) -> np.ndarray:
    """Expected Attention (Devoto et al., arXiv 2510.00636; kvpress's ExpectedAttentionPress) for the prompt
    `ids` whose cache `base` holds: [layers, kv_heads, n].

    The future queries of a layer's head are modelled as a Gaussian: the mean and covariance of its pre-RoPE
    queries over the prompt (the first `sinks` positions left out), rotated by RoPE's rotation averaged over the
    next `n_future` positions. A key's expected attention logit is then scale * mu.k + scale^2 / 2 * k.Sigma.k (the
    Gaussian's moment generating function), softmaxed over the prompt, averaged over the KV head's query heads and
    multiplied by the norm of the position's value; sinks take the maximum. The queries come from the numpy forward
    of the whole prompt, with q norms (which kvpress's version refuses) and with q biases unless `query_bias` is
    False (kvpress's version projects with the weight alone)."""
    cfg = ref.config
    captured = []
    ref.forward(ids, capture=captured)
    n, d = len(ids), cfg.head_dim
    scale = ref._scale() or d ** -0.5
    group = cfg.n_heads // cfg.n_kv_heads
    eye = np.broadcast_to(np.eye(d, dtype=np.float32)[None], (n_future, d, d))
    rotations = {}                                   # per (base, position scale): local and global layers differ
    out = np.zeros((cfg.n_layers, cfg.n_kv_heads, n), np.float32)
    for l, (q, _, _) in enumerate(captured):
        rope, theta, pos_scale = ref.rope_for(l)
        q = rope(q[sinks:], -np.arange(sinks, n) * pos_scale, theta).astype(np.float64)   # undo RoPE: [T, H, D]
        if not query_bias and cfg.qkv_bias and not cfg.qk_norm:
            q -= ref.weights[f"blk.{l}.attn_q.bias"].reshape(cfg.n_heads, d)
        mu = q.mean(0)                                                             # [H, D]
        centred = q - mu
        cov = np.einsum("thi,thj->hij", centred, centred) / len(q)                 # [H, D, D]
        if (theta, pos_scale) not in rotations:     # column j: e_j's rotation averaged over the next positions
            future = np.arange(n, n + n_future) * pos_scale
            rotations[theta, pos_scale] = rope(eye, future, theta).mean(0).astype(np.float64).T
        rot = rotations[theta, pos_scale]
        mu = mu @ rot.T
        cov = np.einsum("ij,hjk,lk->hil", rot, cov, rot)
        for h in range(cfg.n_kv_heads):
            k = base.keys[l][h][sinks:n].astype(np.float64)                          # [S, D]
            heads = slice(h * group, (h + 1) * group)
            logits = scale * mu[heads] @ k.T + scale * scale / 2 * np.einsum("si,hij,sj->hs", k, cov[heads], k)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            row = p.mean(0) * np.linalg.norm(base.values[l][h][sinks:n], axis=-1)
            out[l, h, sinks:] = row
            out[l, h, :sinks] = row.max()
    return out


def head_counts(scores: np.ndarray, budget: int, allocation: str) -> np.ndarray:
    """Slots per [layer, head], budget on average, each at least RECENCY + 1 and at most the prompt."""
    layers, heads, n = scores.shape
    floor = RECENCY + 1
    if allocation == "uniform":
        return np.full((layers, heads), budget)
    if allocation == "layers":
        per_layer = layer_budgets(budget, layers, SnapKVSettings(allocation="scores", recency=RECENCY), scores)
        return np.repeat(np.asarray(per_layer)[:, None], heads, axis=1)
    groups = [scores[l:l + 1] for l in range(layers)] if allocation == "heads" else [scores]
    counts = []
    for group in groups:
        flat = np.sort(group.reshape(-1))[::-1]
        threshold = flat[min(group.shape[0] * heads * budget, flat.size) - 1]
        counts.append((group >= threshold).sum(axis=2))
    counts = np.clip(np.concatenate(counts), floor, n)
    return _held_to(counts, budget * (heads if allocation == "heads" else layers * heads), allocation, floor)


def _held_to(counts: np.ndarray, total: int, allocation: str, floor: int) -> np.ndarray:
    """Take back what the floor and ties added, from the counts above the floor in proportion (per layer for
    "heads", over everything for "layers+heads")."""
    rows = counts if allocation == "heads" else counts.reshape(1, -1)
    out = []
    for row in rows:
        excess = int(row.sum()) - total
        above = row - floor
        if excess > 0 and above.sum() > 0:
            cut = np.floor(above * min(excess / above.sum(), 1.0)).astype(np.int64)
            for i in np.argsort(-above)[:max(0, excess - int(cut.sum()))]:
                cut[i] += 1 if row[i] - cut[i] > floor else 0
            row = row - cut
        out.append(row)
    return np.asarray(out).reshape(counts.shape)


def keep_sets(scores: np.ndarray, counts: np.ndarray) -> list[list[np.ndarray]]:
    return [[select_row(scores[l, h], int(counts[l, h]), RECENCY, "max", KERNEL) for h in range(scores.shape[1])]
            for l in range(scores.shape[0])]


def greedy(session: ReferenceSession, question: list[int], steps: int, stop_ids) -> list[int]:
    token, out = int(np.argmax(session.feed(question)[-1])), []
    while True:
        out.append(token)
        if token in stop_ids or len(out) == steps:
            return out
        token = int(np.argmax(session.feed([token])[-1]))


def run_prompt(ref, model, task, length, depth, trial, ratios, steps, stop_ids, scorer="keydiff") -> list[dict]:
    prompt = build_prompt(task, model.tokenize, length, depth, trial=trial)
    ids = prompt.context_ids
    question, answers = prompt.questions[0]
    start = time.perf_counter()
    n = len(ids)
    with model.session(snapkv_budget=0) as prefilled:
        prefilled.prefill(ids)
        base = RaggedSession.from_engine(ref, prefilled)
        prefill_s = time.perf_counter() - start
        if scorer in ("expected", "expected-kvpress"):
            scores = expected_attention_scores(ref, ids, base, query_bias=scorer == "expected")
        else:
            scores = model.scorer(scorer).scores(prefilled, np.asarray(ids))[:, :, :n]     # [L, KVH, n]
    full = base.ragged_copy([[np.arange(n)] * scores.shape[1] for _ in range(scores.shape[0])])
    rows = [_row(task, depth, trial, 0, "full", model.detokenize(greedy(full, question, steps, stop_ids)),
                 answers, n, prefill_s)]
    for ratio in ratios:
        budget = max(RECENCY + 1, round(n * (100 - ratio) / 100))
        for allocation in ALLOCATIONS:
            counts = head_counts(scores, budget, allocation)
            session = base.ragged_copy(keep_sets(scores, counts))
            output = model.detokenize(greedy(session, question, steps, stop_ids))
            rows.append(_row(task, depth, trial, ratio, allocation, output, answers, n, prefill_s,
                             slots=float(counts.mean())))
    return rows


def _row(task, depth, trial, ratio, allocation, output, answers, n, prefill_s, slots=None) -> dict:
    return {"task": task, "depth": depth, "trial": trial, "ratio": ratio, "allocation": allocation,
            "output": output, "answers": list(answers), "score": match_score(output, answers), "tokens": n,
            "mean_slots": slots, "prefill_s": round(prefill_s, 1)}


def report(rows: list[dict]) -> None:
    """The suite's score per allocation and compression, its paired gap to the full cache with the bootstrap 95%
    interval (sharpi.eval.report's), and each task's mean."""
    rows = [{"length": r["tokens"], "seed": 0, "hit": r["score"] == 1.0, **r} for r in rows]
    full_rows = [r for r in rows if r["allocation"] == "full"]
    full = {prompt_key(r): row_score(r) for r in full_rows}
    ratios = sorted({r["ratio"] for r in rows} - {0})
    tasks = sorted({r["task"] for r in rows})
    print(f"{len(full)} prompts; full cache {suite_score(full_rows):.1f}\n")
    print("| allocation | " + " | ".join(f"{ratio}% compression" for ratio in ratios) + " |\n| --- |"
          + " --- |" * len(ratios))
    for allocation in ALLOCATIONS:
        cells = []
        for ratio in ratios:
            cell = [r for r in rows if r["allocation"] == allocation and r["ratio"] == ratio]
            cells.append(f"{suite_score(cell):.1f} ({gap_to_full(cell, full)})" if cell else "-")
        print(f"| {allocation} | " + " | ".join(cells) + " |")
    print("\nPer-head allocations against per-layer ones on the same prompts (paired, bootstrap 95%):")
    for allocation in ("heads", "layers+heads"):
        for ratio in ratios:
            per_layer = {prompt_key(r): row_score(r) for r in rows if r["allocation"] == "layers"
                         and r["ratio"] == ratio}
            print(f"- {allocation} - layers at {ratio}%: " + str(gap_to_full(
                [r for r in rows if r["allocation"] == allocation and r["ratio"] == ratio], per_layer)))
    for ratio in ratios:
        print(f"\nEach task at {ratio}% compression (mean score, points):\n")
        print("| allocation | " + " | ".join(tasks) + " |\n| --- |" + " --- |" * len(tasks))
        for allocation in ("full", *ALLOCATIONS):
            cells = [[row_score(r) for r in rows if r["allocation"] == allocation and r["task"] == task
                      and r["ratio"] in (ratio, 0)] for task in tasks]
            print(f"| {allocation} | " + " | ".join(f"{100 * np.mean(c):.0f}" if c else "-" for c in cells) + " |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="a compiled artifact of the model (its tokenizer)")
    p.add_argument("gguf", help="the model's GGUF (the numpy forward's weights)")
    p.add_argument("--tasks", default=",".join(t for t in TASKS if t != "passkey"))
    p.add_argument("--lengths", default="4000")
    p.add_argument("--depths", default="25,75")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--ratios", default="50,75")
    p.add_argument("--scorer", default="keydiff",
                   help="the query-agnostic scorer (sharpi eval's --scorers names, or expected: Expected Attention "
                        "computed here from the numpy forward's queries; expected-kvpress: without the q bias, as "
                        "kvpress computes it)")
    p.add_argument("--out", required=True, help="results JSON, resumed if it exists (with --trials 0: its report)")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    if args.trials == 0:
        return report(rows)
    model = sharpi.load(args.artifact)
    ref = NumpyReference(args.gguf)
    stop_ids = set(model.tokenizer.info.stop_ids)
    done = {(r["task"], r["depth"], r["trial"]) for r in rows}
    ratios = [int(r) for r in args.ratios.split(",")]
    for trial in range(args.trials):
        for task in args.tasks.split(","):
            for length in (int(x) for x in args.lengths.split(",")):
                for depth in (float(d) for d in args.depths.split(",")):
                    if (task, depth, trial) in done:
                        continue
                    steps = answer_steps(model, task, 0)
                    new = run_prompt(ref, model, task, length, depth, trial, ratios, steps, stop_ids, args.scorer)
                    rows += new
                    out.write_text(json.dumps(rows, indent=1))
                    print(f"{task} {depth:g} T{trial}: " + ", ".join(f"{r['allocation']}@{r['ratio']} {r['score']:.2f}"
                                                                  for r in new), file=sys.stderr, flush=True)
    report(rows)


if __name__ == "__main__":
    main()
