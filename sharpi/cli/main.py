"""sharpi fetch | inspect | run | chat | serve | adapters | bench | eval | check | cache: use compiled artifacts and
known models."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import compile_cache
from ..common.errors import ConfigError, ContextLengthError
from ..common.settings import parse_positive_int
from ..frontend.fetch import fetch
from ..frontend.inspect import describe

from .common import (MODEL_HELP, STDIN, ArgumentParser, add_compress_flag, add_device_flags, add_prompt_flags,
                     add_sampling_flags, add_snapkv_flags, add_speculative_flags, generation_options, load_model,
                     print_compression, prompt_text, read_text, user_errors_exit_2)
from .bench import run_bench
from .check import add_check_parser, cmd_check
from .eval import add_eval_parser, cmd_eval
from .serve import add_serve_parser, cmd_serve


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="sharpi", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download and verify a known model")
    f.add_argument("name")

    i = sub.add_parser("inspect", help="show a GGUF's architecture, config, tensor types and tokenizer")
    i.add_argument("model", help="a .gguf path or a known model name")
    i.add_argument("--json", action="store_true")

    r = sub.add_parser("run", help="answer one prompt (-p TEXT, --file PATH, or either - for stdin), greedy")
    r.add_argument("artifact", metavar="MODEL", help=MODEL_HELP)
    add_prompt_flags(r)
    r.add_argument("--raw", action="store_true",
                   help="continue the prompt's text as it is (a completion) instead of sending it as a user "
                        "message through the model's chat template (the default where the GGUF has one)")
    r.add_argument("--verbose", action="store_true",
                   help="print timing, the artifact's target and, when SnapKV evicted, what the compression kept")
    add_sampling_flags(r, chat=False)
    add_snapkv_flags(r)
    add_compress_flag(r)
    add_speculative_flags(r)
    add_device_flags(r)

    c = sub.add_parser("chat", help="chat with the model (its GGUF chat template)")
    c.add_argument("artifact", metavar="MODEL", help=MODEL_HELP)
    c.add_argument("--file", metavar="PATH",
                   help="a UTF-8 text document to ask about: it opens the first user message, your first question "
                        "after it (a user turn, not a system message: every chat template takes one, and SnapKV's "
                        "scoring queries, the prompt's last, then read the question about it); it stays in the "
                        "conversation for the later questions")
    c.add_argument("--verbose", action="store_true", help="after each answer, print its timing and, when SnapKV "
                                                          "evicted, what the compression kept")
    add_sampling_flags(c, chat=True)
    add_snapkv_flags(c)
    add_compress_flag(c)
    add_speculative_flags(c)
    add_device_flags(c)

    sub.add_parser("adapters", help="list the Vulkan adapters (the vulkan target's devices)")

    b = sub.add_parser("bench", help="prefill and decode speed")
    b.add_argument("artifact", metavar="MODEL", help=MODEL_HELP)
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--gen-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--compare-llama-cpp", action="store_true",
                   help="run llama.cpp (llama-cpp-python) on the same GGUF and threads, and print ratios")
    add_snapkv_flags(b)
    add_speculative_flags(b)
    b.add_argument("--gguf", default=None, help="the GGUF for --compare-llama-cpp (default: found by its sha256)")
    add_device_flags(b)

    add_eval_parser(sub)
    add_check_parser(sub)
    add_serve_parser(sub)

    k = sub.add_parser("cache", help="list the compile cache's artifacts (least recently used first), or clear it")
    k.add_argument("--clear", action="store_true", help="delete every cached compile")
    return p


@user_errors_exit_2
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


def cmd_fetch(args) -> int:
    print(fetch(args.name))
    return 0


def cmd_inspect(args) -> int:
    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key:>16}: {value}")
    return 0


def cmd_run(args) -> int:
    prompt = prompt_text(args)                     # a bad --file is one sentence before the model loads
    model = load_model(args)
    options = generation_options(model, args)
    templated = model.has_chat_template and not args.raw
    if templated:          # as llama-cli and ollama run do: an instruct model answers a message
        prompt = model.chat_prompt([{"role": "user", "content": prompt}])
    stream = model.stream(prompt, args.max_tokens, **options)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        _print_stats(model, stream.result, options["snapkv"], "chat template" if templated else "raw")
    return 0


def _print_stats(model, result, settings, prompt_form: str = "chat template") -> None:
    st = result.stats
    print(f"[{model.backend}; prompt {st['prompt_tokens']} tokens ({prompt_form}) "
          f"at {st['prefill_tok_s']:.1f} tok/s; {st['generated_tokens']} generated at {st['decode_tok_s']:.1f} "
          f"tok/s; finish: {result.finish_reason}; KV after prefill: {st['kv_slots_after_prefill']} slots "
          f"a layer, {st['kv_bytes_after_prefill'] / 2**20:.1f} MiB{' (SnapKV evicted)' if st['evicted'] else ''}]",
          file=sys.stderr)
    if st["speculative"] != "off":
        print(f"[speculative {st['speculative']}: {st['accepted_tokens']} of {st['drafted_tokens']} drafted tokens "
              f"accepted in {st['verifications']} verifications]", file=sys.stderr)
    print_compression(result, settings)


def cmd_chat(args) -> int:
    if args.file == STDIN:
        raise ConfigError("chat reads your questions from stdin, so --file - cannot read the document from it: "
                          "give the document's path.")
    document = read_text(args.file, "--file") if args.file is not None else None
    model = load_model(args)
    # checked now, not after the user has typed the first message
    options = generation_options(model, args, model.sampling_defaults)
    if args.verbose:
        print(f"sharpi chat: sampling {_sampling_line(options)}", file=sys.stderr)
    if document is not None:                       # too long for the context: said now, not after the question
        tokens = len(model.tokenize(document))
        if tokens >= model.max_context:
            raise ContextLengthError(f"--file {args.file} has {tokens} tokens, which leaves no room for a question "
                                     f"in the context of {model.max_context}.")
        print(f"sharpi chat: {args.file} ({tokens} tokens) goes before your first question", file=sys.stderr)
    messages = []
    print("sharpi chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        content = f"{document}\n\n{line}" if document is not None and not messages else line
        messages.append({"role": "user", "content": content})
        result = model.chat(messages, max_tokens=args.max_tokens, **options)
        print(result.text)
        if args.verbose:
            _print_stats(model, result, options["snapkv"])
        messages.append({"role": "assistant", "content": result.text})
    return 0


def _sampling_line(options: dict) -> str:
    if not options["temperature"]:
        return "greedy"
    return (f"temperature {options['temperature']:g}, top-k {options['top_k']}, top-p {options['top_p']:g}, "
            f"min-p {options['min_p']:g}, repeat penalty {options['repeat_penalty']:g}")


def cmd_adapters(args) -> int:
    from ..runtime.vulkan import list_adapters
    adapters = list_adapters()
    if not adapters:
        print("no Vulkan adapters (on Debian or Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1)")
    for a in adapters:
        f16 = "shader-f16" if "shader-f16" in a["features"] else "no shader-f16"
        print(f"{a['name']}  ({a['type']}, {a['backend']}, {f16})")
    return 0


def cmd_bench(args) -> int:
    _check_bench_flags(args)
    run_bench(args)
    return 0


def _check_bench_flags(args) -> None:


    parse_positive_int(args.prompt_tokens, "--prompt-tokens")
    parse_positive_int(args.gen_tokens, "--gen-tokens", allow_zero=True)
    parse_positive_int(args.repeats, "--repeats")
    if args.gguf is not None and not Path(args.gguf).is_file():
        raise ConfigError(f"--gguf {args.gguf} does not exist or is not a file.")


def cmd_cache(args) -> int:

    limit = compile_cache.limit_bytes()
    listed = compile_cache.clear() if args.clear else compile_cache.entries(unfinished=True)
    for entry in listed:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
        what = "last used" if entry.finished else "killed compile, started"
        shared = f"  ({entry.shared / 2**20:.1f} MiB shared with output folders)" if entry.shared else ""
        print(f"{entry.nbytes / 2**20:8.1f} MiB  {what} {used}  {entry.path.name}{shared}")
    total = sum(e.nbytes for e in listed) / 2**30        # each file once, however many names it has
    shared = sum(e.shared for e in listed) / 2**30
    killed = sum(not e.finished for e in listed)
    compiles = f"{len(listed) - killed} cached compiles"
    if killed:
        compiles += f" and {killed} killed compiles' leftovers"
    if args.clear:
        kept = f"; {shared:.2f} GiB of it stays in the output folders that share it" if shared else ""
        print(f"deleted {compiles} ({total:.2f} GiB) from {compile_cache.cache_root()}{kept}")
    else:
        over = " (over it: the next compile deletes the least recently used)" if total * 2**30 > limit else ""
        print(f"{compiles}, {total:.2f} GiB of {limit / 2**30:g} GiB (SHARPI_CACHE_GB){over} in "
              f"{compile_cache.cache_root()}")
    return 0


COMMANDS = {"fetch": cmd_fetch, "inspect": cmd_inspect, "run": cmd_run, "chat": cmd_chat, "adapters": cmd_adapters,
            "bench": cmd_bench, "eval": cmd_eval, "check": cmd_check, "cache": cmd_cache,
            "serve": cmd_serve}

if __name__ == "__main__":
    sys.exit(main())
