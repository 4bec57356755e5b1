"""Speculative decoding's speed on the tasks where users wait, against plain decoding of the same artifact.

    python benchmarks/speculative.py ARTIFACT [--threads 2] [--max-tokens 256] [--code 20] [--prose 5]
        [--story 5] [--translate 5] [--out benchmarks/speculative] [--draft DIR]

Four tasks, greedy, through the model's chat template:
- code: a ~1,500-token stretch of a Python module of sharpi's own dependencies (numpy, gguf, jinja2), and "rewrite
  it with NAME renamed to NEW" (NAME the stretch's most used identifier): the answer copies the prompt;
- prose: a ~1,500-token passage of the shipped Alice text and "summarise it, quoting the key sentences";
- story: a one-paragraph opening and "continue the story" (a small model's greedy story repeats itself, so
  drafts hit more than one would think);
- translate: a ~300-token passage of the Alice text to put into French: the prompt's n-grams recur, its
  continuations are the wrong language, so drafts miss and the adaptive draft length must fall back to plain
  decoding.
Decode speed is tokens generated after the first over the time after the first (the first comes from the
prefill). Both runs of a prompt are in this process, one after the other, plain first on even prompts and
speculative first on odd ones. Writes OUT.md (a table per prompt, the medians, the acceptance rates) and OUT.png.
"""
from __future__ import annotations

import argparse
import builtins
import collections
import importlib
import inspect
import keyword
import re
import statistics
import sys
import time
from pathlib import Path

import sharpi

HERE = Path(__file__).resolve().parent
ALICE = HERE.parent / "sharpi" / "eval" / "data" / "alice.txt"
CODE_MODULES = ["numpy.lib._function_base_impl", "numpy.lib._npyio_impl", "numpy._core.fromnumeric",
                "numpy.lib._shape_base_impl", "numpy.lib._index_tricks_impl", "numpy.linalg._linalg",
                "numpy.polynomial.polynomial", "numpy.lib._arraysetops_impl", "numpy.ma.core",
                "numpy.random.__init__", "gguf.gguf_reader", "gguf.gguf_writer", "gguf.quants",
                "gguf.vocab", "gguf.metadata", "jinja2.lexer", "jinja2.parser", "jinja2.compiler",
                "jinja2.environment", "jinja2.filters"]
STORIES = ["The lighthouse keeper found the map folded inside a bottle that had not been there the night before.",
           "On the morning the river ran backwards, Mara packed her grandmother's compass and left the village.",
           "The robot had been built to sweep the station's corridors, but tonight it stood at the airlock, waiting.",
           "Nobody in the orchestra knew who had written the last page of the score, only that it was in red ink.",
           "The bakery on Fennel Street opened at midnight, and only for customers who brought something to trade."]
NOT_RENAMED = set(dir(builtins)) | set(keyword.kwlist) | {"self", "cls"}


def code_prompts(model, count: int, tokens: int) -> list[tuple[str, str]]:
    """(label, user message) of `count` rename tasks."""
    prompts = []
    for name in CODE_MODULES[:count]:
        source = inspect.getsource(importlib.import_module(name))
        lines = source.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith(("def ", "class ")))
        excerpt = _lines_within(model, lines[first:], tokens)
        identifier = _most_used_identifier(excerpt)
        new = _renamed(identifier)
        prompts.append((f"{name} ({identifier})",
                        f"Here is some Python code:\n\n```python\n{excerpt}\n```\n\nRewrite the code with `{identifier}` "
                        f"renamed to `{new}`, changing nothing else. Output the whole code."))
    return prompts


def prose_prompts(model, count: int, tokens: int) -> list[tuple[str, str]]:
    paragraphs = [p.strip() for p in ALICE.read_text().splitlines() if p.strip()]
    prompts, start = [], len(paragraphs) // 10
    step = max(1, (len(paragraphs) - start) // max(count, 1))
    for i in range(count):
        passage = _lines_within(model, paragraphs[start + i * step:], tokens, joiner="\n\n")
        prompts.append((f"alice part {i + 1}", f"{passage}\n\nSummarise this passage in a few paragraphs, quoting "
                                                f"its most important sentences word for word in quotation marks."))
    return prompts


def translate_prompts(model, count: int, tokens: int = 300) -> list[tuple[str, str]]:
    paragraphs = [p.strip() for p in ALICE.read_text().splitlines() if p.strip()]
    step = max(1, len(paragraphs) // max(count, 1))
    return [(f"alice to French {i + 1}", "Translate this passage into French:\n\n"
             + _lines_within(model, paragraphs[i * step + 3:], tokens, joiner="\n\n")) for i in range(count)]


def story_prompts(count: int) -> list[tuple[str, str]]:
    return [(f"story {i + 1}", f"Continue this story for several paragraphs:\n\n{opening}")
            for i, opening in enumerate(STORIES[:count])]


def _lines_within(model, lines: list[str], tokens: int, joiner: str = "\n") -> str:
    kept, used = [], 0
    for line in lines:
        n = len(model.tokenize(line + joiner, add_bos=False))
        if used + n > tokens:
            break
        kept.append(line)
        used += n
    return joiner.join(kept)


def _most_used_identifier(code: str) -> str:
    words = collections.Counter(w for w in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b", code)
                                if w not in NOT_RENAMED and not w.startswith("__"))
    return words.most_common(1)[0][0]


def _renamed(identifier: str) -> str:
    if identifier[:1].isupper():
        return identifier + "Renamed"
    return identifier + "_renamed"


def measure(model, message: str, max_tokens: int, speculative: dict, order: int) -> tuple[dict, dict]:
    ids = model.chat_prompt([{"role": "user", "content": message}])
    runs = {}
    for which in (("plain", "spec") if order % 2 == 0 else ("spec", "plain")):
        options = speculative if which == "spec" else {}
        result = model.generate(ids, max_tokens, **options)
        runs[which] = {**result.stats, "text": result.text, "ids": result.token_ids}
    return runs["plain"], runs["spec"]


def divergence_gap(model, message: str, plain: list[int], spec: list[int]) -> float:
    """Where the outputs first differ, plain decoding's gap between its best two log-probabilities: the
    conformance rule lets them differ only where it is within the tolerance (a near-tie)."""
    import numpy as np
    from sharpi.runtime.sampling import log_softmax
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    ids = model.chat_prompt([{"role": "user", "content": message}]) + plain[:i]
    with model.session() as s:
        top = np.sort(log_softmax(s.prefill(ids)))[-2:]
    return float(top[1] - top[0])


def forward_costs(model, draft, context: int = 1500, repeats: int = 5) -> dict:
    """Median seconds of the model's decode step and verification of n = 2 .. 17 tokens, and the draft model's
    decode step, each after a `context`-token prompt (on forks of one prefilled session)."""
    import numpy as np

    def timed(session, run) -> float:
        times = []
        for _ in range(repeats):
            with session.fork() as fork:
                started = time.perf_counter()
                run(fork)
                times.append(time.perf_counter() - started)
        return statistics.median(times)

    ids = model.tokenize((ALICE.read_text() * 2)[:context * 8])[:context]
    costs = {}
    with model.session() as s:
        s.prefill(ids)
        costs["decode"] = timed(s, lambda f: f.decode(ids[0]))
        for n in range(2, 18):
            costs[n] = timed(s, lambda f: f.verify(np.array(ids[:n])))
    if draft is not None:
        with draft.session() as s:
            s.prefill(ids)
            costs["draft"] = timed(s, lambda f: f.decode(ids[0]))
    return costs


def break_even(costs: dict, draft: bool) -> list[tuple[int, float]]:
    """(k, the acceptance a drafted token needs for k drafts a step to beat plain decoding): the smallest a with
    (1 + a + ... + a^k) / (verify(k + 1) + k draft) >= 1 / decode."""
    rows = []
    for k in range(1, 17):
        cost = costs[k + 1] + (k * costs["draft"] if draft else 0.0)
        need = cost / costs["decode"]            # tokens a step must yield
        lo, hi = 0.0, 1.0
        for _ in range(50):
            a = (lo + hi) / 2
            lo, hi = (a, hi) if sum(a ** i for i in range(k + 1)) < need else (lo, a)
        rows.append((k, hi if need <= k + 1 else float("nan")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--code", type=int, default=20)
    p.add_argument("--prose", type=int, default=5)
    p.add_argument("--story", type=int, default=5)
    p.add_argument("--translate", type=int, default=5)
    p.add_argument("--draft", default=None, help="a draft model's artifact (speculative draft instead of lookup)")
    p.add_argument("--out", default=str(HERE / "speculative"))
    p.add_argument("--costs-only", action="store_true", help="only the forward times and break-even acceptances")
    args = p.parse_args()
    model = sharpi.load(args.artifact, threads=args.threads)
    draft = model.draft_model(args.draft) if args.draft else None
    costs = forward_costs(model, draft)
    print("forward times (ms):", {k: round(v * 1e3, 1) for k, v in costs.items()}, flush=True)
    if args.costs_only:
        print(cost_section(costs, draft is not None, args), end="")
        return
    speculative = {"speculative": "draft", "draft": args.draft} if args.draft else {"speculative": "lookup"}
    tasks = {"code": code_prompts(model, args.code, args.prompt_tokens),
             "prose": prose_prompts(model, args.prose, args.prompt_tokens),
             "story": story_prompts(args.story),
             "translate": translate_prompts(model, args.translate)}
    rows, order = [], 0
    for task, prompts in tasks.items():
        for label, message in prompts:
            plain, spec = measure(model, message, args.max_tokens, speculative, order)
            order += 1
            same = plain["ids"] == spec["ids"]
            gap = None if same else divergence_gap(model, message, plain["ids"], spec["ids"])
            rows.append({"task": task, "label": label, "prompt": plain["prompt_tokens"],
                         "generated": spec["generated_tokens"], "plain": plain["decode_tok_s"],
                         "spec": spec["decode_tok_s"], "ratio": spec["decode_tok_s"] / plain["decode_tok_s"],
                         "acceptance": spec["acceptance_rate"], "drafted": spec["drafted_tokens"],
                         "verifications": spec["verifications"], "same": same, "gap": gap})
            r = rows[-1]
            print(f"{task:5} {label:42} prompt {r['prompt']:5d} plain {r['plain']:6.1f} spec {r['spec']:6.1f} tok/s "
                  f"x{r['ratio']:.2f} accepted {r['acceptance']:.0%} of {r['drafted']} same={same}"
                  + ("" if same else f" (first difference at a top-2 gap of {gap:.3f})"), flush=True)
    write_report(Path(args.out), rows, model, args, speculative["speculative"], cost_section(costs, draft is not None,
                                                                                            args))


def cost_section(costs: dict, draft: bool, args) -> str:
    """The cost model as markdown: measured forward times and the break-even acceptance per draft length."""
    lines = ["", "## When drafting pays", "",
             f"Measured after a 1,500-token prompt: a decode step {costs['decode'] * 1e3:.1f} ms"
             + (f", the draft model's step {costs['draft'] * 1e3:.1f} ms" if draft else "") + "; verifying n tokens "
             + ", ".join(f"{n}: {costs[n] * 1e3:.1f}" for n in (2, 3, 5, 9, 13, 17)) + " ms. k drafted tokens a "
             "step pay when (1 + a + ... + a^k) / (verify(k + 1)" + (" + k draft" if draft else "") + ") exceeds "
             "1 / decode, a the chance a drafted token is accepted after the ones before it:", "",
             "| k | " + " | ".join(str(k) for k, _ in break_even(costs, draft)) + " |",
             "|---|" + "---|" * 16,
             "| a needed | " + " | ".join("never" if a != a else f"{a:.2f}" for _, a in break_even(costs, draft))
             + " |"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, rows: list[dict], model, args, method: str, costs: str) -> None:
    lines = [f"# Speculative decoding ({method}) against plain decoding", "",
             f"`python benchmarks/speculative.py {args.artifact} --threads {args.threads} --max-tokens "
             f"{args.max_tokens}`: {model.backend}, {model.manifest.target.get('matmuls', '')} matmuls, greedy, "
             f"{args.max_tokens} tokens at most. Decode tok/s: tokens after the first over the time after the first.",
             "", "| task | median speedup | min | max | acceptance | identical output |", "|---|---|---|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in rows):
        rs = [r for r in rows if r["task"] == task]
        ratios = [r["ratio"] for r in rs]
        drafted = sum(r["drafted"] for r in rs)
        accepted = sum(r["acceptance"] * r["drafted"] for r in rs)
        lines.append(f"| {task} ({len(rs)}) | {statistics.median(ratios):.2f}x | {min(ratios):.2f}x | "
                     f"{max(ratios):.2f}x | {accepted / drafted if drafted else 0:.0%} of {drafted} | "
                     f"{sum(r['same'] for r in rs)} of {len(rs)} |")
    lines += ["", "Identical: the speculative output equals plain decoding's token for token; where not, the top-2 "
              "log-probability gap of plain decoding where they first differ (int8 matmuls: a verification's GEMM "
              "sums in another order than the decode GEMV, so near-ties may fall either way).", "",
              "| task | prompt | tokens in | tokens out | plain tok/s | speculative tok/s | speedup | accepted | "
              "verifications | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['label']} | {r['prompt']} | {r['generated']} | {r['plain']:.1f} | "
                     f"{r['spec']:.1f} | {r['ratio']:.2f}x | {r['acceptance']:.0%} of {r['drafted']} | "
                     f"{r['verifications']} | {_identical(r)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + costs)
    plot(out.with_suffix(".png"), rows, method)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


def _identical(row: dict) -> str:
    return "yes" if row["same"] else f"no (gap {row['gap']:.3f})"


def plot(path: Path, rows: list[dict], method: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, task in enumerate(tasks):
        rs = [r for r in rows if r["task"] == task]
        ax.scatter([r["acceptance"] for r in rs], [r["ratio"] for r in rs], label=task, s=36, color=f"C{i}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("drafted tokens accepted")
    ax.set_ylabel("decode speed, speculative / plain")
    ax.set_title(f"Speculative decoding ({method}), one point a prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
