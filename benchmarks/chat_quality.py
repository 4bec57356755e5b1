"""Answer quality of sharpi's default CPU path, beside llama.cpp and the exact float32 path (issue #46, item 1).

~50 short chat questions with one right answer each (capitals, arithmetic, colours, units, simple facts:
benchmarks/chat_quality/questions.json, written for this repo) are asked of each model through its own chat
template, answered greedily (up to --max-tokens tokens, stopping at the model's end-of-generation tokens) by three
engines, and an answer is right when one of the question's patterns (regular expressions, case-insensitive)
matches its text:

- sharpi-int8: sharpi's default artifact (`sharpi-compile MODEL --target llvm`: int8-quantized activations times the
  quantized weights with integer dot products, llama.cpp's arithmetic; compiled here with --max-context 1024, which
  sizes only the KV page pool),
- sharpi-float: the `--matmuls float` artifact (float32 throughout, exact to the numpy reference),
- llama.cpp: llama-cpp-python on the same GGUF, its default settings (f16 KV cache).

A model whose GGUF carries no chat template is a base (pretrained, not instruction-tuned) model: Gemma-3-270M here,
which answers every chat-templated question with an echo of it under every engine (0/53 under all three, the first
run). Such a model is asked with a few-shot completion prompt instead ("Q: ...\nA:" after two solved examples that are
not in the set), and its answer is the first line of its output (it goes on with questions of its own);
--prompt-style chat forces the chat template on it.

The prompt's token ids are rendered once, by sharpi's tokenizer and chat template, and the same ids are fed to every
engine, so only the arithmetic differs; every engine's output ids are cut at the first id that any of them counts as
end of generation and detokenized by sharpi's tokenizer, so texts are compared the same way. Each engine runs in a
process of its own (this file with --worker; llama.cpp's with the Python of its own venv): TVM's and llama.cpp's
thread pools in one process spin against each other.

What matters is the paired discordance: questions right under llama.cpp and wrong under sharpi's default (the
issue's bound: at most 2 per model), and the reverse. Greedy decoding amplifies near-ties, so a few flips each way
are expected from any two arithmetics (see ../shared/anchors/README.md, Numerics); sharpi-float vs llama.cpp gives
that noise floor.

Run (about 4 minutes on a quiet 2-core machine, plus the compiles the first time; artifacts are compiled once into
--artifacts-dir and reused afterwards, so that compiler edits, which change the compile cache's key, do not force
recompiles):

    python benchmarks/chat_quality.py --artifacts-dir /tmp/cq --llama-python /work/llama-venv/bin/python

It writes benchmarks/chat_quality/results.json (every answer of every engine), benchmarks/chat_quality.md (the
accuracy table and the discordant questions with both answers) and benchmarks/chat_quality.png (accuracy bars; skipped
without matplotlib), with benchmarks/chat_quality/notes.md (a person's reading of the run) after the table.
--models, --engines and --limit run a subset; --out-dir/--md/--plot write elsewhere; --report-only rewrites the
report from results.json.
"""
from __future__ import annotations

import argparse
import math
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTIONS = HERE / "chat_quality" / "questions.json"
# What a person found reading a run (why answers differ): appended to the report as it stands, by hand, dated.
NOTES = HERE / "chat_quality" / "notes.md"
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
ENGINES = ("llama.cpp", "sharpi-int8", "sharpi-float")
MATMULS = {"sharpi-int8": "int8", "sharpi-float": "float"}
DEFAULT = "sharpi-int8"          # sharpi's default artifact on a CPU with AVX2
REFERENCE = "llama.cpp"
PROMPT_STYLES = ("auto", "chat", "completion")
# The few-shot prefix of the completion style (a base model's way to be asked): two questions not in the set.
FEW_SHOT = "Q: What is the capital of Portugal?\nA: Lisbon\n\nQ: What is 3 + 5?\nA: 8\n\n"
BOUND = 2                        # the acceptance: at most this many right under llama.cpp, wrong under sharpi
# The context only sizes the KV page pool (prompts here are < 100 tokens): small keeps 32k-context models' pools small.
MAX_CONTEXT = 1024


# -- questions and judging (pure: tests/test_chat_quality.py) --------------------------------------------------------
def load_questions(path: Path = QUESTIONS) -> list[dict]:
    """The questions, checked: unique ids, a non-empty question, at least one pattern, every pattern compiles."""
    questions = json.loads(Path(path).read_text())["questions"]
    seen = set()
    for q in questions:
        if q["id"] in seen:
            raise ValueError(f"{path}: question id {q['id']!r} twice.")
        seen.add(q["id"])
        if not q["question"].strip() or not q["answers"]:
            raise ValueError(f"{path}: question {q['id']!r} needs a question and at least one answer pattern.")
        for pattern in q["answers"]:
            re.compile(pattern, re.IGNORECASE)
    return questions


def is_right(text: str, answers: list[str]) -> bool:
    """Whether any accepted pattern occurs in the answer, case-insensitively."""
    return any(re.search(pattern, text, re.IGNORECASE) for pattern in answers)


def answer_part(text: str, style: str) -> str:
    """What is judged of an output: all of a chat answer; a completion's first line (a base model goes on with a
    question of its own after it, whose answer must not count)."""
    return text.strip().split("\n", 1)[0] if style == "completion" else text


def cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    """The tokens before the first end-of-generation id (engines may disagree on the set: sharpi stops at the chat
    template's end-of-turn, llama.cpp at every EOG id the vocabulary marks; the union is applied to all)."""
    stop = set(stop_ids)
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[:i]
    return list(tokens)


def discordant(rows: list[dict], right_engine: str, wrong_engine: str) -> list[tuple[dict, dict]]:
    """(row of right_engine, row of wrong_engine) for each question of one model right under the first, wrong
    under the second."""
    by_engine = {}
    for row in rows:
        by_engine.setdefault(row["engine"], {})[row["id"]] = row
    first, second = by_engine.get(right_engine, {}), by_engine.get(wrong_engine, {})
    return [(first[i], second[i]) for i in first if i in second and first[i]["right"] and not second[i]["right"]]


# -- the engines, each in a process of its own -----------------------------------------------------------------------
def worker_main(kind: str, source: str, job_path: str, out_path: str) -> None:
    """Greedy answers for every prompt of the job; writes {"info", "stop_ids", "answers": [{"tokens", "seconds"}]}."""
    job = json.loads(Path(job_path).read_text())
    run = {"sharpi": sharpi_answers, "llama": llama_answers}[kind]
    result = run(source, job)
    Path(out_path).write_text(json.dumps(result))


def _progress(job: dict, i: int, tokens: list[int], seconds: float) -> None:
    print(f"    {job['label']} {i + 1}/{len(job['prompts'])} {job['ids'][i]}: {len(tokens)} tokens, "
          f"{seconds:.2f} s", flush=True)


def sharpi_answers(artifact: str, job: dict) -> dict:
    import numpy as np

    import sharpi

    model = sharpi.load(artifact, threads=job["threads"])
    stop = set(model.tokenizer.info.stop_ids)
    answers = []
    for i, ids in enumerate(job["prompts"]):
        t0 = time.perf_counter()
        tokens = []
        with model.session() as session:
            logits = session.prefill(ids)
            while len(tokens) < job["max_tokens"]:
                token = int(np.argmax(logits))
                if token in stop:
                    break
                tokens.append(token)
                if len(tokens) < job["max_tokens"]:
                    logits = session.decode(token)
        answers.append({"tokens": tokens, "seconds": time.perf_counter() - t0})
        _progress(job, i, tokens, answers[-1]["seconds"])
    return {"info": f"sharpi {sharpi.__version__}, {model.backend}, matmuls {model.manifest.target.get('matmuls')}, "
                    f"KV {model.manifest.kv_dtype}", "stop_ids": sorted(stop), "answers": answers}


def llama_answers(gguf: str, job: dict) -> dict:
    """llama.cpp's greedy answers: eval of the prompt's ids, then argmax of the last logits one token at a time
    (llama-cpp-python keeps no logits without logits_all, so they are read from the context directly)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=job["n_ctx"], n_threads=job["threads"],
                          n_threads_batch=job["threads"], logits_all=False, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    stop = {i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    answers = []
    for i, ids in enumerate(job["prompts"]):
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(ids)
        tokens = []
        while len(tokens) < job["max_tokens"]:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            if token in stop:
                break
            tokens.append(token)
            if len(tokens) < job["max_tokens"]:
                llm.eval([token])
        answers.append({"tokens": tokens, "seconds": time.perf_counter() - t0})
        _progress(job, i, tokens, answers[-1]["seconds"])
    system = llama_cpp.llama_print_system_info().decode().strip()
    return {"info": f"llama-cpp-python {llama_cpp.__version__} ({system}), f16 KV",
            "stop_ids": sorted(stop), "answers": answers}


def run_worker(python: str, kind: str, source: Path, job: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="chat_quality_") as folder:
        job_path, out_path = Path(folder) / "job.json", Path(folder) / "out.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        subprocess.run([python, str(Path(__file__).resolve()), "--worker", kind, "--source", str(source),
                        "--job", str(job_path), "--out", str(out_path)], check=True, env=env)
        return json.loads(out_path.read_text())


# -- the driver ------------------------------------------------------------------------------------------------------
def artifact(model: str, matmuls: str, artifacts_dir: Path) -> Path:
    """The artifact of (model, matmuls) in artifacts_dir, compiled there once; an existing one is reused as is."""
    path = artifacts_dir / f"{model}-{matmuls}"
    if not (path / "manifest.json").is_file():
        print(f"compiling {model} --matmuls {matmuls} into {path}", flush=True)
        subprocess.run(["sharpi-compile", model, "--target", "llvm", "--matmuls", matmuls, "--max-context",
                        str(MAX_CONTEXT), "-o", str(path), "--quiet"], check=True)
    return path


def gguf_path(model: str) -> Path:
    from sharpi.frontend.fetch import fetch

    return Path(fetch(model, show_progress=False))


def prompt_style(gguf: Path, asked: str) -> str:
    """chat for a model whose GGUF has a chat template (an instruction-tuned one), completion for one without (a
    base model; sharpi's tokenizer then falls back on a built-in template that such a model was never tuned on)."""
    if asked != "auto":
        return asked
    from sharpi.frontend.gguf_file import GGUFFile

    return "chat" if GGUFFile(gguf).metadata.get("tokenizer.chat_template") else "completion"


def prompts(info, questions: list[dict], style: str) -> list[list[int]]:
    """Each question's prompt ids, tokenized once. chat: one user turn through the model's chat template (special
    tokens parsed, BOS as the GGUF says), what Model.chat feeds its engine; completion: the few-shot Q/A text."""
    from sharpi.common.chat import render_chat

    if style == "completion":
        return [info.tokenize(f"{FEW_SHOT}Q: {q['question']}\nA:") for q in questions]
    t = info.tokenizer.info
    return [info.tokenize(render_chat(t.chat_template, [{"role": "user", "content": q["question"]}],
                                      bos_token=t.bos_token, eos_token=t.eos_token), special=True)
            for q in questions]


def run_model(model: str, questions: list[dict], engines: list[str], args) -> tuple[list[dict], dict]:
    """Every engine's answers to every question for one model: result rows, and each engine's description."""
    from sharpi.runtime.model_info import ModelInfo

    info = ModelInfo(artifact(model, "int8", args.artifacts_dir))
    style = prompt_style(gguf_path(model), args.prompt_style)
    prompt_ids = prompts(info, questions, style)
    outputs = {}
    for engine in engines:
        print(f"  {model} / {engine}", flush=True)
        job = {"prompts": prompt_ids, "ids": [q["id"] for q in questions], "max_tokens": args.max_tokens,
               "threads": args.threads, "n_ctx": MAX_CONTEXT, "label": f"{model} {engine}"}
        if engine == REFERENCE:
            outputs[engine] = run_worker(args.llama_python, "llama", gguf_path(model), job, args.threads)
        else:
            source = artifact(model, MATMULS[engine], args.artifacts_dir)
            outputs[engine] = run_worker(sys.executable, "sharpi", source, job, args.threads)
    stop = set().union(*(o["stop_ids"] for o in outputs.values()))
    rows = []
    for engine, output in outputs.items():
        for q, ids, answer in zip(questions, prompt_ids, output["answers"]):
            tokens = cut_at_stop(answer["tokens"], stop)
            text = answer_part(info.detokenize(tokens, special=False), style)
            rows.append({"model": model, "engine": engine, "style": style, "id": q["id"], "question": q["question"],
                         "prompt_tokens": len(ids), "tokens": tokens, "answer": text,
                         "right": is_right(text, q["answers"]), "seconds": round(answer["seconds"], 3)})
    return rows, {engine: o["info"] for engine, o in outputs.items()}


def machine() -> str:
    from sharpi.common.cpu import usable_cpu_flags

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                "unknown CPU")
    flags = usable_cpu_flags()
    isa = ("AMX" if "amx_int8" in flags else "AVX-512 VNNI" if {"avx512f", "avx512_vnni"} <= flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{name} ({isa}), {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at the start"


# -- the report ------------------------------------------------------------------------------------------------------
def accuracy(rows: list[dict], model: str, engine: str) -> tuple[int, int]:
    mine = [r for r in rows if r["model"] == model and r["engine"] == engine]
    return sum(r["right"] for r in mine), len(mine)


def identical(rows: list[dict], model: str, a: str, b: str) -> int:
    """Questions whose judged answers are the same text under both engines."""
    first = {r["id"]: r["answer"] for r in rows if r["model"] == model and r["engine"] == a}
    return sum(first.get(r["id"]) == r["answer"] for r in rows if r["model"] == model and r["engine"] == b)


def markdown(results: dict, notes: Path | None = None) -> str:
    rows, models, engines = results["rows"], results["models"], results["engines"]
    out = ["# Chat answer quality: sharpi's default CPU path vs llama.cpp", "",
           f"{len(results['questions'])} short chat questions with one right answer each "
           "(benchmarks/chat_quality/questions.json), each through the model's chat template (a base model: a few-shot "
           "Q/A prompt), answered greedily "
           f"(at most {results['max_tokens']} tokens); the same prompt ids go to every engine, so only the "
           "arithmetic differs. Right = one of the question's patterns matches the answer (case-insensitive). "
           "sharpi-int8 is sharpi's default artifact (int8 activations x quantized weights, as llama.cpp), "
           "sharpi-float the `--matmuls float` one (exact float32).", "",
           f"Command: `{results['command']}`", "",
           f"Machine: {results['machine']}; {results['threads']} threads per engine; full run "
           f"{results['wall_s'] / 60:.1f} min.", ""]
    for model in models:
        for engine, info in results["engine_info"].get(model, {}).items():
            out.append(f"- {model} / {engine}: {info}")
    out += ["", "## Accuracy", "", _accuracy_table(rows, models, engines), "",
            f"Acceptance (issue #46): at most {BOUND} questions per model right under llama.cpp and wrong under "
            "sharpi's default. Columns `L+ X-` count questions right under llama.cpp and wrong under X, `X+ L-` the "
            "reverse; `same answer`: answers whose judged text is identical to llama.cpp's. `prompt`: chat (the "
            "model's chat template) or completion (few-shot Q/A for a base model whose GGUF has no chat template; "
            "its answer is the first line). `sign test p`: the two-sided exact sign test (McNemar's) on sharpi-int8's "
            "discordant pairs against llama.cpp's, the chance of a split at least this uneven between two engines "
            "equally often right.", ""]
    if notes is not None and notes.is_file():
        out += [notes.read_text().strip(), ""]
    out += _discordant_lists(rows, models, engines)
    return "\n".join(out).rstrip() + "\n"


def _accuracy_table(rows, models, engines) -> str:
    others = [e for e in engines if e != REFERENCE] if REFERENCE in engines else []
    head = ["model", "prompt"] + [e for e in engines]
    for e in others:
        head += [f"L+ {e}-", f"{e}+ L-", f"same answer {e}"]
    if DEFAULT in others:
        head += ["sign test p", "within bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        cells = [model, next((r["style"] for r in rows if r["model"] == model), "")]
        for e in engines:
            right, n = accuracy(rows, model, e)
            cells.append(f"{right}/{n} ({100 * right / max(n, 1):.0f}%)")
        for e in others:
            model_rows = [r for r in rows if r["model"] == model]
            cells += [str(len(discordant(model_rows, REFERENCE, e))), str(len(discordant(model_rows, e, REFERENCE))),
                      str(identical(rows, model, REFERENCE, e))]
        if DEFAULT in others:
            model_rows = [r for r in rows if r["model"] == model]
            lost, won = len(discordant(model_rows, REFERENCE, DEFAULT)), len(discordant(model_rows, DEFAULT, REFERENCE))
            cells.append(f"{sign_test_p(lost, won):.2f}")
            cells.append("yes" if lost <= BOUND else f"**no** ({lost} > {BOUND})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sign_test_p(lost: int, won: int) -> float:
    """Two-sided exact sign test (McNemar's exact test) on the discordant pairs: the chance of a split at least
    this uneven if neither engine were more often right than the other."""
    n, k = lost + won, min(lost, won)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _discordant_lists(rows, models, engines) -> list[str]:
    if REFERENCE not in engines:
        return []
    out = ["## Discordant questions", ""]
    for model in models:
        model_rows = [r for r in rows if r["model"] == model]
        for e in (e for e in engines if e != REFERENCE):
            for right, wrong in ((REFERENCE, e), (e, REFERENCE)):
                pairs = discordant(model_rows, right, wrong)
                out.append(f"### {model}: right under {right}, wrong under {wrong} ({len(pairs)})")
                out.append("")
                for a, b in pairs:
                    out.append(f"- **{a['question']}** ({a['id']})")
                    out.append(f"  - {right}: {_quote(a['answer'])}")
                    out.append(f"  - {wrong}: {_quote(b['answer'])}")
                out.append("")
    return out


def _quote(text: str) -> str:
    return "`" + " ".join(text.split()).replace("`", "'") + "`" if text.strip() else "(empty)"


def plot(results: dict, path: Path) -> bool:
    """Accuracy bars, one group per model, one bar per engine; False (and nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models, engines, rows = results["models"], results["engines"], results["rows"]
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for k, engine in enumerate(engines):
        values = [100 * accuracy(rows, m, engine)[0] / max(accuracy(rows, m, engine)[1], 1) for m in models]
        bars = ax.bar([i + (k - (len(engines) - 1) / 2) * width for i in range(len(models))], values, width,
                      label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("questions right (%)")
    ax.set_ylim(0, 120)             # room above the bars for the legend
    ax.set_title(f"Chat answer quality ({len(results['questions'])} questions, greedy)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncols=len(engines))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- command line ----------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated known model names")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--artifacts-dir", type=Path, default=Path("/tmp/cq"),
                   help="where <model>-int8 and <model>-float artifacts are (compiled there if missing)")
    p.add_argument("--llama-python", default="/work/llama-venv/bin/python",
                   help="a Python with llama-cpp-python installed")
    p.add_argument("--questions", type=Path, default=QUESTIONS)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions (a quick look)")
    p.add_argument("--prompt-style", choices=PROMPT_STYLES, default="auto",
                   help="auto: the chat template where the GGUF has one, else the few-shot completion prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=HERE / "chat_quality", help="where results.json goes")
    p.add_argument("--md", type=Path, default=HERE / "chat_quality.md")
    p.add_argument("--plot", type=Path, default=HERE / "chat_quality.png")
    p.add_argument("--notes", type=Path, default=NOTES, help="Markdown put in the report after the table, if present")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the report and plot from --out-dir's results.json without running anything")
    # a worker process: one engine's answers (internal)
    p.add_argument("--worker", choices=("sharpi", "llama"), help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.source, args.job, args.out)
        return
    if args.report_only:
        write_report(json.loads((args.out_dir / "results.json").read_text()), args)
        return
    t0 = time.perf_counter()
    questions = load_questions(args.questions)[:args.limit]
    models = args.models.split(",")
    engines = [e for e in ENGINES if e in args.engines.split(",")]
    results = {"command": " ".join(["python", "benchmarks/chat_quality.py", *sys.argv[1:]]), "machine": machine(),
               "threads": args.threads, "max_tokens": args.max_tokens, "models": models, "engines": engines,
               "questions": questions, "engine_info": {}, "rows": []}
    print(results["machine"], flush=True)
    for model in models:
        rows, info = run_model(model, questions, engines, args)
        results["rows"] += rows
        results["engine_info"][model] = info
        print("  " + ", ".join(f"{e} {accuracy(rows, model, e)[0]}/{len(questions)}" for e in engines), flush=True)
    results["wall_s"] = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    write_report(results, args)
    print(f"wrote {args.out_dir / 'results.json'}; {results['wall_s'] / 60:.1f} min", flush=True)


def write_report(results: dict, args) -> None:
    args.md.write_text(markdown(results, args.notes))
    if not plot(results, args.plot):
        print("matplotlib is not installed: no plot", flush=True)
    print(_accuracy_table(results["rows"], results["models"], results["engines"]))
    print(f"wrote {args.md}", flush=True)


if __name__ == "__main__":
    main()
