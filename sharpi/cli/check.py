"""sharpi check ART [ART2 ...]: the conformance suite (sharpi/testing/conformance.py) on compiled artifacts (or a
GGUF or known model name: its cached compile, compiled on first use), one pass/fail table per artifact, as
`sharpi-compile --check` prints it. Exit code 0 when every check passed (or was
skipped), 1 when a check failed, 2 for bad input (a path that is not an artifact, a reference GGUF not found)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..common.errors import ArtifactError, ConfigError
from ..common.settings import parse_positive_int
from ..testing.options import SUITE_OPTIONS
from .common import MODEL_HELP, artifact_path

def add_check_parser(sub) -> None:
    """Register `sharpi check` on the `sharpi` CLI's subparsers; its options are the pytest plugin's
    (sharpi.testing.options), without the --sharpi- prefix."""
    c = sub.add_parser("check", help="run the conformance suite on compiled artifacts (exit 1 if a check fails)",
                       description=__doc__)
    c.add_argument("artifacts", nargs="+", metavar="ARTIFACT", help=f"{MODEL_HELP}; each in turn")
    for name, option in SUITE_OPTIONS.items():
        c.add_argument(f"--{name}", **option)       # --decode-tokens is checked by parse_positive_int in cmd_check


def cmd_check(args) -> int:
    # The suite runs through conformance.run_and_report, not through pytest with the plugin: the checks are the
    # same (each of the plugin's test_<check> is one Suite.run(<check>) on the same Suite, in the same order),
    # and this way the command works on a plain `pip install .`, which brings no pytest: the very install whose
    # user found `pytest --sharpi-artifact` unrecognized. pytest with the plugin stays the way to run your own
    # tests beside the suite (the sharpi_* fixtures).
    from ..testing import conformance

    options = {"prompt": args.prompt or conformance.DEFAULT_PROMPT,
               "decode_tokens": conformance.DECODE_TOKENS if args.decode_tokens is None
               else parse_positive_int(args.decode_tokens, "--decode-tokens")}
    for path in args.gguf:
        if not Path(path).expanduser().is_file():
            raise ConfigError(f"--gguf {path} does not exist or is not a file.")
    references = list(args.gguf)        # and the GGUFs given as models
    artifacts = [_artifact(path, references) for path in args.artifacts]
    for artifact in artifacts:          # every input checked before the first (slow) suite runs
        _reference_gguf(conformance, artifact, references)
    code = 0
    for n, artifact in enumerate(artifacts):
        if n:
            print()
        code = max(code, conformance.run_and_report(artifact, reference=args.reference, gguf=references,
                                                    **options))
        sys.stdout.flush()
    return code


def _artifact(path: str, references: list) -> Path:
    """The artifact directory `path` names (a GGUF or a known model name: its cached compile, the GGUF then one
    of the `references`), or a SharpiError (exit 2) when it names none; a manifest that is there but does not
    read is the `loads` check's failure (exit 1), not bad input."""
    artifact = artifact_path(path)
    if not (artifact / "manifest.json").is_file():
        raise ConfigError(f"{path} is not a sharpi artifact (a directory with a manifest.json, as sharpi-compile "
                          f"writes).")
    if Path(path).expanduser().is_file():
        references.append(path)
    return artifact


def _reference_gguf(conformance, artifact: Path, candidates) -> None:
    """Find the artifact's source GGUF now (a ConfigError naming --gguf when it is nowhere), so that a missing
    reference is one line and exit 2 rather than a table of failed checks; the hash is cached for the suite."""
    from ..common.manifest import Manifest
    try:
        manifest = Manifest.read(artifact)
    except ArtifactError:
        return                          # the suite's `loads` check reports it
    conformance.find_gguf(artifact, manifest, candidates)
