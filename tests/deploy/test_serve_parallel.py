"""A Serve app whose unified engine is a tp=2 worker group (two ShardWorker actors, gloo) answers exactly like
the session's single-shard app, and its group's pages are all free afterwards."""
from __future__ import annotations

import pytest


def _live_groups() -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values()
            if pg["state"] == "CREATED" and len(pg["bundles"]) == 2]


@pytest.fixture(scope="module")
def tp2_app(serve_app):
    cfg = {**serve_app.config, "api_key": None,
           "unified": {**serve_app.config["unified"], "tp": 2, "num_cpus_per_shard": 0.1}}
    before = len(_live_groups())
    base = serve_app.deploy_extra("tp2", cfg)
    serve_app.wait_healthy_at(base)
    yield base, before
    serve_app.delete_extra("tp2")


def test_tp2_serve_app_matches_single_shard(serve_app, tp2_app):
    from openai import OpenAI

    tp2_app, groups_before = tp2_app
    assert len(_live_groups()) == groups_before + 1  # the tp2 engine's placement: two shard bundles

    tp2 = OpenAI(base_url=f"{tp2_app}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [[30, 31, 32], list(range(40, 100)), [7] * 17]
    for p in prompts:
        kw = dict(model=serve_app.model, prompt=p, max_tokens=6, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})
        want = serve_app.client().completions.create(**kw).choices[0]
        got = tp2.completions.create(**kw).choices[0]
        assert got.text == want.text
        for a, b in zip(want.logprobs.top_logprobs, got.logprobs.top_logprobs, strict=True):
            assert set(a) == set(b) and max(abs(a[k] - b[k]) for k in a) <= 1e-4
    import httpx

    rows = httpx.get(f"{tp2_app}/admin/stats", timeout=30).json()["engines"]
    assert len(rows) == 1
    s = rows[0]["stats"]
    assert s["num_pages_free"] == s["num_pages_total"] and s["num_running"] == 0
