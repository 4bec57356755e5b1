"""The README runs as written (issue #46): every `sh` and `python` block of README.md runs, in a temporary folder,
against the suite's SHARPI_HOME (so the models the other tests compiled are cache hits), and the two set-up commands
are the ones .ci/run runs word for word (their pip installs are CI's to run, not a test's; the first command's
sharpi part also runs here, and must stop at the model's end token as the README's expected output says)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 900          # a block may compile a model the suite has not (run alone, without the rest)

pytestmark = pytest.mark.slow


def blocks(kind: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text(encoding="utf-8")) if lang == kind]


def setup_commands() -> list[str]:
    return [b.strip() for b in blocks("sh") if "pip install" in b]


def runnable(kind: str) -> list[str]:
    return [b for b in blocks(kind) if "pip install" not in b]


def _env() -> dict:
    """This interpreter's scripts first on PATH (the `sharpi` of the checkout under test)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run in a process group of its own, so that a block's background server goes with it; `cwd` gets the
    clone's docs/ (the examples the blocks read, by paths relative to the clone's root as a reader runs them)."""
    (cwd / "docs").symlink_to(ROOT / "docs", target_is_directory=True)
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_two_commands_are_what_ci_runs():
    commands = setup_commands()
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for command in commands:
        assert command in ci, f"{command!r} is not a line of .ci/run"


def test_the_first_command_stops_at_the_end_of_its_answer(tmp_path):
    first = setup_commands()[0]
    sharpi_part = first.split("&&", 1)[1].strip()
    done = _run(["bash", "-euo", "pipefail", "-c", sharpi_part], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr
    answer, stats_line = blocks("text")[0].strip().splitlines()      # what the README says it prints
    assert done.stdout.strip() == answer, (done.stdout, done.stderr)
    stats = [line for line in done.stderr.splitlines() if line.startswith("[CPU")]
    assert len(stats) == 1 and re.fullmatch(_numbers_free(stats_line), stats[0]), (stats, stats_line)


def _numbers_free(line: str) -> str:
    """A pattern of `line` where the CPU's name and every number may differ (the machine's, the speeds)."""
    pattern = re.escape(re.sub(r"\d+(\.\d+)?", "0", re.sub(r"^\[CPU \([\w.+-]+", "[CPU (cpu", line)))
    return pattern.replace("cpu", r"[\w.+-]+").replace("0", r"\d+(?:\.\d+)?")


@pytest.mark.parametrize("index", range(len(runnable("sh"))))
def test_shell_block_runs_as_written(index, tmp_path):
    block = runnable("sh")[index]
    done = _run(["bash", "-euo", "pipefail", "-c", block], tmp_path)
    assert done.returncode == 0, f"{block}\n--- stderr:\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr and done.stdout.strip(), done.stderr[-4000:]


@pytest.mark.parametrize("index", range(len(runnable("python"))))
def test_python_block_runs_as_written(index, tmp_path):
    block = runnable("python")[index]
    done = _run([sys.executable, "-c", block], tmp_path)
    assert done.returncode == 0, f"{block}\n--- stderr:\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), done.stderr[-4000:]
