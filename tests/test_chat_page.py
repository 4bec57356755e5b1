"""The chat page at / (sharpi.serve.page) and the route behind its shaded view (/v1/compress/shares): the page's
headers and files, the shares against the runtime's own compression of the same tokens, and the page driven in a
real headless browser (Debian's chromium and chromium-driver through selenium) against a server on 127.0.0.1.

The browser test skips where chromium, its driver or selenium is missing, except in CI (CI=1), which installs
them (.ci/run) and must fail without them. On a failure it saves a screenshot under the test's tmp_path (kept for
failed tests) and prints its path; SHARPI_PAGE_SCREENSHOT=FILE saves the last state of a passing run too."""
from __future__ import annotations

import math
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

import sharpi
from sharpi.common.chat import render_chat
from sharpi.serve.app import ServerState, create_app
from sharpi.serve.page import CSP

from openai_server import NAME, Server

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ACK = "I have read the document."          # app.js's assistant turn after the document
BUDGET = 96
STATIC = Path(sharpi.__file__).parent / "serve" / "static"


def _document() -> str:
    """~450 tokens of plain facts, one of them asked about, and markup that must stay text."""
    rng = np.random.default_rng(5)
    cities = "Oslo Lima Cairo Perth Quito Dakar Hanoi Tunis Riga Sofia Accra Minsk".split()
    lines = [f"Station {i}: {rng.choice(cities)} reports {rng.integers(2, 40)} degrees and {rng.integers(0, 90)} mm "
             f"of rain." for i in range(24)]
    lines.insert(11, "The secret code of the archive is 4812.")
    lines.append('<img src="x" onerror="document.title=\'pwned\'"> <b>not bold</b> & done.')
    return "\n".join(lines)


@pytest.fixture(scope="module")
def server(smollm2_artifact):
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=8192), parallel=4, api_key=KEY)
    yield s
    s.close()


def _shares(url: str, text: str, budget: int = BUDGET, scorer: str = "probe", **extra) -> httpx.Response:
    """The shares of a document as the page asks for them (its messages, then the question to come)."""
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": ACK},
                {"role": "user", "content": ""}]
    return httpx.post(url + "/v1/compress/shares", headers=AUTH, timeout=300,
                      json={"messages": messages, "compress": {"scorer": scorer, "budget": budget}, **extra})


def _prefix_ids(model, text: str) -> list[int]:
    info = model.tokenizer.info
    prompt = render_chat(info.chat_template, [{"role": "user", "content": text},
                                              {"role": "assistant", "content": ACK}],
                         bos_token=info.bos_token, eos_token=info.eos_token, add_generation_prompt=False)
    return model.tokenize(prompt, special=True)


# -- the page's files and headers (no model needed) ----------------------------------------------------------------
def test_the_page_is_served_with_its_security_headers_and_nothing_else():
    client = TestClient(create_app(ServerState(NAME, api_key=KEY)))
    for path, kind in [("/", "text/html"), ("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")]:
        r = client.get(path)                                          # no key needed: the page holds no data
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
        assert r.headers["x-frame-options"] == "DENY"
    for directive in ["default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
                      "frame-ancestors 'none'", "base-uri 'none'", "form-action 'none'"]:
        assert directive in CSP
    for path in ["/index.html", "/static/", "/static/../app.py", "/static/page.py", "/static/app.js/x"]:
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert client.post("/").status_code == 405
    assert client.post("/v1/compress/shares", json={}).status_code == 401        # the API keeps its key
    assert TestClient(create_app(ServerState(NAME, chat_page=False))).get("/").status_code == 404


def test_the_page_has_no_inline_script_no_external_fetch_and_no_html_insertion():
    html, js, css = ((STATIC / name).read_text() for name in ("index.html", "app.js", "style.css"))
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/static/app.js" defer>']
    assert not re.search(r"\son\w+\s*=", html) and "style=" not in html          # no inline handlers or styles
    for text in (html, js, css):
        assert not re.search(r"(https?:)?//[\w.-]+\.\w", text.replace("http://www.w3.org", "")), \
            "no URL of another origin"
    for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"]:
        assert sink not in js, sink
    assert "sessionStorage" in js and "localStorage" not in js


# -- the shares ------------------------------------------------------------------------------------------------------
def test_shares_match_the_runtimes_compression_of_the_same_tokens(server, smollm2):
    doc = _document()
    r = _shares(server.url, doc)
    assert r.status_code == 200, r.text
    body = r.json()
    prefix = _prefix_ids(smollm2, doc)
    n = len(prefix)
    assert body["token_ids"] == prefix and body["prefix_tokens"] == n and n > 400
    assert len(body["tokens"]) == len(body["shares"]) == n
    assert "".join(body["tokens"]) == smollm2.detokenize(prefix, special=True)
    with smollm2.session(compress="probe", snapkv_budget=BUDGET) as s:         # the runtime: the same compression
        s.prefill(prefix)
        assert s.evicted
        kept = s.kept_positions                                                # per layer [kv_heads, slots]
        heads = kept[0].shape[0]
        counts = sum(np.bincount(layer[h], minlength=n) for layer in kept for h in range(heads))
        assert body["kv_bytes"] == s.kv_bytes
    np.testing.assert_array_equal(np.array(body["shares"]), counts / (len(kept) * heads))
    assert (body["layers"], body["kv_heads"]) == (len(kept), heads)
    assert body["kept_slots"] == [BUDGET] * len(kept) and math.isclose(sum(body["shares"]), BUDGET)
    assert body["ratio"] == pytest.approx(n / BUDGET) and body["full_kv_bytes"] > 3 * body["kv_bytes"]
    assert body["cached_tokens"] == 0 and body["scorer"] == "probe" and body["budget"] == BUDGET

    again = _shares(server.url, doc).json()            # the compressed prefix found in the cache: nothing computed
    assert again["cached_tokens"] == n and again["shares"] == body["shares"]
    messages = [{"role": "user", "content": doc}, {"role": "assistant", "content": ACK},
                {"role": "user", "content": "What is the secret code?"}]
    chat = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=300, json={
        "messages": messages, "max_tokens": 4, "temperature": 0, "compress": {"scorer": "probe", "budget": BUDGET}})
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n      # a question reuses it
    server.wait_idle()
    assert server.sequence_pages() == 0


def test_bad_shares_requests_are_openai_errors(server):
    doc = _document()
    cases = [({}, 400, "compress"), ({"compress": None}, 400, "compress"),
             ({"compress": {"scorer": "zip", "budget": 8}}, 400, "compress.scorer"),
             ({"compress": {"budget": 5000}}, 400, "compress"),
             ({"model": "gpt-4", "compress": {"budget": 8}}, 404, "model")]
    messages = [{"role": "user", "content": doc}, {"role": "user", "content": "?"}]
    for extra, status, param in cases:
        r = httpx.post(server.url + "/v1/compress/shares", headers=AUTH, json={"messages": messages, **extra})
        assert r.status_code == status and r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(server.url + "/v1/compress/shares", json={"messages": messages, "compress": {"budget": 8}})
    assert r.status_code == 401
    r = httpx.post(server.url + "/v1/compress/shares", headers=AUTH, content=b"{bad")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# -- the page in a browser -----------------------------------------------------------------------------------------
def _browser():
    """Headless chromium through selenium, or a skip naming what is missing (a failure in CI)."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install '.[test]')")
    if missing:
        message = f"the chat page's browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)                 # CI installs them: missing there is a failure
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]:     # nothing but the test server
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def _wait(driver, condition, what: str, timeout: float = 180):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def _last_answer(driver) -> dict:
    return driver.execute_script("""
        const box = [...document.querySelectorAll('.message.assistant')].pop();
        return box ? {state: box.dataset.state, text: box.querySelector('.text').textContent,
                      chunks: box.dataset.chunks, meta: box.querySelector('.meta').textContent} : null;""")


def _ask(driver, question: str) -> dict:
    from selenium.webdriver.common.by import By
    before = len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    box = driver.find_element(By.ID, "question")
    box.send_keys(question)
    driver.find_element(By.ID, "ask").click()
    _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message.assistant")) > before, "an answer box")
    seen_streaming = False
    for _ in range(int(300 / 0.05)):                      # the answer as it streams, until it is done
        answer = _last_answer(driver)
        seen_streaming |= answer["state"] == "streaming" and bool(answer["text"])
        if answer["state"] != "streaming":
            break
        time.sleep(0.05)
    status = driver.find_element(By.ID, "status").text
    assert answer["state"] == "done", (answer, status)
    return {**answer, "seen_streaming": seen_streaming}


def test_the_chat_page_in_a_headless_browser(server, smollm2, tmp_path):
    driver = _browser()
    started = time.monotonic()
    try:
        _browse(driver, server, smollm2)
        if os.environ.get("SHARPI_PAGE_SCREENSHOT"):
            driver.save_screenshot(os.environ["SHARPI_PAGE_SCREENSHOT"])
    except BaseException:
        shot = tmp_path / "chat-page-failure.png"
        driver.save_screenshot(str(shot))
        print(f"screenshot of the page at the failure: {shot}")
        print("browser log:", driver.get_log("browser"))
        raise
    finally:
        print(f"the browser test took {time.monotonic() - started:.1f} s")
        driver.quit()


def _browse(driver, server, smollm2) -> None:
    from selenium.webdriver.common.by import By
    driver.get(server.url + "/")
    # the server has a key: its 401 shows the key field; the key entered, the model is named
    _wait(driver, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the API key field")
    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
    _wait(driver, lambda d: d.find_element(By.ID, "model").text.startswith(NAME), "the model's name")
    assert not driver.find_element(By.ID, "key-form").is_displayed()
    assert driver.execute_script("return sessionStorage.getItem('sharpi-api-key')") == KEY

    # a question without a document: the streamed answer is the model's greedy one
    max_tokens = driver.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("24")
    answer = _ask(driver, "What is the capital of France?")
    want = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], 24).text
    assert answer["text"] == want and int(answer["chunks"]) > 1, answer
    print("streamed while visible:", answer["seen_streaming"])

    # a document compressed: stats and one shaded span per token, as the shares say
    doc = _document()
    driver.execute_script("const d = document.getElementById('document'); d.value = arguments[0];"
                          "d.dispatchEvent(new Event('input'));", doc)
    budget = driver.find_element(By.ID, "budget")
    budget.clear()
    budget.send_keys(str(BUDGET))
    driver.find_element(By.ID, "compress").click()
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#shaded .tok"), "the shaded document")
    shares = _shares(server.url, doc).json()                    # the same compression, from the cache
    spans = driver.execute_script("""return [...document.querySelectorAll('#shaded .tok')].map(s =>
        [s.textContent, Number(s.dataset.share), s.className, getComputedStyle(s).backgroundColor]);""")
    assert len(spans) == shares["prefix_tokens"] == len(shares["tokens"])
    for (text, share, kind, _), piece, want_share in zip(spans, shares["tokens"], shares["shares"]):
        assert (text, share, kind) == (piece, want_share, f"tok s{math.floor(want_share * 10 + 0.5)}")
    colours = {kind: colour for _, _, kind, colour in spans}
    assert colours["tok s0"] != colours["tok s10"] and len(set(colours.values())) == len(colours) >= 3
    stats = driver.find_element(By.ID, "doc-stats").text
    assert f"{shares['prefix_tokens']} tokens" in stats and "ratio" in stats and "KV memory held" in stats
    assert not driver.find_elements(By.CSS_SELECTOR, "#shaded img, #shaded b")   # markup stays text
    assert driver.title == "sharpi chat"

    # a question about it reuses the compressed document
    answer = _ask(driver, "What is the secret code of the archive? <script>alert(1)</script>")
    reused = int(re.search(r"\((\d+) reused", answer["meta"]).group(1))
    assert reused >= shares["prefix_tokens"], answer
    assert "<script>" in driver.find_elements(By.CSS_SELECTOR, ".message.user .text")[-1].text
    assert not driver.find_elements(By.CSS_SELECTOR, "#transcript script")
    # nothing fetched from elsewhere, no CSP violation or script error
    urls = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert all(u.startswith(server.url) for u in urls), urls
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
              and not (e["source"] == "network" and "/v1/models" in e["message"] and "401" in e["message"])]
    assert not errors, errors
