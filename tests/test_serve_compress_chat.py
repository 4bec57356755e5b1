"""A multi-turn chat about one document with `compress`, through the unmodified `openai` client (issue #46 item 5):
each turn sends the whole conversation with the same compress options, and turns 2 and 3 go on from the compressed
document (and the earlier turns) instead of computing it again: cached_tokens covers the document, and the server's
prefill counter grows by exactly the tokens the turn did not reuse. The answers are the runtime's: one session
that compresses the document and is continued turn after turn (the RoPE positions of the reused cache are right).
A plain request afterwards adopts the document's uncompressed full pages from the prefix cache, and a turn whose
prefix holds more than a budget of tokens past the compressed part is compressed afresh."""
from __future__ import annotations

import numpy as np
import pytest

import sharpi
from sharpi.common.chat import render_chat

from openai_server import MARGIN, NAME, Server

BUDGET = 128
COMPRESS = {"scorer": "keydiff", "budget": BUDGET}     # the chat's prefix: every message but the last (default)
MAX_TOKENS = 24
FACTS = [("red", "Oslo", 4821), ("green", "Lima", 1937), ("blue", "Cairo", 7302), ("amber", "Quito", 5560),
         ("violet", "Perth", 2684), ("silver", "Dakar", 9013), ("orange", "Hanoi", 3349), ("black", "Turin", 6175)]


def _document() -> str:
    lines = []
    for round_ in range(4):
        for colour, city, code in FACTS:
            lines.append(f"Note {len(lines) + 1}: the {colour} box was shipped from {city}, and its lock opens "
                         f"with the code {code + round_}.")
    return "Shipping log.\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def server(smollm2_artifact):
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=8192), parallel=4)
    yield s
    s.close()


def _render(model, messages, generation_prompt: bool) -> list[int]:
    info = model.tokenizer.info
    text = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token,
                       add_generation_prompt=generation_prompt)
    return model.tokenize(text, special=True)


class _Replica:
    """The runtime doing what the server does for this chat, call for call: the document prefilled and compressed
    alone (kept: the compressed prefix), the rest of turn 1 as a continuation, the answer decoded token by token
    (kept when it ends: the finished conversation); a later turn continues whichever of the two the server says
    it reused (its cached_tokens), computing the rest."""

    def __init__(self, model, eos: set[int]):
        self.model, self.eos = model, eos
        self.entries: dict[tuple, object] = {}           # tokens seen -> a session holding them

    def turn(self, ids: list[int], prefix: int, cached: int) -> tuple[list[int], list[float]]:
        if cached == 0:
            session = self.model.session(compress=COMPRESS["scorer"], snapkv_budget=BUDGET)
            session.prefill(ids[:prefix])
            assert session.evicted
            self.entries[tuple(ids[:prefix])] = session.fork()
            logits, seen = session.prefill(ids[prefix:]), list(ids)
        else:
            session = self.entries[tuple(ids[:cached])].fork()
            logits, seen = session.prefill(ids[cached:]), list(ids)
        out, margins = [], []
        while True:
            top = np.sort(logits)[-2:]
            token = int(np.argmax(logits))
            margins.append(float(top[1] - top[0]))
            if token in self.eos:
                break
            out.append(token)
            if len(out) == MAX_TOKENS:
                break
            logits = session.decode(token)
            seen.append(token)
        self.entries[tuple(seen)] = session
        return out, margins

    def close(self):
        for session in self.entries.values():
            session.close()


def _same_answer(model, server_text: str, tokens: list[int], margins: list[float], label: str) -> bool:
    """Whether the server answered the replica's tokens; a difference is allowed only from a token where the
    replica's top two logits were within MARGIN (batched vs single decode), and then False (stop comparing)."""
    if server_text == model.detokenize(tokens, special=False):
        return True
    for i in range(len(tokens) + 1):
        if not server_text.startswith(model.detokenize(tokens[:i + 1], special=False)) or i == len(tokens):
            assert margins[i] < MARGIN, f"{label}: the server's answer {server_text!r} departs from the runtime's " \
                                        f"{model.detokenize(tokens, special=False)!r} at token {i} " \
                                        f"(top-2 margin {margins[i]:.2e})"
            print(f"{label}: differs from token {i} on, where the runtime's top-2 margin is {margins[i]:.2e}")
            return False
    return False


def test_a_three_turn_compressed_chat_reuses_its_document(server, smollm2):
    c = server.client
    doc = _document()
    questions = ["Which city was the blue box shipped from?", "What code opens the red box's lock?",
                 "Which box was shipped from Hanoi?"]
    messages = [{"role": "system", "content": doc}]
    document_tokens = len(_render(smollm2, messages, False))
    assert document_tokens > 600

    def computed() -> float:
        return server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')

    replica = _Replica(smollm2, set(smollm2.tokenizer.info.stop_ids))
    compare = True
    try:
        cached = []
        for turn, question in enumerate(questions, 1):
            messages.append({"role": "user", "content": question})
            ids, prefix = _render(smollm2, messages, True), _render(smollm2, messages[:-1], False)
            before, hits = computed(), server.metric("sharpi_conversation_cache_hits_total")
            r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"compress": COMPRESS})
            answer, usage = r.choices[0].message.content, r.usage
            reused = usage.prompt_tokens_details.cached_tokens
            print(f"turn {turn}: prompt {usage.prompt_tokens}, cached {reused}, computed {computed() - before}, "
                  f"answer {answer!r}")
            assert answer.strip(), f"turn {turn} answered nothing"
            assert usage.prompt_tokens == len(ids)
            assert computed() - before == usage.prompt_tokens - reused        # only the new tokens computed
            if turn == 1:
                assert reused == 0
            else:
                assert reused >= document_tokens                               # the compressed document reused
                assert server.metric("sharpi_conversation_cache_hits_total") == hits + 1
            cached.append(reused)
            if compare:
                tokens, margins = replica.turn(ids, len(prefix), reused)
                compare = _same_answer(smollm2, answer, tokens, margins, f"turn {turn}")
            messages.append({"role": "assistant", "content": answer})
        assert cached[2] >= cached[1]
    finally:
        replica.close()

    # a plain follow-up (no compress) adopts the document's full pages, uncompressed, from the prefix cache
    plain = messages + [{"role": "user", "content": "Thank you. Which box was shipped from Lima?"}]
    before = computed()
    r = c.chat.completions.create(model=NAME, messages=plain, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == document_tokens // 16 * 16
    assert computed() - before == r.usage.prompt_tokens - document_tokens // 16 * 16

    # more than a budget of the prefix past the compressed document: the prefix is compressed afresh
    pasted = " ".join(f"Item {i} weighs {i * 3 + 1} kilograms." for i in range(40))
    long = messages + [{"role": "user", "content": pasted}, {"role": "assistant", "content": "Noted."},
                       {"role": "user", "content": "Which box was shipped from Lima?"}]
    assert len(_render(smollm2, long[:-1], False)) - document_tokens > BUDGET
    before = computed()
    r = c.chat.completions.create(model=NAME, messages=long, max_tokens=8, temperature=0,
                                  extra_body={"compress": COMPRESS})
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and computed() - before == r.usage.prompt_tokens
    server.wait_idle()
    assert server.sequence_pages() == 0


def test_a_template_that_renders_the_earlier_messages_otherwise_compresses_what_they_share(monkeypatch):
    """The prefix is compared as token ids: the earlier messages' ids as far as they begin the whole prompt's
    (a template may close the last of them differently alone, e.g. strip an answer's reasoning later): no 400."""
    from sharpi.serve import app
    from sharpi.serve.protocol import ChatCompletionRequest
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "doc"},
                                                              {"role": "user", "content": "q"}],
                                                 "compress": {"budget": 4}})
    ids = list(range(20))
    monkeypatch.setattr(app, "_chat_prompt", lambda *a, **k: list(range(12)))
    assert app._chat_prefix(None, body, ids) == 12                 # a true prefix: all of it
    monkeypatch.setattr(app, "_chat_prompt", lambda *a, **k: list(range(9)) + [99, 98])
    assert app._chat_prefix(None, body, ids) == 9                  # rendered otherwise from id 9: the shared 9
