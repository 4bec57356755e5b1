"""What a compile is asked for, as it travels from the API and the CLI through the driver to a target's build."""
from __future__ import annotations

from dataclasses import dataclass, field

from . import kv_codecs
from .errors import ConfigError
from .settings import parse_positive_int
from .snapkv_settings import SnapKVSettings, check_against
from .targets import DEFAULT_TARGET, target_spec, targets_taking

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
    kv_dtype: str | None = None              # the KV cache's type for keys; None: the target's default
    kv_dtype_v: str | None = None            # for values; None: the target's default, or (resolved) the keys' type
    max_context: int | None = None
    snapkv: str = "on"                       # whether the SnapKV ops are compiled in
    snapkv_explicit: bool = False            # snapkv was asked for (not the default)
    snapkv_defaults: SnapKVSettings = field(default_factory=SnapKVSettings)   # the artifact's run-time defaults

    @property
    def kv_types(self) -> tuple[str, str]:
        """(keys' type, values' type) of resolved options."""
        return self.kv_dtype, self.kv_dtype_v or self.kv_dtype

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
        # the keys' type comes from --kv-dtype or --kv-dtype-k, the values' from --kv-dtype or --kv-dtype-v
        for flag, value in (("--kv-dtype", self.kv_dtype), ("--kv-dtype-v", self.kv_dtype_v)):
            if value is None:
                continue
            if value not in kv_codecs.names():
                raise ConfigError(f"{flag} must be one of {', '.join(kv_codecs.flags())}, got {value!r}.")
            why = kv_codecs.codec(value).unavailable.get(self.target)
            if why:
                others = ", ".join(kv_codecs.flag_of(t) for t in kv_codecs.available_on(self.target))
                raise ConfigError(f"{flag} {kv_codecs.flag_of(value)} is not available on the {self.target} target "
                                  f"({why}); use {others}.")
        if self.max_context is not None:
            parse_positive_int(self.max_context, "--max-context")


def kv_dtype_of(name: str | None) -> str | None:
    """--kv-dtype's names (f32, f16, bf16, q8_0, q4_0, q4_ch: kv_codecs' flags) as KV types; other values are left
    for validate() to refuse."""
    return kv_codecs.flags().get(name, name) if name is not None else None


def kv_types_of(kv_dtype: str | None, kv_dtype_k: str | None = None, kv_dtype_v: str | None = None) -> dict:
    """CompileOptions' kv_dtype (keys) and kv_dtype_v (values) from --kv-dtype (both) and --kv-dtype-k /
    --kv-dtype-v (one each, over it), as llama.cpp's -ctk / -ctv; None leaves a side to the target's default."""
    return {"kv_dtype": kv_dtype_of(kv_dtype_k or kv_dtype), "kv_dtype_v": kv_dtype_of(kv_dtype_v or kv_dtype)}


def resolved_kv_types(options: "CompileOptions", default: str) -> dict:
    """A target's resolve(): each side's type or the target's default, kv_dtype_v None where it is the keys'
    (so that an artifact of one type is described, cached and recorded as before K and V could differ)."""
    keys, values = options.kv_dtype or default, options.kv_dtype_v or default
    return {"kv_dtype": keys, "kv_dtype_v": values if values != keys else None}
