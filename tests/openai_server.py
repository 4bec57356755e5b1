"""The OpenAI-client side of the server tests (test_serve.py, test_serve_ray.py): a server in this process on one
engine, and the comparison of a greedy answer with the same request's answer alone.

A "solo" output is the request's output with nothing else running on the server. Concurrent outputs must equal it;
a difference is allowed only from a position where the solo run's top-2 logit margin is below the float path's
tolerance (batched decode reads the same numbers through other GEMM tiles), and the test prints it."""
from __future__ import annotations

import re
import time

import httpx
import openai

from sharpi.serve.app import ServerState
from sharpi.serve.client import LocalEngine
from sharpi.serve.engine import ServeEngine, ServeSettings
from sharpi.serve.http_guard import HttpLimits
from sharpi.serve.server import serve_in_thread

NAME = "smollm2-test"
MARGIN = 1e-3           # logits: the float path's decode_batch vs decode difference is ~1e-5 (test_decode_batch)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are", "My favourite food is", "In 1492, Columbus", "Water boils at",
           "The moon is"]


class Server:
    def __init__(self, model, **settings):
        api_key = settings.pop("api_key", None)
        knobs = settings.pop("snapkv_knobs", {})
        limits = settings.pop("limits", HttpLimits())
        self.engine = ServeEngine(model, ServeSettings(**settings)).start()
        self.state = ServerState(NAME, api_key=api_key, snapkv_knobs=knobs, model=model,
                                 engine=LocalEngine(self.engine), limits=limits)
        self._context = serve_in_thread(self.state)
        self.url = self._context.__enter__()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0,
                                    timeout=120)

    def close(self):
        self._context.__exit__(None, None, None)
        self.engine.shutdown()

    def metric(self, name: str, labels: str = "") -> float:
        headers = {"Authorization": f"Bearer {self.state.api_key}"} if self.state.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers).text
        match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.engine.idle:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.02)

    def sequence_pages(self) -> int:
        """Pages held by sequences (not by the prefix and conversation caches)."""
        pool = self.engine.pool_summary()
        return pool["used"] - pool["cached"]


def complete(client, prompt, max_tokens=24, **extra):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     logprobs=2, **extra)


def assert_same_greedy(solo, other, label: str) -> None:
    """Token by token equal to the solo run, or different only from a position where the solo run's top two
    were within MARGIN (reported)."""
    a, b = solo.choices[0].logprobs, other.choices[0].logprobs
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            top = sorted(a.top_logprobs[i].values(), reverse=True)
            margin = top[0] - top[1]
            assert margin < MARGIN, f"{label}: token {i} is {y!r}, alone {x!r} (top-2 margin {margin:.2e})"
            print(f"{label}: differs from token {i} on, where the solo top-2 margin is {margin:.2e}")
            return
    assert len(a.tokens) == len(b.tokens) and solo.choices[0].text == other.choices[0].text, label


