"""KV cache types as codecs, one module each (f32, f16 and bf16 share floats.py), and the registry that picks one by
name. base.KVCodec is the interface; kv_format.KVFormat lays two codecs (keys', values') out as a pool's rows; the
CPU and GPU kernels compose the codecs' pieces (codegen/kernels/kv_rows.py, gpu/kv_rows.py). A new type is a module
defining a KVCodec and registering it here, plus its tests."""
from __future__ import annotations

from ..errors import ConfigError
from .base import Field, KVCodec, Part

_CODECS: dict[str, KVCodec] = {}


def register(codec: KVCodec) -> KVCodec:
    """Make a codec known by its name and its --kv-dtype flag (a name taken by another codec is refused)."""
    for taken in _CODECS.values():
        if taken is not codec and (taken.name in (codec.name, codec.flag) or taken.flag in (codec.name, codec.flag)):
            raise ValueError(f"The KV type name {codec.name!r} / {codec.flag!r} is taken by {taken!r}.")
    _CODECS[codec.name] = codec
    return codec


def unregister(name: str) -> None:
    """Forget a codec (a test's own)."""
    _CODECS.pop(name, None)


def codec(name: str) -> KVCodec:
    """The codec of a KV type by name (as the manifest records it), or a ConfigError listing the known ones."""
    found = _CODECS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"Unknown KV cache type {name!r} (known: {', '.join(_CODECS)}).")
    return found


def names() -> tuple[str, ...]:
    return tuple(_CODECS)


def flags() -> dict[str, str]:
    """--kv-dtype's names -> the types' names."""
    return {c.flag: c.name for c in _CODECS.values()}


def flag_of(name: str) -> str:
    return codec(name).flag


def available_on(target: str) -> tuple[str, ...]:
    """The types a target's kernels read and write."""
    return tuple(c.name for c in _CODECS.values() if target not in c.unavailable)


def _register_builtins() -> None:
    from . import floats, q4_0, q4_ch, q8_0, turboquant
    for c in (floats.FLOAT32, floats.FLOAT16, floats.BFLOAT16, q8_0.CODEC, q4_0.CODEC, q4_ch.CODEC,
              turboquant.TQ3, turboquant.TQ4):
        register(c)


_register_builtins()

__all__ = ["Field", "KVCodec", "Part", "available_on", "codec", "flag_of", "flags", "names", "register",
           "unregister"]
