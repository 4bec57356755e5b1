"""sharpi: compile GGUF language models with TVM and run them from Python.

`import sharpi` stays light: the compiler (and tvm.relax) loads only when `sharpi.compile` is called.
"""
from .common.errors import (ArtifactError, CompileError, ConfigError, ContextLengthError, FetchError, GGUFError,
                            KeepSetError, ModelNotFoundError, NonFiniteLogitsError, ServerBusyError, SharpiError,
                            SharpiNote, SharpiWarning, TokenizerError, UnsupportedArchitectureError,
                            UnsupportedTensorTypeError)
from .common.targets import DEFAULT_TARGET
from .common.version import __version__


def compile(model, target: str = DEFAULT_TARGET, output=None, **options):
    """Compile a GGUF file or known model name for a target (sharpi.common.targets: llvm, cuda, vulkan); returns
    the artifact directory. See sharpi.compiler.compile for the options."""
    from .compiler import compile as _compile
    return _compile(model, target=target, output=output, **options)


def export_onnx(model, output=None, **options):
    """Export a GGUF file or known model name as ONNX graphs (prefill, decode, SnapKV) into a directory; returns
    its path. See sharpi.compiler.export_onnx."""
    from .compiler import export_onnx as _export_onnx
    return _export_onnx(model, output=output, **options)


def load(model, *, show_progress: bool = False, **options):
    """Load a model: a compiled artifact directory, or a GGUF file or known model name, which is compiled for this
    machine into the compile cache on first use (show_progress: say so and show the compile's progress on
    stderr) and loaded from there. options: threads, verify, pool_sequences or pool_tokens, adapter,
    expect_sha256, lock_weights (runtime.model.Model).

    An artifact is code: its kernel library is loaded into this process. Load only artifacts you built or trust,
    and pin one you got from elsewhere with expect_sha256=artifact_sha256(...) of the copy you trust."""
    from .artifact_source import resolve_artifact
    from .runtime.model import Model
    resolved = resolve_artifact(model, show_progress=show_progress)
    if resolved.checked and options.get("verify", True) is True:
        options["verify"] = False      # the cache entry's files were hashed a moment ago: not twice
    return Model(resolved.path, **options)


def artifact_sha256(directory) -> str:
    """The sha256 of an artifact's manifest file, which lists the sha256 of every other file: the value to pin
    with load(directory, expect_sha256=...) or --expect-sha256 (sharpi-compile prints it)."""
    from .common.manifest import manifest_sha256
    return manifest_sha256(directory)


def fetch(name: str, show_progress: bool = True):
    """Download and verify a known model; returns the path of its GGUF."""
    from .frontend.fetch import fetch as _fetch
    return _fetch(name, show_progress=show_progress)


__all__ = ["compile", "export_onnx", "load", "artifact_sha256", "fetch", "SharpiError", "ArtifactError",
           "CompileError", "ConfigError", "ContextLengthError", "FetchError", "GGUFError", "KeepSetError",
           "ModelNotFoundError", "NonFiniteLogitsError", "ServerBusyError", "SharpiNote", "SharpiWarning",
           "TokenizerError", "UnsupportedArchitectureError", "UnsupportedTensorTypeError", "__version__"]
