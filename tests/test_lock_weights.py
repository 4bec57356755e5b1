"""lock_weights / --mlock: a CPU artifact's weights read in at load and locked in memory, still the file's page
cache pages (a private mapping's read faults, not copies), with the same logits; a system that refuses the lock
gets a warning and an unlocked model; a GPU artifact refuses the flag in one sentence."""
from __future__ import annotations

import re
import sys
import warnings

import numpy as np
import pytest

import sharpi
from sharpi.cli import main as main_cli
from sharpi.codegen.artifact import WEIGHTS
from sharpi.runtime import loader

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="mlock2 and /proc/self/smaps are Linux's")


def _mapping_of(path) -> dict[str, int]:
    """The kB fields of /proc/self/smaps for this process's mappings of `path`, summed."""
    fields: dict[str, int] = {}
    ours = False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            ours = line.rstrip().endswith(str(path))
        elif ours and line.split()[-1:] == ["kB"]:
            name, value = line.split()[:2]
            fields[name.rstrip(":")] = fields.get(name.rstrip(":"), 0) + int(value)
    return fields


def _logits(model, ids):
    with model.session() as s:
        return s.prefill(ids)


@linux_only
def test_locked_weights_are_the_file_s_pages_locked_and_compute_the_same(tiny_artifact):
    weights = (tiny_artifact / WEIGHTS).resolve()
    plain = sharpi.load(tiny_artifact, threads=1)
    expected = _logits(plain, [1, 2, 3, 4])
    del plain
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = sharpi.load(tiny_artifact, threads=1, lock_weights=True)
    refused = [str(w.message) for w in caught if issubclass(w.category, sharpi.SharpiWarning)]
    if refused:     # an unprivileged user past RLIMIT_MEMLOCK: the system's limit, not sharpi's
        pytest.skip(refused[0])
    mapped = _mapping_of(weights)
    size_kb = weights.stat().st_size // 1024
    assert mapped["Locked"] >= size_kb and mapped["Rss"] >= size_kb, mapped     # all of it, resident and locked
    assert mapped["Anonymous"] == 0, mapped                                    # no page was copied
    np.testing.assert_array_equal(_logits(model, [1, 2, 3, 4]), expected)


def test_a_refused_lock_is_a_warning_and_the_model_still_runs(tiny_artifact, monkeypatch):
    monkeypatch.setattr(loader, "lock_in_memory", lambda mapped: "mlock2: Cannot allocate memory; raise `ulimit -l`")
    with pytest.warns(sharpi.SharpiWarning, match="could not be locked in memory .*ulimit -l"):
        model = sharpi.load(tiny_artifact, threads=1, lock_weights=True)
    assert np.isfinite(_logits(model, [1, 2, 3])).all()


def test_lock_weights_must_be_a_bool(tiny_artifact):
    with pytest.raises(sharpi.ConfigError, match="lock_weights must be True or False"):
        sharpi.load(tiny_artifact, lock_weights="yes")


def test_a_gpu_artifact_refuses_mlock_in_one_sentence(smollm2_vulkan_artifact, capsys):
    with pytest.raises(sharpi.ConfigError, match="applies to CPU artifacts"):
        sharpi.load(smollm2_vulkan_artifact, lock_weights=True)
    assert main_cli.main(["run", str(smollm2_vulkan_artifact), "-p", "hi", "-n", "1", "--mlock"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "applies to CPU artifacts" in err


@linux_only
def test_run_with_mlock(tiny_artifact, capsys):
    assert main_cli.main(["run", str(tiny_artifact), "-p", "hi", "-n", "2", "--mlock"]) == 0


def test_weights_larger_than_the_available_memory_are_not_locked(tiny_artifact, monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda: 4096)
    with pytest.warns(sharpi.SharpiWarning, match="more than the 0.0 GiB of memory available"):
        sharpi.load(tiny_artifact, threads=1, lock_weights=True)
