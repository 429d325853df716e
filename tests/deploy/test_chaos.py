"""A short chaos run (issue 22), opt-in: `pytest -m chaos tests/deploy/test_chaos.py -s` (docs/operations.md).

A disaggregated app (1 prefill + 1 decode engine replica, one router) with two ingress replicas, on an app of its
own beside the shared one, under a bounded mixed load (tests/deploy/chaos.py: chat and completions, streaming and
not, short and long, a fifth of the clients hanging up early) for `M3SERVE_CHAOS_SECONDS` (default 90 s), while a
seeded schedule `kill -9`s a replica of a random role (prefill, decode, router or ingress; every role once before
any twice) `M3SERVE_CHAOS_KILLS` times (default 4), each at a random moment 3-15 s after the app recovered from the
previous kill (every role replaced, `/health` 200), or with `M3SERVE_CHAOS_OVERLAP=1` 1-8 s after it, recovered or
not. Seed: `M3SERVE_CHAOS_SEED` (default 1); the schedule, every kill
and the summary are printed.

Why this layout: disaggregation has the most that can go wrong on a death (KV pairs to re-open, prefills in the
router's hands, streams redirected to a decode replica), and a second ingress replica keeps the service up while
one ingress is killed, so its clients see the cut and the others do not; a unified app on top would double the
engine processes on a 2-core box and add no failure path test_replica_death.py does not already take.

Then, nothing lost: every request ended within `HANG_BOUND_S` as `ok`, `retryable`, `hung_up` or (only while an
ingress died) `cut`; never a 500 of ours, a 4xx, a stream without `[DONE]`, a wrong token count; afterwards the
engines run and hold nothing (no running or waiting request, every page free), the router counts nothing in
flight, and new requests succeed with the greedy tokens from before the chaos.

Findings (2-core box, seeds 1-5, one with overlapping kills; each run 450-700 requests, 3-6 kills, 0 bad):
- seed 1: a non-streamed request whose decode replica was killed got 503 `engine_unavailable` without
  `Retry-After` (every other 503 has one). Fixed in deploy/ingress.py; this run caught it (the `retryable`
  verdict wants the header).
- An ingress death: Ray Serve's proxy cuts the streams that replica held and answers its non-streamed requests with
  a bare `500 Internal Server Error` (ray/serve/_private/http_util.py gives a body only to 408/429/503). Ray's, not
  the app's: counted `cut`, allowed only while an ingress died, documented in docs/operations.md.
- A prefill death: until its replacement is up (5-18 s here) requests fail fast with 503 `kv_transfer_failed`
  (`pair_broken: peer_gone`), 35-63 of them per kill as the clients retry: retryable and honest, but the router
  admits each on the decode replica and starts a transfer to a dead peer rather than answering `not_ready` at once
  (deploy/router.py; not changed here).
- No retryable error started after `/health` said 200 again (the `after` column of the summary): readiness does not
  lie about a restarted replica.
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import httpx
import pytest

from tests.deploy.chaos import HANG_BOUND_S, Load, summary
from tests.deploy.pdapp import PD_CONFIG

pytestmark = pytest.mark.chaos

APP = "chaos"
ROLES = {"prefill": "EngineServer-prefill-0", "decode": "EngineServer-decode-0", "router": "Router",
         "ingress": "Ingress"}
SEED = int(os.environ.get("M3SERVE_CHAOS_SEED", "1"))
SECONDS = float(os.environ.get("M3SERVE_CHAOS_SECONDS", "90"))
KILLS = int(os.environ.get("M3SERVE_CHAOS_KILLS", "4"))
OVERLAP = os.environ.get("M3SERVE_CHAOS_OVERLAP", "0") == "1"  # kill again before the app recovered
CLIENTS = 6
RECOVER_BOUND_S = 240.0  # a killed replica is replaced and its engine loaded again (2 shared cores)
PROMPT = [random.Random(22).randrange(3, 384) for _ in range(24)]


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name=APP)


def _pids(role: str) -> set[int]:
    """The live replicas' pids of a role (several calls at once, each held a moment, so Serve spreads them)."""
    if role == "ingress":
        calls = [_handle("Ingress").pid.remote(0.3) for _ in range(6)]
        return {c.result(timeout_s=60)["pid"] for c in calls}
    return {_handle(ROLES[role]).pid.remote().result(timeout_s=60)}


def _recovered(base: str, role: str, victim: int, replicas: int) -> bool:
    try:
        pids = _pids(role)
    except Exception:  # the replica is being replaced: the call failed or timed out
        return False
    if victim in pids or len(pids) < replicas:
        return False
    try:
        return httpx.get(f"{base}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _await_recovery(base: str, kill: dict) -> None:
    """Until the killed replica is replaced and the app healthy (records how long that took), or the bound."""
    replicas = 2 if kill["role"] == "ingress" else 1
    while time.monotonic() - kill["t"] < RECOVER_BOUND_S:
        if _recovered(base, kill["role"], kill["pid"], replicas):
            kill["t_back"] = time.monotonic()
            kill["recovered_s"] = kill["t_back"] - kill["t"]
            print(f"chaos: {kill['role']} back after {kill['recovered_s']:.1f} s", flush=True)
            return
        time.sleep(0.5)
    kill["note"] = f"not back within {RECOVER_BOUND_S} s"


def _chaos(base: str, rng: random.Random, deadline: float, t0: float, kills: list[dict]) -> None:
    """The kill schedule: `KILLS` times, wait a random 3-15 s, kill a random role's replica, and (unless
    `OVERLAP`) wait until it is replaced and the app is healthy before the next; with `OVERLAP`, the next kill may
    come while replicas are still restarting (each recovery is watched in a thread of its own)."""
    order: list[str] = []
    watchers: list[threading.Thread] = []
    for _ in range(KILLS):
        if not order:  # every role once, in a random order, before any twice
            order = rng.sample(sorted(ROLES), len(ROLES))
        role = order.pop()
        time.sleep(rng.uniform(3.0, 15.0) if not OVERLAP else rng.uniform(1.0, 8.0))
        if time.monotonic() > deadline - 5:
            break
        kill: dict = {"role": role, "at_s": time.monotonic() - t0}
        kills.append(kill)
        try:
            victim = rng.choice(sorted(_pids(role)))
            os.kill(victim, signal.SIGKILL)  # the replica's own process, as `kill -9` would
        except Exception as e:  # noqa: BLE001 - logged; the run goes on
            kill["note"] = f"no kill: {type(e).__name__}: {e}"
            continue
        kill.update(pid=victim, at_s=time.monotonic() - t0, t=time.monotonic())
        print(f"chaos: {kill['at_s']:6.1f} s kill -9 {role} pid {victim}", flush=True)
        if OVERLAP:
            watchers.append(threading.Thread(target=_await_recovery, args=(base, kill), daemon=True))
            watchers[-1].start()
        else:
            _await_recovery(base, kill)
            if kill.get("recovered_s") is None:
                return
    for w in watchers:
        w.join(RECOVER_BOUND_S + 30)


def _greedy(base: str, headers: dict, model: str) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _ingress_died_during(res, kills: list[dict]) -> bool:
    return any(k["role"] == "ingress" and k.get("t") is not None and res.start - 1 <= k["t"] <= res.end + 1
               for k in kills)


def test_chaos_run_loses_nothing(serve_app):
    base = serve_app.deploy_extra(APP, {**PD_CONFIG, "api_key": serve_app.api_key, "ingress_replicas": 2})
    h, model = serve_app.headers, serve_app.model
    app = dataclasses.replace(serve_app, base_url=base, extra_apps=[])
    try:
        serve_app.wait_healthy_at(base)
        want = _greedy(base, h, model)
        rng = random.Random(SEED)
        t0 = time.monotonic()
        deadline = t0 + SECONDS
        print(f"\nchaos: seed {SEED}, {SECONDS:g} s, {CLIENTS} clients, up to {KILLS} kills", flush=True)
        load = Load(base=base, headers=h, model=model, seed=SEED, clients=CLIENTS, deadline=deadline)
        clients = load.start()
        kills: list[dict] = []
        killer = threading.Thread(target=_chaos, args=(base, rng, deadline, t0, kills), daemon=True)
        killer.start()
        for t in clients:
            t.join(timeout=max(1.0, deadline - time.monotonic()) + HANG_BOUND_S + 30)
        killer.join(timeout=2 * RECOVER_BOUND_S + 60)
        results = list(load.results)
        print(summary(results, kills), flush=True)

        failures: list[str] = []
        if any(t.is_alive() for t in clients):
            failures.append("a client is still waiting past the hang bound")
        if killer.is_alive() or any(k.get("recovered_s") is None for k in kills if k.get("pid")):
            failures.append(f"a killed replica did not come back: {kills}")
        if not any(k.get("pid") for k in kills):
            failures.append(f"nothing was killed: {kills}")
        bad = [r for r in results if r.outcome == "bad" or r.end - r.start > HANG_BOUND_S + 5
               or (r.outcome == "cut" and not _ingress_died_during(r, kills))]
        failures += [f"{r.spec.kind} {r.outcome} {r.status} {r.detail} ({r.start - t0:.1f}-{r.end - t0:.1f} s)"
                     for r in bad[:20]]
        if sum(r.outcome == "ok" for r in results) < 10:
            failures.append("the load barely ran")

        # nothing left behind: healthy, no request running or waiting, every page free, router in-flight 0
        serve_app.wait_healthy_at(base, timeout=RECOVER_BOUND_S)
        try:
            rows = app.wait_idle(timeout=60)
            assert all(r["inflight"] == 0 for r in rows), rows
        except AssertionError as e:
            failures.append(f"left behind: {e}")
        assert not failures, "\n".join(failures)
        # and new requests succeed, through the official client too, with the greedy tokens from before
        assert [_greedy(base, h, model) for _ in range(3)] == [want] * 3
        client = app.client()
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 4
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        app.wait_idle(timeout=30)
    finally:
        serve_app.delete_extra(APP)
