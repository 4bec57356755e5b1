"""The HTTP layer: OpenAI's routes on FastAPI, a thin translation of request bodies (sharpi.serve.protocol) into
engine requests and of engine events into OpenAI responses and server-sent events.

Errors are OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for a bad body or value (the field
named) or ambiguous framing or authorization, 401 for a missing or wrong API key, 404 for another model or route,
408 for a body that does not arrive in time, 413 for a body over the bound, 503 while the model loads or when the
queue is full, 500 if the engine fails.

A request's size is bounded before any work proportional to it: the body by the HTTP guard (sharpi.serve.
http_guard), a text prompt against the context before it is tokenized whole (Tokenizer.tokenize's limit), an id
list by its length before its ids are checked. Work on large inputs (parsing, tokenizing, rendering, detokenizing)
runs in worker threads, never on the event loop.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..common.chat import render_chat
from ..common.errors import ConfigError, ContextLengthError, ServerBusyError, SharpiError
from ..common.speculative_settings import SpeculativeSettings, check_model_can_speculate
from ..common.tokenizer import PromptTooLongError, token_ids
from ..runtime.sampling import SamplingParams
from .client import EngineClient, EventStream, ModelFront
from .http_guard import GuardMiddleware, HttpLimits, RequestNote, RequestRefused
from .page import install_page
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       _Generation)
from .request import Event, GenerationRequest, TokenLogprob
from .shares import shares_body

log = logging.getLogger("sharpi.serve")
THREAD_BODY_BYTES = 64 << 10         # a body at least this large is parsed in a worker thread


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass
class ServerState:
    """What the routes see: the model (its front: tokenizer, settings) and the engine client once loaded (None
    while loading), the model's id, the API key, the server's SnapKV knobs (the defaults of a request's own)
    and its HTTP limits; whether the chat page is served at / (sharpi.serve.page)."""
    model_name: str
    api_key: str | None = None
    snapkv_knobs: dict = field(default_factory=dict)
    speculative: SpeculativeSettings = SpeculativeSettings()   # a request's when it names none
    limits: HttpLimits = field(default_factory=HttpLimits)
    model: ModelFront | None = None
    engine: EngineClient | None = None
    load_error: str | None = None
    chat_page: bool = True

    def ready(self) -> tuple[ModelFront, EngineClient]:
        if self.engine is None:
            detail = f": {self.load_error}" if self.load_error else "; try again shortly"
            raise ApiError(503, f"The model is not loaded{detail}.", "server_error", code="loading")
        return self.model, self.engine


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="sharpi", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sharpi = state
    _install_error_handlers(app)
    app.add_middleware(GuardMiddleware, limits=state.limits, answer_refusal=_refusal_response)
    auth = [Depends(_require_key(state))]
    if state.chat_page:
        install_page(app)

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "error" if state.load_error else "loading"}, status_code=503)
        if state.engine.health() is not None:
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state)

    @app.get("/metrics", dependencies=auth)
    async def metrics():
        _, engine = state.ready()
        return Response(engine.metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        model, _ = state.ready()
        body = await _parse(request, TokenizeRequest)
        _check_model(state, body.model)
        ids = await run_in_threadpool(_tokenize, model, body.prompt, "prompt", False,
                                      None if body.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_context}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        model, _ = state.ready()
        body = await _parse(request, DetokenizeRequest)
        _check_model(state, body.model)
        ids = _check_ids(model, body.tokens, "tokens", generate=False)
        text = await run_in_threadpool(model.detokenize, ids)
        return {"prompt": text, "content": text}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        model, engine = state.ready()
        body = await _parse(request, CompletionRequest)
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            ids = await run_in_threadpool(_tokenize, model, body.prompt, "prompt")
        else:
            ids = _check_ids(model, body.prompt, "prompt")
        generation = _generation_request(state, model, body, ids, body.max_tokens, body.logprobs,
                                         _completion_prefix(body, ids))
        return await _respond(request, engine, model, state, generation, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        model, engine = state.ready()
        body = await _parse(request, ChatCompletionRequest)
        generation = await _chat_generation(state, model, body)
        return await _respond(request, engine, model, state, generation, body, chat=True)

    @app.post("/v1/compress/shares", dependencies=auth)
    async def compress_shares(request: Request):
        """A chat completion's body with compress: its prefix compressed (or found compressed), nothing generated;
        the answer says, token by token, the share of (layer, KV head) slots that kept it (sharpi.serve.shares)."""
        model, engine = state.ready()
        body = await _parse(request, ChatCompletionRequest)
        if body.compress is None:
            raise ApiError(400, "The shares are a compressed prefix's: give compress (scorer, budget).",
                           param="compress")
        generation = await _chat_generation(state, model, body)
        n = generation.compress[1]
        # the prefix and one token more: the cache's lookup leaves a token to compute
        generation = replace(generation, prompt_ids=generation.prompt_ids[:n + 1], max_tokens=1, compress_only=True)
        usage = await _compression(request, engine, state, generation)
        if usage is None:                           # the client went away
            return Response(status_code=499)
        return await run_in_threadpool(shares_body, state.model_name, model.tokenizer, generation.prompt_ids,
                                       usage["compression"], body.compress.scorer, body.compress.budget,
                                       usage["cached_tokens"])

    return app


# -- requests ----------------------------------------------------------------------------------------------------
async def _parse(request: Request, schema: type[BaseModel]):
    """The body as `schema`, whatever its Content-Type says (curl -d sends form encoding; llama-server and
    vLLM read JSON regardless); a 400 naming the field otherwise."""
    data = await request.body()
    try:
        if len(data) >= THREAD_BODY_BYTES:
            return await run_in_threadpool(schema.model_validate_json, data)
        return schema.model_validate_json(data)
    except ValidationError as error:
        raise _validation_error(error.errors()) from None


async def _chat_generation(state: ServerState, model: ModelFront, body: ChatCompletionRequest) -> GenerationRequest:
    """A chat completion's body as an engine request (the chat route's, and the shares route's compression)."""
    _check_model(state, body.model)
    ids = await run_in_threadpool(_chat_prompt, model, body)
    prefix = await run_in_threadpool(_chat_prefix, model, body, ids) if body.compress else None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _generation_request(state, model, body, ids, body.token_limit(), logprobs, prefix)


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")


def _model_card(state: ServerState) -> dict:
    model = state.model
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "sharpi"}
    if model is not None:
        card["max_model_len"] = model.max_context
    return card


def _check_ids(model: ModelFront, ids, name: str, generate: bool = True) -> list[int]:
    """The id list as ints, each in the vocabulary, fitting the context (its length checked first)."""
    limit = _limit(model, generate)
    if len(ids) > limit:
        raise _too_long(model, name, f"{len(ids)}", generate)
    try:
        ids = token_ids(ids, name)
    except ConfigError as error:
        raise ApiError(400, str(error), param=name) from None
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"{name}: token ids must be in [0, {vocab}).", param=name)
    return ids


def _tokenize(model: ModelFront, text: str, name: str, generate: bool = True, add_bos: bool | None = None,
              special: bool = False) -> list[int]:
    """The text's ids, or a 400 once they are sure not to fit the context (found before tokenizing all of a long
    text: Tokenizer.tokenize's limit)."""
    try:
        return model.tokenize(text, add_bos, special, limit=_limit(model, generate))
    except PromptTooLongError as error:
        raise _too_long(model, name, f"{error.tokens}" if error.exact else f"at least {error.tokens}",
                        generate) from None


def _limit(model: ModelFront, generate: bool) -> int:
    """The most prompt tokens: the context, less the first generated token's place when generating."""
    return model.max_context - (1 if generate else 0)


def _too_long(model: ModelFront, name: str, count: str, generate: bool) -> ApiError:
    what = {"messages": "The messages have", "tokens": "The token list has"}.get(name, f"The {name} has")
    room = " (one more is needed for the first generated token)" if generate else ""
    return ApiError(400, f"{what} {count} tokens; the context holds {model.max_context}{room}.",
                    param=name, code="context_length_exceeded")


def _chat_prompt(model: ModelFront, body: ChatCompletionRequest, last: int | None = None,
                 generation_prompt: bool = True) -> list[int]:
    info = model.tokenizer.info
    messages = [{"role": m.role, "content": m.text()} for m in body.messages[:last]]
    characters, longest = sum(len(m["content"]) for m in messages), model.tokenizer.longest_token
    if characters > _limit(model, True) * longest:           # refused before the template renders them
        raise _too_long(model, "messages", f"at least {-(-characters // longest)}", True)
    try:
        prompt = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token,
                             add_generation_prompt=generation_prompt)
    except SharpiError as error:
        raise ApiError(400, str(error), param="messages") from None
    return _tokenize(model, prompt, "messages", special=True)


def _chat_prefix(model: ModelFront, body: ChatCompletionRequest, ids: list[int]) -> int:
    """The tokens of every message but the last: the prefix `compress` compresses. Where the chat template renders
    the earlier messages otherwise alone than in the whole conversation (e.g. the last one closed differently), the
    ids they share from the start (compared as ids, not text)."""
    if body.compress.prefix_tokens is not None:
        return body.compress.prefix_tokens
    if len(body.messages) < 2:
        raise ApiError(400, "compress.prefix all-but-last-message needs at least two messages.", param="compress")
    prefix = _chat_prompt(model, body, last=-1, generation_prompt=False)
    return next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))


def _completion_prefix(body: CompletionRequest, ids: list[int]) -> int | None:
    if body.compress is None:
        return None
    if body.compress.prefix is not None or body.compress.prefix_tokens is None:
        raise ApiError(400, "A completion's compress takes prefix_tokens (the prompt's first N tokens).",
                       param="compress.prefix_tokens")
    return body.compress.prefix_tokens


def _generation_request(state: ServerState, model: ModelFront, body: _Generation, ids: list[int],
                        max_tokens: int | None, logprobs: int | None, prefix: int | None = None) -> GenerationRequest:
    room = model.max_context - len(ids)
    if room <= 0:
        raise ApiError(400, f"The prompt has {len(ids)} tokens; the context holds {model.max_context} (one more "
                            f"is needed for the first generated token).", param="messages" if
                       isinstance(body, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    sampling = SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                              min_p=body.min_p, repeat_penalty=body.repetition_penalty, seed=body.seed,
                              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty)
    knobs = {**state.snapkv_knobs, **(body.snapkv.knobs() if body.snapkv else {})}
    compress = None
    if body.compress is not None:
        if body.snapkv is not None and body.snapkv.budget is not None:
            raise ApiError(400, "Give the budget once: compress.budget, not also snapkv.budget.", param="snapkv")
        knobs["budget"] = body.compress.budget
        compress = (body.compress.scorer, _check_prefix(prefix, len(ids), body.compress.budget))
    try:
        sampling.validate()
    except ConfigError as error:
        raise ApiError(400, str(error)) from None
    try:
        settings, _ = model.snapkv_settings(**knobs)
    except SharpiError as error:
        raise ApiError(400, str(error), param="compress" if compress else "snapkv") from None
    return GenerationRequest(ids, max_tokens=room if max_tokens is None else min(max_tokens, room),
                             sampling=sampling, stop=tuple(s for s in body.stops() if s), logprobs=logprobs,
                             snapkv=settings, ignore_eos=body.ignore_eos, compress=compress,
                             speculative=_speculative(state, body.speculative, model))


def _speculative(state: ServerState, given, model: ModelFront) -> SpeculativeSettings:
    """A request's speculative decoding (its own method and max_draft over the server's default), which the model
    must be able to roll back."""
    settings = _requested_speculation(state, given)
    try:
        return check_model_can_speculate(settings, model.config)
    except ConfigError as error:
        raise ApiError(400, str(error), param="speculative") from None


def _requested_speculation(state: ServerState, given) -> SpeculativeSettings:
    if given is None:
        return state.speculative
    if isinstance(given, str):
        return replace(state.speculative, method=given)
    draft = given.max_draft if given.max_draft is not None else state.speculative.max_draft
    return replace(state.speculative, method=given.method, max_draft=draft)


def _check_prefix(prefix: int, tokens: int, budget: int) -> int:
    if not budget < prefix < tokens:
        raise ApiError(400, f"The prefix to compress has {prefix} tokens; it must be longer than the budget "
                            f"({budget}) and shorter than the prompt ({tokens} tokens).", param="compress")
    return prefix


# -- responses ---------------------------------------------------------------------------------------------------
@dataclass
class _Reply:
    """One request's answer as it comes: text, logprobs, finish reason, usage, and the times for its log line."""
    id: str
    created: int
    model: str
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    first_token_s: float | None = None
    note: RequestNote | None = None       # the request's log line

    def noted(self) -> None:
        """Tell the log line how the generation ended."""
        if self.note is None:
            return
        if self.finish_reason is None:
            self.note.outcome = "cancelled: the client went away"
        elif self.usage is not None:
            u = self.usage
            self.note.outcome = (f"prompt={u['prompt_tokens']} cached={u['cached_tokens']} "
                                 f"completion={u['completion_tokens']} finish={self.finish_reason}")
            if self.first_token_s is not None:
                self.note.outcome += f" first_token={self.first_token_s:.3f}s"
        else:
            self.note.outcome = f"finish={self.finish_reason}"


async def _respond(request: Request, engine: EngineClient, model: ModelFront, state: ServerState,
                   generation: GenerationRequest, body: _Generation, chat: bool):
    reply = _Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), state.model_name,
                   note=request.scope.get("sharpi_note"))
    start = time.monotonic()
    if generation.max_tokens == 0:                  # nothing to generate: the prompt is not even computed
        events = EventStream.finished(Event("finish", finish_reason="length", usage={
            "prompt_tokens": len(generation.prompt_ids), "completion_tokens": 0, "cached_tokens": 0}))
    else:
        events = await _open(engine, generation)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(model, events, reply, start, chat, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **_replica_header(events)})
    async for event in _events_until_disconnect(request, events):
        _take(reply, event, start)
    reply.noted()
    if reply.finish_reason is None:                 # the client went away: nothing to answer
        return Response(status_code=499)
    _raise_if_failed(reply)
    # read at the end: a request sent again after its replica died names the replica that answered
    return JSONResponse(_full_response(model, reply, chat), headers=_replica_header(events))


async def _compression(request: Request, engine: EngineClient, state: ServerState,
                       generation: GenerationRequest) -> dict | None:
    """Run a compress_only request to its end; its finish's usage (with the compression's report), or None when
    the client went away."""
    reply = _Reply("compression", int(time.time()), state.model_name, note=request.scope.get("sharpi_note"))
    start = time.monotonic()
    async for event in _events_until_disconnect(request, await _open(engine, generation)):
        _take(reply, event, start)
    reply.noted()
    if reply.finish_reason is None:
        return None
    _raise_if_failed(reply)
    if "compression" not in (reply.usage or {}):     # the pool could not hold the prefix (finish "length")
        raise ApiError(503, "The server's KV pool has no room to compress this prefix now; try again later.",
                       "server_error", code="overloaded")
    return reply.usage


def _replica_header(events: EventStream) -> dict:
    """Which engine replica serves the request (Ray Serve deployments; none in a single-engine server)."""
    return {"x-sharpi-replica": events.replica} if events.replica else {}


async def _open(engine: EngineClient, generation: GenerationRequest) -> EventStream:
    try:
        return await engine.open(generation)
    except ServerBusyError as error:
        raise ApiError(503, str(error), "server_error", code="overloaded") from None
    except ContextLengthError as error:
        raise ApiError(400, str(error), param="prompt", code="context_length_exceeded") from None
    except ConfigError as error:
        raise ApiError(400, str(error)) from None


async def _events_until_disconnect(request: Request, events: EventStream):
    """The request's events until its finish; a client that disconnects cancels it (its pages freed)."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.next(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield event
            if event.kind == "finish":
                return
    finally:
        events.cancel()


def _take(reply: _Reply, event: Event, start: float) -> None:
    if event.text and reply.first_token_s is None:
        reply.first_token_s = time.monotonic() - start
    reply.text += event.text
    reply.logprobs.extend(event.logprobs)
    if event.kind == "finish":
        reply.finish_reason, reply.usage = event.finish_reason, event.usage
        reply.error = event.message


def _raise_if_failed(reply: _Reply) -> None:
    if reply.finish_reason == "error":
        raise ApiError(500, reply.error or "The server's engine failed.", "server_error")
    if reply.finish_reason == "cancelled":
        raise ApiError(503, "The request was cancelled: the server is shutting down.", "server_error")


def _usage(usage: dict) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}


def _full_response(model: ModelFront, reply: _Reply, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                  "logprobs": _chat_logprobs(model, reply.logprobs) if reply.logprobs else None,
                  "finish_reason": reply.finish_reason}
    else:
        choice = {"index": 0, "text": reply.text,
                  "logprobs": _completion_logprobs(model, reply.logprobs, 0) if reply.logprobs else None,
                  "finish_reason": reply.finish_reason}
    return {"id": reply.id, "object": "chat.completion" if chat else "text_completion", "created": reply.created,
            "model": reply.model, "choices": [choice], "usage": _usage(reply.usage)}


async def _sse(model: ModelFront, events: EventStream, reply: _Reply, start: float, chat: bool,
               include_usage: bool):
    """Server-sent events: a chunk per piece of text, the finish reason, the usage if asked, then [DONE]. The
    stream's consumer going away (a disconnect) closes this generator, which cancels the request."""
    object_name = "chat.completion.chunk" if chat else "text_completion"
    offset = 0

    def chunk(choices: list, **extra) -> str:
        body = {"id": reply.id, "object": object_name, "created": reply.created, "model": reply.model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict:
        nonlocal offset
        if chat:
            lp = {"content": _chat_logprobs(model, logprobs)["content"]} if logprobs else None
            out = {"index": 0, "delta": {"content": text} if text or not finish else {}, "logprobs": lp,
                   "finish_reason": finish}
        else:
            lp = _completion_logprobs(model, logprobs, offset) if logprobs else None
            out = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        offset += len(text)
        return out

    try:
        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        while True:
            event = await events.next()
            _take(reply, event, start)
            if event.kind == "text":
                if event.text or event.logprobs:
                    yield chunk([choice(event.text, event.logprobs, None)])
                continue
            if event.finish_reason in ("error", "cancelled"):
                message = event.message or "The request was cancelled: the server is shutting down."
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
            else:
                if event.text:
                    yield chunk([choice(event.text, [], None)])
                yield chunk([choice("", [], event.finish_reason)])
                if include_usage:
                    yield chunk([], usage=_usage(event.usage))
            yield "data: [DONE]\n\n"
            return
    finally:
        reply.noted()
        events.cancel()


def _token_text(model: ModelFront, token: int) -> str:
    return model.detokenize([token])


def _chat_logprobs(model: ModelFront, logprobs: list[TokenLogprob]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = _token_text(model, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def _completion_logprobs(model: ModelFront, logprobs: list[TokenLogprob], offset: int) -> dict:
    tokens = [_token_text(model, lp.token) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token_text(model, t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


# -- errors, auth, limits, logging -------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        _note_error(request, error.code or error.type)
        return error.response()

    @app.exception_handler(RequestRefused)
    async def refused(request: Request, error: RequestRefused):
        _note_error(request, error.code)
        return _refusal_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return _validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        _note_error(request, "not_found" if error.status_code == 404 else f"http_{error.status_code}")
        if error.status_code == 404:
            return ApiError(404, f"There is no route {request.method} {request.url.path}.",
                            code="not_found").response()
        if error.status_code == 405:
            return ApiError(405, f"{request.url.path} does not take {request.method}.").response()
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("request failed")
        _note_error(request, type(error).__name__)
        return ApiError(500, f"The server failed on this request: {type(error).__name__}.",
                        "server_error").response()


def _note_error(request: Request, code: str) -> None:
    note = request.scope.get("sharpi_note")
    if note is not None:
        note.outcome = f"error={code}"


def _refusal_response(refusal: RequestRefused) -> JSONResponse:
    """The HTTP guard's refusal in OpenAI's error body."""
    return ApiError(refusal.status, refusal.message, code=refusal.code).response()


def _validation_error(errors: list[dict]) -> ApiError:
    """The most specific pydantic error (the deepest field: of a union's branches, the one that got furthest) as
    one sentence naming the field."""
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # pydantic names the branch of a union it tried (e.g. prompt.str); keep only the field's path
    loc = [part for part in loc if part not in _TYPE_NAMES and not part.startswith(("list[", "function-"))]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "The request body is not valid JSON.", code="invalid_json")
    if kind == "missing" and param:
        return ApiError(400, f"The field '{param}' is required.", param=param)
    if kind == "extra_forbidden":
        return ApiError(400, f"The field '{param}' is not supported by this server.", param=param,
                        code="unsupported_field")
    if kind in ("model_type", "model_attributes_type", "dict_type") and not param:
        return ApiError(400, "The request body must be a JSON object.")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}." if param else f"{message}.", param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "literal['auto']", "TextPart", "ChatMessage"}


def _require_key(state: ServerState):
    async def check(request: Request):
        if state.api_key is None:
            return
        headers = request.headers.getlist("authorization")
        if len(headers) > 1:
            raise ApiError(400, "Send one Authorization header, not several.", code="ambiguous_authorization")
        scheme, _, token = (headers[0] if headers else "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise ApiError(401, "A valid API key is required: send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
    return check
