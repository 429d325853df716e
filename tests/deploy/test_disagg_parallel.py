"""Disaggregated serving across parallel layouts, through the router: a prefill replica whose engine is a tp=2
worker group (two ShardWorker actors, each sending its own KV heads from its own process) and a tp=1 decode
replica, deployed next to the session's unified app. Concurrent greedy completions equal the unified app; a
refused transfer from both prefill shards is a clean 503; both sides hold zero pages afterwards.

(Decode with attention DP needs the router to send each request to its admitting dp rank's sub-group: see
docs/disaggregation.md; the engine-level tests in tests/workers/test_disagg_parallel.py cover it.)"""
from __future__ import annotations

import asyncio
import random

import pytest

from deploy.protocol import EngineChunk, EngineError, EngineRequest
from tests.deploy.pdapp import PD_CONFIG
from workers.request import SamplingParams

NAME = "pdtp2"
LENGTHS = [6, 40, 70, 97, 133, 190]  # four past the 64 tokens where sparse selection starts
MAX_TOKENS = [5, 3, 6, 4, 5, 3]


def handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=NAME)


@pytest.fixture(scope="module")
def app(serve_app):
    import dataclasses

    config = {**PD_CONFIG, "api_key": serve_app.api_key,
              "prefill": {"tp": 2, "num_cpus_per_shard": 0.1}, "decode": {"num_cpus_per_shard": 0.1}}
    base = serve_app.deploy_extra(NAME, config)
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, config=config, extra_apps=[])
    serve_app.delete_extra(NAME)


def pages_in_use(app) -> dict[str, int]:
    return {f"{r['role']}-{r['replica']}": r["stats"]["num_pages_total"] - r["stats"]["num_pages_free"]
            for r in app.engine_stats()}


async def completions(app, prompts):
    client = app.async_client()
    try:
        return await asyncio.gather(*(
            client.completions.create(model=app.model, prompt=p, max_tokens=k, temperature=0, logprobs=5,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
            for p, k in zip(prompts, MAX_TOKENS)))
    finally:
        await client.close()


def test_tp2_prefill_to_tp1_decode_equals_unified(app, serve_app):
    rng = random.Random(23)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]
    got = asyncio.run(completions(app, prompts))
    want = asyncio.run(completions(serve_app, prompts))
    for i, (g, w) in enumerate(zip(got, want)):
        c, u = g.choices[0], w.choices[0]
        where = f"prompt {i} ({LENGTHS[i]} tokens)"
        assert c.model_extra["token_ids"] == u.model_extra["token_ids"] and len(c.model_extra["token_ids"]) == \
            MAX_TOKENS[i], where
        assert c.text == u.text and c.finish_reason == u.finish_reason == "length", where
        for a, b in zip(c.logprobs.token_logprobs, u.logprobs.token_logprobs, strict=True):
            assert abs(a - b) <= 1e-4, where
        for a, b in zip(c.logprobs.top_logprobs, u.logprobs.top_logprobs, strict=True):
            assert sorted(a.values()) == pytest.approx(sorted(b.values()), abs=1e-4), where
    rows = app.wait_idle()
    assert {r["role"] for r in rows} == {"prefill", "decode"}
    assert pages_in_use(app) == {"prefill-0": 0, "decode-0": 0}
    # the prefill replica reports one transfer per handed-off request (both shards' bytes together)
    totals = handle("EngineServer-prefill-0").transfer_totals.remote().result()
    per_page = 16 * 4 * (4 * 2 * 2 * 32 + 3 * 32)
    assert totals["transfers"] == len(LENGTHS) and totals["failed"] == 0
    assert totals["bytes"] == sum(-(-n // 16) for n in LENGTHS) * per_page


def test_refused_transfer_from_both_shards_is_a_503(app):
    prompt = [random.Random(2).randrange(3, 384) for _ in range(80)]
    req = EngineRequest(request_id="pdtp2-bad", prompt_token_ids=prompt,
                        params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    handle("EngineServer-prefill-0").inject_transfer_faults.remote({"pdtp2-bad": "corrupt_header"}).result()
    try:
        events = list(handle("Router").options(stream=True).generate.remote(req))
    finally:
        handle("EngineServer-prefill-0").inject_transfer_faults.remote({}).result()
    assert isinstance(events[0], EngineChunk) and len(events[0].samples[0].token_ids) == 1  # the first token
    err = events[-1]
    assert isinstance(err, EngineError) and err.status == 503 and err.code == "kv_transfer_failed", err
    assert "header mismatch" in err.message
    app.wait_idle()
    assert pages_in_use(app) == {"prefill-0": 0, "decode-0": 0}
