"""A GGUF's chat template is code from the model file: it renders in jinja2's sandbox in a child process with
bounded time, memory and output, and every way it can fail (an escape attempt, a loop without end, recursion,
arithmetic, an allocation without bound) is one TokenizerError sentence, off the main thread too."""
from __future__ import annotations

import os
import threading
import time
from importlib.metadata import requires, version

import pytest

import sharpi
from sharpi.common import chat
from sharpi.common.chat import SANDBOX, render_chat

MESSAGES = [{"role": "user", "content": "hi"}]

ESCAPES = [   # payloads of the sandbox escapes published for jinja2 (3.1.4's |attr, 3.1.5's format) and classics
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.environ }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').environ }}",
    "{{ ('{0.__class__.__mro__[1]}')|attr('format')(1) }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set x = lipsum.__globals__ %}{{ x }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ 'a'.format.__self__ }}",
    "{{ (1).__class__.__base__.__subclasses__() }}",
]


def test_the_jinja2_floor_has_no_known_sandbox_escape():
    floor = next(r for r in requires("sharpi") if r.lower().startswith("jinja2"))
    assert ">=3.1.6" in floor.replace(" ", "")
    assert tuple(int(part) for part in version("jinja2").split(".")[:3]) >= (3, 1, 6)


@pytest.mark.parametrize("payload", ESCAPES)
def test_escape_attempts_are_one_sentence_and_read_nothing(payload, monkeypatch):
    monkeypatch.setenv("SHARPI_TEST_SECRET", "s3cret-value")
    try:
        out = render_chat(payload, MESSAGES)
    except sharpi.TokenizerError as exc:
        assert "\n" not in str(exc)
        return
    assert "s3cret-value" not in out and "<class" not in out and "environ" not in out


def test_the_renderer_sees_none_of_this_processs_environment(monkeypatch):
    monkeypatch.setenv("SHARPI_TEST_SECRET", "s3cret-value")
    env = chat._worker_env()
    assert "SHARPI_TEST_SECRET" not in env and "PATH" not in env and "HOME" not in env


FAILURES = {   # template -> fragment of the TokenizerError
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "did not finish rendering",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": "recurses without end",
    "{{ 1 // 0 }}": "ZeroDivisionError",
    "{{ 10.0 ** 400 }}": "OverflowError",
    "{{ 'x' * 3000000000 }}": "needs more than",
    "{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxx{% endfor %}{% endfor %}": "renders more than",
    "{{ messages[0]['content'][99999999] }}": None,        # jinja: undefined, renders '' (no error)
    "{% for %}": "could not be rendered",
    "{{ messages|map(attribute='role')|join(0) }}": None,
}


@pytest.mark.parametrize("template", list(FAILURES))
def test_failures_are_one_sentence(template):
    fragment = FAILURES[template]
    started = time.monotonic()
    if fragment is None:
        render_chat(template, MESSAGES, timeout_s=1.0)
        return
    with pytest.raises(sharpi.TokenizerError) as info:
        render_chat(template, MESSAGES, timeout_s=1.0)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert time.monotonic() - started < 5


def test_a_template_that_refuses_is_a_config_error():
    with pytest.raises(sharpi.ConfigError, match="refused the messages: roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", MESSAGES)
    for payload in ("lipsum(1000)", "'a\\nb\\n' * 5000", "messages[0]['content']"):   # found by the fuzzer
        with pytest.raises(sharpi.ConfigError) as info:
            render_chat("{{ raise_exception(" + payload + ") }}", [{"role": "user", "content": "x\ny"}])
        assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_renders_off_the_main_thread_and_after_the_renderer_was_killed():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    results = []
    threads = [threading.Thread(target=lambda: results.append(render_chat(template, MESSAGES))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["<user>hi"] * 4
    os.kill(SANDBOX._process.pid, 9)                       # killed from outside: the next render starts another
    SANDBOX._process.wait()
    assert render_chat(template, MESSAGES) == "<user>hi"


def test_messages_are_checked_first():
    for bad in (None, [], ["hi"], [{"role": "user"}], [{"role": 1, "content": "x"}],
                [{"role": "user", "content": "x", "tool_calls": []}]):
        with pytest.raises(sharpi.ConfigError):
            render_chat("{{ messages }}", bad)
