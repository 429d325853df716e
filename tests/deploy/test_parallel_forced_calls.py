"""`tool_choice: "required"` (issue 20): one or more calls, each to a listed tool, in M3's one wrapper
(deploy/guided.py, an xgrammar `repeat` inside the structural tag), as OpenAI's default `parallel_tool_calls: true`
allows. With `parallel_tool_calls: false`, and for a named function, a forced turn is exactly one call; an unforced
answer's calls after the first are dropped (whole and streamed), as OpenAI and vLLM do.

The grammar on its own (against the syntax the tool parser reads), then through the running server with the
`openai` client on the random tiny model: over seeds every reply is >= 1 valid call, some seeds write several,
streamed deltas too."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import pytest

from deploy import chat, guided
from deploy.protocol import ChatCompletionRequest
from deploy.tool_parser import NS
from workers.models import tiny_model_dir
from workers.structured import StructuredOutputCompiler
from workers.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_day", "parameters": {
        "type": "object", "properties": {"offset": {"type": "integer", "minimum": 0, "maximum": 6}},
        "required": ["offset"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TIME = f'{NS}<invoke name="get_time">{NS}<zone>utc{NS}</zone>{NS}</invoke>\n'
DAY = f'{NS}<invoke name="get_day">{NS}<offset>4{NS}</offset>{NS}</invoke>\n'


def _wrap(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, **fields})


@pytest.fixture(scope="module")
def compiler():
    return StructuredOutputCompiler(Tokenizer.from_dir(tiny_model_dir()))


def _accepts(compiler, body, text: str) -> bool:
    import xgrammar

    spec = guided.chat_spec(body, chat.offered_tools(body), False)
    m = xgrammar.GrammarMatcher(compiler.compile(spec))
    return m.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("fields", [{"tool_choice": "required", "parallel_tool_calls": True},
                                    {"tool_choice": "required"}], ids=["required-true", "required-default"])
def test_parallel_grammar_takes_one_to_the_bound_of_calls(compiler, fields):
    body = _body(**fields)
    assert _accepts(compiler, body, _wrap(TIME))
    assert _accepts(compiler, body, _wrap(TIME, DAY, TIME))
    assert _accepts(compiler, body, _wrap(*[DAY] * guided.MAX_PARALLEL_CALLS))
    assert not _accepts(compiler, body, _wrap(*[DAY] * (guided.MAX_PARALLEL_CALLS + 1)))
    assert not _accepts(compiler, body, _wrap())  # at least one call
    assert not _accepts(compiler, body, _wrap(TIME, DAY.replace("4", "9")))  # every call's schema holds
    assert not _accepts(compiler, body, "text" + _wrap(TIME))
    out = chat.parse_output(_wrap(TIME, DAY), chat.OutputSpec(tools=TOOLS, starts_in_reasoning=False))
    assert [(c.function.name, c.function.arguments) for c in out.tool_calls] == [
        ("get_time", '{"zone": "utc"}'), ("get_day", '{"offset": 4}')]


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_day"}}, "parallel_tool_calls": True},
    {"tool_choice": {"type": "function", "function": {"name": "get_day"}}},
], ids=["required-false", "named-true", "named-default"])
def test_without_parallel_a_forced_turn_is_one_call(compiler, fields):
    body = _body(**fields)
    assert _accepts(compiler, body, _wrap(DAY))
    assert not _accepts(compiler, body, _wrap(DAY, DAY))


@pytest.mark.parametrize("parallel", [None, True, False])
def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(parallel):
    """tool_choice "auto": the model wrote two calls; `parallel_tool_calls: false` answers with the first only
    (message and stream alike, finish_reason tool_calls); left out or true, both."""
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    spec = chat.OutputSpec(tools=TOOLS, single_call=_body(**fields).parallel_tool_calls is False)
    text = _wrap(TIME, DAY)
    want = [("get_time", '{"zone": "utc"}')] + ([] if parallel is False else [("get_day", '{"offset": 4}')])
    message, reason = chat.response_message(text, spec, "stop")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == want
    assert reason == "tool_calls" and message.content is None
    splitter = chat.ChatStreamSplitter(spec)
    pieces = [splitter.feed(text[i:i + 7], final=i + 7 >= len(text)) for i in range(0, len(text), 7)]
    streamed: dict[int, list[str]] = {}
    for d in (d for p in pieces for d in p.tool_calls):
        entry = streamed.setdefault(d["index"], [d["function"]["name"], ""])
        entry[1] += d["function"]["arguments"]
    assert [(n, a) for _, (n, a) in sorted(streamed.items())] == want
    assert splitter.made_calls and "".join(p.content for p in pieces).strip() == ""


PAR_APP = "tools-parallel"
SEEDS = range(8)
# a call here is ~100 tokens of the tiny vocabulary (the namespace token alone costs ~12, written 6 times)
MAX_TOKENS = 100 * guided.MAX_PARALLEL_CALLS + 200


@pytest.fixture(scope="module")
def par_app(serve_app):
    """The tiny model once more, with room for the tool list and MAX_PARALLEL_CALLS calls."""
    engine = {**serve_app.config["engine"], "max_model_len": 2048}
    base = serve_app.deploy_extra(PAR_APP, {**serve_app.config, "model": str(serve_app.model_dir),
                                            "model_name": PAR_APP, "engine": engine})
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, model=PAR_APP, extra_apps=[])
    serve_app.delete_extra(PAR_APP)


async def _chats(app, seeds, **fields) -> list:
    client = app.async_client()
    try:
        return await asyncio.gather(*(client.chat.completions.create(
            model=app.model, messages=[{"role": "user", "content": "hi"}], temperature=1.0, seed=s, **fields)
            for s in seeds))
    finally:
        await client.close()


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert 1 <= len(calls) <= guided.MAX_PARALLEL_CALLS, calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_parallel_through_the_server(par_app):
    replies = asyncio.run(_chats(par_app, SEEDS, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
                                 max_tokens=MAX_TOKENS))
    counts = []
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        _check_calls(calls)
        assert len({c.id for c in choice.message.tool_calls}) == len(calls)
        counts.append(len(calls))
    assert max(counts) > 1, counts  # the grammar lets the model go on: some seeds do
    # the same seeds with the flag left out (OpenAI's default, true): several calls again; with false: one each
    default = asyncio.run(_chats(par_app, SEEDS, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS))
    assert max(len(r.choices[0].message.tool_calls) for r in default) > 1
    single = asyncio.run(_chats(par_app, SEEDS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                max_tokens=MAX_TOKENS))
    assert [len(r.choices[0].message.tool_calls) for r in single] == [1] * len(SEEDS)
    par_app.wait_idle()


def test_required_parallel_streamed(par_app):
    client = par_app.client()
    fields = dict(model=par_app.model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=True, temperature=1.0, max_tokens=MAX_TOKENS)
    for seed in range(4):
        reply = client.chat.completions.create(seed=seed, **fields)  # alone, as the stream below runs
        stream = client.chat.completions.create(seed=seed, stream=True, **fields)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        _check_calls(streamed)
        # same seed, same tokens: the deltas add up to exactly the non-streamed calls
        assert streamed == [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    par_app.wait_idle()
