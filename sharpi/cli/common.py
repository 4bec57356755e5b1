"""What both CLIs share: turning SharpiErrors into one sentence and exit code 2, and the run-time flags."""
from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path

from ..common.errors import ConfigError, SharpiError, SharpiNote, SharpiWarning
from ..common.settings import parse_int, parse_positive_int
from ..common.snapkv_settings import KNOBS, PREFIX
from ..common.speculative_settings import MAX_DRAFT, speculative_settings
from ..runtime.sampling import SamplingParams
from ..runtime.scorers import SCORERS

EXIT_USER_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (an unknown flag, a missing argument, "--threads x") are a ConfigError,
    so they are one `error:` line and exit code 2 like every other bad value, not the usage and a prefixed
    message. Subparsers are made of the same class."""

    def error(self, message: str):
        raise ConfigError(f"{message[0].upper()}{message[1:]} (see {self.prog} --help).")


def user_errors_exit_2(main):
    """Run a CLI entry point; a SharpiError (bad input) prints its sentence and exits 2, never a traceback; a
    SharpiWarning is one `warning:` line (a SharpiNote, a setting sharpi adjusted, one `note:` line), printed when
    it is raised (before a generation's text, not after it)."""
    @functools.wraps(main)
    def wrapper(argv=None):
        with warnings.catch_warnings():          # restores the filters and showwarning on the way out
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            try:
                return main(argv) or 0
            except SharpiError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return EXIT_USER_ERROR
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                return 130
    return wrapper


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, SharpiWarning):
        print(f"{'note' if issubclass(category, SharpiNote) else 'warning'}: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def add_device_flags(parser) -> None:
    """The flags of loading an artifact: threads, the Vulkan adapter, the pinned manifest sha256, mlock."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the kernels (default: SHARPI_NUM_THREADS or all available)")
    parser.add_argument("--expect-sha256", default=None, metavar="HEX",
                        help="refuse the artifact unless its manifest.json has this sha256 (sharpi-compile prints "
                             "it; every file is then verified before anything is loaded). An artifact is code: pin "
                             "one you did not build")
    parser.add_argument("--adapter", default=None,
                        help="vulkan artifacts: part of the adapter's name (default: SHARPI_VULKAN_ADAPTER or the "
                             "highest-performance adapter; `sharpi adapters` lists them)")
    parser.add_argument("--mlock", action="store_true",
                        help="CPU artifacts: read the weights in at load and lock them in memory, so that none is "
                             "dropped and read from disk again (as llama.cpp's --mlock; needs `ulimit -l` room)")


MODEL_HELP = ("an artifact folder, a .gguf file or a known model name (a GGUF or a name is compiled for this "
              "machine into the compile cache on first use)")


def load_model(args):
    """The model args.artifact names (see artifact_path), loaded with the device flags."""
    import sharpi
    return sharpi.load(args.artifact, show_progress=True, threads=args.threads, adapter=args.adapter,
                       expect_sha256=args.expect_sha256, lock_weights=args.mlock, **already_checked(args))


def artifact_path(model: str) -> Path:
    """The artifact folder a command's MODEL argument names: a folder as it is, a GGUF file or known model name
    compiled into the compile cache on first use (one line and the compile's progress on stderr) and found there
    after (sharpi.artifact_source: the one resolver sharpi.load uses too)."""
    return _resolved(model).path


def resolve_model_arg(args) -> None:
    """args.artifact made the artifact folder it names (artifact_path), remembering whether that folder's files
    were hashed just now (a cache entry), so that loading it does not hash them again (already_checked)."""
    resolved = _resolved(args.artifact)
    args.artifact, args.artifact_checked = str(resolved.path), resolved.checked


def already_checked(args) -> dict:
    """sharpi.load's verify=False where resolve_model_arg found args.artifact's files hashed a moment ago."""
    return {"verify": False} if getattr(args, "artifact_checked", False) else {}


def _resolved(model: str):
    from ..artifact_source import resolve_artifact
    return resolve_artifact(model, show_progress=True)


def add_sampling_flags(parser, *, chat: bool) -> None:
    """-n and the sampling flags. Unset flags take the command's defaults: greedy for `run` (reproducible
    completions), the model's own for `chat` (sampling_defaults)."""
    parser.add_argument("-n", "--max-tokens", type=int, default=256,
                        help="most tokens to generate (default 256; generation ends earlier at the model's end "
                             "token)")
    default = ("the GGUF's general.sampling, else llama.cpp's: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05"
               if chat else "greedy: temperature 0")
    parser.add_argument("--temperature", type=float, default=None, help=f"0 = greedy (default: {default})")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repeat-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")


def sampling_kwargs(args, defaults: dict | None = None) -> dict:
    """The sampling options: each flag given, else its value in `defaults` (None: SamplingParams' greedy ones)."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    return {**(defaults or {}), **given, "seed": args.seed, "stop": args.stop}


def generation_options(model, args, sampling_defaults: dict | None = None) -> dict:
    """The sampling (flags over `sampling_defaults`), SnapKV and --compress flags as generate()/chat() take them,
    checked now, before any generation (chat would otherwise meet a bad value only after the first message); the
    SnapKV settings resolved once (a note if the budget shrank the default recency)."""
    parse_positive_int(args.max_tokens, "--max-tokens", allow_zero=True)
    sampling = sampling_kwargs(args, sampling_defaults)
    SamplingParams(**{k: v for k, v in sampling.items() if k != "stop"}).validate()
    compress = compress_flag(args)
    model.scorer(compress)          # SHARPI_COMPRESS when the flag is not given; an artifact that cannot score
    settings, budget = model.snapkv_settings(**snapkv_knobs(args))
    if compress not in (None, "snapkv") and not budget:
        warnings.warn(f"--compress {compress} changes nothing while SnapKV's budget is 0 (eviction off, the "
                      f"default on CPU): give --snapkv-budget N.", SharpiWarning)
    options = {**sampling, "snapkv": settings, **speculative_options(model, args)}
    if compress is not None:
        options["compress"] = compress
    return options


def add_speculative_flags(parser) -> None:
    parser.add_argument("--speculative", default=None, metavar="METHOD",
                        help="speculative decoding, faster where the answer repeats the prompt (code edits, "
                             "quotes) and as exact as plain decoding: lookup (drafts copied from the prompt and "
                             "the answer), draft (a smaller model's: --draft), off (default; draft with --draft)")
    parser.add_argument("--draft", default=None, metavar="MODEL",
                        help="a draft model for --speculative draft: a compiled artifact (or model name) of the "
                             "same vocabulary, smaller than MODEL")
    parser.add_argument("--draft-max", type=int, default=None, metavar="K",
                        help="the most drafted tokens one forward verifies (default 16; fewer are verified where "
                             "the measured acceptance says more would not pay)")


def speculative_options(model, args) -> dict:
    """generate()'s speculative= and draft= from the flags, checked (the draft model loaded once)."""
    method, draft, k = getattr(args, "speculative", None), getattr(args, "draft", None), getattr(args, "draft_max", None)
    if method is None and draft is None and k is None:
        return {}
    value = {} if method is None else {"method": method.strip().lower()}
    if k is not None:
        value["max_draft"] = parse_int(k, "--draft-max", 1, MAX_DRAFT)
    if method is None and draft is None:
        value["method"] = "lookup"
    speculative_settings(value, draft=draft is not None)      # a bad combination is said before any loading
    options = {"speculative": value}
    if draft is not None:
        options["draft"] = model.draft_model(artifact_path(draft))
    return options


def add_compress_flag(parser) -> None:
    parser.add_argument("--compress", default=None, metavar="SCORER",
                        help="what ranks the prompt's positions when SnapKV evicts (a budget is needed): snapkv "
                             "(the prompt's own last queries: best when the question ends the prompt), or for "
                             "questions asked after the compression kvzip, probe, keydiff or hybrid "
                             "(default: SHARPI_COMPRESS, else snapkv)")


def compress_flag(args) -> str | None:
    """--compress's scorer, lower-cased (None: not given, so SHARPI_COMPRESS or snapkv decides)."""
    given = getattr(args, "compress", None)
    if given is None:
        return None
    name = given.strip().lower()
    if name not in SCORERS:
        raise ConfigError(f"--compress must be one of {', '.join(SCORERS)}, got {given!r}.")
    return name


STDIN = "-"


def add_prompt_flags(parser) -> None:
    """-p TEXT and/or --file PATH (a document, then the question after it); `-` for either reads stdin."""
    parser.add_argument("-p", "--prompt", metavar="TEXT",
                        help="the prompt, or with --file the question about the document; - reads it from stdin")
    parser.add_argument("--file", metavar="PATH",
                        help="read the prompt from a UTF-8 text file (- : stdin); with -p, the file is a document "
                             "and -p the question after it; one trailing newline is dropped, as llama.cpp's -f "
                             "does")


def prompt_text(args) -> str:
    """The prompt -p and --file give (either `-`: stdin): the file's text, the -p text, or the document, a blank
    line and the question (as `sharpi chat --file` puts them)."""
    if args.prompt is None and args.file is None:
        raise ConfigError("Give the prompt with -p TEXT or --file PATH (or both: a document and a question about it).")
    if args.prompt == STDIN and args.file == STDIN:
        raise ConfigError("-p - and --file - would both read stdin: give the document's path or the question's text.")
    document = read_text(args.file, "--file") if args.file is not None else None
    question = read_text(STDIN, "-p") if args.prompt == STDIN else args.prompt
    if document is None:
        return question
    return document if question is None else f"{document}\n\n{question}"


def read_text(path: str, flag: str) -> str:
    """A UTF-8 text file's contents (`-`: stdin's), a leading byte-order mark and one trailing newline dropped;
    a missing, unreadable, non-UTF-8 or empty file is one sentence (a ConfigError)."""
    if path == STDIN:
        what = "stdin"
        stream = sys.stdin
        if stream is None:
            raise ConfigError(f"{flag} - reads stdin, and this process has none.")
        if getattr(stream, "isatty", lambda: False)():
            print("sharpi: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
        data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read().encode("utf-8")
    else:
        what = f"{flag} {path}"
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{what} does not exist.") from None
        except IsADirectoryError:
            raise ConfigError(f"{what} is a directory, not a text file.") from None
        except PermissionError:
            raise ConfigError(f"{what} cannot be read: permission denied.") from None
        except OSError as exc:
            raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}.") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          f"convert it first, e.g. with iconv -t UTF-8.") from None
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise ConfigError(f"{what} is empty: there is no prompt in it.")
    return text


def print_compression(result, settings) -> None:
    """--verbose: what SnapKV's eviction did to the prompt (scorer, budget and settings, the slots each layer
    kept); nothing when the prompt was not evicted."""
    st = result.stats
    if not st.get("evicted"):
        return
    kept, prompt = st["kv_slots_per_layer_after_prefill"], st["prompt_tokens"]
    if len(set(kept)) == 1:
        slots = f"kept {kept[0]} of the prompt's {prompt} slots in each of {len(kept)} layers"
    else:
        slots = (f"kept {'/'.join(map(str, kept))} (mean {sum(kept) / len(kept):.0f}) of the prompt's {prompt} "
                 f"slots, by layer")
    sinks = f", sinks {settings.sinks}" if settings.sinks else ""
    print(f"[compression: scorer {st['scorer']}, budget {st['snapkv_budget']} (recency {settings.recency}, "
          f"window {settings.window}{sinks}, pooling {settings.pooling}/{settings.kernel}, {settings.granularity}, "
          f"{settings.allocation}); {slots}]", file=sys.stderr)


def add_snapkv_flags(parser) -> None:
    """The SnapKV knobs (run-time flags; on sharpi-compile they set the artifact's defaults)."""
    parser.add_argument("--snapkv-budget", default=None, help="auto (default: off on CPU), 0 = off, or N slots")
    parser.add_argument("--snapkv-window", default=None, help="last queries that score the prompt (64)")
    parser.add_argument("--snapkv-recency", default=None, help="last positions always kept (64)")
    parser.add_argument("--snapkv-pooling", default=None, help="max (default), avg or none")
    parser.add_argument("--snapkv-kernel", default=None, help="odd pooling kernel (31)")
    parser.add_argument("--snapkv-granularity", default=None, help="kv-head (default) or shared")
    parser.add_argument("--snapkv-sinks", default=None, help="first positions always kept (0)")
    parser.add_argument("--snapkv-allocation", default=None,
                        help="the budget per layer: uniform (default), pyramid (PyramidKV: more in early layers) "
                             "or scores (one threshold over every layer's scores, KVzip's)")


def snapkv_knobs(args) -> dict:
    """The SnapKV flags given, by knob: {"budget": "256", ...} (each parsed where it is resolved)."""
    return {knob: getattr(args, f"snapkv_{knob}") for knob in KNOBS if getattr(args, f"snapkv_{knob}") is not None}


def snapkv_keywords(args) -> dict:
    """The SnapKV flags given, as the API's keyword arguments (snapkv_budget=...)."""
    return {PREFIX + knob: value for knob, value in snapkv_knobs(args).items()}
