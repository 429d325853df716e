"""Tool calls and reasoning through the running server and the official `openai` client (issue 20).

The served model is real (real weights, the real engine under real Ray Serve on loopback), but a random model
never writes the tool-call syntax. So these tests serve `scripted_model.write_scripted_checkpoint`: the tiny
architecture whose lm_head was fit offline so that greedy decoding answers the two turns of one conversation as
scripted below (turn 1: reasoning, then a call; turn 2, after the tool result: reasoning, then text). The server
renders, tokenizes, decodes, parses and streams as for any model; nothing in it is patched. Should the server
render a different prompt (tools or the tool turn left out, kwargs ignored) the scripted answer would not come
out, so the prompts are also checked against an independent local rendering.
"""
from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from deploy import chat
from deploy.protocol import ChatCompletionRequest
from deploy.tool_parser import NS
from workers.models import tiny_model_dir
from workers.tokenizer import Tokenizer

from tests.deploy.scripted_model import write_scripted_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}
ARGS = {"city": "Paris", "days": 3}
# Turn 1 (thinking on: the prompt ends inside <mm:think>): reasoning, its closing tag, then one call.
ANSWER_1 = ("Paris weather.</mm:think>" + f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris'
            f"{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>\n{NS}</tool_call>")
TOOL_RESULT = '{"temp": 21}'
# Turn 2 (thinking off): the model opens and closes its reasoning itself, then answers.
ANSWER_2 = "<mm:think>Got it.</mm:think>It is 21 C in Paris."
APP = "scripted"


def turn_2_messages(call_id: str) -> list[dict]:
    return USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Paris weather.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


def local_prompt(tok: Tokenizer, messages: list[dict], **fields) -> list[int]:
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS, **fields})
    return tok.encode(chat.render_chat(tok, body, None).text)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir())  # the scripted checkpoint has the tiny model's tokenizer


@pytest.fixture(scope="module")
def scripted(serve_app, tok, tmp_path_factory):
    """The scripted checkpoint served as one more app of the shared Serve instance."""
    scripts = [(local_prompt(tok, USER, **THINKING), tok.encode(ANSWER_1)),
               (local_prompt(tok, turn_2_messages("call_any")), tok.encode(ANSWER_2))]
    model_dir = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), scripts)
    # Sampling defaults for requests that leave them out (test_generation_config_sampling_defaults).
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    engine = {**serve_app.config["engine"], "max_model_len": 1024}
    base = serve_app.deploy_extra(APP, {**serve_app.config, "model": str(model_dir), "model_name": APP,
                                        "engine": engine})
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, model=APP, extra_apps=[])
    serve_app.delete_extra(APP)


def create(app, messages, **kw):
    return app.client().chat.completions.create(model=app.model, messages=messages, tools=TOOLS, temperature=0,
                                                max_completion_tokens=300, **kw)


def test_full_tool_round_trip(scripted, tok):
    first = create(scripted, USER, extra_body={**THINKING, "return_token_ids": True})
    assert first.model_extra["prompt_token_ids"] == local_prompt(tok, USER, **THINKING)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Paris weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS  # typed by the schema: days is an integer

    # Turn 2: the assistant message as the client got it, then the tool's result, rendered by the template.
    assistant = choice.message.model_dump(exclude_none=True)
    messages = USER + [assistant, {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    second = create(scripted, messages, extra_body={"return_token_ids": True})
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt == local_prompt(tok, turn_2_messages(call.id))
    text = tok.decode(prompt, skip_special_tokens=False)
    assert f'<|tool|>\n{TOOL_RESULT}<|eos|>\n<|assistant|>\n' in text
    assert f'<mm:think>Paris weather.</mm:think>{NS}<tool_call>\n{NS}<invoke name="get_weather">' in text
    assert second.usage.prompt_tokens == len(prompt)
    answer = second.choices[0]
    assert (answer.finish_reason, answer.message.tool_calls) == ("stop", None)
    assert answer.message.content == "It is 21 C in Paris."
    assert answer.message.model_extra["reasoning_content"] == "Got it."


def test_streamed_call_accumulates_to_the_non_streamed_call(scripted):
    whole = create(scripted, USER, extra_body=THINKING).choices[0]
    chunks = list(create(scripted, USER, extra_body=THINKING, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    pieces = [t for d in deltas for t in d.tool_calls or []]
    heads = [t for t in pieces if t.id is not None]
    assert len(heads) == 1 and heads[0].type == "function" and heads[0].function.name == "get_weather"
    assert all(t.index == 0 for t in pieces)
    arguments = "".join(t.function.arguments or "" for t in pieces)
    assert len([t for t in pieces if t.function.arguments]) > 1  # the arguments came in pieces, as they were made
    assert (reasoning, content) == ("Paris weather.", "")
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_reasoning_split_streamed_and_not(scripted):
    messages = turn_2_messages("call_1")
    whole = create(scripted, messages).choices[0].message
    deltas = [c.choices[0].delta for c in create(scripted, messages, stream=True) if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content) == (
        "Got it.", "It is 21 C in Paris.")
    assert not any(d.tool_calls for d in deltas)


def test_tools_with_the_random_model_never_fail(serve_app):
    """The random tiny model writes no readable call: its output comes back as content, with any tool_choice
    the server supports, streamed or not."""
    client = serve_app.client()
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=serve_app.model, messages=USER, tools=TOOLS, tool_choice=choice,
                                           max_completion_tokens=8, temperature=0, extra_body=THINKING)
        assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    body = {"model": serve_app.model, "messages": USER, "tools": TOOLS, "stream": True, "max_tokens": 8}
    r = httpx.post(f"{serve_app.base_url}/v1/chat/completions", json=body, headers=serve_app.headers, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_generation_config_sampling_defaults(scripted):
    """The checkpoint's generation_config.json says temperature 0: a request without `temperature` decodes
    greedily whatever its seed (the server's own default, 1.0, would sample), one that sets it samples."""
    client = scripted.client()
    kw = dict(model=scripted.model, prompt="Once upon a time", max_tokens=24, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert [client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)] == [greedy] * 3
    sampled = {client.completions.create(**kw, seed=s, temperature=1.5).choices[0].text for s in (1, 2, 3)}
    assert sampled != {greedy}
