"""Every error the API promises, in OpenAI's shape and with its status, through real Ray Serve; after each one
the server still serves. Also: 429 + Retry-After when the waiting queue overflows, and 503 while an engine is
not ready (a checkpoint whose weights are corrupt never becomes ready; the server says why and stays up)."""
from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

MAX_LEN = 512  # conftest TEST_CONFIG engine.max_model_len
VOCAB = 384  # the tiny preset


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"] or status in (404,), err
    if code is not None:
        assert err["code"] == code, err
    return err


def still_serves(app) -> None:
    r = httpx.post(f"{app.base_url}/v1/completions", headers=app.headers, timeout=60,
                   json={"model": app.model, "prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _completion(app, **fields):
    return {"model": app.model, "prompt": "hello", "max_tokens": 4, **fields}


def _chat(app, **fields):
    return {"model": app.model, "messages": [{"role": "user", "content": "hi"}], **fields}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (name, path, body builder, expected status, param, code)
CASES = [
    ("negative temperature", "/v1/completions", lambda a: _completion(a, temperature=-1), 400, "temperature", None),
    ("top_p zero", "/v1/chat/completions", lambda a: _chat(a, top_p=0), 400, "top_p", None),
    ("n zero", "/v1/completions", lambda a: _completion(a, n=0), 400, "n", None),
    ("logprobs too many", "/v1/completions", lambda a: _completion(a, logprobs=50), 400, "logprobs", None),
    ("wrong type", "/v1/completions", lambda a: _completion(a, max_tokens="ten"), 400, "max_tokens", None),
    ("zero max_tokens", "/v1/completions", lambda a: _completion(a, max_tokens=0), 400, "max_tokens", None),
    ("no messages", "/v1/chat/completions", lambda a: _chat(a, messages=[]), 400, "messages", None),
    ("bad role", "/v1/chat/completions",
     lambda a: _chat(a, messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", None),
    ("top_logprobs alone", "/v1/chat/completions", lambda a: _chat(a, top_logprobs=2), 400, "top_logprobs", None),
    ("empty prompt", "/v1/completions", lambda a: _completion(a, prompt=[]), 400, "prompt", None),
    ("token out of vocab", "/v1/completions", lambda a: _completion(a, prompt=[1, VOCAB + 5]), 400, "prompt", None),
    ("prompt too long", "/v1/completions", lambda a: _completion(a, prompt=[7] * MAX_LEN), 400, "prompt",
     "context_length_exceeded"),
    ("prompt + max_tokens too long", "/v1/completions",
     lambda a: _completion(a, prompt=[7] * 500, max_tokens=20), 400, "max_tokens", "context_length_exceeded"),
    ("chat too long", "/v1/chat/completions",
     lambda a: _chat(a, messages=[{"role": "user", "content": "word " * 2000}]), 400, "messages",
     "context_length_exceeded"),
    ("unknown model", "/v1/completions", lambda a: _completion(a, model="gpt-17"), 404, "model", "model_not_found"),
    ("tool_choice names a function not given", "/v1/chat/completions",
     lambda a: _chat(a, tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice", "invalid_value"),
    ("tool_choice required without tools", "/v1/chat/completions",
     lambda a: _chat(a, tool_choice="required"), 400, "tool_choice", "invalid_value"),
    ("schema that does not compile", "/v1/chat/completions",
     lambda a: _chat(a, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "frob"}}}), 400, "response_format.json_schema.schema", None),
    ("regex that does not compile", "/v1/completions", lambda a: _completion(a, guided_regex="(("), 400,
     "guided_regex", None),
    ("two structured-output constraints", "/v1/completions",
     lambda a: _completion(a, guided_regex="a+", response_format={"type": "json_object"}), 400, "guided_regex",
     None),
    ("response_format of an unknown type", "/v1/chat/completions",
     lambda a: _chat(a, response_format={"type": "xml"}), 400, "response_format.type", None),
    ("tool without function", "/v1/chat/completions", lambda a: _chat(a, tools=[{"type": "function"}]), 400,
     "tools.0.function", None),
    ("tool call arguments not an object", "/v1/chat/completions", lambda a: _chat(a, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]), 400, "messages",
     None),
    ("reserved template kwarg", "/v1/chat/completions",
     lambda a: _chat(a, chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs", None),
]


@pytest.mark.parametrize("name,path,build,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_error_case(serve_app, name, path, build, status, param, code):
    r = httpx.post(f"{serve_app.base_url}{path}", json=build(serve_app), headers=serve_app.headers, timeout=60)
    assert_openai_error(r, status, param=param, code=code)
    still_serves(serve_app)


def test_unknown_fields_are_ignored_not_refused(serve_app):
    """As vLLM: a field this server does not know (a newer OpenAI field, or a typo such as `max_token`) is
    ignored and named once in the log, instead of failing clients that send it."""
    r = httpx.post(f"{serve_app.base_url}/v1/completions", headers=serve_app.headers, timeout=60,
                   json={"model": serve_app.model, "prompt": "hello", "max_token": 3, "temperature": 0,
                         "ignore_eos": True, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens, not the misspelt 3
    r = httpx.post(f"{serve_app.base_url}/v1/chat/completions", headers=serve_app.headers, timeout=60,
                   json=_chat(serve_app, max_tokens=2, messages=[{"role": "user", "content": "hi", "x_meta": 1}],
                              metadata={"a": "b"}, store=False))
    assert r.status_code == 200, r.text


def test_malformed_json_unknown_route_and_auth(serve_app):
    url = f"{serve_app.base_url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={**serve_app.headers, "Content-Type": "application/json"})
    assert_openai_error(r, 400)
    assert_openai_error(httpx.get(f"{serve_app.base_url}/v1/nothing", headers=serve_app.headers), 404)
    body = _completion(serve_app)
    err = assert_openai_error(httpx.post(url, json=body), 401, code="invalid_api_key")
    assert err["type"] == "authentication_error"
    assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(f"{serve_app.base_url}/v1/models"), 401)
    still_serves(serve_app)


def test_openai_client_raises_typed_errors(serve_app):
    import openai

    client = serve_app.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=serve_app.model, messages=[{"role": "user", "content": "x"}],
                                       temperature=-3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="bad", max_retries=0).models.list()


def test_queue_overflow_answers_429_with_retry_after(serve_app):
    """More long requests at once than max_num_seqs (16) + max_waiting (32): the overflow gets 429 +
    Retry-After at once; then every client leaves, and the aborted requests free all their pages."""
    serve_app.wait_idle()
    body = {"model": serve_app.model, "prompt": [9, 8, 7, 6], "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    total = 64

    async def one(http: httpx.AsyncClient, results: list) -> None:
        async with http.stream("POST", f"{serve_app.base_url}/v1/completions", json=body,
                               headers=serve_app.headers) as r:
            if r.status_code != 200:
                await r.aread()
                results.append((r.status_code, r.headers.get("retry-after"), r.json()))
                return
            results.append((200, None, None))
            async for _ in r.aiter_lines():  # hold the stream open until cancelled
                pass

    async def main() -> list:
        results: list = []
        limits = httpx.Limits(max_connections=total + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            tasks = [asyncio.create_task(one(http, results)) for _ in range(total)]
            deadline = asyncio.get_running_loop().time() + 60
            while not any(s == 429 for s, _, _ in results) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return results

    results = asyncio.run(main())
    rejected = [(ra, body) for s, ra, body in results if s == 429]
    assert rejected, f"no 429 among {[s for s, _, _ in results]}"
    retry_after, err = rejected[0]
    assert retry_after is not None and int(retry_after) >= 1
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "rate_limit_error"
    assert all(s in (200, 429) for s, _, _ in results), results
    serve_app.wait_idle(timeout=60)
    still_serves(serve_app)


@pytest.fixture(scope="module")
def broken_app(serve_app, tmp_path_factory):
    """A second app whose checkpoint has a valid tokenizer and config but corrupt weights."""
    broken = tmp_path_factory.mktemp("broken") / "m3-broken"
    shutil.copytree(serve_app.model_dir, broken)
    for shard in broken.glob("*.safetensors"):
        shard.write_bytes(b"this is not a safetensors file")
    base = serve_app.deploy_extra("broken", {**serve_app.config, "model": str(broken), "api_key": None})
    yield base
    serve_app.delete_extra("broken")


def test_not_ready_engine_gives_503_and_server_stays_up(serve_app, broken_app):
    import time

    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(f"{broken_app}/health", timeout=30)
        err = assert_openai_error(r, 503, code="not_ready")
        if "failed to load" in err["message"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert "failed to load" in err["message"], err
    assert r.headers.get("retry-after") is not None
    r = httpx.post(f"{broken_app}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert_openai_error(r, 503, code="not_ready")
    still_serves(serve_app)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_openai_client_gets_context_length_exceeded_for_both_endpoints(serve_app, endpoint):
    """A prompt longer than max_model_len, and a prompt + max_tokens past it: 400 `context_length_exceeded`,
    naming the field, raised by the official client as BadRequestError."""
    import openai

    client = serve_app.client()
    if endpoint == "completions":
        too_long = lambda: client.completions.create(model=serve_app.model, prompt=[7] * (MAX_LEN + 10),
                                                     max_tokens=2)
        with_max = lambda: client.completions.create(model=serve_app.model, prompt=[7] * 100, max_tokens=MAX_LEN)
        fields = ("prompt", "max_tokens")
    else:
        msg = [{"role": "user", "content": "word " * 2000}]
        too_long = lambda: client.chat.completions.create(model=serve_app.model, messages=msg, max_tokens=2)
        with_max = lambda: client.chat.completions.create(model=serve_app.model, max_completion_tokens=MAX_LEN,
                                                          messages=[{"role": "user", "content": "hi"}])
        fields = ("messages", "max_completion_tokens")
    for call, field_name in zip((too_long, with_max), fields):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == field_name
        assert field_name in e.value.body["message"] and str(MAX_LEN) in e.value.body["message"]
    still_serves(serve_app)


def _engine_replica():
    """The shared app's engine replica actor (Ray Serve names it SERVE_REPLICA::<app>#<deployment>#<id>)."""
    import ray
    from ray.util import list_named_actors

    prefix = "SERVE_REPLICA::m3#EngineServer-unified-0#"
    names = [(a["name"], a["namespace"]) for a in list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    return ray.get_actor(*names[0])


def _fail_next_step(prefill_end: int | None = None, decode_position: int | None = None):
    """Test-only, run inside the engine replica through Ray's `__ray_call__`: wrap the engine's executor so the
    first step holding a prefill chunk that ends at `prefill_end` (or a decode row at `decode_position`) raises
    torch.OutOfMemoryError; None for both: unwrap it again. A closure, so it travels by value."""
    def install(replica) -> None:
        import torch

        class FailOnce:
            def __init__(self, inner) -> None:
                self.inner, self.fired = inner, False

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def execute(self, batch):
                hit = any((not c.is_decode and c.start + c.num_tokens == prefill_end)
                          or (c.is_decode and c.start == decode_position) for c in batch.chunks)
                if hit and not self.fired:
                    self.fired = True
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (injected)")
                return self.inner.execute(batch)

        engine = replica._replica_impl._user_callable_wrapper.user_callable._engine.engine
        inner = getattr(engine.executor, "inner", engine.executor)
        engine.executor = inner if prefill_end is None and decode_position is None else FailOnce(inner)

    return install


def test_a_step_out_of_memory_fails_its_request_with_json_and_the_server_serves_on(serve_app):
    """The engine's step runs out of memory: that request gets 503 `out_of_memory` as OpenAI error JSON (and a
    stream already started an error event, then [DONE]); the replica keeps serving and frees every page."""
    import json

    import ray

    serve_app.wait_idle()
    replica = _engine_replica()
    before = serve_app.engine_stats()[0]["counters"]
    url = f"{serve_app.base_url}/v1/completions"
    try:
        ray.get(replica.__ray_call__.remote(_fail_next_step(prefill_end=77)))
        r = httpx.post(url, headers=serve_app.headers, timeout=60,
                       json={"model": serve_app.model, "prompt": [11] * 77, "max_tokens": 4})
        err = assert_openai_error(r, 503, code="out_of_memory")
        assert err["message"].startswith("the engine ran out of GPU memory in this step (77 tokens, 1 requests)")
        assert "max_num_batched_tokens" in err["message"] and r.headers.get("retry-after") == "1"
        still_serves(serve_app)
        # a stream: its prompt (55 tokens) and three tokens went out, then the step of position 58 fails
        ray.get(replica.__ray_call__.remote(_fail_next_step(decode_position=58)))
        body = {"model": serve_app.model, "prompt": [12] * 55, "max_tokens": 20, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url, json=body, headers=serve_app.headers, timeout=60) as s:
            assert s.status_code == 200
            events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "out_of_memory" and "ran out of GPU memory" in error["message"]
        tokens = [json.loads(e) for e in events[:-2]]
        assert tokens and all("choices" in t for t in tokens) and len(tokens) <= 4
    finally:
        ray.get(replica.__ray_call__.remote(_fail_next_step()))
    still_serves(serve_app)
    serve_app.wait_idle()
    after = serve_app.engine_stats()[0]["counters"]
    assert after["failed"] == before.get("failed", 0) + 2
