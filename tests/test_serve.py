"""sharpi serve against the unmodified `openai` client, on 127.0.0.1 only, on SmolLM2's exact float path (solo
outputs and their comparison: openai_server.py)."""
from __future__ import annotations

import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

import sharpi
from sharpi.common.chat import render_chat
from sharpi.common.snapkv_settings import SnapKVSettings
from sharpi.serve.app import ServerState
from sharpi.serve.engine import generate
from sharpi.serve.request import GenerationRequest
from sharpi.serve.server import serve_in_thread

from openai_server import NAME, PROMPTS, Server, assert_same_greedy, complete


@pytest.fixture(scope="module")
def server(smollm2_artifact):
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=8192), parallel=8)
    yield s
    s.close()


def test_completion_and_chat_streaming_and_not(server, smollm2):
    c = server.client
    ids = smollm2.tokenize("The capital of France is")
    r = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == smollm2.generate("The capital of France is", 8).text
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)

    pieces = list(c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == r.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == smollm2.chat(messages, 12).text
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    stream = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == \
        chat.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert stream[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    # text content parts are one string
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    assert c.chat.completions.create(model=NAME, messages=parts, max_tokens=12, temperature=0) \
        .choices[0].message.content == chat.choices[0].message.content


def test_stop_strings_logprobs_and_sampling(server, smollm2):
    c = server.client
    full = complete(c, "The capital of France is", 12).choices[0].text
    stop = full.strip().split()[1]
    r = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0,
                             stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    lp = complete(c, "The capital of France is", 4).choices[0].logprobs
    logits = smollm2.score(smollm2.tokenize("The capital of France is"))[-1].astype(np.float64)
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert lp.token_logprobs[0] == pytest.approx(want.max(), abs=1e-4)
    assert len(lp.top_logprobs[0]) == 2 and lp.tokens[0] == max(lp.top_logprobs[0], key=lp.top_logprobs[0].get)
    # seeded sampling is reproducible; penalties are taken
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
              frequency_penalty=0.5, presence_penalty=0.3, extra_body={"top_k": 40, "min_p": 0.05})
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def test_eight_concurrent_requests_each_give_their_solo_output(server):
    c = server.client
    solo = [complete(c, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(c, p), PROMPTS))
    for p, a, b in zip(PROMPTS, solo, together):
        assert_same_greedy(a, b, p)
        assert b.usage.prompt_tokens == a.usage.prompt_tokens and b.usage.completion_tokens == 24
    assert server.metric("sharpi_decode_batch_size_bucket", '{le="4.0"}') < server.metric(
        "sharpi_decode_batch_size_count"), "no decode step ran more than 4 sequences at once"
    server.wait_idle()
    assert server.sequence_pages() == 0


def test_prefix_cache_shares_a_512_token_prefix(server, smollm2):
    c = server.client
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = np.random.default_rng(0)
    doc = smollm2.tokenize(" ".join(rng.choice(words, 600)))[:512]
    first, second = doc + smollm2.tokenize(" First question?"), doc + smollm2.tokenize(" Second one?")
    computed = server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')
    a = complete(c, first, 8)
    after_first = server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')
    b = complete(c, second, 8)
    after_second = server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 512
    assert after_first - computed == len(first) and after_second - after_first == len(second) - 512
    assert b.choices[0].text == smollm2.generate(second, 8).text       # the uncached output: the runtime API
    assert server.metric("sharpi_prefix_cache_hits_total") >= 1


def _greedy_session(session, logits, n: int) -> list[int]:
    """n greedy tokens from `logits`, each but the last fed back (as the server leaves a finished sequence)."""
    out = [int(np.argmax(logits))]
    while len(out) < n:
        out.append(int(np.argmax(session.decode(out[-1]))))
    return out


def test_a_chats_next_turn_continues_its_compressed_cache(server, smollm2):
    """A compressed conversation's next turn (its prompt, the answer, a new message): while the prefix cache holds
    the prompt's full pages, the whole conversation is prefilled from them and compressed again (scored by the new
    message); once those pages are gone, it continues the compressed cache, computing only the new tokens, and
    answers what the runtime's one session continued answers."""
    engine = server.engine
    rng = np.random.default_rng(1)
    words = "red green blue cyan magenta yellow black white grey brown".split()
    knobs = {"snapkv_budget": 128, "snapkv_recency": 16, "compress": "snapkv"}     # whatever SHARPI_COMPRESS says
    settings = SnapKVSettings(budget=128, recency=16)

    def ask(ids):
        _, end, events = generate(engine, GenerationRequest(ids, max_tokens=8, snapkv=settings, ignore_eos=True))
        return [t for e in events for t in e.token_ids], end.usage

    def computed():
        return server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')

    for faithful in (True, False):
        doc = smollm2.tokenize(" ".join(rng.choice(words, 400)))[:300]
        first, _ = ask(doc)
        follow = smollm2.tokenize(" Which colour came first?")
        second = doc + first + follow
        if not faithful:
            with engine.engine.lock:
                engine.prefix_cache.clear()
        hits, before = server.metric("sharpi_conversation_cache_hits_total"), computed()
        answer, usage = ask(second)
        reference = smollm2.session(**knobs)
        assert _greedy_session(reference, reference.prefill(doc), 8) == first and reference.evicted
        if faithful:           # the doc's full pages adopted (up to the scoring window), the rest compressed anew
            adopted = min(len(second) - settings.window, len(doc)) // 16 * 16
            assert usage["cached_tokens"] == adopted and computed() - before == len(second) - adopted
            assert server.metric("sharpi_conversation_cache_hits_total") == hits
            again = smollm2.session(**knobs)
            assert _greedy_session(again, again.prefill(second), 8) == answer and again.evicted
            again.close()
        else:                                          # the compressed cache has seen doc + first[:-1]
            assert usage["cached_tokens"] == len(doc) + len(first) - 1
            assert computed() - before == len(follow) + 1
            assert server.metric("sharpi_conversation_cache_hits_total") == hits + 1
            assert _greedy_session(reference, reference.prefill(first[-1:] + follow), 8) == answer
        reference.close()
    server.wait_idle()
    assert server.sequence_pages() == 0 and engine.conversations.page_set()


def test_two_questions_about_one_compressed_document(server, smollm2):
    """A chat asks for its document (every message but the last) to be compressed by a query-agnostic scorer: the
    second question about the same document reuses the compressed pages (cached_tokens, the prefill counter) and
    answers what the runtime's compressed session answers; bad compress values are 400s."""
    c = server.client
    rng = np.random.default_rng(2)
    doc = " ".join(rng.choice("north south east west up down left right".split(), 500))
    compress = {"scorer": "probe", "budget": 96}

    def ask(question):
        messages = [{"role": "user", "content": doc}, {"role": "user", "content": question}]
        return messages, c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                                   extra_body={"compress": compress, "ignore_eos": True})

    computed = lambda: server.metric("sharpi_prefill_tokens_total", '{kind="prompt"}')    # noqa: E731
    before = computed()
    messages, first = ask("Which word comes first?")
    after_first = computed()
    messages2, second = ask("How many times does north appear?")
    info = smollm2.tokenizer.info
    render = lambda m, gen: smollm2.tokenize(render_chat(info.chat_template, m, bos_token=info.bos_token,  # noqa
                                                         eos_token=info.eos_token, add_generation_prompt=gen),
                                             special=True)
    prefix, ids = render(messages2[:1], False), render(messages2, True)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and after_first - before == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == len(prefix)
    assert computed() - after_first == len(ids) - len(prefix)
    with smollm2.session(compress="probe", snapkv_budget=96) as s:       # the runtime: compress, then ask
        s.prefill(prefix)
        assert s.evicted
        tokens = _greedy_session(s, s.prefill(ids[len(prefix):]), 6)
    assert second.choices[0].message.content == smollm2.detokenize(tokens, special=False)
    for bad, param in [({"scorer": "zip", "budget": 96}, "compress.scorer"), ({"budget": 0}, "compress.budget"),
                       ({"budget": 5000}, "compress"), ({"budget": 96, "prefix_tokens": 10, "prefix":
                                                        "all-but-last-message"}, "compress")]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "compress": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": doc, "compress": {"budget": 96}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "compress.prefix_tokens"
    server.wait_idle()
    assert server.sequence_pages() == 0


def test_speculative_requests_answer_as_plain_ones(server, smollm2):
    """A request with "speculative": "lookup" verifies drafts (the metrics count them) and answers what a plain
    request does, alone and three at once; one that stops inside its accepted drafts leaves the prefix cache what
    it sent, so the same request again (served from that cache) answers the same."""
    c = server.client
    text = "one two three four five six seven eight nine ten, " * 6
    plain = complete(c, text, 40)
    drafted = server.metric("sharpi_speculative_drafted_tokens_total")
    spec = complete(c, text, 40, extra_body={"speculative": "lookup"})
    assert_same_greedy(plain, spec, "speculative")
    assert server.metric("sharpi_speculative_drafted_tokens_total") > drafted
    assert server.metric("sharpi_speculative_accepted_tokens_total") > 0
    words = plain.choices[0].text.split()
    stop = dict(extra_body={"speculative": {"method": "lookup", "max_draft": 8}}, stop=[words[len(words) // 2]])
    first, again = complete(c, text, 40, **stop), complete(c, text, 40, **stop)
    assert first.choices[0].finish_reason == "stop" and first.choices[0].text == again.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # three at once: one decode_batch call a step, each sequence its own drafts (decode_batch entries)
    texts = [text, "red green blue, " * 20, "alpha beta gamma delta " * 10]
    solos = [complete(c, t, 32) for t in texts]
    drafted = server.metric("sharpi_speculative_drafted_tokens_total")
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda t: complete(c, t, 32, extra_body={"speculative": "lookup"}), texts))
    for t, a, b in zip(texts, solos, together):
        assert_same_greedy(a, b, t[:20])
    assert server.metric("sharpi_speculative_drafted_tokens_total") > drafted
    for bad in ("medusa", {"method": "lookup", "max_draft": 0}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "speculative": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("speculative"), r.text
    server.wait_idle()
    assert server.sequence_pages() == 0


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    c, url = server.client, server.url
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    cases = [({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
             ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "logit_bias": {"1": 1}}, "logit_bias"),
             ({"prompt": "x", "tools": []}, "tools"), ({"prompt": [1, 2, 10**9]}, "prompt"),
             ({"prompt": "x", "snapkv": {"budget": -3}}, "snapkv"), ({"prompt": "x", "snapkv": {"colour": 1}},
                                                                     "snapkv.colour"),
             ({"prompt": list(range(9000))}, "prompt"), ({}, "prompt")]
    for body, param in cases:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error
    for raw in [b"{bad json", b"[1, 2]", b"\xff\xfe"]:
        r = httpx.post(url + "/v1/completions", content=raw)
        assert r.status_code == 400 and r.json()["error"]["message"], raw
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]})
    assert chat.status_code == 400 and "image_url" in chat.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").status_code == 404
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:      # a huge body is refused unread
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 413")
    assert complete(c, "The capital of France is", 4).choices[0].text             # still serving


def test_tokenize_detokenize_models_health_metrics(server, smollm2):
    url = server.url
    ids = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert ids == smollm2.tokenize("hello world")
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] == smollm2.detokenize(ids)
    assert [m.id for m in server.client.models.list()] == [NAME]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in ["sharpi_requests_total", "sharpi_time_to_first_token_seconds_bucket",
                 "sharpi_inter_token_latency_seconds_bucket", "sharpi_queue_depth", "sharpi_running_sequences",
                 "sharpi_pool_pages_used", "sharpi_pool_pages_free", "sharpi_snapkv_evictions_total",
                 "sharpi_snapkv_pages_freed_total", "sharpi_prefix_cache_hits_total"]:
        assert name in text, name


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    cancelled = server.metric("sharpi_requests_total", '{outcome="cancelled"}')
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 8:
                assert server.sequence_pages() > 0
                break
    server.wait_idle()
    assert server.sequence_pages() == 0
    assert server.metric("sharpi_requests_total", '{outcome="cancelled"}') == cancelled + 1


def test_preemption_answers_four_growing_sequences_in_a_small_pool(smollm2_artifact, smollm2):
    """256 slots a layer for four sequences that grow to ~100 tokens each, one of them a 221-token prompt
    compressed by SnapKV to 96: sequences are preempted and recomputed, and each output is its solo one."""
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=256), parallel=8, prefix_cache=False)
    try:
        long = " ".join(f"Item {i} is a red apple." for i in range(25))
        prompts = [long + " What colour are the items?", "Once upon a time, in a small village,",
                   "def fibonacci(n):", "The three primary colours are"]
        extra = [{"snapkv": {"budget": 96, "recency": 16}}, {}, {}, {}]
        run = [lambda i=i: complete(s.client, prompts[i], 90, extra_body={"ignore_eos": True, **extra[i]})
               for i in range(4)]
        solo = [f() for f in run]
        evictions = s.metric("sharpi_snapkv_evictions_total")
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda f: f(), run))
        for p, a, b in zip(prompts, solo, together):
            assert_same_greedy(a, b, p[-30:])
            assert b.usage.completion_tokens == 90
        assert s.metric("sharpi_preemptions_total") > 0
        assert s.metric("sharpi_snapkv_evictions_total") > evictions
        s.wait_idle()
        assert s.engine.pool_summary()["used"] == 0
    finally:
        s.close()


def test_queue_overflow_is_a_503_and_a_bounded_load_test_adds_up(smollm2_artifact):
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=4096), parallel=4, max_queue=6)
    try:
        outcomes, completion_tokens, lock = [], [0], threading.Lock()

        def client(k: int):
            for j in range(4):                               # 16 clients x 4 requests
                try:
                    r = s.client.completions.create(model=NAME, prompt=PROMPTS[(k + j) % 8], max_tokens=8,
                                                    temperature=0)
                    with lock:
                        outcomes.append("ok")
                        completion_tokens[0] += r.usage.completion_tokens
                except openai.InternalServerError as e:      # 503: the queue is full
                    assert e.status_code == 503 and "busy" in e.body["message"]
                    with lock:
                        outcomes.append("refused")

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(outcomes) == 64 and "refused" in outcomes and "ok" in outcomes
        s.wait_idle()
        assert s.sequence_pages() == 0
        assert s.metric("sharpi_requests_total", '{outcome="finished"}') == outcomes.count("ok")
        assert s.metric("sharpi_requests_total", '{outcome="refused"}') == outcomes.count("refused")
        assert s.metric("sharpi_generation_tokens_total") == completion_tokens[0]
    finally:
        s.close()


def test_api_key(smollm2_artifact):
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=1024), parallel=2, api_key="s3cret")
    try:
        assert httpx.get(s.url + "/health").status_code == 200                   # no key needed
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert s.client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        s.close()


def test_health_is_503_while_the_model_loads():
    state = ServerState(NAME)
    with serve_in_thread(state) as url:
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"


def test_the_cli_binds_to_loopback_and_frees_everything_on_sigterm(smollm2_artifact):
    import signal
    import subprocess
    import sys
    bad = subprocess.run([sys.executable, "-m", "sharpi.cli.main", "serve", str(smollm2_artifact), "--parallel",
                          "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--parallel" in bad.stderr
    process = subprocess.Popen([sys.executable, "-m", "sharpi.cli.main", "serve", str(smollm2_artifact),
                                "--port", "0", "--pool-tokens", "1024", "--model-name", NAME],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"(http://\S+)/v1", process.stdout.readline()).group(1)
        assert url.startswith("http://127.0.0.1:")
        assert "ready" in process.stdout.readline()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=NAME, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert re.search(r"stopped; 0 of \d+ KV pages still held", out)
    assert "POST /v1/completions 200" in err and "Traceback" not in err
