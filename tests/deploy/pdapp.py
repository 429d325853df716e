"""The disaggregated test app (1 prefill + 1 decode replica of the built-in tiny model, gloo on loopback),
deployed once per session next to the shared unified app (`serve_app`, tests/deploy/conftest.py) under route
prefix /pd; test_disagg.py and test_disagg_faults.py share it through `pd_app(serve_app)`."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any


PD_NAME = "pd"
PD_CONFIG: dict[str, Any] = {
    "model": None,
    "disaggregate": True,
    "engine": {"max_model_len": 512, "max_num_seqs": 16, "max_waiting": 32, "max_num_batched_tokens": 512,
               "num_pages": 256},
    "prefill": {"num_cpus_per_shard": 0.5},
    "decode": {"num_cpus_per_shard": 0.5},
    # short: the dead-peer case waits for this timeout
    "transfer": {"timeout_s": 3.0, "lease_s": 30.0},
}

_app = None  # tests/deploy/conftest.py's ServeApp, pointed at /pd


def pd_app(serve_app):
    """The running disaggregated app (deployed on first use, then shared; Serve goes down with serve_app)."""
    global _app
    if _app is None:
        config = {**PD_CONFIG, "api_key": serve_app.api_key}
        base = serve_app.deploy_extra(PD_NAME, config)
        serve_app.wait_healthy_at(base)
        _app = dataclasses.replace(serve_app, base_url=base, config=config, extra_apps=[])
    return _app


def handle(name: str):
    """A deployment of the pd app ("Router", "EngineServer-prefill-0", "EngineServer-decode-0")."""
    from ray import serve

    return serve.get_deployment_handle(name, app_name=PD_NAME)


def pages_in_use(app) -> dict[str, int]:
    return {f"{r['role']}-{r['replica']}": r["stats"]["num_pages_total"] - r["stats"]["num_pages_free"]
            for r in app.engine_stats()}


async def greedy_completions(app, prompts: list[list[int]], max_tokens: list[int]) -> list:
    """The prompts at once through `app`'s OpenAI endpoint: greedy, top-5 logprobs, token ids, no EOS stop."""
    client = app.async_client()
    try:
        return await asyncio.gather(*(
            client.completions.create(model=app.model, prompt=p, max_tokens=k, temperature=0, logprobs=5,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
            for p, k in zip(prompts, max_tokens)))
    finally:
        await client.close()


def follow(redirect) -> list:
    """The events of the engine replica stream a `Redirect` names, read as the ingress reads it."""
    from ray import serve

    engine = serve.get_deployment_handle(redirect.deployment, app_name=redirect.app_name)
    return list(getattr(engine.options(stream=True), redirect.method).remote(*redirect.args))


def run_direct(router, req) -> list:
    """What the ingress does with a request (minus HTTP): the router's events up to its `Redirect`, then the
    stream on the engine replica it names, then `release` at the router."""
    from deploy.protocol import Redirect

    events: list = []
    for event in router.options(stream=True).generate.remote(req):
        if not isinstance(event, Redirect):
            events.append(event)
            continue
        try:
            events += follow(event)
        finally:
            router.release.remote(event.release_id).result()
    return events
