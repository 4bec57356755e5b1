"""The chat-template renderer's child process (started by sharpi.common.chat.TemplateSandbox, never imported).

It reads one JSON request per line on stdin ({"template", "context", "max_chars"}) and answers one JSON line on
stdout: {"text": ...} or {"error": kind, "message": ...}. The template runs in jinja2's immutable sandbox, and the
process itself is the second wall: it limits its own address space, cannot write files or start processes, has
an empty environment (nothing to read from it), and the parent kills it when a render takes too long. Only the
standard library and jinja2 are imported, so it starts in a few tens of milliseconds.
"""
import json
import sys

MEMORY_LIMIT = 1 << 30          # address space; the interpreter and jinja2 take ~40 MB of it
CACHED_TEMPLATES = 8


class Refused(Exception):
    """raise_exception() called by the template: it refuses the messages."""


def _limit_self() -> None:
    try:
        import resource
    except ImportError:           # not POSIX: the parent's timeout still bounds the render
        return
    for limit, value in ((resource.RLIMIT_AS, MEMORY_LIMIT), (resource.RLIMIT_FSIZE, 0),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass


def _raise_exception(message):
    raise Refused(str(message))


def _render(env, cache: dict, request: dict) -> dict:
    import jinja2

    template, max_chars = request["template"], int(request["max_chars"])
    try:
        compiled = cache.get(template)
        if compiled is None:
            compiled = env.from_string(template)
            if len(cache) >= CACHED_TEMPLATES:
                cache.pop(next(iter(cache)))
            cache[template] = compiled
        pieces, size = [], 0
        for piece in compiled.generate(**request["context"]):
            size += len(piece)
            if size > max_chars:
                return {"error": "size", "message": f"it renders more than {max_chars} characters"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except Refused as exc:
        return {"error": "refused", "message": str(exc)}
    except jinja2.TemplateError as exc:
        return {"error": "template", "message": f"{type(exc).__name__}: {exc}"}
    except MemoryError:
        return {"error": "memory", "message": f"it needs more than {MEMORY_LIMIT >> 20} MiB"}
    except RecursionError:
        return {"error": "failed", "message": "it recurses without end (RecursionError)"}
    except Exception as exc:      # the template's own arithmetic, indexing, ...: reported, never fatal
        return {"error": "failed", "message": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    _limit_self()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    cache: dict = {}
    for line in sys.stdin:
        try:
            reply = _render(env, cache, json.loads(line))
        except MemoryError:
            reply = {"error": "memory", "message": f"it needs more than {MEMORY_LIMIT >> 20} MiB"}
        try:
            out = json.dumps(reply)
        except (ValueError, TypeError, MemoryError):      # e.g. lone surrogates cannot be encoded
            out = json.dumps({"error": "failed", "message": "its output is not valid text"})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
