"""Fuzzing chat-template rendering: every template must render to a string or end in one SharpiError sentence,
within its time bound, without ever reading this process's environment or hurting this process.

    python benchmarks/fuzz_gguf.py --target template [--seconds 600] [--work DIR]

Templates come from a small grammar of Jinja constructs that make trouble (loops over big ranges, nested and
recursive loops, recursive macros, string and integer arithmetic that grows without bound, filters that widen or
repeat, attribute and item access with dunder names, the published sandbox escapes, include/import/extends,
set/call/filter blocks), and from the real templates of the project's models (SmolLM2, Gemma 3, and the llama-3 /
qwen style ChatML ones) mutated character by character. A finding is an exception that is not a SharpiError, a
message of more than one line, a render that took longer than its bound plus a second, output that holds the
secret planted in this process's environment, or growth of this process's memory.
"""
from __future__ import annotations

import json
import os
import random
import resource
import time
import traceback
from pathlib import Path

SECRET = "sharpi-fuzz-secret-4f1d"
TIMEOUT_S = 0.5
SLACK_S = 1.5                   # a restart of the renderer (after a timeout) costs ~0.1 s, a cold one more

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
STRICT = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}"
          "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{{ '[INST] ' + message['content'] + ' [/INST]' if message['role'] == 'user' else message['content'] }}"
          "{% endfor %}")

ATOMS = ["messages", "messages[0]", "messages[0]['content']", "messages[-1].role", "bos_token", "eos_token",
         "add_generation_prompt", "range(100000)", "range(10**9)", "'x' * 1000", "'x' * 10**9", "10 ** 10 ** 3",
         "(2 ** 64) ** 64", "1 // 0", "1 % 0", "1.0e308 * 10", "[1] * 10**8", "lipsum(1000)", "cycler(1, 2)",
         "namespace(a=1)", "joiner(',')", "dict(a=1)", "''.__class__", "messages.__class__.__mro__",
         "cycler.__init__.__globals__", "self._TemplateReference__context", "loop", "undefined_name",
         "'%s' % messages", "'{0.__class__}'.format(1)", "('{0.__class__}')|attr('format')(1)",
         "''|attr('__class__')", "messages|map(attribute='__class__')|list", "'abc'[::-1]", "[][0]", "{}['x']",
         "namespace.__init__.__globals__.os", "range.__self__", "'a'.format_map", "messages|tojson",
         "'x'|center(10**9)", "'x'|indent(10**8)", "'x\\n'|wordwrap(1)", "messages|batch(0)|list",
         "range(10)|slice(0)|list", "'%*d' % (10**9, 1)", "'{:>1000000000}'.format(1)"]
FILTERS = ["trim", "upper", "list", "join(',')", "length", "first", "last", "reverse", "sort", "unique", "tojson",
           "string", "int", "float", "abs", "sum", "center(10**7)", "replace('x', 'xx' * 1000)", "batch(3)|list",
           "map('upper')|list", "selectattr('role')|list", "dictsort", "wordcount", "urlize", "striptags",
           "xmlattr", "pprint", "format(1)", "truncate(5)", "default('d')", "attr('__dict__')"]


def random_template(rng: random.Random, depth: int = 0) -> str:
    """A template from the grammar: statements nested up to a few levels."""
    def expr() -> str:
        e = rng.choice(ATOMS)
        for _ in range(rng.choice([0, 0, 1, 2])):
            e = f"({e})|{rng.choice(FILTERS)}"
        if rng.random() < 0.2:
            e = f"{e} {rng.choice(['+', '*', '~', '**', '//', '%', 'in', '=='])} {rng.choice(ATOMS)}"
        return e

    def block() -> str:
        if depth > 3:
            return "{{ " + expr() + " }}"
        inner = random_template(rng, depth + 1)
        kind = rng.randrange(11)
        if kind == 0:
            return "{% for x in " + expr() + " %}" + inner + "{% endfor %}"
        if kind == 1:
            return "{% for x in " + expr() + " recursive %}" + inner + "{{ loop(x) }}{% endfor %}"
        if kind == 2:
            return "{% macro m(n) %}" + inner + "{{ m(n) }}{% endmacro %}{{ m(1) }}"
        if kind == 3:
            return "{% set v = " + expr() + " %}" + inner + "{{ v }}"
        if kind == 4:
            return "{% if " + expr() + " %}" + inner + "{% else %}{{ " + expr() + " }}{% endif %}"
        if kind == 5:
            return "{% filter " + rng.choice(["upper", "center(100000)", "indent(1000)"]) + " %}" + inner + \
                "{% endfilter %}"
        if kind == 6:
            return "{% " + rng.choice(["include", "import", "extends"]) + " 'x.j2' %}"
        if kind == 7:
            return "{% set ns = namespace(s='') %}{% for i in range(1000) %}{% set ns.s = ns.s ~ ns.s ~ 'x' %}" \
                   "{% endfor %}{{ ns.s|length }}"
        if kind == 8:
            return "{{ raise_exception(" + expr() + ") }}"
        return "{{ " + expr() + " }}"

    return "".join(block() for _ in range(rng.choice([1, 1, 2, 3])))


def mutate_real(rng: random.Random) -> str:
    """A real template, character-mutated: deletions, duplications, swapped delimiters."""
    from sharpi.common.tokenizer import GEMMA_CHAT_TEMPLATE
    text = list(rng.choice([CHATML, LLAMA3, STRICT, GEMMA_CHAT_TEMPLATE]))
    for _ in range(rng.choice([1, 2, 4, 8])):
        i = rng.randrange(len(text))
        op = rng.randrange(4)
        if op == 0:
            del text[i]
        elif op == 1:
            text[i:i] = text[i:i + rng.randrange(1, 40)]
        elif op == 2:
            text[i] = rng.choice(["{", "}", "%", "(", ")", "'", "|", "~", "*", "-"])
        else:
            text[i:i] = list(rng.choice(["{{ loop(x) }}", "{% for y in messages %}", "{% endfor %}", "**9",
                                         "|attr('__class__')", "[0]"]))
    return "".join(text)


def messages(rng: random.Random) -> list[dict]:
    roles = ["system", "user", "assistant", "tool", "ünïcödé", ""]
    contents = ["hi", "", "{{ 7 * 7 }}", "\x00\ud800", "x" * 10000, "<|im_end|>", "\n" * 50]
    return [{"role": rng.choice(roles), "content": rng.choice(contents)} for _ in range(rng.choice([1, 2, 5, 40]))]


def run(work: Path, seconds: float, seed: int) -> dict:
    """The fuzzing loop: random and mutated templates for `seconds`; findings in WORK/findings."""
    import sharpi
    from sharpi.common.chat import render_chat

    work.mkdir(parents=True, exist_ok=True)
    findings = work / "findings"
    findings.mkdir(exist_ok=True)
    os.environ["SHARPI_FUZZ_SECRET"] = SECRET
    rng = random.Random(seed)
    stats = {"renders": 0, "outcomes": {}, "findings": {}, "slowest_s": 0.0, "rss_mb": {}}
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    deadline, last_save = time.time() + seconds, 0.0
    while time.time() < deadline:
        template = random_template(rng) if rng.random() < 0.7 else mutate_real(rng)
        chat = messages(rng)
        started = time.monotonic()
        finding = None
        try:
            out = render_chat(template, chat, bos_token="<s>", eos_token="</s>", timeout_s=TIMEOUT_S)
            outcome = "rendered"
            if SECRET in out:
                finding = "the environment's secret in the output"
        except sharpi.SharpiError as exc:
            outcome = type(exc).__name__ + (": timeout" if "within" in str(exc) else "")
            if "\n" in str(exc) or not str(exc):
                finding = f"{type(exc).__name__} of {str(exc).count(chr(10)) + 1} lines"
        except BaseException as exc:                                  # noqa: BLE001 - exactly what is looked for
            outcome, finding = "FINDING", f"{type(exc).__name__}: {traceback.format_exc(limit=-1).strip()[-200:]}"
        elapsed = time.monotonic() - started
        if elapsed > TIMEOUT_S + SLACK_S:
            finding = finding or f"took {elapsed:.1f} s (bound {TIMEOUT_S} s)"
        stats["renders"] += 1
        stats["slowest_s"] = max(stats["slowest_s"], round(elapsed, 3))
        stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
        if finding:
            count = stats["findings"].get(finding, 0)
            stats["findings"][finding] = count + 1
            if count == 0:
                (findings / f"finding-{len(stats['findings']):03d}.json").write_text(
                    json.dumps({"finding": finding, "template": template, "messages": chat}, indent=1))
        if time.time() - last_save > 10:
            last_save = time.time()
            stats["rss_mb"] = {"start": round(rss_start), "now": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
            (work / "stats.json").write_text(json.dumps(stats, indent=1))
    stats["rss_mb"] = {"start": round(rss_start),
                       "end": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    if stats["rss_mb"]["end"] - rss_start > 200:
        stats["findings"]["this process grew by more than 200 MB"] = 1
    (work / "stats.json").write_text(json.dumps(stats, indent=1))
    return stats
