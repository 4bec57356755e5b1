"""The OpenAI request bodies the server takes, as pydantic models: types checked strictly, values bounded, and any
field the server does not implement refused by name (extra="forbid"), never silently ignored."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..common.speculative_settings import MAX_DRAFT
from ..runtime.text_output import MAX_STOP_CHARS

MAX_LOGPROBS = 20
MAX_STOP = 16
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SnapKVOptions(BaseModel):
    """Per-request SnapKV knobs (sharpi's extension): any left out come from the server's flags, then the
    artifact's defaults. budget: "auto", 0 (off) or slots a layer."""
    model_config = _STRICT
    budget: Union[int, Literal["auto"], None] = None
    window: int | None = None
    recency: int | None = None
    pooling: str | None = None
    kernel: int | None = None
    granularity: str | None = None
    sinks: int | None = None
    allocation: str | None = None

    def knobs(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class CompressOptions(BaseModel):
    """A query-agnostic compression of the prompt's prefix (sharpi's extension): the prefix is compressed to
    `budget` slots a layer by `scorer` (probe, the default: the best measured for its cost, benchmarks/
    compression.md; keydiff, hybrid or kvzip, sharpi.runtime.scorers), kept in the server's cache under its exact
    tokens, and reused by any later prompt that starts with them (another question about the same document).
    The prefix: a chat's messages but the last ("all-but-last-message", the default for chat; the ids the
    earlier messages render to, as far as they begin the whole conversation's) or a completion prompt's first
    `prefix_tokens` tokens.

    Reuse (a chat's next turn sends the same options): a request goes on from the longest compressed entry with
    the same scorer, budget and SnapKV settings whose tokens its prompt starts with (the compressed document, or
    an earlier turn's whole conversation, kept when it finished), computing only the tokens after it, uncompressed
    (a continuation never evicts). Its own prefix is compressed afresh only when more than `budget` of its tokens
    lie past the part that entry compressed. usage.prompt_tokens_details.cached_tokens is then the entry's token
    count: every prompt token the request did not compute."""
    model_config = _STRICT
    scorer: Literal["probe", "keydiff", "hybrid", "kvzip"] = "probe"
    budget: int = Field(ge=1, le=1 << 24)
    prefix: Literal["all-but-last-message"] | None = None
    prefix_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_prefix(self):
        if self.prefix is not None and self.prefix_tokens is not None:
            raise ValueError("give prefix or prefix_tokens, not both")
        return self


class SpeculativeOptions(BaseModel):
    """Speculative decoding (sharpi's extension): "lookup" drafts tokens from the prompt and the answer and verifies
    them in one forward where the request is decoded on its own (few requests running); the output is plain
    decoding's either way. max_draft: the most drafted tokens one forward verifies."""
    model_config = _STRICT
    method: Literal["off", "lookup"] = "lookup"
    max_draft: int | None = Field(None, ge=1, le=MAX_DRAFT)


class _Generation(BaseModel):
    """What completions and chat completions share."""
    model_config = _STRICT
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)                     # -1 (vLLM) or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Union[str, list[str], None] = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100,
                                      validation_alias=AliasChoices("repetition_penalty", "repeat_penalty"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    ignore_eos: bool = False
    snapkv: SnapKVOptions | None = None
    compress: CompressOptions | None = None
    speculative: Union[Literal["off", "lookup"], SpeculativeOptions, None] = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported (one choice per request)")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        total = sum(map(len, [stop] if isinstance(stop, str) else stop or []))
        if total > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings have {total} characters together; at most {MAX_STOP_CHARS}")
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Generation):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported, not a list of several")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, value, info):
        """Accepted in their neutral values only (False, empty, 1), so a client that sends them is not misled."""
        refusals = {"echo": (bool(value), "echo is not supported"),
                    "suffix": (bool(value), "suffix (insertion) is not supported"),
                    "best_of": (value not in (None, 1), "only best_of = 1 is supported")}
        refused, message = refusals[info.field_name]
        if refused:
            raise ValueError(message)
        return value


class TextPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"content parts of type {data.get('type')!r} are not supported (text only)")
        return data


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = Field(None, validation_alias=AliasChoices("prompt", "content"))
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _has_prompt(self):
        if self.prompt is None:
            raise ValueError("give the text to tokenize as prompt (or content)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
