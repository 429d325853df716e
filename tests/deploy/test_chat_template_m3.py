"""The tiny model's M3-format chat template (msa/chat_template.py): rendered in jinja2's sandbox as the ingress
renders it, its assistant turns parse back with the tool and reasoning parsers to the same calls."""
from __future__ import annotations

import json

import jinja2
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deploy.chat import arguments_as_objects
from deploy.reasoning_parser import ReasoningStreamParser, parse_reasoning, prompt_starts_in_reasoning
from deploy.tool_parser import NS, ToolCallStreamParser, parse_tool_calls
from msa.chat_template import CHAT_TEMPLATE as CHAT_TEMPLATE_M3
from workers.tokenizer import Tokenizer

BOS, EOS = "<|bos|>", "<|eos|>"
# The tiny model's plain template before issue 20, frozen here: plain chats must still render exactly this, or
# every existing prompt (and every greedy output the tests compare) would change.
PLAIN_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token ~ '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": ["string", "null"]}, "hourly": {"type": "boolean"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "properties": {
            "trip": {"type": "object", "properties": {"budget": {"type": "number"}, "code": {"type": "string"},
                                                      "stops": {"type": "array", "items": {"type": "string"}}}},
            "legs": {"type": "array", "items": {"type": "object", "properties": {
                "day": {"type": "integer"}, "note": {"type": "string"}}}}}}}},
]
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": None, "hourly": True}},
    {"name": "plan", "arguments": {"trip": {"budget": 1250.5, "code": "007", "stops": ["Lyon", None, "Nice"]},
                                   "legs": [{"day": 1, "note": 'say "hi" <b> & \\n'}, {"day": 2, "note": None}]}},
]


def render(messages, template: str = CHAT_TEMPLATE_M3, **kwargs) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, bos_token=BOS, eos_token=EOS,
        add_generation_prompt=kwargs.pop("add_generation_prompt", True),
        **{"tools": None, **kwargs})


def without_nulls(v):
    if isinstance(v, dict):
        return {k: without_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [without_nulls(x) for x in v if x is not None]
    return v


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and plan a trip?"},
        {"role": "assistant", "content": "Let me check.\n", "reasoning_content": "Two tools apply.",
         "tool_calls": [{"id": f"call_{i}", "type": "function",
                         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                        for i, c in enumerate(CALLS)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "planned"}]},
        {"role": "assistant", "content": "Sunny; trip planned.", "reasoning_content": "Both done."},
    ]


def assistant_turns(text: str) -> list[str]:
    return [part.split(EOS)[0] for part in text.split("<|assistant|>\n")[1:]]


def test_rendered_tool_calls_and_reasoning_parse_back_to_the_same():
    text = render(arguments_as_objects(conversation()), tools=TOOLS, add_generation_prompt=False)
    first, second = assistant_turns(text)
    r = parse_reasoning(first)
    assert (r.reasoning, r.content.startswith("Let me check.\n" + NS)) == ("Two tools apply.", True)
    parsed = parse_tool_calls(r.content, TOOLS)
    assert parsed.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c["name"], without_nulls(c["arguments"])) for c in CALLS]
    last = parse_reasoning(second)
    assert (last.reasoning, last.content) == ("Both done.", "Sunny; trip planned.")
    assert parse_tool_calls(second, TOOLS).tool_calls == ()


def test_exact_rendering():
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"function": {"name": "f", "arguments": {"a": [1, None, {"b": False}], "c": None}}}]},
                {"role": "tool", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert render(messages, tools=tools) == (
        f"{BOS}<|system|>\n# Tools\nYou may call one or more of these functions, whose definitions follow as JSON, "
        'one per line:\n<tools>\n{"name": "f", "parameters": {"type": "object"}}\n</tools>\n'
        f"To call functions, end your answer with:\n{NS}<tool_call>\n{NS}<invoke name=\"FUNCTION\">{NS}<ARGUMENT>value"
        f"{NS}</ARGUMENT>{NS}</invoke>\n{NS}</tool_call>\nwith one invoke per call. Write objects as nested elements, "
        f"lists as {NS}<item> elements, and leave out null values.{EOS}\n"
        f"<|user|>\nHi{EOS}\n"
        f'<|assistant|>\n{NS}<tool_call>\n{NS}<invoke name="f">{NS}<a>{NS}<item>1{NS}</item>{NS}<item>{NS}<b>false'
        f"{NS}</b>{NS}</item>{NS}</a>{NS}</invoke>\n{NS}</tool_call>{EOS}\n"
        f"<|tool|>\nok{EOS}\n<|assistant|>\n")
    assert render([{"role": "user", "content": "Hi"}]) == f"{BOS}<|user|>\nHi{EOS}\n<|assistant|>\n"
    no_arguments = [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": None}}, {"function": {"name": "g"}}]}]
    assert render(no_arguments, add_generation_prompt=False) == (
        f'{BOS}<|assistant|>\n{NS}<tool_call>\n{NS}<invoke name="f">{NS}</invoke>\n{NS}<invoke name="g">{NS}</invoke>\n'
        f"{NS}</tool_call>{EOS}\n")


def test_thinking_switch_and_old_reasoning_dropped():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "old"},
                {"role": "user", "content": "c"}]
    on, off = render(messages, enable_thinking=True), render(messages, enable_thinking=False)
    assert on.endswith("<|assistant|>\n<mm:think>") and prompt_starts_in_reasoning(on)
    assert off.endswith("<|assistant|>\n") and not prompt_starts_in_reasoning(off)
    assert render(messages) == off and "old" not in off


def test_arguments_must_be_objects_and_roles_known():
    with pytest.raises(jinja2.exceptions.TemplateError, match="arguments must be an object"):
        render(conversation(), tools=TOOLS)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown chat role"):
        render([{"role": "critic", "content": "x"}])
    with pytest.raises(ValueError):
        arguments_as_objects([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    blank = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": " "}}]}]
    assert arguments_as_objects(blank) == [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]


def test_the_ingress_tokenizer_renders_it_the_same():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({BOS: 0, EOS: 1, "<unk>": 2}, unk_token="<unk>"))
    tok = Tokenizer(backend, {"bos_token": BOS, "eos_token": EOS}, chat_template=CHAT_TEMPLATE_M3)
    messages = arguments_as_objects(conversation())
    assert tok.apply_chat_template(messages, tools=TOOLS, enable_thinking=True) == render(
        messages, tools=TOOLS, enable_thinking=True)


def stream_turn(pieces: list[str], tools, starts_in_reasoning: bool = False):
    """The ingress's chain: reasoning split first, its content deltas into the tool parser."""
    reasoning, tool_parser = ReasoningStreamParser(starts_in_reasoning), ToolCallStreamParser(tools)
    thought, content, calls = [], [], {}

    def take(delta):
        content.append(delta.content)
        for t in delta.tool_calls:
            calls.setdefault(t.index, [t.name, ""])[1] += t.arguments

    for r in [reasoning.feed(p) for p in pieces] + [reasoning.finish()]:
        thought.append(r.reasoning)
        take(tool_parser.feed(r.content))
    take(tool_parser.finish())
    return "".join(thought) or None, "".join(content), [(n, json.loads(a)) for n, a in calls.values()]


def test_rendered_turn_streamed_through_both_parsers():
    text = render(arguments_as_objects(conversation()), tools=TOOLS, add_generation_prompt=False)
    turn = assistant_turns(text)[0]
    expected = ("Two tools apply.", "Let me check.\n", [(c["name"], without_nulls(c["arguments"])) for c in CALLS])
    assert stream_turn(list(turn), TOOLS) == expected
    assert stream_turn([turn], TOOLS) == expected
    # thinking on: the prompt holds the opening tag, the model writes the rest
    assert stream_turn(list(turn[len("<mm:think>"):]), TOOLS, starts_in_reasoning=True) == expected


KEYS = st.one_of(st.sampled_from(["item", "invoke", "tool_call", "name", "a"]),
                 st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True))
SCALAR_SCHEMAS = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean")])
SCHEMAS = st.recursive(SCALAR_SCHEMAS, lambda inner: st.one_of(
    st.dictionaries(KEYS, inner, max_size=4).map(lambda p: {"type": "object", "properties": p}),
    inner.map(lambda s: {"type": "array", "items": s})), max_leaves=8)


def or_null(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), values, values, values)


def value_for(schema: dict) -> st.SearchStrategy:
    """Values a schema allows, nulls included where the model would leave them out."""
    t = schema["type"]
    if t == "object":
        return st.fixed_dictionaries({k: or_null(value_for(s)) for k, s in schema["properties"].items()})
    if t == "array":
        return st.lists(or_null(value_for(schema["items"])), max_size=3)
    return {"string": st.text(max_size=12).filter(lambda v: NS not in v), "integer": st.integers(),
            "number": st.floats(allow_nan=False, allow_infinity=False), "boolean": st.booleans()}[t]


@st.composite
def tool_and_arguments(draw):
    props = draw(st.dictionaries(KEYS, SCHEMAS, min_size=1, max_size=4))
    schema = {"type": "object", "properties": props}
    return schema, draw(value_for(schema)), draw(st.randoms(use_true_random=False))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool_and_arguments())
def test_any_arguments_round_trip_through_template_and_parser(case):
    schema, arguments, rng = case
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "ok",
                 "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}]
    turn = assistant_turns(render(messages, tools=tools, add_generation_prompt=False))[0]
    parsed = parse_tool_calls(turn, tools)
    assert parsed.content == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", without_nulls(arguments))]
    cuts = sorted(rng.sample(range(len(turn) + 1), min(len(turn) + 1, 6)))
    pieces = [turn[a:b] for a, b in zip([0] + cuts, cuts + [len(turn)])]
    assert stream_turn(pieces, tools) == (None, "ok", [("f", without_nulls(arguments))])


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Again"}]}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_chats_render_as_the_tiny_models_template_does(messages, add_generation_prompt):
    """Without tools, tool calls or reasoning, the M3 template renders what the plain template rendered."""
    assert render(messages, add_generation_prompt=add_generation_prompt) == render(
        messages, PLAIN_TEMPLATE, add_generation_prompt=add_generation_prompt)
