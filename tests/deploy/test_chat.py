"""deploy/chat.py without a server: chat requests rendered by the tiny checkpoint's own template (tools, past
calls, tool turns, reasoning, template kwargs), and model output split into content, reasoning and calls, whole
and streamed at every split. The HTTP path is tested through the running server in test_tools_e2e.py."""
from __future__ import annotations

import json
import random

import pytest

from deploy import chat
from deploy.extras import UnknownFieldLog
from deploy.protocol import (
    ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChunkEncoder, CompletionRequest,
    ToolCallOut, chat_chunk_choice, sse_event, unknown_fields,
)
from deploy.tool_parser import NS
from workers.models import tiny_model_dir
from workers.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
CALL_TEXT = (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>'
             f"{NS}</invoke>\n{NS}</tool_call>")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir())


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                                 **fields})


def round_trip_messages() -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def test_tools_past_calls_tool_turns_and_reasoning_are_rendered(tokenizer):
    r = chat.render_chat(tokenizer, request(messages=round_trip_messages(), tools=TOOLS), None)
    text = r.text
    assert '<tools>\n{"name": "get_weather", "description": "Current weather"' in text
    # the past call is rendered in the model's syntax, its JSON-text arguments as elements
    assert (f'<|assistant|>\n<mm:think>Use the tool.</mm:think>{NS}<tool_call>\n{NS}<invoke name="get_weather">'
            f"{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>\n{NS}</tool_call><|eos|>\n") in text
    assert text.endswith('<|tool|>\n{"temp": 21}<|eos|>\n<|assistant|>\n')
    assert r.spec == chat.OutputSpec(tools=TOOLS, starts_in_reasoning=False)
    # the tool turn costs tokens: the same conversation without it renders shorter
    shorter = chat.render_chat(tokenizer, request(messages=round_trip_messages()[:2], tools=TOOLS), None)
    assert len(tokenizer.encode(shorter.text)) < len(tokenizer.encode(text))


def test_template_kwargs_server_default_and_request_override(tokenizer):
    on = chat.render_chat(tokenizer, request(), {"enable_thinking": True})
    assert on.text.endswith("<|assistant|>\n<mm:think>") and on.spec.starts_in_reasoning
    off = chat.render_chat(tokenizer, request(chat_template_kwargs={"enable_thinking": False}),
                           {"enable_thinking": True})
    assert off.text.endswith("<|assistant|>\n") and not off.spec.starts_in_reasoning
    plain = chat.render_chat(tokenizer, request(), None)
    assert plain.text == tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}])
    assert plain.spec == chat.OutputSpec()
    # no generation prompt: the text never leaves the model inside reasoning
    assert not chat.render_chat(tokenizer, request(add_generation_prompt=False), {"enable_thinking": True}
                                ).spec.starts_in_reasoning


@pytest.mark.parametrize("fields,param,code", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]}, "messages",
     "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages",
     "invalid_value"),
])
def test_requests_the_server_cannot_serve_name_the_field(tokenizer, fields, param, code):
    with pytest.raises(chat.ChatRequestError) as e:
        chat.render_chat(tokenizer, request(tools=TOOLS, **fields), None)
    assert (e.value.param, e.value.code) == (param, code) and str(e.value).startswith(param + ": ")


def test_tool_choice_none_neither_renders_nor_parses_tools(tokenizer):
    r = chat.render_chat(tokenizer, request(tools=TOOLS, tool_choice="none"), None)
    assert "<tools>" not in r.text and r.spec.tools is None
    assert chat.parse_output(CALL_TEXT, r.spec).content == CALL_TEXT


def test_developer_role_is_the_system_prompt(tokenizer):
    r = chat.render_chat(tokenizer, request(messages=[{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]), None)
    assert r.text.startswith("<|bos|><|system|>\nBe brief.<|eos|>\n")


OUTPUTS = [
    # (text, spec, content, reasoning, calls as (name, arguments))
    ("<mm:think>Need weather.</mm:think>Checking.\n" + CALL_TEXT, chat.OutputSpec(tools=TOOLS), "Checking.\n",
     "Need weather.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("Need weather.</mm:think>" + CALL_TEXT, chat.OutputSpec(tools=TOOLS, starts_in_reasoning=True), None,
     "Need weather.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("Just text.", chat.OutputSpec(tools=TOOLS), "Just text.", None, []),
    (f"{NS}<tool_call>garbage {NS}</tool_call>", chat.OutputSpec(tools=TOOLS),
     f"{NS}<tool_call>garbage {NS}</tool_call>", None, []),
    (CALL_TEXT, chat.OutputSpec(), CALL_TEXT, None, []),  # no tools offered: calls are not parsed
    ("thinking cut off", chat.OutputSpec(starts_in_reasoning=True), "", "thinking cut off", []),
]


@pytest.mark.parametrize("text,spec,content,reasoning,calls", OUTPUTS)
def test_output_split_whole_and_streamed_at_every_split(text, spec, content, reasoning, calls):
    whole = chat.parse_output(text, spec)
    assert (whole.content, whole.reasoning) == (content, reasoning)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.tool_calls)
    rng = random.Random(0)
    cuts = [[i] for i in range(len(text) + 1)] + [sorted(rng.sample(range(len(text) + 1), 6)) for _ in range(30)]
    for cut in cuts:
        splitter = chat.ChatStreamSplitter(spec)
        bounds = [0, *cut, len(text)]
        pieces = [splitter.feed(text[a:b], final=(k == len(bounds) - 2)) for k, (a, b) in
                  enumerate(zip(bounds, bounds[1:]))]
        assert "".join(p.content for p in pieces) == (content or "")
        assert "".join(p.reasoning for p in pieces) == (reasoning or "")
        assert splitter.made_calls == bool(calls)
        assert accumulate([d for p in pieces for d in p.tool_calls]) == calls


def accumulate(deltas: list[dict]) -> list[tuple[str, dict]]:
    """What an OpenAI client builds from streamed `tool_calls` deltas: name from the first piece of each index,
    arguments concatenated."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d["id"] is not None:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
        else:
            calls[d["index"]][1] += d["function"]["arguments"]
    return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


def test_finish_reason_and_response_message():
    assert chat.finish_reason("stop", True) == "tool_calls"
    assert chat.finish_reason("length", True) == "length"
    assert chat.finish_reason("stop", False) == "stop"
    message, reason = chat.response_message(CALL_TEXT, chat.OutputSpec(tools=TOOLS), "stop")
    assert reason == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    message, reason = chat.response_message("hi", None, "length")
    assert (message.content, message.tool_calls, message.reasoning_content, reason) == ("hi", None, None, "length")


def test_stream_piece_delta_fields():
    assert chat.StreamPiece().delta_fields() == {"content": "", "reasoning_content": None, "tool_calls": None}
    assert chat.StreamPiece(reasoning="r").delta_fields()["content"] is None
    assert chat.StreamPiece(content="c", reasoning="r").delta_fields()["content"] == "c"


def test_chunk_encoder_writes_tool_call_deltas_as_pydantic_does():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    frag = {"index": 0, "id": None, "type": None, "function": {"name": None, "arguments": '{"a"'}}
    enc = ChunkEncoder(id="chatcmpl-1", object="chat.completion.chunk", model="m")
    for calls, reasoning in (([call], None), ([frag], "why\u2028")):
        ours = json.loads(enc.event([chat_chunk_choice(index=0, content=None, reasoning_content=reasoning,
                                                       tool_calls=calls)], None, prompt_token_ids=None)[6:])
        theirs = json.loads(sse_event(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatChunkChoice(
            index=0, delta=ChatDelta(reasoning_content=reasoning,
                                     tool_calls=[ToolCallOut.model_validate(c) for c in calls]))]))[6:])
        theirs["created"] = ours["created"]
        assert ours == theirs


def test_unknown_fields_are_ignored_and_named():
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi", "foo": 1}, {"role": "user", "content": "x", "foo": 2}],
        "reasoning_effort": "low", "max_token": 3, "tools": [{"type": "function", "function": {"name": "f"},
                                                                "bar": 1}]})
    assert unknown_fields(body) == ["reasoning_effort", "max_token", "messages.*.foo", "tools.*.bar"]
    assert unknown_fields(CompletionRequest.model_validate({"prompt": "x"})) == []
    logged = []

    class Log:
        def warning(self, fmt, name):
            logged.append(name)

    log = UnknownFieldLog(Log())
    log(["a", "b"])
    log(["a", "c"])
    assert logged == ["a", "b", "c"]
