"""What a compile is asked for, as it travels from the API and the CLI through the driver to a target's build."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .settings import parse_positive_int
from .snapkv_settings import SnapKVSettings, check_against
from .targets import DEFAULT_TARGET, target_spec, targets_taking

KV_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}    # --kv-dtype names -> element types
MATMULS = ("float", "int8")
PREFILL_CHUNK = 512
# how each target-only option is named in messages (and on the command line)
_FLAGS = {"mcpu": "--mcpu", "arch": "--arch", "cuda_graph": "--cuda-graph", "matmuls": "--matmuls int8"}


@dataclass(frozen=True)
class CompileOptions:
    target: str = DEFAULT_TARGET
    mcpu: str | None = None                  # llvm: the CPU (None: this one)
    arch: str | None = None                  # cuda: sm_XY
    cuda_graph: bool = False                 # cuda: decode replays one captured CUDA graph
    matmuls: str | None = None               # llvm: "int8" (int8 activations, integer dots) or "float"; None: the
                                             # target's default ("float" elsewhere: their only arithmetic)
    kv_dtype: str | None = None              # the KV page pool's element type; None: the target's default
    max_context: int | None = None
    snapkv: str = "on"                       # whether the SnapKV ops are compiled in
    snapkv_explicit: bool = False            # snapkv was asked for (not the default)
    snapkv_defaults: SnapKVSettings = field(default_factory=SnapKVSettings)   # the artifact's run-time defaults

    def validate(self) -> None:
        """The checks that need no target code: names and values, and which target takes which option."""
        if self.snapkv not in ("on", "off"):
            raise ConfigError(f"--snapkv must be 'on' or 'off', got {self.snapkv!r}.")
        settings = self.snapkv_defaults
        check_against(settings, settings.budget or 0, settings.window)
        spec = target_spec(self.target)
        for option, flag in _FLAGS.items():
            value = getattr(self, option)
            given = value not in (None, False) and not (option == "matmuls" and value == "float")
            if given and option not in spec.options:
                owners = " and ".join(targets_taking(option))
                raise ConfigError(f"{flag} applies to the {owners} target only.")
        if self.matmuls is not None and self.matmuls not in MATMULS:
            raise ConfigError(f"--matmuls must be one of {', '.join(MATMULS)}, got {self.matmuls!r}.")
        if self.kv_dtype is not None:
            if self.kv_dtype not in KV_DTYPES.values():
                raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}.")
            if self.kv_dtype not in spec.kv_dtypes:
                name = next(k for k, v in KV_DTYPES.items() if v == self.kv_dtype)
                others = " or ".join(k for k, v in reversed(KV_DTYPES.items()) if v in spec.kv_dtypes)
                raise ConfigError(f"--kv-dtype {name} is not available on the {self.target} target "
                                  f"({spec.kv_dtype_note}); use {others}.")
        if self.max_context is not None:
            parse_positive_int(self.max_context, "--max-context")


def kv_dtype_of(name: str | None) -> str | None:
    """--kv-dtype's names (f32, f16, bf16) as element types; other values are left for validate() to refuse."""
    return KV_DTYPES.get(name, name) if name is not None else None
