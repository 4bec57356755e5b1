"""Chat prompts rendered with the GGUF's own Jinja chat template (`tokenizer.chat_template`).

A chat template is code from the model file, so it is rendered in jinja2's immutable sandbox inside a child
process (sharpi.common.template_worker) with bounded memory, output and time: a template that loops without end,
recurses, allocates without bound or fails in any other way is one TokenizerError sentence, and the process that
asked (a server thread, say) is never at risk. A sandbox subclass counting operations in-process was the other
way; it cannot stop one huge allocation ("x" * 10**10) or a C-level loop, a process can.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from .errors import ConfigError, TokenizerError

RENDER_SECONDS = 5.0          # a real template renders in milliseconds, even around a long document
MIN_OUTPUT_CHARS = 1 << 20    # the output bound: this, or 8x what went in (the template and the messages)


def render_chat(template: str | None, messages: list[dict], *, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True,
                timeout_s: float = RENDER_SECONDS) -> str:
    if not template:
        raise TokenizerError("This model has no chat template (tokenizer.chat_template is missing in the GGUF).")
    _check_messages(messages)
    context = {"messages": [dict(m) for m in messages], "bos_token": bos_token or "", "eos_token": eos_token or "",
               "add_generation_prompt": bool(add_generation_prompt)}
    size = len(template) + sum(len(m["content"]) + len(m["role"]) for m in messages)
    return SANDBOX.render(template, context, max(MIN_OUTPUT_CHARS, 8 * size), timeout_s)


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("chat() takes a non-empty list of {'role': ..., 'content': ...} messages.")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"Each chat message must be a dict with string 'role' and 'content', got {m!r:.80}.")
        extra = set(m) - {"role", "content"}
        if extra:
            raise ConfigError(f"A chat message holds 'role' and 'content' only, got {', '.join(sorted(extra))}.")


class TemplateSandbox:
    """One renderer process, started at the first render and again after one was killed; renders from several
    threads take turns (each is milliseconds)."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def render(self, template: str, context: dict, max_chars: int, timeout_s: float) -> str:
        request = (json.dumps({"template": template, "context": context, "max_chars": max_chars}) + "\n").encode()
        with self._lock:
            reply = self._exchange(request, timeout_s)
        if "text" in reply:
            return reply["text"]
        kind, message = reply.get("error"), _one_line(reply.get("message", ""))
        if kind == "refused":
            raise ConfigError(f"The chat template refused the messages: {message}")
        if kind == "template":
            raise TokenizerError(f"The GGUF's chat template could not be rendered: {message}")
        raise TokenizerError(f"The GGUF's chat template failed while rendering: {message}.")

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _exchange(self, request: bytes, timeout_s: float) -> dict:
        process = self._started()
        try:
            process.stdin.write(request)
            process.stdin.flush()
        except OSError:          # it died since the last render (killed from outside): once more, afresh
            self._stop()
            process = self._started()
            process.stdin.write(request)
            process.stdin.flush()
        line = self._read_line(process, time.monotonic() + timeout_s)
        if line is None:
            self._stop()
            raise TokenizerError(f"The GGUF's chat template did not finish rendering within {timeout_s:g} s (a loop "
                                 f"without end?); it was stopped.")
        if not line:
            code = process.poll()
            self._stop()
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise TokenizerError(f"The GGUF's chat template crashed its renderer ({how}).")
        return json.loads(line)

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-s", "-B", "-c", _RUN_WORKER, str(Path(__file__).with_name("template_worker.py"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=_worker_env(), cwd="/", close_fds=True)
        return self._process

    @staticmethod
    def _read_line(process: subprocess.Popen, deadline: float) -> bytes | None:
        """The reply line (b"" if the process ended first), or None at the deadline."""
        fd, buffer = process.stdout.fileno(), bytearray()
        while not buffer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buffer += chunk
        return bytes(buffer)

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                stream.close()
            self._process = None


def _one_line(text: str, limit: int = 300) -> str:
    """A message from the template (its raise_exception() text, a Jinja error) as one line of bounded length."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _worker_env() -> dict:
    """Nothing of this process's environment (a template that escaped the sandbox would find no secrets), only
    where jinja2 lives."""
    import jinja2
    import markupsafe

    paths = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (jinja2, markupsafe))
    return {"PYTHONPATH": os.pathsep.join(paths), "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


# The worker runs as a file, not a module: it imports nothing of sharpi, and its own folder stays off sys.path.
_RUN_WORKER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
# The renderer process of this Python process: an explicit cache of one child, started on first use and stopped
# when the interpreter exits (it would see its stdin close then anyway; this leaves no warning behind).
SANDBOX = TemplateSandbox()
atexit.register(SANDBOX.close)
