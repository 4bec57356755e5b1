"""What every entry point that takes a model accepts (sharpi.load; `sharpi run`, `chat`, `serve`, `bench`, `eval`,
`check`): a compiled artifact folder, a GGUF file or a known model name. A GGUF or a name is compiled for this
machine into the compile cache on first use and loaded from there, as `llama-cli -m model.gguf` or `ollama run
NAME` take a model; later uses find the cached compile (checked intact) at once.

The compiler is imported only when a GGUF or a name needs it, so `import sharpi` and loading an artifact folder
stay light (the runtime itself never imports this module or the compiler).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .common.errors import NoModelError

GGUF_MAGIC = b"GGUF"


class Resolved(NamedTuple):
    path: Path                   # the artifact folder
    checked: bool                # a cache entry whose files were verified (or written) just now


def resolve_artifact(model: str | Path, *, show_progress: bool = False) -> Resolved:
    """The artifact folder `model` names: a folder as it is (the load says if it is not an artifact); a known
    model name (fetched if needed) or a GGUF file compiled into the cache, or found there (show_progress: one line
    and the compile's progress on stderr when it compiles); anything else is a NoModelError (a
    ModelNotFoundError, and an ArtifactError) naming the accepted forms."""
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return Resolved(path, False)
    from .frontend.fetch import KNOWN_MODELS
    if text in KNOWN_MODELS or (path.is_file() and _is_gguf(path)):
        from .compiler import compile_into_cache
        return Resolved(compile_into_cache(text, show_progress=show_progress), True)
    why = "it does not start with GGUF's magic bytes" if path.exists() else "no such file or folder"
    raise NoModelError(f"{text} is not a sharpi artifact, a GGUF file or a known model name ({why}); give an "
                       f"artifact folder (sharpi-compile MODEL -o DIR), a .gguf file or one of "
                       f"{', '.join(sorted(KNOWN_MODELS))}.")


def _is_gguf(path: Path) -> bool:
    """Named .gguf (a damaged one then gets the GGUF reader's sentence) or starting with GGUF's magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
