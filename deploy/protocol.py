"""Wire types: the OpenAI-compatible HTTP schemas (pydantic) and the plain messages between deployments.

HTTP request bodies are validated here; numeric ranges of sampling fields are checked once, by
`workers.request.SamplingParams`, whose errors already name the field. Unknown body fields are accepted and
ignored, as vLLM does (OpenAI adds fields faster than servers follow; clients send them): `unknown_fields` names
them so the ingress can log each name once.

Below the ingress everything is token ids: `EngineRequest` goes down, `EngineChunk` (token/text deltas) or
`EngineError` comes back up through the router. Those are dataclasses, not pydantic: they never touch HTTP.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from workers.request import SamplingParams

# --------------------------------------------------------------------------------------------------------------
# Errors


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorBody


# HTTP status -> OpenAI error `type`, as OpenAI's API names them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    501: "not_implemented",
    503: "service_unavailable",
}


# --------------------------------------------------------------------------------------------------------------
# Requests


class _Body(BaseModel):
    # Unknown fields are kept aside (`model_extra`), not refused: `unknown_fields` lists them for the log.
    model_config = ConfigDict(extra="allow")


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `body` ignored, nested bodies included; list items as `*` (`messages.*.foo`),
    so each name is one log line however many messages carry it."""
    out = [prefix + k for k in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        sub = f"{prefix}{name}.*." if isinstance(value, list) else f"{prefix}{name}."
        for item in items:
            if isinstance(item, BaseModel):
                out += [n for n in unknown_fields(item, sub) if n not in out]
    return out


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is a reserved name in pydantic, hence the
    alias)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's newer `structured_outputs` object: exactly one of its constraints."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Body):
    """Sampling fields common to both endpoints (OpenAI's, plus vLLM's usual extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM: choices carry `token_ids`, and `prompt_token_ids` is returned
    user: str | None = None  # accepted for compatibility; not used
    logit_bias: dict[str, float] | None = None  # only empty/None is supported (checked by the ingress)
    # structured outputs (deploy/guided.py): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, a token-id list, or a list of token-id lists."""

    prompt: Union[list[list[int]], list[int], list[str], str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top-N logprobs per token (OpenAI allows 0..5; we allow up to 20)
    echo: bool = False
    suffix: str | None = None  # not supported unless None
    best_of: int | None = None  # only == n (or None) is supported


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    """A past call in an assistant message: `arguments` as OpenAI sends it (a JSON object as text), or an
    object."""
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # tool messages: the call this result answers
    tool_calls: list[ToolCallIn] | None = None  # assistant messages: the calls it made
    reasoning_content: str | None = None  # assistant messages: rendered back in the current tool loop

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the deprecated `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extra: render the assistant prefix after the last message
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # auto: the model decides how many calls it writes; with tool_choice "required", an explicit true allows 1-8
    # forced calls (left out or false: exactly one, docs/tools.md "Forced calls")
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": true}


# --------------------------------------------------------------------------------------------------------------
# vLLM's /tokenize and /detokenize requests (answered by deploy/extras.py)


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """Rendered as `/v1/chat/completions` renders it (same template, tools and kwargs), then tokenized."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------------------------
# Responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists over the choice's tokens."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ToolCallFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    """A call the model made: `function.arguments` is a JSON object as text. Streamed, the first piece of a call
    carries `id`, `type` and `function.name`; later pieces carry `index` and argument fragments only."""
    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(BaseModel):
    """A streamed completions event: same object name as the full response, as OpenAI sends it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "m3serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_event(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>\\n\\n` (or the literal `[DONE]` terminator). JSON is ASCII-escaped
    (`_sse_json`)."""
    body = payload if isinstance(payload, str) else _sse_json(json.loads(payload.model_dump_json()))
    return f"data: {body}\n\n"


def _sse_json(value: Any) -> str:
    # ASCII only: SSE is read line by line, and clients split lines at more than \n (Python's str.splitlines,
    # which httpx uses, also splits at U+2028, U+0085, ...): a raw one inside a JSON string cuts the event.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


SSE_DONE = sse_event("[DONE]")


class ChunkEncoder:
    """The SSE events of one streamed response, written as one `json.dumps` of plain dicts: the envelope (id,
    object, created, model) is fixed per response, as OpenAI sends it, and no pydantic model is built per token.
    The JSON is what `sse_event(CompletionChunk(...))` / `sse_event(ChatCompletionChunk(...))` write (same
    fields, same order); logprobs stay pydantic models, written by pydantic (`_logprobs_json`)."""

    def __init__(self, *, id: str, object: str, model: str) -> None:
        head = _sse_json({"id": id, "object": object, "created": _now(), "model": model})
        self._head = head[:-1] + ',"choices":'

    def event(self, choices: list[dict], usage: UsageInfo | None = None, **extra: Any) -> str:
        tail = _sse_json({"usage": None if usage is None else usage.model_dump(), **extra})
        return f"data: {self._head}{_sse_json(choices)},{tail[1:]}\n\n"


def completion_choice(*, index: int, text: str, logprobs: CompletionLogprobs | None = None,
                      finish_reason: str | None = None, stop_reason: int | str | None = None,
                      token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """A `CompletionChoice` as the dict `ChunkEncoder` writes."""
    return {"index": index, "text": text, "logprobs": _logprobs_json(logprobs), "finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": token_ids,
            "prompt_token_ids": prompt_token_ids}


def chat_chunk_choice(*, index: int, content: str | None, role: str | None = None,
                      reasoning_content: str | None = None, tool_calls: list[dict] | None = None,
                      logprobs: ChatLogprobs | None = None, finish_reason: str | None = None,
                      stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict:
    """A `ChatChunkChoice` as the dict `ChunkEncoder` writes (`tool_calls`: `ToolCallOut` dicts)."""
    delta = {"role": role, "content": content, "reasoning_content": reasoning_content, "tool_calls": tool_calls}
    return {"index": index, "delta": delta, "logprobs": _logprobs_json(logprobs),
            "finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": token_ids}


def _logprobs_json(logprobs: BaseModel | None) -> Any:
    """Logprobs as pydantic writes them (a -inf logprob becomes null, which json.dumps would write as -Infinity,
    not JSON): only requests that asked for logprobs pay for the round trip."""
    return None if logprobs is None else json.loads(logprobs.model_dump_json())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------------------------
# Messages between deployments (ingress -> router -> engine server and back). Plain dataclasses, pickled by Ray.


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One prompt's generation, as token ids. `n` samples are in `params.n`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(kw_only=True)
class SampleDelta:
    """What one sample (choice) gained since the previous chunk."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None  # one dict per new token: token id -> logprob
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(kw_only=True)
class EngineChunk:
    """One step's progress of one request. The first chunk also carries the prompt (ids, prompt logprobs)."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool = False
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True, kw_only=True)
class EngineError:
    """A request the engine refused or failed; the ingress turns it into an OpenAI error with this status."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds, for 429/503


@dataclass(frozen=True, kw_only=True)
class Redirect:
    """Router -> ingress (`Router.generate`): take the rest of this request's stream straight
    from an engine replica, `deployment.method(*args)`, instead of through the router: every hop costs CPU per
    streamed item, and the router only needs to decide. The router keeps counting the request on that replica
    until the ingress calls `Router.release(release_id)`; if the stream is cut before it ends, the ingress aborts
    `request_id` on that replica (a stream that never started has nothing to cancel there)."""

    app_name: str
    deployment: str
    method: str  # "generate" (unified) or "decode" (after a disaggregated prefill)
    args: tuple
    request_id: str  # the engine's id of the request on that replica
    release_id: str  # the router's id of the request


EngineEvent = Union[EngineChunk, EngineError]


def param_of(message: str) -> str | None:
    """The field a `"field: why"` validation message names (SamplingParams/Engine style), else None."""
    head, sep, _ = message.partition(":")
    if sep and head and " " not in head.strip():
        return head.strip()
    return None
