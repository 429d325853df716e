"""The API details third-party clients hit (issue 20), through the running server (shared tiny-model app):
`GET /v1/models/{id}`, `HEAD /health`, vLLM's `/tokenize` and `/detokenize`, `/version`, `X-Request-Id`
echoed, SSE JSON ASCII-escaped. generation_config.json defaults: unit-tested here, served in test_tools_e2e.py."""
from __future__ import annotations

import json
from importlib import metadata

import httpx
import pytest

from deploy import chat
from deploy.extras import sampling_defaults
from deploy.protocol import ChatCompletionRequest
from workers.tokenizer import Tokenizer

MAX_LEN = 512  # conftest TEST_CONFIG engine.max_model_len
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}]
# Characters Python's str.splitlines (and so httpx's line reader) treats as line ends, besides \n and \r.
LINE_BREAKERS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"


@pytest.fixture(scope="module")
def tok(serve_app) -> Tokenizer:
    return Tokenizer.from_dir(serve_app.model_dir)


def post(app, path, body, **kw):
    return httpx.post(f"{app.base_url}{path}", json=body, headers={**app.headers, **kw.pop("headers", {})},
                      timeout=60, **kw)


def test_model_by_id_and_head_health(serve_app):
    r = httpx.get(f"{serve_app.base_url}/v1/models/{serve_app.model}", headers=serve_app.headers, timeout=30)
    assert r.status_code == 200, r.text
    card = r.json()
    assert (card["id"], card["object"], card["max_model_len"]) == (serve_app.model, "model", MAX_LEN)
    assert serve_app.client().models.retrieve(serve_app.model).id == serve_app.model
    r = httpx.get(f"{serve_app.base_url}/v1/models/gpt-17", headers=serve_app.headers, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{serve_app.base_url}/v1/models/{serve_app.model}", timeout=30).status_code == 401
    head = httpx.head(f"{serve_app.base_url}/health", timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_tokenize_prompt_and_chat_as_vllm_shapes_them(serve_app, tok):
    r = post(serve_app, "/tokenize", {"model": serve_app.model, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok.encode("Hello world", add_special_tokens=True)
    assert body == {"count": len(want), "max_model_len": MAX_LEN, "tokens": want,
                    "token_strs": [tok.id_to_token(i) for i in want]}
    messages = [{"role": "user", "content": "Call f"}]
    r = post(serve_app, "/tokenize", {"messages": messages, "tools": TOOLS,
                                      "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200, r.text
    rendered = chat.render_chat(tok, ChatCompletionRequest.model_validate(
        {"messages": messages, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}}), None).text
    assert rendered.endswith("<mm:think>") and "<tools>" in rendered
    assert r.json()["tokens"] == tok.encode(rendered) and r.json()["token_strs"] is None
    # the chat endpoint counts the same prompt
    usage = serve_app.client().chat.completions.create(
        model=serve_app.model, messages=messages, tools=TOOLS, max_completion_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}}).usage
    assert usage.prompt_tokens == r.json()["count"]


def test_detokenize_and_its_errors(serve_app, tok):
    ids = tok.encode("<|user|>\nHi é 世界", add_special_tokens=False)
    r = post(serve_app, "/detokenize", {"model": serve_app.model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "<|user|>\nHi é 世界"}
    r = post(serve_app, "/detokenize", {"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(serve_app, "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = post(serve_app, "/tokenize", {"prompt": "x", "model": "gpt-17"})
    assert r.status_code == 404
    assert httpx.post(f"{serve_app.base_url}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401


def test_version(serve_app):
    assert httpx.get(f"{serve_app.base_url}/version", timeout=30).status_code == 401  # a key is set
    r = httpx.get(f"{serve_app.base_url}/version", headers=serve_app.headers, timeout=30)
    assert r.status_code == 200 and r.json() == {"version": metadata.version("m3serve")}


def test_request_id_echoed_or_made(serve_app):
    """Ray Serve's proxy echoes a client's X-Request-Id (streams and errors included) and makes one otherwise."""
    chat_body = {"model": serve_app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(serve_app, "/v1/chat/completions", chat_body, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    with httpx.stream("POST", f"{serve_app.base_url}/v1/chat/completions", json={**chat_body, "stream": True},
                      headers={**serve_app.headers, "X-Request-Id": "stream-7"}, timeout=60) as s:
        assert s.headers["x-request-id"] == "stream-7"
        assert "".join(s.iter_text()).rstrip().endswith("data: [DONE]")
    r = post(serve_app, "/v1/chat/completions", {**chat_body, "model": "nope"}, headers={"X-Request-Id": "e1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "e1"
    made = [httpx.get(f"{serve_app.base_url}/health", timeout=30).headers["x-request-id"] for _ in range(2)]
    assert all(made) and made[0] != made[1]


def test_sse_json_is_ascii_so_line_splitting_clients_read_every_event(serve_app):
    """Echoed prompt text full of characters str.splitlines breaks at: the raw stream stays ASCII, and every
    event still parses, so the text comes back whole (the guidellm failure of issue 20)."""
    prompt = f"a{LINE_BREAKERS}b é 世界"
    body = {"model": serve_app.model, "prompt": prompt, "echo": True, "max_tokens": 3, "stream": True}
    r = post(serve_app, "/v1/completions", body)
    assert r.status_code == 200
    assert r.text.isascii()
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith(prompt)
    stream = serve_app.client().completions.create(model=serve_app.model, prompt=prompt, echo=True, max_tokens=3,
                                                   stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices).startswith(prompt)


def test_sampling_defaults_from_generation_config(tmp_path):
    assert sampling_defaults(tmp_path) == {}  # no file: the server's own defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "do_sample": True, "eos_token_id": [2]}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 40}
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "top_k": true}')
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
