"""Chat requests with tools and reasoning (issue 20): OpenAI messages -> what the checkpoint's chat template
renders, and the model's output -> OpenAI `content`, `reasoning_content` and `tool_calls`, whole or streamed.

Rendering: the template gets `tools` (when tool calls are possible), assistant `tool_calls` with their
`arguments` parsed into objects (templates render objects; clients send JSON text, as vLLM also parses), `tool`
messages with `tool_call_id`, assistant `reasoning_content`, and the template kwargs: the server's default
(`ServeConfig.chat_template_kwargs`) with the request's `chat_template_kwargs` over it. The tokenizer renders in
jinja2's ImmutableSandboxedEnvironment (`workers.tokenizer`).

Output: reasoning is split first (`deploy.reasoning_parser`; the rendered prompt says whether generation starts
inside `<mm:think>`), then tool calls are parsed from the rest (`deploy.tool_parser`) when the request offered
tools and did not say `tool_choice: "none"`. Neither parser raises: what they cannot read stays content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deploy.protocol import ChatCompletionRequest, ChatMessage, ChatResponseMessage, ToolCallFunction, ToolCallOut
from deploy.reasoning_parser import ReasoningStreamParser, parse_reasoning, prompt_starts_in_reasoning
from deploy.tool_parser import ToolCallStreamParser, parse_tool_calls

# Template variables a request may not set through chat_template_kwargs: the renderer owns them.
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "pad_token",
                              "unk_token"})


class ChatRequestError(ValueError):
    """A chat request the server cannot render or serve as asked: a 400 naming `param`."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.code = param, code


@dataclass(frozen=True)
class OutputSpec:
    """How one chat request's output is split: `tools` (OpenAI tool dicts) when calls are parsed, else None;
    `starts_in_reasoning` when the prompt left the model inside `<mm:think>`; `single_call` when the request said
    `parallel_tool_calls: false` (OpenAI: at most one call; calls the model writes after the first are dropped)."""

    tools: list[dict] | None = None
    starts_in_reasoning: bool = False
    single_call: bool = False


@dataclass(frozen=True)
class RenderedChat:
    text: str
    spec: OutputSpec


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose assistant `tool_calls[*].function.arguments` JSON strings are parsed into objects (the
    template renders objects). A string that is not a JSON object raises ValueError (a 400 for the caller)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            parsed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    value = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    if not isinstance(value, dict):
                        raise ValueError("tool_calls: function.arguments must be a JSON object")
                    fn["arguments"] = value
                parsed.append({**call, "function": fn})
            m = {**m, "tool_calls": parsed}
        out.append(m)
    return out


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    # OpenAI's `developer` role is the system prompt of newer models; templates know `system`.
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    return out


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the template reads them. Raises ChatRequestError for call arguments that are
    not a JSON object."""
    try:
        return arguments_as_objects([_message_dict(m) for m in messages])
    except ValueError as e:
        raise ChatRequestError("messages", f"tool_calls: function.arguments must be a JSON object ({e})") from None


def offered_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the model may call, as dicts; None when there are none or `tool_choice` is "none" (then they are
    not rendered either, so the model is not invited to call them). A forced choice ("required", a named
    function) is rendered the same way; `deploy.guided` turns it into a grammar that makes the call."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def template_kwargs(body: ChatCompletionRequest, server_default: dict[str, Any] | None) -> dict[str, Any]:
    """Server default kwargs with the request's over them; a reserved name (set by the renderer) is a 400."""
    given = body.chat_template_kwargs or {}
    bad = sorted(set(given) & _RESERVED_KWARGS)
    if bad:
        raise ChatRequestError("chat_template_kwargs", f"{bad[0]!r} is set by the server, not by the request")
    return {**(server_default or {}), **given}


def single_call(body: Any) -> bool:
    """`parallel_tool_calls: false` (OpenAI: at most one call). A body without the field (vLLM's `/tokenize` chat
    form) renders the same prompt and splits no output."""
    return getattr(body, "parallel_tool_calls", None) is False


def render_chat(tokenizer: Any, body: ChatCompletionRequest, server_kwargs: dict[str, Any] | None) -> RenderedChat:
    """The prompt text and how to split its output. Template errors (roles out of order, a variable of the
    wrong type) are ChatRequestError: the client's to fix."""
    tools = offered_tools(body)
    kwargs = template_kwargs(body, server_kwargs)
    messages = template_messages(body.messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=tools, **kwargs)
    except Exception as e:  # jinja2 errors, and TypeErrors from kwargs the template uses in its own way
        raise ChatRequestError("messages", f"the chat template rejected them: {e}") from None
    starts = body.add_generation_prompt and prompt_starts_in_reasoning(text)
    return RenderedChat(text, OutputSpec(tools=tools, starts_in_reasoning=starts,
                                         single_call=tools is not None and single_call(body)))


# ----------------------------------------------------------------------------------------------------------------
# Output


@dataclass(frozen=True)
class ChatOutput:
    """A whole answer split: `content` None when the answer is only calls; `tool_calls` `ToolCallOut`s."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCallOut] = field(default_factory=list)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's `tool_calls` when the model stopped after calling; a cut-off answer stays `length`."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def parse_output(text: str, spec: OutputSpec) -> ChatOutput:
    """Split one finished answer (never raises: unreadable output is content)."""
    r = parse_reasoning(text, spec.starts_in_reasoning)
    content, calls = r.content, []
    if spec.tools is not None:
        parsed = parse_tool_calls(content, spec.tools)
        content = parsed.content
        calls = [ToolCallOut(id=c.id, type="function", function=ToolCallFunction(name=c.name, arguments=c.arguments))
                 for c in parsed.tool_calls[:1 if spec.single_call else None]]
    if calls and not content.strip():
        content = None
    return ChatOutput(content=content, reasoning=r.reasoning, tool_calls=calls)


@dataclass
class StreamPiece:
    """What one streamed text delta settled: the fields of an OpenAI chat delta (`tool_calls` as dicts)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def delta_fields(self) -> dict[str, Any]:
        """`content` / `reasoning_content` / `tool_calls` for `protocol.chat_chunk_choice`. A piece that settled
        nothing still has content "" (the event carries its token ids and logprobs)."""
        only_other = not self.content and (self.reasoning or self.tool_calls)
        return {"content": None if only_other else self.content, "reasoning_content": self.reasoning or None,
                "tool_calls": self.tool_calls or None}


class ChatStreamSplitter:
    """One streamed choice: `feed(text, final)` per engine delta (final on the one that finishes it). The
    pieces concatenate to `parse_output` of the whole text, call by call and argument by argument."""

    def __init__(self, spec: OutputSpec) -> None:
        self._reasoning = ReasoningStreamParser(spec.starts_in_reasoning)
        self._tools = ToolCallStreamParser(spec.tools) if spec.tools is not None else None
        self._max_calls = 1 if spec.single_call else None  # deltas of later calls are dropped (parse_output's)
        self.made_calls = False

    def feed(self, text: str, final: bool = False) -> StreamPiece:
        r = self._reasoning.feed(text)
        reasoning, content = r.reasoning, r.content
        if final:
            end = self._reasoning.finish()
            reasoning, content = reasoning + end.reasoning, content + end.content
        if self._tools is None:
            return StreamPiece(content=content, reasoning=reasoning)
        pieces = [self._tools.feed(content)] + ([self._tools.finish()] if final else [])
        calls = [_call_delta(d) for p in pieces for d in p.tool_calls
                 if self._max_calls is None or d.index < self._max_calls]
        self.made_calls = self.made_calls or bool(calls)
        return StreamPiece(content="".join(p.content for p in pieces), reasoning=reasoning, tool_calls=calls)


def _call_delta(d: Any) -> dict:
    """A `ToolCallDelta` as OpenAI streams it: the first piece of a call names it, later ones add arguments."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name,
                                                                              "arguments": d.arguments}}
    return {"index": d.index, "id": None, "type": None, "function": {"name": None, "arguments": d.arguments}}


def response_message(text: str, spec: OutputSpec | None, reason: str | None) -> tuple[ChatResponseMessage, str | None]:
    """The non-streamed `message` of one choice and its finish reason."""
    if spec is None:
        return ChatResponseMessage(content=text), reason
    out = parse_output(text, spec)
    message = ChatResponseMessage(content=out.content, reasoning_content=out.reasoning,
                                  tool_calls=out.tool_calls or None)
    return message, finish_reason(reason, bool(out.tool_calls))
