"""What both CLIs share: turning SharpiErrors into one sentence and exit code 2, and the run-time flags."""
from __future__ import annotations

import argparse
import functools
import sys
import warnings

from ..common.errors import ConfigError, SharpiError, SharpiWarning
from ..common.settings import parse_positive_int
from ..common.snapkv_settings import KNOBS, PREFIX
from ..runtime.sampling import SamplingParams

EXIT_USER_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (an unknown flag, a missing argument, "--threads x") are a ConfigError,
    so they are one `error:` line and exit code 2 like every other bad value, not the usage and a prefixed
    message. Subparsers are made of the same class."""

    def error(self, message: str):
        raise ConfigError(f"{message[0].upper()}{message[1:]} (see {self.prog} --help).")


def user_errors_exit_2(main):
    """Run a CLI entry point; a SharpiError (bad input) prints its sentence and exits 2, never a traceback; a
    SharpiWarning is one `warning:` line."""
    @functools.wraps(main)
    def wrapper(argv=None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            try:
                return main(argv) or 0
            except SharpiError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return EXIT_USER_ERROR
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                return 130
            finally:
                _print_warnings(caught)
    return wrapper


def _print_warnings(caught) -> None:
    for w in caught:
        if issubclass(w.category, SharpiWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))


def add_device_flags(parser) -> None:
    """The flags of loading an artifact: threads, the Vulkan adapter, the pinned manifest sha256."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the kernels (default: SHARPI_NUM_THREADS or all available)")
    parser.add_argument("--expect-sha256", default=None, metavar="HEX",
                        help="refuse the artifact unless its manifest.json has this sha256 (sharpi-compile prints "
                             "it; every file is then verified before anything is loaded). An artifact is code: pin "
                             "one you did not build")
    parser.add_argument("--adapter", default=None,
                        help="vulkan artifacts: part of the adapter's name (default: SHARPI_VULKAN_ADAPTER or the "
                             "highest-performance adapter; `sharpi adapters` lists them)")


def load_model(args):
    import sharpi
    return sharpi.load(args.artifact, threads=args.threads, adapter=args.adapter, expect_sha256=args.expect_sha256)


def add_sampling_flags(parser) -> None:
    parser.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repeat-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop)


def generation_options(model, args) -> dict:
    """The sampling and SnapKV flags as generate()/chat() take them, checked now, before any generation (chat
    would otherwise meet a bad value only after the first message); the SnapKV settings resolved once."""
    parse_positive_int(args.max_tokens, "--max-tokens", allow_zero=True)
    SamplingParams(**{k: v for k, v in sampling_kwargs(args).items() if k != "stop"}).validate()
    settings, _ = model.snapkv_settings(**snapkv_knobs(args))
    return {**sampling_kwargs(args), "snapkv": settings}


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
