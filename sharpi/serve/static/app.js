// sharpi's chat page (served by sharpi.serve.page): streamed chat completions, a document compressed once and
// reused by every question, and the document shaded by what the compression kept. Every text from the model or
// the user goes into the page with textContent, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "sharpi-api-key";            // sessionStorage: this tab only
  const ACK = "I have read the document.";  // the assistant's turn that closes the document's messages

  const state = {
    model: null,
    document: null,     // {text, scorer, budget, shares} once compressed
    history: [],        // the chat's earlier turns, after the document
    controller: null,   // aborts the request in flight
  };

  // -- the API ---------------------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function api(path, body, signal) {
    const init = body === undefined ? { headers: headers() }
      : { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
    const response = await fetch(path, init);
    if (!response.ok) throw await apiError(response);
    return response;
  }

  async function apiError(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: the status line says it */ }
    if (response.status === 401) $("key-form").hidden = false;
    return new ApiError(response.status, message);
  }

  // Server-sent events of a streamed completion: each `data:` payload parsed, up to [DONE].
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  // -- the page's parts ------------------------------------------------------------------------------------------
  function setStatus(text, error = false) {
    $("status").textContent = text;
    $("status").classList.toggle("error", error);
  }

  function setBusy(busy) {
    for (const id of ["ask", "compress", "forget", "clear"]) $(id).disabled = busy;
    $("stop").disabled = !busy;
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function addMessage(role, text) {
    const box = document.createElement("div");
    box.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    box.append(body, meta);
    $("transcript").append(box);
    box.scrollIntoView({ block: "end" });
    return { box, body, meta };
  }

  function addNote(text) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = text;
    $("transcript").append(note);
  }

  // -- the document ----------------------------------------------------------------------------------------------
  function documentMessages(text) {
    return [{ role: "user", content: text }, { role: "assistant", content: ACK }];
  }

  function documentSettings() {
    return { text: $("document").value, scorer: $("scorer").value, budget: Number.parseInt($("budget").value, 10) };
  }

  function compressedIsCurrent() {
    const d = state.document, now = documentSettings();
    return d !== null && d.text === now.text && d.scorer === now.scorer && d.budget === now.budget;
  }

  async function compress() {
    const settings = documentSettings();
    if (!settings.text.trim()) throw new Error("The document is empty.");
    if (!(settings.budget >= 1)) throw new Error("The budget must be a positive number of slots.");
    setStatus(`Compressing the document (${settings.scorer}, budget ${settings.budget})…`);
    // the body of a question about it; the empty last message stands for the question (not compressed)
    const body = {
      model: state.model,
      messages: [...documentMessages(settings.text), { role: "user", content: "" }],
      compress: { scorer: settings.scorer, budget: settings.budget },
    };
    const shares = await (await api("/v1/compress/shares", body, state.controller.signal)).json();
    const fresh = state.document === null || state.document.text !== settings.text;
    state.document = { ...settings, shares };
    if (fresh && state.history.length) {
      state.history = [];
      addNote("A new document: the chat starts again.");
    }
    showStats(shares);
    showShades(shares);
    setStatus("");
  }

  function showStats(s) {
    const mean = s.kept_slots.length ? s.kept_slots.reduce((a, b) => a + b, 0) / s.kept_slots.length : s.prefix_tokens;
    const source = s.cached_tokens ? "found compressed in the server's cache" : "compressed now";
    $("doc-stats").textContent =
      `${s.prefix_tokens} tokens, ${Math.round(mean)} kept a layer: ratio ${s.ratio.toFixed(2)}× · ` +
      `KV memory held ${bytes(s.kv_bytes)} (uncompressed ${bytes(s.full_kv_bytes)}) · ` +
      `${s.scorer}, budget ${s.budget}, ${source}`;
  }

  function showShades(s) {
    const view = $("shaded");
    const slots = `${s.layers} layers × ${s.kv_heads} KV heads`;
    const fragment = document.createDocumentFragment();
    s.tokens.forEach((piece, i) => {
      const share = s.shares[i];
      const span = document.createElement("span");
      span.className = `tok s${Math.round(share * 10)}`;
      span.dataset.share = String(share);
      span.title = `${(share * 100).toFixed(0)}% of the (layer, KV head) slots kept it (${slots})`;
      span.textContent = piece;
      fragment.append(span);
    });
    view.replaceChildren(fragment);
    $("legend").hidden = false;
  }

  function forget() {
    state.document = null;
    $("doc-stats").textContent = "";
    $("shaded").replaceChildren();
    $("legend").hidden = true;
  }

  // -- asking ----------------------------------------------------------------------------------------------------
  function question() {
    const messages = state.document ? documentMessages(state.document.text) : [];
    return messages.concat(state.history);
  }

  async function ask(text) {
    if ($("document").value.trim() && !compressedIsCurrent()) await compress();
    const messages = [...question(), { role: "user", content: text }];
    const body = {
      model: state.model, messages, stream: true, stream_options: { include_usage: true },
      max_tokens: Number.parseInt($("max-tokens").value, 10) || 256,
      temperature: Number.parseFloat($("temperature").value) || 0,
    };
    if (state.document) body.compress = { scorer: state.document.scorer, budget: state.document.budget };
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.box.dataset.state = "streaming";
    setStatus("Waiting for the first token…");
    const started = performance.now();
    try {
      const { finish, usage, chunks } = await stream(body, answer);
      answer.box.dataset.chunks = String(chunks);
      answer.box.dataset.state = "done";
      answer.meta.textContent = describe(usage, finish, performance.now() - started);
      state.history.push({ role: "user", content: text }, { role: "assistant", content: answer.body.textContent });
      setStatus("");
    } catch (error) {
      answer.box.dataset.state = error.name === "AbortError" ? "stopped" : "error";
      answer.meta.textContent = error.name === "AbortError" ? "stopped" : "";
      throw error;
    }
  }

  async function stream(body, answer) {
    const response = await api("/v1/chat/completions", body, state.controller.signal);
    let finish = null, usage = null, chunks = 0;
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        answer.body.textContent += choice.delta.content;
        chunks += 1;
        setStatus("Answering…");
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    return { finish, usage, chunks };
  }

  function describe(usage, finish, ms) {
    if (!usage) return `finish: ${finish}`;
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    return `${usage.prompt_tokens} prompt tokens (${cached} reused from the cache) · ` +
      `${usage.completion_tokens} generated · ${(ms / 1000).toFixed(1)} s · finish: ${finish}`;
  }

  // -- wiring ----------------------------------------------------------------------------------------------------
  async function run(action) {
    state.controller = new AbortController();
    setBusy(true);
    try {
      await action();
    } catch (error) {
      setStatus(error.name === "AbortError" ? "Stopped." : error.message, error.name !== "AbortError");
    } finally {
      state.controller = null;
      setBusy(false);
    }
  }

  async function connect() {
    try {
      const models = await (await api("/v1/models")).json();
      const card = models.data[0];
      state.model = card.id;
      $("model").textContent = card.max_model_len ? `${card.id} · context ${card.max_model_len}` : card.id;
      $("key-form").hidden = true;
      setStatus("");
    } catch (error) {
      $("model").textContent = "not connected";
      setStatus(error.message, true);
    }
  }

  function wire() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, $("api-key").value.trim());
      $("api-key").value = "";
      connect();
    });
    $("doc-form").addEventListener("submit", (event) => {
      event.preventDefault();
      run(compress);
    });
    $("ask-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("question").value.trim();
      if (!text || state.controller) return;
      $("question").value = "";
      run(() => ask(text));
    });
    $("question").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        $("ask-form").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("forget").addEventListener("click", forget);
    $("clear").addEventListener("click", () => {
      state.history = [];
      $("transcript").replaceChildren();
      setStatus("");
    });
    $("document").addEventListener("input", () => {
      if (state.document && !compressedIsCurrent()) setStatus("The document changed: the next question compresses it again.");
    });
  }

  wire();
  connect();
})();
