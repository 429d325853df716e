"""deploy/guided.py without a server: request fields -> the engine's GrammarSpec, the 400s naming the field, and
the forced tool-call grammar matching exactly the M3 call syntax the tool parser reads (thinking on or off)."""
from __future__ import annotations

import pytest

from deploy import chat, guided
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from deploy.tool_parser import NS
from workers.models import tiny_model_dir
from workers.structured import StructuredOutputCompiler
from workers.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop"}}]
CALL = (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>'
        f'{NS}</invoke>\n{NS}</tool_call>')


def chat_body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion_body(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


@pytest.fixture(scope="module")
def compiler():
    return StructuredOutputCompiler(Tokenizer.from_dir(tiny_model_dir()))


def test_each_field_gives_its_spec():
    rf = {"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object"}}}
    cases = [({"response_format": rf}, "json_schema", "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
             ({"guided_json": {"type": "integer"}}, "json_schema", "guided_json"),
             ({"guided_regex": "a+"}, "regex", "guided_regex"),
             ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
             ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
             ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs.choice")]
    for fields, kind, source in cases:
        spec = guided.request_spec(completion_body(**fields))
        assert (spec.kind, spec.source) == (kind, source)
    assert guided.request_spec(completion_body(response_format={"type": "text"})) is None
    assert guided.request_spec(completion_body()) is None


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {}}, "structured_outputs"),
])
def test_bad_or_conflicting_fields_name_the_field(fields, param):
    with pytest.raises(chat.ChatRequestError) as e:
        guided.request_spec(completion_body(**fields))
    assert e.value.param == param and str(e.value).startswith(param + ": ")


@pytest.mark.parametrize("fields", [{"tool_choice": "required"},
                                    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                                    {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}])
def test_forced_choice_errors(fields):
    body = chat_body(**fields)
    with pytest.raises(chat.ChatRequestError) as e:
        guided.chat_spec(body, chat.offered_tools(body), False)
    assert e.value.param == "tool_choice"


def _accepts(compiler, spec, text: str) -> bool:
    import xgrammar

    m = xgrammar.GrammarMatcher(compiler.compile(spec))
    return m.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_call_grammar_is_the_parsers_syntax(compiler, thinking):
    body = chat_body(tools=TOOLS, tool_choice="required")
    spec = guided.chat_spec(body, chat.offered_tools(body), thinking)
    prefix = guided.THINK_END if thinking else ""
    assert _accepts(compiler, spec, prefix + CALL)
    assert not _accepts(compiler, spec, prefix + CALL.replace("3", "12"))  # days out of bounds
    assert not _accepts(compiler, spec, prefix + "text first" + CALL)
    assert not _accepts(compiler, spec, CALL if thinking else guided.THINK_END + CALL)
    out = chat.parse_output(prefix + CALL, chat.OutputSpec(tools=TOOLS, starts_in_reasoning=thinking))
    assert [(c.function.name, c.function.arguments) for c in out.tool_calls] == \
        [("get_weather", '{"city": "Paris", "days": 3}')]
    named = chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}})
    spec = guided.chat_spec(named, chat.offered_tools(named), thinking)
    assert not _accepts(compiler, spec, prefix + CALL)  # only the named function
    assert _accepts(compiler, spec, f'{prefix}{NS}<tool_call>\n{NS}<invoke name="noop">{NS}</invoke>\n{NS}</tool_call>')


def test_thinking_on_puts_the_close_tag_before_any_constraint(compiler):
    spec = guided.chat_spec(chat_body(guided_choice=["yes", "no"]), None, True)
    assert _accepts(compiler, spec, "</mm:think>yes") and not _accepts(compiler, spec, "yes")
    spec = guided.chat_spec(chat_body(response_format={"type": "json_object"}), None, True)
    assert _accepts(compiler, spec, '</mm:think>{"a": 1}')
