"""The served /openapi.json is true to the server (issue 20): it documents the 400s (not FastAPI's 422), SSE and
Prometheus text where they are sent, and, property-based over random chat and completion requests (valid and
not), every answer the running server gives has a documented status below 500 and a body the schema's own
component validates."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator


@pytest.fixture(scope="module")
def spec(serve_app) -> dict:
    assert httpx.get(f"{serve_app.base_url}/openapi.json", timeout=30).status_code == 401  # a key is set
    r = httpx.get(f"{serve_app.base_url}/openapi.json", headers=serve_app.headers, timeout=30)
    assert r.status_code == 200
    return r.json()


def validator(spec: dict, ref: dict) -> Draft202012Validator:
    # The components ride along in the root document, so "#/components/schemas/..." refs resolve.
    return Draft202012Validator({**ref, "components": spec["components"]})


def test_schema_documents_what_the_server_sends(spec):
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses)
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    roles = spec["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == {"system", "developer", "user", "assistant", "tool"}
    for ref in _refs(spec):  # every reference resolves
        assert ref.split("/")[-1] in spec["components"]["schemas"], ref


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"])},
    optional={"parameters": st.sampled_from([{"type": "object", "properties": {"x": {"type": "integer"}}}, {}])})})
TEXT = st.text(max_size=20)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "developer", "assistant", "tool"])},
    optional={"content": st.one_of(TEXT, st.none(), st.just([{"type": "text", "text": "hi"}])),
              "tool_call_id": st.just("call_1"), "reasoning_content": TEXT,
              "tool_calls": st.just([{"id": "c", "type": "function",
                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]),
              "x_unknown": st.integers()})
COMMON = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "n": st.integers(1, 2),
          "stream": st.booleans(), "seed": st.integers(0, 9), "unknown_field": st.booleans(),
          "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2))}
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**COMMON, "tools": st.lists(TOOL, max_size=2), "tool_choice": st.sampled_from(["auto", "none"]),
              "chat_template_kwargs": st.sampled_from([{"enable_thinking": True}, {}]), "logprobs": st.booleans()})
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 383), min_size=1, max_size=4))},
    optional={**COMMON, "echo": st.booleans(), "logprobs": st.integers(0, 3)})
# One field made wrong, in about a third of the requests: every kind of refusal must be documented too.
BREAKAGE = st.sampled_from([
    {}, {}, {}, {}, {"temperature": -1}, {"n": 0}, {"max_tokens": -1}, {"max_tokens": "ten"}, {"top_p": 0},
    {"messages": [{"role": "wizard", "content": "x"}]}, {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"tools": [{"type": "other", "function": {"name": "f"}}]}, {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}}, {"chat_template_kwargs": {"tools": 1}},
    {"prompt": [-1]}, {"prompt": [7] * 600}, {"model": "gpt-17"}, {"logprobs": 50}, {"stream_options": {}},
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_requests_get_documented_answers(serve_app, spec, data):
    path = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = {"model": serve_app.model, "max_tokens": 2,  # bounded work per example
            **data.draw(CHAT if path.endswith("chat/completions") else COMPLETION), **data.draw(BREAKAGE)}
    r = httpx.post(f"{serve_app.base_url}{path}", json=body, headers=serve_app.headers, timeout=120)
    event(f"{path} {r.status_code}")
    responses = spec["paths"][path]["post"]["responses"]
    assert str(r.status_code) in responses and r.status_code < 500, (r.status_code, r.text, body)
    media = r.headers["content-type"].split(";")[0]
    content = responses[str(r.status_code)]["content"]
    assert media in content, (media, list(content))
    schema = validator(spec, content[media]["schema"])
    if media == "text/event-stream":
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and r.text.isascii()
        for raw in events[:-1]:
            payload = json.loads(raw)
            if "error" not in payload:  # a failure after the 200 is an error event (documented in operations.md)
                schema.validate(payload)
    else:
        schema.validate(r.json())
