"""sharpi's pytest plugin: the conformance suite on your own compiled artifacts.

    python -m pytest --sharpi-artifact DIR [--sharpi-artifact DIR2 ...] [--sharpi-reference numpy|cpu]
                     [--sharpi-gguf PATH]

runs every check of sharpi.testing.conformance on each artifact, as tests named
`test_<check>[<artifact>]` (sharpi/testing/conformance_suite.py). Without paths on the command line only the
suite runs; with paths, your tests run too and can use the public fixtures:

    sharpi_artifact    the artifact directory (a Path), one test per --sharpi-artifact
    sharpi_model       that artifact loaded (sharpi.load), once per artifact
    sharpi_reference   the reference for it: .logits(ids) -> [len(ids), vocab], .decode_after_compaction(...)
    sharpi_prompt      the prompt text the suite feeds (--sharpi-prompt)
    sharpi_tolerance   the artifact's tolerance (conformance.Tolerance: logprob_atol, near_tie)

The plugin is registered through the `pytest11` entry point (`-p no:sharpi` turns it off) of the environment
sharpi is installed in (`python -m pip install ".[test]"` in the clone brings pytest with it; `python -m pytest`
runs that environment's pytest); it does nothing unless --sharpi-artifact is given. `sharpi check DIR` runs the
same suite without pytest. The plugin's import stays light: numpy and sharpi load when a fixture is first used.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .options import SUITE_OPTIONS

SUITE = Path(__file__).with_name("conformance_suite.py")
_RESULTS = pytest.StashKey[list]()        # (title, [CheckResult]) per artifact, for the terminal summary


def pytest_addoption(parser):
    group = parser.getgroup("sharpi", "sharpi conformance suite on compiled artifacts")
    group.addoption("--sharpi-artifact", action="append", default=[], metavar="DIR",
                    help="a compiled sharpi artifact to run the conformance suite on (repeatable)")
    for name, option in SUITE_OPTIONS.items():
        group.addoption(f"--sharpi-{name}", **option, **({"type": int} if name == "decode-tokens" else {}))
    group.addoption("--sharpi-skip-suite", action="store_true",
                    help="run only the tests on the command line (with the sharpi_* fixtures), not the suite")


def pytest_configure(config):
    if _suite_wanted(config) and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args[:] = []      # no paths given: the suite alone, not the tests under testpaths or the cwd


def _suite_wanted(config) -> bool:
    return bool(config.getoption("sharpi_artifact")) and not config.getoption("sharpi_skip_suite")


@pytest.hookimpl(tryfirst=True)       # before -k / -m deselect, so they apply to the suite's tests too
def pytest_collection_modifyitems(session, config, items):
    """Add the suite's tests (conformance_suite.py, named `sharpi-conformance::test_<check>[<artifact>]` wherever
    sharpi is installed) to what was collected."""
    if not _suite_wanted(config) or any(getattr(i, "path", None) == SUITE for i in items):
        return
    module = pytest.Module.from_parent(session, path=SUITE, nodeid="sharpi-conformance")
    items.extend(session.genitems(module))


def _artifact_ids(paths) -> list[str]:
    names = [Path(p).name or str(p) for p in paths]
    return [name if names.count(name) == 1 else f"{name}{i}" for i, name in enumerate(names)]


def pytest_generate_tests(metafunc):
    if "sharpi_artifact" in metafunc.fixturenames:
        paths = [Path(p) for p in metafunc.config.getoption("sharpi_artifact")]
        metafunc.parametrize("sharpi_artifact", paths, ids=_artifact_ids(paths), indirect=True, scope="session")


@pytest.fixture(scope="session")
def sharpi_artifact(request) -> Path:
    """The artifact directory under test (one per --sharpi-artifact)."""
    if not hasattr(request, "param"):
        pytest.skip("no --sharpi-artifact given")
    return request.param


@pytest.fixture(scope="session")
def sharpi_prompt(pytestconfig) -> str:
    """The prompt text the suite feeds every check (--sharpi-prompt, else conformance.DEFAULT_PROMPT)."""
    from .conformance import DEFAULT_PROMPT
    return pytestconfig.getoption("sharpi_prompt") or DEFAULT_PROMPT


@pytest.fixture(scope="session")
def sharpi_suite(sharpi_artifact, sharpi_prompt, pytestconfig):
    """conformance.Suite for the artifact: one load, one reference, shared by the checks and the fixtures."""
    from .conformance import DECODE_TOKENS, Suite
    decode = pytestconfig.getoption("sharpi_decode_tokens")
    suite = Suite(sharpi_artifact, reference=pytestconfig.getoption("sharpi_reference"),
                  gguf=pytestconfig.getoption("sharpi_gguf"), prompt=sharpi_prompt,
                  decode_tokens=DECODE_TOKENS if decode is None else decode)
    pytestconfig.stash.setdefault(_RESULTS, []).append((suite.describe(), suite.results))
    yield suite
    suite.close()


@pytest.fixture(scope="session")
def sharpi_model(sharpi_suite):
    """The artifact loaded with sharpi.load (hashes verified); a load failure fails the test with its reason."""
    from .conformance import CheckSkipped
    try:
        return sharpi_suite.model
    except CheckSkipped:
        pytest.fail(str(sharpi_suite._load_error), pytrace=False)


@pytest.fixture(scope="session")
def sharpi_reference(sharpi_suite):
    """The reference for the artifact's source GGUF (--sharpi-reference): .logits(ids) and
    .decode_after_compaction(prompt_ids, kept_positions, token)."""
    try:
        return sharpi_suite.reference
    except Exception as exc:
        pytest.fail(f"no {sharpi_suite.reference_kind} reference: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def sharpi_tolerance(sharpi_model):
    """conformance.Tolerance for the artifact's target and KV dtype."""
    from .conformance import tolerance_for
    return tolerance_for(sharpi_model.manifest)


def pytest_terminal_summary(terminalreporter, config):
    """The suite's table (as sharpi-compile --check prints it), one per artifact."""
    from .conformance import format_table
    for title, results in config.stash.get(_RESULTS, []):
        if results:
            terminalreporter.write_sep("-", "sharpi conformance")
            terminalreporter.write_line(format_table(results, title))


def run_check(suite, name: str) -> str:
    """Run one check for a test: its detail on PASS, pytest.skip on SKIP, and on FAIL a failure whose message
    starts with the check's name (a crash inside a check is re-raised with its traceback)."""
    from .conformance import CheckFailed
    result = suite.run(name)
    if result.status == "SKIP":
        pytest.skip(f"{name}: {result.detail}")
    if result.status == "FAIL":
        if isinstance(result.error, CheckFailed) or result.error is None:
            pytest.fail(f"{name}: {result.detail}", pytrace=False)
        raise result.error
    return result.detail
