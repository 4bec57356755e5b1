"""sharpi eval TASK ARTIFACT: long-context accuracy swept over prompt length, needle depth, SnapKV budget and
settings, written to a resumable JSON file, with heatmaps, an accuracy-vs-budget chart and a Markdown table.
`sharpi eval ruler ARTIFACT` runs the RULER-style suite (--tasks, all six by default) into one file and scores
it as a whole. `sharpi eval report RESULTS.json` redraws the plots and tables from a results file alone."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..common.errors import ConfigError
from ..eval.tasks import RULER_TASKS, TASKS
from .common import MODEL_HELP, add_device_flags, add_snapkv_flags, load_model

TASK_CHOICES = (*TASKS, "ruler", "report")
EPILOG = """SnapKV: --snapkv-pooling, --snapkv-kernel, --snapkv-granularity, --snapkv-sinks and --snapkv-allocation take
comma lists; every combination is one setting (one line in the charts), run on the same prefill as the others.
--snapkv-window and
--snapkv-recency take one value. Budget 0 is the full cache. Rerunning with the same --out resumes: cells already
in the file are not recomputed.

example: sharpi eval passkey smollm2-llvm --lengths 2000,4000 --depths 0,50,100 --budgets 0,256,512 --trials 5 \\
    --snapkv-granularity kv-head,shared --out passkey.json
the question after the compression: sharpi eval multikey DIR --protocol agnostic --scorers snapkv,kvzip
the suite, by compression ratio, several questions per compression: sharpi eval ruler DIR --protocol agnostic \
    --scorers snapkv,kvzip,probe --budgets 0 --ratios 50,75 --questions all --lengths 4000 --out ruler.json"""


def add_eval_parser(sub) -> None:
    """Register `sharpi eval` on the `sharpi` CLI's subparsers."""
    e = sub.add_parser("eval", help="long-context accuracy sweeps (passkey, the RULER-style suite) with plots",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("task", choices=TASK_CHOICES,
                   help="the task, `ruler` for the suite (--tasks), or `report` to redraw from a results file")
    e.add_argument("--tasks", type=_names, default=list(RULER_TASKS),
                   help=f"with `ruler`: the suite's tasks, comma-separated (default {','.join(RULER_TASKS)})")
    e.add_argument("artifact", metavar="MODEL", help=f"{MODEL_HELP}; with `report`: the results JSON")
    e.add_argument("--lengths", type=_list_of(int), default=[2000, 4000],
                   help="prompt lengths in tokens, comma-separated (default 2000,4000)")
    e.add_argument("--depths", type=_list_of(float), default=[0, 25, 50, 75, 100],
                   help="needle depths in percent, comma-separated (default 0,25,50,75,100)")
    e.add_argument("--budgets", type=_list_of(int), default=[0, 256, 512, 1024],
                   help="SnapKV budgets, comma-separated; 0 = the full cache (default 0,256,512,1024)")
    e.add_argument("--ratios", type=_list_of(int), default=[],
                   help="compression ratios in percent of the compressed tokens evicted, comma-separated, beside "
                        "--budgets (the budget follows each prompt's length); e.g. 50,75,90")
    e.add_argument("--trials", type=int, default=5, help="prompts per (length, depth) (default 5)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default=None, help="results JSON, resumed if it exists (default eval-TASK.json)")
    e.add_argument("--report", default=None,
                   help="directory for report.md and the PNG plots (default: beside --out, OUT-report)")
    e.add_argument("--no-plots", action="store_true", help="write the Markdown table only")
    e.add_argument("--show-kept", action="store_true",
                   help="save each layer's kept positions (first trial) and plot them over the prompt")
    e.add_argument("--scorers", type=_names, default=["snapkv"],
                   help="what ranks the positions, comma-separated: snapkv (the prompt's last queries), kvzip (how "
                        "much repeating the context needs each), probe (a generic instruction's queries), keydiff "
                        "(how unlike the mean key each key is); all rank one prefill (default snapkv)")
    e.add_argument("--protocol", choices=("aware", "agnostic"), default="aware",
                   help="aware: the question is in the compressed prompt; agnostic: the context is compressed and "
                        "the question asked after (default aware)")
    e.add_argument("--questions", choices=("first", "all"), default="first",
                   help="with --protocol agnostic: all asks every follow-up question a task has (other keys of the "
                        "same document) on forks of one compressed cache, each scored (default first)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    add_snapkv_flags(e)
    add_device_flags(e)


def _list_of(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated non-negative numbers, got {text!r}")
        return values
    return parse


def _names(text: str) -> list[str]:
    return [v.strip().lower() for v in text.split(",") if v.strip()]


def _choices(text: str | None) -> list:
    """A comma list of one SnapKV knob (validated when the settings are resolved); [None] = the default."""
    if text is None:
        return [None]
    return [v.strip() for v in str(text).split(",") if v.strip()] or [None]


def cmd_eval(args) -> int:
    if args.task == "report":
        return _report_only(args)
    if args.snapkv_budget is not None:
        raise ConfigError("sharpi eval sweeps --budgets; --snapkv-budget does not apply.")
    from ..eval.sweep import Results, SweepConfig, check_config, model_identity, resolve_settings, run_sweep

    tasks = _suite_tasks(args.tasks) if args.task == "ruler" else [args.task]
    out = Path(args.out or f"eval-{args.task}.json")
    model = load_model(args)
    results = Results(out, model_identity(model))        # a file of another model is refused before any work
    window, settings = resolve_settings(
        model, window=args.snapkv_window, recency=args.snapkv_recency, poolings=_choices(args.snapkv_pooling),
        kernels=_choices(args.snapkv_kernel), granularities=_choices(args.snapkv_granularity),
        sinks=_choices(args.snapkv_sinks), allocations=_choices(args.snapkv_allocation), budgets=args.budgets)
    configs = [SweepConfig(task=task, lengths=args.lengths, depths=args.depths, budgets=args.budgets,
                           trials=args.trials, seed=args.seed, settings=settings, window=window,
                           show_kept=args.show_kept, scorers=args.scorers, protocol=args.protocol,
                           ratios=args.ratios, questions=args.questions) for task in tasks]
    for config in configs:
        check_config(model, config)          # every task's errors before the first one's work
    for config in configs:
        run_sweep(model, config, results, progress=not args.quiet)
    _write_report(results, _report_dir(args, out), args, tasks=tasks)
    return 0


def _suite_tasks(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        got = unknown[0] if unknown else "none"
        raise ConfigError(f"--tasks takes a comma list of {', '.join(TASKS)}, got {got}.")
    return list(dict.fromkeys(names))


def _report_only(args) -> int:
    from ..eval.sweep import Results
    path = Path(args.artifact)
    if not path.is_file():
        raise ConfigError(f"{path} is not a results file; `sharpi eval report` takes the JSON a sweep wrote.")
    results = Results(path)
    _write_report(results, _report_dir(args, path), args, tasks=None)
    return 0


def _report_dir(args, out: Path) -> Path:
    return Path(args.report) if args.report else out.with_name(out.stem + "-report")


def _write_report(results, directory: Path, args, tasks) -> None:
    from ..eval.report import write_report
    text, files = write_report(results, directory, plots=not args.no_plots, show_kept=args.show_kept,
                               tasks=tasks)
    print(text)
    print(f"[results: {results.path}; report and {len(files) - 1} plots in {directory}]", file=sys.stderr)
