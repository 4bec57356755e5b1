"""Fuzzing the artifact's manifest: every edit must end in a SharpiError with a one-line message, or load and run.

    python benchmarks/fuzz_gguf.py --target manifest [--seconds 600] [--work DIR]

A mutant is a folder holding a changed manifest.json beside links to an intact artifact's other files (the tiny
llama of tests/tiny_gguf.py, compiled once into WORK). Each is loaded twice, with its digest recomputed after the
edit (an edit made on purpose, verify=True) and with verify=False, by a worker process: a mutant that loads runs
a prefill and 8 decode steps. A finding is an exception that is not a SharpiError, a SharpiError whose message is
not one line, a worker killed by a signal (a segfault, SIGBUS, an abort from std::bad_alloc), or a mutant still
running after HANG_SECONDS (the worker is then killed). Mutators: every leaf replaced by hostile values of its own
and other types (tests/test_manifest_fuzz.py runs them all, field by field), keys dropped and added, values moved
between fields, list items dropped and repeated, and raw byte flips of the file.
"""
from __future__ import annotations

import json
import os
import random
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HANG_SECONDS = 20.0
DECODE_STEPS = 8
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


# -- mutants ------------------------------------------------------------------------------------------------------
def leaves(value, path=()):
    """(path, value) of every leaf of a JSON value; of a long list only its first and last items."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, path + (k,))
    elif isinstance(value, list) and value:
        for i in sorted({0, len(value) - 1}):
            yield from leaves(value[i], path + (i,))
    else:
        yield path, value


def hostile_values(value) -> list:
    """Replacements for a leaf: near and far values of its own type, and values of the other JSON types."""
    if isinstance(value, bool):
        own = [not value]
    elif isinstance(value, int):
        own = [value + 1, value - 1, 0, -1, value * 2 + 1, 2**31 + 1, 2**63, 10**30]
    elif isinstance(value, float):
        own = [0.0, -value, value * 1e6, 1e308, float("inf"), float("nan")]
    elif isinstance(value, str):
        own = ["", value + "x", value[:-1], "../" + value, "\x00", "x" * 5000]
    else:                     # None, or an empty list or object
        own = [0, "", [0]]
    others = [None, True, 1, 1.5, "1", [], {}]
    return own + [v for v in others if type(v) is not type(value)]


def set_at(content: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(content))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def field_mutants(content: dict, values_per_leaf: int | None = None):
    """(label, mutated manifest dict) for every leaf and every hostile value (or the first few of them), and
    every key dropped."""
    for path, value in leaves(content):
        if path == ("digest",):
            continue
        values = hostile_values(value)
        for v in values[:values_per_leaf]:
            yield f"{'.'.join(map(str, path))} = {v!r:.40}", set_at(content, path, v)
        if isinstance(path[-1], str):
            dropped = json.loads(json.dumps(content))
            node = dropped
            for key in path[:-1]:
                node = node[key]
            del node[path[-1]]
            yield f"{'.'.join(map(str, path))} dropped", dropped


def random_mutant(content: dict, rng: random.Random) -> tuple[str, dict]:
    """One to four structural edits chosen at random."""
    labels = []
    for _ in range(rng.choice([1, 1, 2, 4])):
        all_leaves = list(leaves(content))
        path, value = rng.choice(all_leaves)
        kind = rng.random()
        if kind < 0.6:
            new = rng.choice(hostile_values(value))
            labels.append(f"{'.'.join(map(str, path))} = {new!r:.30}")
        elif kind < 0.8:                       # a value moved from another field
            _, new = rng.choice(all_leaves)
            labels.append(f"{'.'.join(map(str, path))} <- {new!r:.30}")
        else:                                  # a list item dropped or repeated, or a key added
            parent = content
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, list) and parent:
                items = list(parent)
                i = rng.randrange(len(items))
                items[i:i + 1] = [] if rng.random() < 0.5 else [items[i], items[i]]
                labels.append(f"{'.'.join(map(str, path[:-1]))} item {i} dropped/repeated")
                content = set_at(content, path[:-1], items) if len(path) > 1 else content
                continue
            new = dict(parent) if isinstance(parent, dict) else {}
            new["unexpected"] = 1
            labels.append(f"{'.'.join(map(str, path[:-1]))}.unexpected added")
            content = set_at(content, path[:-1], new) if len(path) > 1 else {**content, "unexpected": 1}
            continue
        content = set_at(content, path, new)
    return "; ".join(labels), content


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        i = rng.randrange(len(buf))
        buf[i] = rng.choice([buf[i] ^ (1 << rng.randrange(8)), rng.randrange(256),
                             ord(rng.choice('0123456789"{}[],:'))])
    return bytes(buf)


def encode(content: dict, digest: bool) -> bytes:
    """The mutant's manifest file; with `digest`, its digest recomputed (as a deliberate edit would)."""
    from sharpi.common.manifest import content_digest

    if digest:
        try:
            content = {**content, "digest": content_digest(content)}
        except (TypeError, ValueError):          # NaN and friends: json can still write them
            pass
    return json.dumps(content).encode()


# -- the worker ---------------------------------------------------------------------------------------------------
def worker_main() -> None:
    """Loads the mutant folders named on stdin, one JSON line each ({"dir", "verify"}), and answers one line each."""
    import traceback

    import numpy as np

    import sharpi
    for line in sys.stdin:
        request = json.loads(line)
        try:
            model = sharpi.load(request["dir"], verify=request["verify"], pool_sequences=1)
            with model.session() as s:
                logits = s.prefill(PROMPT)
                for _ in range(DECODE_STEPS):
                    logits = s.decode(int(np.argmax(logits)))
            reply = {"outcome": "ran"}
        except sharpi.SharpiError as exc:
            text = str(exc)
            reply = {"outcome": type(exc).__name__, "message": text}
            if "\n" in text or not text:
                reply = {"finding": f"{type(exc).__name__} of {text.count(chr(10)) + 1} lines", "detail": text}
        except BaseException as exc:                                   # noqa: BLE001 - exactly what is looked for
            where = traceback.extract_tb(exc.__traceback__)[-1]
            reply = {"finding": f"{type(exc).__name__} at {Path(where.filename).name}:{where.lineno}",
                     "detail": "".join(traceback.format_exception(exc))}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class LoadWorker:
    """A worker process (restarted after it dies or hangs, and every RESTART_EVERY loads: TVM's module loader keeps
    ~90 KB of every library it loads, so a worker's memory grows with its loads); `check(dir, verify)` is its
    answer as a dict."""
    RESTART_EVERY = 20_000

    def __init__(self, threads: int = 1):
        self._process = None
        self._loads = 0
        self._env = {**os.environ, "SHARPI_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}

    def check(self, directory: Path, verify: bool, timeout: float = HANG_SECONDS) -> dict:
        self._loads += 1
        if self._loads % self.RESTART_EVERY == 0:
            self.close()
        process = self._started()
        process.stdin.write((json.dumps({"dir": str(directory), "verify": verify}) + "\n").encode())
        process.stdin.flush()
        started, line = time.monotonic(), b""
        while not line.endswith(b"\n"):
            left = started + timeout - time.monotonic()
            if left <= 0 or not select.select([process.stdout], [], [], left)[0]:
                self.close()
                return {"finding": f"still running after {timeout:g} s"}
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                code = process.wait()
                self._process = None
                return {"finding": f"worker killed by signal {-code}" if code < 0 else f"worker exited {code}"}
            line += chunk
        return json.loads(line)

    def _started(self):
        if self._process is None:
            self._process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env)
        return self._process

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


def mutant_dir(artifact: Path, folder: Path, manifest: bytes) -> Path:
    """`folder` holding `manifest` and links to every other file of `artifact` (same inodes: the kernel library
    is loaded once per worker, and nothing of the artifact is copied)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for path in artifact.iterdir():
        if path.name != "manifest.json":
            (folder / path.name).symlink_to(path.resolve())
    (folder / "manifest.json").write_bytes(manifest)
    return folder


def tiny_artifact(work: Path) -> Path:
    """The tiny llama compiled into WORK once (float matmuls: the same on every CPU)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_gguf import write_tiny_llama

    import sharpi
    art = work / "artifact"
    if not (art / "manifest.json").is_file():
        gguf = write_tiny_llama(work / "tiny.gguf")
        sharpi.compile(str(gguf), output=art, matmuls="float")
    return art


def run(work: Path, seconds: float, seed: int) -> dict:
    """The fuzzing loop (fuzz_gguf.py --target manifest): random structural edits and byte flips for `seconds`."""
    work.mkdir(parents=True, exist_ok=True)
    findings = work / "findings"
    findings.mkdir(exist_ok=True)
    art = tiny_artifact(work)
    original = (art / "manifest.json").read_bytes()
    content = json.loads(original)
    rng, worker = random.Random(seed), LoadWorker()
    stats = {"mutants": 0, "loads": 0, "outcomes": {}, "findings": {}, "slowest_s": 0.0}
    deadline, last_save = time.time() + seconds, 0.0
    try:
        while time.time() < deadline:
            if rng.random() < 0.25:
                label, data = "bytes flipped", flip_bytes(original, rng)
            else:
                label, mutated = random_mutant(content, rng)
                data = encode(mutated, digest=True)
            folder = mutant_dir(art, work / "mutant", data)
            stats["mutants"] += 1
            for verify in (True, False):
                started = time.perf_counter()
                reply = worker.check(folder, verify)
                stats["slowest_s"] = max(stats["slowest_s"], round(time.perf_counter() - started, 3))
                stats["loads"] += 1
                outcome = "FINDING" if "finding" in reply else reply["outcome"]
                stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
                if "finding" in reply:
                    signature = reply["finding"]
                    count = stats["findings"].get(signature, 0)
                    stats["findings"][signature] = count + 1
                    if count == 0:
                        name = f"finding-{len(stats['findings']):03d}"
                        (findings / f"{name}.json").write_bytes(data)
                        (findings / f"{name}.txt").write_text(f"{label} (verify={verify})\n{signature}\n\n"
                                                               f"{reply.get('detail', '')}")
            if time.time() - last_save > 10:
                last_save = time.time()
                (work / "stats.json").write_text(json.dumps(stats, indent=1))
    finally:
        worker.close()
        (work / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.path.insert(0, str(ROOT))
    worker_main()
