"""Disaggregated serving across parallel layouts, through the router, next to the session's unified app:
- a prefill replica whose engine is a tp=2 worker group (two ShardWorker actors, each sending its own KV heads
  from its own process) and a tp=1 decode replica: concurrent greedy completions equal the unified app; a
  refused transfer from both prefill shards is a clean 503;
- a prefill replica with attention DP (dp=2: one sending shard per dp rank) and a decode replica with attention
  DP (dp=2, ep=2: one receiving shard per dp rank, the experts split over both): the prefill replica places
  each request on its least loaded dp rank, the decode replica admits it on a dp rank of its own and expects
  the KV from the placed prefill rank's shard, and the router has that shard send it to the admitting rank's
  sub-group; concurrent greedy completions equal the unified app.
Both sides hold zero pages afterwards. (The tp=1 prefill -> dp2 decode and dp2 ep2 prefill layouts are covered
engine to engine in tests/workers/test_disagg_parallel.py; one app here covers both sides' dp through the
router, since every extra app costs ~15-20 s of start on the 2-core box.)"""
from __future__ import annotations

import asyncio
import random

import pytest

from deploy.protocol import EngineError, EngineRequest
from tests.deploy.pdapp import PD_CONFIG, greedy_completions, run_direct
from workers.request import SamplingParams

NAME = "pdtp2"
DP_NAME = "pddp2"
LENGTHS = [6, 40, 70, 97, 133, 190]  # four past the 64 tokens where sparse selection starts
MAX_TOKENS = [5, 3, 6, 4, 5, 3]
# tiny model, per page: 16 tokens x 4 B x (4 layers x K+V x 2 KV heads x 32 dims + index-K of 3 sparse layers x 32)
PER_PAGE = 16 * 4 * (4 * 2 * 2 * 32 + 3 * 32)


def handle(deployment: str, app_name: str = NAME):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app_name)


@pytest.fixture(scope="module")
def app(serve_app):
    import dataclasses

    config = {**PD_CONFIG, "api_key": serve_app.api_key,
              "prefill": {"tp": 2, "num_cpus_per_shard": 0.1}, "decode": {"num_cpus_per_shard": 0.1}}
    base = serve_app.deploy_extra(NAME, config)
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, config=config, extra_apps=[])
    serve_app.delete_extra(NAME)


@pytest.fixture(scope="module")
def dp_app(serve_app):
    import dataclasses

    config = {**PD_CONFIG, "api_key": serve_app.api_key, "prefill": {"dp": 2, "num_cpus_per_shard": 0.1},
              "decode": {"dp": 2, "ep": 2, "num_cpus_per_shard": 0.1}}
    base = serve_app.deploy_extra(DP_NAME, config)
    serve_app.wait_healthy_at(base)
    yield dataclasses.replace(serve_app, base_url=base, config=config, extra_apps=[])
    serve_app.delete_extra(DP_NAME)


def pages_in_use(app) -> dict[str, int]:
    return {f"{r['role']}-{r['replica']}": r["stats"]["num_pages_total"] - r["stats"]["num_pages_free"]
            for r in app.engine_stats()}


def completions(app, prompts):
    return greedy_completions(app, prompts, MAX_TOKENS)


def assert_equal_to_unified(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        c, u = g.choices[0], w.choices[0]
        where = f"prompt {i} ({LENGTHS[i]} tokens)"
        assert c.model_extra["token_ids"] == u.model_extra["token_ids"] and len(c.model_extra["token_ids"]) == \
            MAX_TOKENS[i], where
        assert c.text == u.text and c.finish_reason == u.finish_reason == "length", where
        for a, b in zip(c.logprobs.token_logprobs, u.logprobs.token_logprobs, strict=True):
            assert abs(a - b) <= 1e-4, where
        for a, b in zip(c.logprobs.top_logprobs, u.logprobs.top_logprobs, strict=True):
            assert sorted(a.values()) == pytest.approx(sorted(b.values()), abs=1e-4), where


def test_tp2_prefill_to_tp1_decode_equals_unified(app, serve_app):
    rng = random.Random(23)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]
    got = asyncio.run(completions(app, prompts))
    want = asyncio.run(completions(serve_app, prompts))
    assert_equal_to_unified(got, want)
    rows = app.wait_idle()
    assert {r["role"] for r in rows} == {"prefill", "decode"}
    assert pages_in_use(app) == {"prefill-0": 0, "decode-0": 0}
    # the prefill replica reports one transfer per handed-off request (both shards' bytes together)
    totals = handle("EngineServer-prefill-0").transfer_totals.remote().result()
    assert totals["transfers"] == len(LENGTHS) and totals["failed"] == 0
    assert totals["bytes"] == sum(-(-n // 16) for n in LENGTHS) * PER_PAGE


def refused_is_a_503(app, app_name: str) -> None:
    """A transfer whose header every prefill shard corrupts: the decode replica's stream (decode-first: it would
    have carried the first token too) is one 503 naming the refusal; the pairs are in step still (not replaced),
    and no page is held."""
    rid = f"{app_name}-bad"
    prompt = [random.Random(2).randrange(3, 384) for _ in range(80)]
    req = EngineRequest(request_id=rid, prompt_token_ids=prompt,
                        params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    prefill = handle("EngineServer-prefill-0", app_name)
    prefill.inject_transfer_faults.remote({rid: "corrupt_header"}).result()
    try:
        events = run_direct(handle("Router", app_name), req)
    finally:
        prefill.inject_transfer_faults.remote({}).result()
    assert len(events) == 1, events  # no token reached the client: it may retry
    err = events[-1]
    assert isinstance(err, EngineError) and err.status == 503 and err.code == "kv_transfer_failed", err
    assert "header mismatch" in err.message
    app.wait_idle()
    assert pages_in_use(app) == {"prefill-0": 0, "decode-0": 0}
    assert handle("Router", app_name).pairs.remote().result() == {"prefill-0->decode-0": 0}


def test_refused_transfer_from_both_shards_is_a_503(app):
    refused_is_a_503(app, NAME)


def test_dp2_prefill_to_dp2_decode_equals_unified(dp_app, serve_app):
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]
    got = asyncio.run(completions(dp_app, prompts))
    want = asyncio.run(completions(serve_app, prompts))
    assert_equal_to_unified(got, want)
    dp_app.wait_idle()
    assert pages_in_use(dp_app) == {"prefill-0": 0, "decode-0": 0}  # the decode row sums both dp ranks
    pairs = handle("Router", DP_NAME).pairs.remote().result()
    assert pairs == {"prefill-0->decode-0": 0}, pairs  # opened once, never broken
    # the requests were spread over both dp ranks on each side (each prefilled on the rank it was placed on,
    # landed in the pages of the decode rank that admitted it)
    for role in ("prefill", "decode"):
        taken = handle(f"EngineServer-{role}-0", DP_NAME).dp_admissions.remote().result()
        assert set(taken) == {0, 1} and min(taken.values()) >= 2 and sum(taken.values()) == len(LENGTHS), \
            (role, taken)
    totals = handle("EngineServer-prefill-0", DP_NAME).transfer_totals.remote().result()
    assert totals["transfers"] == len(LENGTHS) and totals["failed"] == 0
    assert totals["bytes"] == sum(-(-n // 16) for n in LENGTHS) * PER_PAGE


def test_refused_transfer_from_a_prefill_dp_rank_is_a_503(dp_app):
    """The same from the dp2 prefill replica's shard that ran it: the router checks both ends of the pair (the
    decode side's per-prefill-dp-rank pairs, the prefill side's per-decode-dp-rank ones), finds none broken."""
    refused_is_a_503(dp_app, DP_NAME)
