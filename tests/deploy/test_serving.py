"""The OpenAI-compatible API end to end: the official `openai` client and raw HTTP against real Ray Serve on
loopback, serving the built-in tiny model (one shared app, see conftest.py)."""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import torch

from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(serve_app) -> Tokenizer:
    return Tokenizer.from_dir(serve_app.model_dir)


@pytest.fixture(scope="module")
def reference(serve_app, tmp_path_factory):
    """transformers' MiniMaxM3VLForCausalLM with the served weights (same preset and seed, transformers layout)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    from workers.models import TINY_PRESET, write_preset_checkpoint

    path = write_preset_checkpoint(TINY_PRESET, tmp_path_factory.mktemp("ref") / "tiny", seed=0,
                                   layout="transformers")
    return MiniMaxM3VLForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by definition: argmax of the full forward at every step (no EOS stop)."""
    threads = torch.get_num_threads()
    # One intra-op thread: on a shared 2-core machine torch's thread pool is ~30x slower on these tiny shapes.
    torch.set_num_threads(1)
    try:
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt_ids):]
    finally:
        torch.set_num_threads(threads)


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (each event is `data: ...` + blank line)."""
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), f"not an SSE data event: {block[:80]!r}"
        events.append(block[len("data: "):])
    return events


def test_health_models_and_auth_on_models(serve_app):
    r = httpx.get(f"{serve_app.base_url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = serve_app.client().models.list()
    assert [m.id for m in models.data] == [serve_app.model]
    assert httpx.get(f"{serve_app.base_url}/metrics").status_code == 401  # a key is set: only /health is open
    r = httpx.get(f"{serve_app.base_url}/metrics", headers=serve_app.headers)
    assert r.status_code == 200 and "text/plain" in r.headers["content-type"]


def test_greedy_completions_equal_transformers(serve_app, reference):
    """Token-id prompts (one long enough that MSA block selection is active) through the openai client:
    greedy output ids == transformers greedy generation for the same checkpoint and ids."""
    client = serve_app.client()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (5, 23, 90)]
    max_new = 12
    for prompt in prompts:
        resp = client.completions.create(model=serve_app.model, prompt=prompt, max_tokens=max_new, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = resp.choices[0]
        got = choice.model_extra["token_ids"]
        assert got == hf_greedy(reference, prompt, max_new), f"prompt of {len(prompt)} tokens"
        assert choice.model_extra["prompt_token_ids"] == prompt
        assert choice.finish_reason == "length"
        assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == max_new


def test_completion_text_prompt_stream_equals_non_stream(serve_app, tokenizer):
    client = serve_app.client()
    kw = dict(model=serve_app.model, prompt="The quick brown fox", max_tokens=16, temperature=0)
    full = client.completions.create(**kw, extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert full.choices[0].text == tokenizer.decode(full.choices[0].model_extra["token_ids"])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    # the prompt is tokenized at the ingress like a completions prompt in vLLM (special tokens added)
    assert full.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode("The quick brown fox", True)


def test_raw_sse_framing_ends_with_done(serve_app):
    body = {"model": serve_app.model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}
    r = httpx.post(f"{serve_app.base_url}/v1/completions", json=body, headers=serve_app.headers, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_and_not_with_logprobs(serve_app, tokenizer):
    client = serve_app.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there!"}]
    kw = dict(model=serve_app.model, messages=messages, max_completion_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3,
                                          extra_body={"return_token_ids": True})
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    want_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert full.model_extra["prompt_token_ids"] == want_prompt
    assert full.usage.prompt_tokens == len(want_prompt)
    ids = choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(ids) == full.usage.completion_tokens
    for entry, tid in zip(content, ids):
        assert entry.token == tokenizer.decode_token(tid)
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one, and top logprobs come sorted
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.logprob <= 0
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n2_sampling_with_logprobs_stream_and_not(serve_app):
    client = serve_app.client()
    kw = dict(model=serve_app.model, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=1234,
              logprobs=2)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert sorted(c.index for c in full.choices) == [0, 1]
    for c in full.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset)
    assert full.choices[0].model_extra["token_ids"] != full.choices[1].model_extra["token_ids"]
    assert full.usage.completion_tokens == 16
    # the same seed reproduces the same two samples, also when streamed
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in full.choices}


def test_echo_and_multiple_prompts(serve_app, tokenizer):
    client = serve_app.client()
    kw = dict(model=serve_app.model, max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True})
    resp = client.completions.create(prompt=["Hi", "Good morning"], **kw)
    by_index = {c.index: c for c in resp.choices}
    assert sorted(by_index) == [0, 1]
    assert by_index[0].text.startswith("Hi") and by_index[1].text.startswith("Good morning")
    assert resp.usage.prompt_tokens == len(tokenizer.encode("Hi", True)) + len(tokenizer.encode("Good morning", True))
    assert resp.usage.completion_tokens == 6


def test_echo_with_logprobs_leads_with_prompt_tokens(serve_app, tokenizer):
    """Token-id prompts echo their decoded text; with logprobs the prompt tokens lead the lists (first: None)."""
    client = serve_app.client()
    kw = dict(model=serve_app.model, max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True})
    ids = [10, 11, 12]
    resp = client.completions.create(prompt=[ids, [40, 41]], logprobs=1, **kw)
    c0 = {c.index: c for c in resp.choices}[0]
    assert c0.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    assert len(c0.logprobs.tokens) == len(ids) + 3
    assert c0.logprobs.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in c0.logprobs.token_logprobs[1:])


def test_32_concurrent_streams_complete_and_agree(serve_app):
    """32 streaming clients at once (4 prompts x 8): every stream ends properly, and greedy outputs are the same
    for every copy of a prompt and equal to that prompt served alone."""
    prompts = ["alpha", "beta gamma", "delta epsilon zeta", [20, 21, 22, 23, 24, 25]]
    max_tokens = 20
    alone = {i: serve_app.client().completions.create(model=serve_app.model, prompt=p, max_tokens=max_tokens,
                                                      temperature=0).choices[0].text
             for i, p in enumerate(prompts)}

    async def one(client, i: int) -> tuple[int, str, str | None]:
        stream = await client.completions.create(model=serve_app.model, prompt=prompts[i], max_tokens=max_tokens,
                                                 temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return i, text, reason

    async def main():
        async with serve_app.async_client() as client:
            return await asyncio.gather(*(one(client, k % len(prompts)) for k in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for i, text, reason in results:
        assert reason in ("stop", "length")
        assert text == alone[i]
    serve_app.wait_idle()


def _disconnect_after_three_chunks(serve_app) -> str | None:
    """Stream a long greedy completion and close the connection after its third chunk; its request id."""
    body = {"model": serve_app.model, "prompt": list(range(3, 40)), "max_tokens": 450, "temperature": 0,
            "stream": True, "ignore_eos": True}
    request_id = None
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{serve_app.base_url}/v1/completions", json=body,
                         headers=serve_app.headers) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    request_id = json.loads(line[6:])["id"]
                    seen += 1
                    if seen == 3:
                        break
        # leaving the `with` blocks closes the connection mid-stream
    return request_id


def test_client_disconnect_mid_stream_frees_pages(serve_app):
    """Close the connection after a few tokens of a long generation (450 tokens, ~4 s here): the engine aborts it
    (not finished: cut short) and frees its pages, three times in a row (the abort was once lost in several CI
    runs; deploy/stream/ingress_side.py sends it outside the cancelled HTTP request's context)."""
    for _attempt in range(3):
        before = serve_app.wait_idle()[0]["counters"]
        assert _disconnect_after_three_chunks(serve_app) is not None
        rows = serve_app.wait_idle(timeout=20)
        assert rows[0]["stats"]["num_pages_free"] == rows[0]["stats"]["num_pages_total"]
        after = rows[0]["counters"]
        aborted, finished = after["aborted"] - before["aborted"], after["finished"] - before["finished"]
        assert (aborted, finished) == (1, 0), (before, after)


def test_stop_string_ends_the_completion(serve_app):
    client = serve_app.client()
    kw = dict(model=serve_app.model, prompt="Stop here", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].text
    stop = next((free[i:i + 2] for i in range(2, len(free) - 2) if free[i:i + 2].strip() and
                 free.find(free[i:i + 2]) == i), None)
    assert stop is not None, f"no usable stop string in {free!r}"
    # The ingress finds the stop string (the engine sends token ids) and stops the request in the engine: with
    # room for 400 tokens (~4 s here), the engine ends it with "stop" long before that, counted finished.
    kw["max_tokens"] = 400
    serve_app.wait_idle()
    serve_app.pop_request_stats()
    before = serve_app.wait_idle()[0]["counters"]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reason == ["stop"]
            assert chunks[-1].usage is None or chunks[-1].usage.completion_tokens < 24
        else:
            resp = client.completions.create(**kw, stop=[stop])
            choice = resp.choices[0]
            text = choice.text
            assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
            assert resp.usage.completion_tokens < 24  # up to the token that completed the stop string
        assert text == free[:free.find(stop)]
    # the counters come with the engine's stats, which can trail the last request's end by a report: wait for them
    deadline = time.monotonic() + 20
    while True:
        after = serve_app.wait_idle()[0]["counters"]
        if after["finished"] - before["finished"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (after["finished"] - before["finished"], after["aborted"] - before["aborted"]) == (2, 0)
    ended = serve_app.pop_request_stats()
    assert [s.finished_reason for s in ended] == ["stop", "stop"]
    assert all(s.generation_tokens < 400 for s in ended)


def test_stop_string_in_one_choice_stops_only_that_one(serve_app):
    """n=2, seeded: the stop string of choice 0 ends choice 0 (the ingress tells the engine to stop that sample);
    choice 1 runs on to its length with the very text it has without the stop string."""
    client = serve_app.client()
    kw = dict(model=serve_app.model, prompt="Two ways", max_tokens=24, temperature=1.0, n=2, seed=5,
              extra_body={"ignore_eos": True})
    free = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    a, b = free[0].text, free[1].text
    stop = next((a[i:i + 2] for i in range(2, len(a) - 2) if a[i:i + 2].strip() and "\ufffd" not in a[i:i + 2]
                 and a.find(a[i:i + 2]) == i and a[i:i + 2] not in b), None)
    assert stop is not None, f"no usable stop string in {a!r} (not in {b!r})"
    serve_app.wait_idle()
    serve_app.pop_request_stats()
    got = sorted(client.completions.create(**kw, stop=[stop]).choices, key=lambda c: c.index)
    assert (got[0].text, got[0].finish_reason, got[0].model_extra["stop_reason"]) == (a[:a.find(stop)], "stop", stop)
    assert (got[1].text, got[1].finish_reason) == (b, "length")
    rows = serve_app.wait_idle()
    assert rows[0]["stats"]["num_pages_free"] == rows[0]["stats"]["num_pages_total"]
    assert [s.finished_reason for s in serve_app.pop_request_stats()] == ["stop"]  # the engine heard of it


@pytest.fixture(scope="module")
def two_replica_app(serve_app):
    cfg = {**serve_app.config, "api_key": None, "unified": {**serve_app.config["unified"], "replicas": 2}}
    base = serve_app.deploy_extra("two", cfg)
    serve_app.wait_healthy_at(base)
    yield base
    serve_app.delete_extra("two")


def test_router_spreads_requests_over_engine_replicas(serve_app, two_replica_app):
    """Two engine replicas behind one router: requests land on both (fewest in flight, then taking turns), and
    each replica answers exactly like the single-replica app."""
    prompts = [[30 + i, 31 + i, 32 + i] for i in range(6)]
    want = [serve_app.client().completions.create(model=serve_app.model, prompt=p, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    before = {r["replica"]: r["counters"]["started"] for r in _stats(two_replica_app)}

    async def main():
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=f"{two_replica_app}/v1", api_key="EMPTY", max_retries=0) as client:
            async def one(p):
                r = await client.completions.create(model=serve_app.model, prompt=p, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
                return r.choices[0].text
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == want
    after = {r["replica"]: r["counters"]["started"] for r in _stats(two_replica_app)}
    per_replica = {k: after[k] - before[k] for k in after}
    assert sorted(per_replica) == [0, 1] and sum(per_replica.values()) == len(prompts)
    assert min(per_replica.values()) >= 2, per_replica
    # one at a time, equal replicas take turns
    before = after
    for p in prompts[:2]:
        httpx.post(f"{two_replica_app}/v1/completions", json={"prompt": p, "max_tokens": 2}, timeout=60)
    after = {r["replica"]: r["counters"]["started"] for r in _stats(two_replica_app)}
    assert {k: after[k] - before[k] for k in after} == {0: 1, 1: 1}


def _stats(base: str) -> list[dict]:
    r = httpx.get(f"{base}/admin/stats", timeout=30)
    r.raise_for_status()
    return r.json()["engines"]


def test_finished_request_stats_reach_the_router(serve_app):
    """Each finished request's engine stats (what the metrics feed records) can be drained through the router."""
    import time

    resp = serve_app.client().completions.create(model=serve_app.model, prompt=[4, 5, 6, 7], max_tokens=5,
                                                 temperature=0, extra_body={"ignore_eos": True})
    want_id = f"{resp.id}-0"
    seen = {}
    deadline = time.monotonic() + 10
    while want_id not in seen and time.monotonic() < deadline:
        seen.update({s.request_id: s for s in serve_app.pop_request_stats()})
        time.sleep(0.2)
    stats = seen[want_id]
    assert stats.prompt_tokens == 4 and stats.generation_tokens == 5 and stats.finished_reason == "length"
    assert stats.ttft is not None and stats.e2e_latency >= stats.ttft > 0
