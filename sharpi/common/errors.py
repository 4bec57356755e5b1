"""Errors a user can cause. Each carries one clear sentence; the CLIs print it and exit 2."""


class SharpiError(Exception):
    """Base class of every error sharpi raises on bad input or environment."""


class ModelNotFoundError(SharpiError):
    """An unknown model name or a path that does not exist."""


class FetchError(SharpiError):
    """A known model could not be downloaded, extracted or verified."""


class GGUFError(SharpiError):
    """The file is not a GGUF, is truncated, or its contents are inconsistent."""


class UnsupportedArchitectureError(SharpiError):
    """The GGUF holds an architecture sharpi has no frontend for."""


class UnsupportedTensorTypeError(SharpiError):
    """A tensor type that neither sharpi's kernels nor the gguf package can handle."""


class ArtifactError(SharpiError):
    """An artifact is missing, corrupted, of another format version, or built for another CPU."""


class NoModelError(ModelNotFoundError, ArtifactError):
    """What names no artifact folder, GGUF file or known model (sharpi.load, the CLIs' MODEL argument): a
    ModelNotFoundError, and an ArtifactError as loading a path without an artifact always was."""


class ContextLengthError(SharpiError):
    """A prompt (or a generation) that does not fit in the model's context."""


class ConfigError(SharpiError, ValueError):
    """A bad knob value: an option, an argument or an environment variable."""


class KeepSetError(SharpiError, ValueError):
    """A SnapKV keep list that is longer than the cache, out of range or not strictly increasing."""


class TokenizerError(SharpiError):
    """The tokenizer metadata is missing or of a kind sharpi does not support."""


class CompileError(SharpiError):
    """Compiling failed for a reason the user can act on (for example a missing toolchain)."""


class NonFiniteLogitsError(SharpiError):
    """The model computed NaN or infinite logits (non-finite weights, or a mislabelled tensor type in the GGUF)."""


class ServerBusyError(SharpiError):
    """The server's queue of waiting requests is full; the request was not taken (try again later)."""


class SharpiWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLIs print it as one `warning:` line)."""


class SharpiNote(SharpiWarning):
    """A setting sharpi changed so that the work can go on as asked (a SnapKV budget too small for the default
    recency: the recency shrunk to fit); the CLIs print it as one `note:` line."""
