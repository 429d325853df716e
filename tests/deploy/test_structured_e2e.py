"""Structured outputs through the running server (real Ray Serve, the engine's shard actors, the official
`openai` client) on the random tiny model: the grammar forces the format, not luck. JSON schemas with enums,
bounded integers, booleans, nested objects and arrays with maxItems always parse and validate over many seeds at
temperature 1, and the same seeds without the constraint never do; json_object is an object; vLLM's guided
choice / regex; `tool_choice` "required" and a named function always yield a valid call to a listed (the named)
tool, whole and streamed."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["alpha", "beta", "gamma delta"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"},
        "inner": {"type": "object",
                  "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}, "tag": {"enum": ["x", "y"]}},
                  "required": ["level", "tag"], "additionalProperties": False},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "inner", "flags"],
    "additionalProperties": False,
}
SEEDS = range(8)
# The test app's max_model_len is 512; the schema's longest document (16 whitespace characters a gap at most)
# fits in this many tokens of the tiny vocabulary.
MAX_TOKENS = 440
# M3's namespace token costs the tiny vocabulary ~12 tokens each time and every argument writes it twice, and the
# tool list in the prompt is ~700 tokens: forced calls run on an app with a longer context (`tools_app`).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "metric": {"type": "boolean"},
            "where": {"type": "object", "properties": {"zone": {"enum": ["a", "b"]}}, "required": ["zone"],
                      "additionalProperties": False},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
        "required": ["city", "days", "metric", "where", "tags"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "hi"}]
CALL_TOKENS = 700
TOOLS_APP = "tools-structured"


@pytest.fixture(scope="module")
def tools_app(serve_app):
    """The tiny model once more, with room for the tool list and a call (the shared app stops at 512 tokens)."""
    engine = {**serve_app.config["engine"], "max_model_len": 2048}
    base = serve_app.deploy_extra(TOOLS_APP, {**serve_app.config, "model": str(serve_app.model_dir),
                                              "model_name": TOOLS_APP, "engine": engine})
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, model=TOOLS_APP, extra_apps=[])
    serve_app.delete_extra(TOOLS_APP)


def _valid(text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (TypeError, ValueError, jsonschema.ValidationError):
        return False


async def _chats(serve_app, seeds, **fields) -> list:
    client = serve_app.async_client()
    try:
        return await asyncio.gather(*(client.chat.completions.create(
            model=serve_app.model, messages=USER, temperature=1.0, seed=s, **fields) for s in seeds))
    finally:
        await client.close()


def test_json_schema_always_validates_and_without_it_never(serve_app):
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA, "strict": True}}
    replies = asyncio.run(_chats(serve_app, SEEDS, response_format=fmt, max_tokens=MAX_TOKENS))
    texts = [r.choices[0].message.content for r in replies]
    for r, text in zip(replies, texts):
        assert r.choices[0].finish_reason == "stop", (r.choices[0].finish_reason, text)
        assert _valid(text, SCHEMA), text
    assert len({json.dumps(json.loads(t), sort_keys=True) for t in texts}) > len(SEEDS) // 2
    # the same seeds unconstrained: the random model writes no such document
    free = asyncio.run(_chats(serve_app, SEEDS, max_tokens=200))
    assert not any(_valid(r.choices[0].message.content, SCHEMA) for r in free)


def test_json_object_choice_and_regex_on_completions(serve_app):
    client = serve_app.client()
    r = client.completions.create(model=serve_app.model, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=1.0,
                                  seed=3, n=4, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=serve_app.model, prompt="id:", max_tokens=40, temperature=1.0, seed=4,
                                  n=4, extra_body={"guided_regex": r"[a-c]{2}-[0-9]{3}"})
    import re
    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in r.choices), \
        [c.text for c in r.choices]
    # json_object on chat: any object; a random model may write long ones, so only the finished ones are read
    replies = asyncio.run(_chats(serve_app, range(4), response_format={"type": "json_object"},
                                 max_tokens=MAX_TOKENS))
    done = [r.choices[0].message.content for r in replies if r.choices[0].finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)


def _check_call(choice, names: set[str]) -> None:
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    (call,) = choice.message.tool_calls
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}),
                                           ({"type": "function", "function": {"name": "get_weather"}},
                                            {"get_weather"})], ids=["required", "named"])
def test_forced_tool_call_is_a_valid_call_to_a_listed_tool(tools_app, choice, names):
    # one call per forced turn (parallel_tool_calls false; the parallel grammar: test_parallel_forced_calls.py)
    replies = asyncio.run(_chats(tools_app, SEEDS, tools=TOOLS, tool_choice=choice, max_tokens=CALL_TOKENS,
                                 parallel_tool_calls=False))
    for r in replies:
        _check_call(r.choices[0], names)
    if choice == "required":  # the model chooses: both tools come up over the seeds
        assert {r.choices[0].message.tool_calls[0].function.name for r in replies} == names


def test_forced_tool_call_streamed(tools_app):
    client = tools_app.client()
    for seed in range(3):
        stream = client.chat.completions.create(model=tools_app.model, messages=USER, tools=TOOLS,
                                                tool_choice="required", temperature=1.0, seed=seed,
                                                max_tokens=CALL_TOKENS, stream=True, parallel_tool_calls=False)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                    if d.function.name:
                        call["name"] = d.function.name
                    call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        (call,) = calls.values()
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
