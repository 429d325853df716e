"""Structured outputs, the request side: OpenAI's `response_format`, vLLM's `guided_*` fields and its
`structured_outputs` object, and a forced tool call (`tool_choice` "required" or a named function) -> the
engine's `GrammarSpec` (workers/structured.py compiles and applies it).

One constraint per request: two of these fields together are a 400 naming the second. Errors the spec's shape
shows (not JSON, an empty choice list) are 400s here; a schema, regex or grammar xgrammar cannot compile is
refused by the engine before it queues anything, with the same field named (`GrammarSpec.source`).

A forced tool call is an xgrammar structural tag for MiniMax-M3's syntax (../shared/M3_SPEC.md section 7):
`NS<tool_call>\\n`, one `NS<invoke name="F">` whose arguments are the tool's JSON schema written in M3's
namespace XML (xgrammar's `minimax_m3_xml` style: typed scalars, nested elements, `NS<item>` lists), `NS</invoke>\\n`,
`NS</tool_call>`, then EOS. "required" lets the model pick among all offered tools, a named choice allows only
that one. "required" allows one to `MAX_PARALLEL_CALLS` invokes in the one wrapper (the bound keeps a random or
confused model from looping over calls until max_tokens) unless the request says `parallel_tool_calls: false`
(OpenAI's default is true); then, and for a named function, exactly one. The model may never write free text first.

Reasoning: when the rendered prompt leaves the model inside `<mm:think>` (thinking on), every constraint is
preceded by a forced `</mm:think>`: a constrained answer skips its reasoning rather than leave the grammar's
output inside the reasoning block, where the reasoning parser would hide it.
"""
from __future__ import annotations

import json
from typing import Any

from deploy.chat import ChatRequestError
from deploy.tool_parser import NS
from workers.structured_spec import MAX_JSON_WHITESPACE, GrammarError, GrammarSpec

THINK_END = "</mm:think>"
# Whitespace between XML elements of a forced call's arguments (the JSON default is workers.structured's 16).
MAX_XML_WHITESPACE = 1
# Most invokes in one forced wrapper when parallel calls are allowed: agents fan out to a handful of tools at once;
# without a bound a model that keeps choosing "another call" only stops at max_tokens, with a call cut in half.
MAX_PARALLEL_CALLS = 8


def request_spec(body: Any) -> GrammarSpec | None:
    """The one structured-output constraint of a completion or chat body, or None. ChatRequestError (400)
    naming the field for two constraints or a malformed one."""
    found: list[GrammarSpec] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        found.append(_response_format(rf))
    so = body.structured_outputs
    if so is not None:
        found += _structured_outputs(so)
    for name, make in (("guided_json", GrammarSpec.json_schema), ("guided_regex", GrammarSpec.regex),
                       ("guided_choice", GrammarSpec.choice), ("guided_grammar", GrammarSpec.grammar)):
        value = getattr(body, name)
        if value is not None:
            found.append(_spec(name, make, value))
    if len(found) > 1:
        raise ChatRequestError(found[1].source, f"only one structured-output constraint per request "
                                                f"({found[0].source} is given too)")
    return found[0] if found else None


def _spec(source: str, make, value) -> GrammarSpec:
    try:
        return make(value, source=source)
    except GrammarError as e:
        raise ChatRequestError(source, str(e)) from None


def _response_format(rf: Any) -> GrammarSpec:
    if rf.type == "json_object":
        return GrammarSpec.json_object(source="response_format")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ChatRequestError("response_format.json_schema", "type json_schema needs json_schema.schema")
    return _spec("response_format.json_schema.schema", GrammarSpec.json_schema, rf.json_schema.schema_)


def _structured_outputs(so: Any) -> list[GrammarSpec]:
    out = []
    if so.json_ is not None:
        out.append(_spec("structured_outputs.json", GrammarSpec.json_schema, so.json_))
    if so.json_object:
        out.append(GrammarSpec.json_object(source="structured_outputs.json_object"))
    for name, make in (("regex", GrammarSpec.regex), ("choice", GrammarSpec.choice),
                       ("grammar", GrammarSpec.grammar)):
        value = getattr(so, name)
        if value is not None:
            out.append(_spec(f"structured_outputs.{name}", make, value))
    if not out:
        raise ChatRequestError("structured_outputs", "names no constraint (json, json_object, regex, choice or "
                                                     "grammar)")
    return out


def forced_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict] | None:
    """The tools a call must be made to: all offered ones for "required", the named one for a named choice;
    None when the model may answer freely ("auto", "none", no choice). ChatRequestError for a forced choice
    without tools or naming a tool not offered."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise ChatRequestError("tool_choice", "a call is required but no tools are given")
    if tool_choice == "required":
        return tools
    name = tool_choice.function.name
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise ChatRequestError("tool_choice", f"function {name!r} is not one of the tools given")
    return named[:1]


def tool_call_spec(tools: list[dict], *, parallel: bool = False) -> GrammarSpec:
    """One call to one of `tools` (OpenAI tool dicts) in M3's syntax, as an xgrammar structural tag; `parallel`:
    one to MAX_PARALLEL_CALLS calls, each to any of them, in the one `NS<tool_call>` wrapper (M3 writes parallel
    calls that way: invokes back to back, each ending with a newline)."""
    invokes = [{"type": "tag", "begin": f'{NS}<invoke name="{t["function"]["name"]}">',
                "content": {"type": "json_schema", "json_schema": _parameters(t), "style": "minimax_m3_xml",
                            "max_whitespace_cnt": MAX_XML_WHITESPACE},
                "end": f"{NS}</invoke>\n"} for t in tools]
    body = invokes[0] if len(invokes) == 1 else {"type": "or", "elements": invokes}
    if parallel:
        body = {"type": "repeat", "min": 1, "max": MAX_PARALLEL_CALLS, "content": body}
    call = {"type": "tag", "begin": f"{NS}<tool_call>\n", "content": body, "end": f"{NS}</tool_call>"}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": call}, source="tools")


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def after_reasoning(spec: GrammarSpec) -> GrammarSpec:
    """`spec` preceded by a forced `</mm:think>` (the prompt left the model inside reasoning)."""
    formats = {
        "json_object": lambda: {"type": "json_schema", "json_schema": {"type": "object"},
                                "max_whitespace_cnt": MAX_JSON_WHITESPACE},
        "json_schema": lambda: {"type": "json_schema", "json_schema": json.loads(spec.spec),
                                "max_whitespace_cnt": MAX_JSON_WHITESPACE},
        "regex": lambda: {"type": "regex", "pattern": spec.spec},
        "grammar": lambda: {"type": "grammar", "grammar": spec.spec},
        "choice": lambda: {"type": "or", "elements": [{"type": "const_string", "value": c}
                                                      for c in json.loads(spec.spec)]},
        "structural_tag": lambda: json.loads(spec.spec)["format"],
    }
    inner = formats[spec.kind]()
    tag = {"type": "structural_tag",
           "format": {"type": "sequence", "elements": [{"type": "const_string", "value": THINK_END}, inner]}}
    return GrammarSpec.structural_tag(tag, source=spec.source)


def chat_spec(body: Any, tools: list[dict] | None, starts_in_reasoning: bool) -> GrammarSpec | None:
    """The chat request's constraint: its structured-output fields, or a forced tool call; both is a 400."""
    spec = request_spec(body)
    forced = forced_tools(tools, body.tool_choice)
    if forced is not None:
        if spec is not None:
            raise ChatRequestError("tool_choice", f"a forced tool call cannot be combined with {spec.source}")
        # OpenAI's default for parallel_tool_calls is true: only an explicit false makes "required" one call
        spec = tool_call_spec(forced, parallel=body.tool_choice == "required" and body.parallel_tool_calls is not False)
    if spec is not None and starts_in_reasoning:
        spec = after_reasoning(spec)
    return spec
