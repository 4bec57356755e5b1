"""Every edit of an artifact's manifest is one SharpiError sentence or a model that runs (issue: the manifest was
trusted blindly). Each mutant is loaded by a worker process (benchmarks/fuzz_manifest.py) twice: with its digest
recomputed after the edit (verify=True) and with verify=False; one that loads runs a prefill and 8 decode steps.
A signal, an exception that is not a SharpiError, a message of more than one line or more than 20 s fails."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

import sharpi

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fuzz_manifest as fm  # noqa: E402


@pytest.fixture(scope="module")
def worker():
    w = fm.LoadWorker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def manifest(tiny_artifact) -> dict:
    return json.loads((tiny_artifact / "manifest.json").read_text())


def _findings(worker, tiny_artifact, folder: Path, mutants) -> tuple[list, dict]:
    found, outcomes = [], {}
    for label, data in mutants:
        fm.mutant_dir(tiny_artifact, folder, data)
        for verify in (True, False):
            reply = worker.check(folder, verify)
            if "finding" in reply:
                found.append(f"{label} (verify={verify}): {reply['finding']}\n{reply.get('detail', '')[-600:]}")
            else:
                outcomes[reply["outcome"]] = outcomes.get(reply["outcome"], 0) + 1
    return found, outcomes


def test_every_field_edited_in_turn(worker, tiny_artifact, manifest, tmp_path):
    mutants = [(label, fm.encode(m, digest=True)) for label, m in fm.field_mutants(manifest)]
    assert len(mutants) > 500                      # every leaf, each with ~13 hostile values, and every key dropped
    found, outcomes = _findings(worker, tiny_artifact, tmp_path / "mutant", mutants)
    assert found == [], "\n\n".join(found[:10])
    assert outcomes.get("ArtifactError", 0) > outcomes.get("ran", 0) > 0     # most refused, the harmless ones run


def test_random_byte_flips(worker, tiny_artifact, manifest, tmp_path):
    rng, original = random.Random(7), (tiny_artifact / "manifest.json").read_bytes()
    mutants = []
    for i in range(60):
        flipped = fm.flip_bytes(original, rng)
        try:                                       # still JSON: recompute its digest, as a deliberate edit would
            flipped = fm.encode(json.loads(flipped), digest=True)
        except (ValueError, RecursionError):
            pass
        mutants.append((f"flip {i}", flipped))
    found, _ = _findings(worker, tiny_artifact, tmp_path / "mutant", mutants)
    assert found == [], "\n\n".join(found[:10])


def test_random_structural_edits(worker, tiny_artifact, manifest, tmp_path):
    rng = random.Random(11)
    mutants = [(label, fm.encode(m, digest=True)) for label, m in (fm.random_mutant(manifest, rng)
                                                                   for _ in range(80))]
    found, _ = _findings(worker, tiny_artifact, tmp_path / "mutant", mutants)
    assert found == [], "\n\n".join(found[:10])


@pytest.mark.parametrize("path, value, message", [
    (("config", "vocab_size"), 100_000, "config.vocab_size is 100000 there but 257 in model.so"),
    (("config", "n_layers"), 3, "config.n_layers is 3 there but 2 in model.so"),
    (("max_context",), 128, "max_pages should be max_context / page_size"),
    (("snapkv", "defaults", "kernel"), 2**31 + 1, "snapkv.defaults.kernel must be an integer in [1, 255]"),
    (("snapkv", "defaults", "budget"), 16, "snapkv.defaults: SnapKV recency (64) must be smaller than the budget"),
    (("tokenizer", "eos_id"), 300, "tokenizer.eos_id should be an integer in [0, 256]"),
    (("format_version",), "2", "format_version should be an integer, got '2'"),
    (("format_version",), 1.0, "format_version should be an integer, got 1.0"),
    (("format",), "something", "its format marker is 'something'"),
    (("target", "cpu_features"), [], "target.cpu_features length is 0 there"),
    (("params", 0, "shape"), [9, 9], "params[0].nbytes should be the bytes of shape [9, 9]"),
    (("source", "name"), "../../etc/passwd", "source.name should be a plain file name"),
])
def test_edits_name_the_field(path, value, message, tiny_artifact, manifest, tmp_path):
    folder = fm.mutant_dir(tiny_artifact, tmp_path / "m", fm.encode(fm.set_at(manifest, path, value), digest=True))
    for verify in (True, False):
        with pytest.raises(sharpi.ArtifactError) as info:
            sharpi.load(folder, verify=verify)
        assert message in str(info.value), str(info.value)


def test_an_edit_without_a_new_digest_is_corruption(tiny_artifact, manifest, tmp_path):
    folder = fm.mutant_dir(tiny_artifact, tmp_path / "m", fm.encode(fm.set_at(manifest, ("prefill_chunk",), 100),
                                                                     digest=False))
    with pytest.raises(sharpi.ArtifactError, match="does not match its own digest"):
        sharpi.load(folder)
    assert sharpi.load(folder, verify=False).manifest.prefill_chunk == 100      # valid otherwise: it runs
