"""Disaggregation under faults, on the shared disaggregated Serve app (tests/deploy/pdapp.py). Faults are
keyed by request id: transfer faults on the prefill replica's channel (FaultyChannel), a pause in the router
as a request enters its decode phase, pages taken out of the decode pool. Requests go through the Router
deployment's handle with chosen ids and follow its `Redirect` to the decode replica (what the ingress does, minus
HTTP), by either path (deploy/pd.py): decode-first (the default) or first-token (here: prompt logprobs asked, so
the first token comes back through the router before the redirect). Cancelling the stream is what the ingress
does when the client disconnects. Each case ends in a clear response, and afterwards both sides hold zero pages."""
from __future__ import annotations

import random
import threading
import time

import openai
import pytest

from deploy.protocol import EngineChunk, EngineError, EngineRequest
from tests.deploy.pdapp import handle, pages_in_use, pd_app, run_direct
from workers.request import SamplingParams

PROMPT = [random.Random(5).randrange(3, 384) for _ in range(90)]


@pytest.fixture(scope="module")
def pd(serve_app):
    app = pd_app(serve_app)
    yield app
    handle("EngineServer-prefill-0").inject_transfer_faults.remote({}).result()
    handle("Router").inject_faults.remote({}, retry_prefill=False).result()


def request(rid: str, max_tokens: int = 5, first_token: bool = False) -> EngineRequest:
    """`first_token`: ask prompt logprobs, which the prefill computes, so the first token comes back through the
    router (the first-token path) instead of from the KV header on the decode replica (decode-first)."""
    return EngineRequest(request_id=rid, prompt_token_ids=PROMPT,
                         params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                               prompt_logprobs=0 if first_token else None))


def run(rid: str, max_tokens: int = 5, first_token: bool = False) -> list:
    return run_direct(handle("Router"), request(rid, max_tokens, first_token))


def tokens(events: list) -> list[int]:
    return [t for e in events if isinstance(e, EngineChunk) for s in e.samples for t in s.token_ids]


def assert_clean(pd) -> None:
    pd.wait_idle(timeout=30)
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}


@pytest.fixture(scope="module")
def healthy(pd) -> list[int]:
    """The request's greedy tokens when nothing fails."""
    events = run("healthy")
    assert isinstance(events[-1], EngineChunk) and events[-1].finished
    return tokens(events)


@pytest.mark.parametrize("first_token", [False, True], ids=["decode_first", "first_token"])
@pytest.mark.parametrize("kind, says", [
    ("corrupt_header", "header mismatch"),  # the decode side refuses the payload: the pair stays in step
    ("peer_gone", "peer_gone"),  # the prefill side cannot reach its peer: the pair is replaced
    ("drop_payload", "timeout"),  # prefill goes silent mid-transfer (a dead peer): both time out, pair replaced
])
def test_transfer_failure_is_a_503_and_frees_both_sides(pd, healthy, kind, says, first_token):
    rid = f"fault-{kind}-{first_token}"
    handle("EngineServer-prefill-0").inject_transfer_faults.remote({rid: kind}).result()
    before = handle("Router").pairs.remote().result()
    events = run(rid, first_token=first_token)
    # first-token path: the first token reached the client before the transfer failed; decode-first: no token
    # did (the decode replica had none to send); then one clear error ends the stream
    assert tokens(events) == (healthy[:1] if first_token else [])
    err = events[-1]
    assert isinstance(err, EngineError) and err.status == 503 and err.code == "kv_transfer_failed", err
    assert says in err.message
    assert_clean(pd)
    # the router replaces a broken pair when the prefill reports the failure, beside the decode side's error
    replaced = kind != "corrupt_header"
    deadline = time.monotonic() + 10
    while True:
        after = handle("Router").pairs.remote().result()
        if [after[k] - before[k] for k in before] == [int(replaced)] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [after[k] - before[k] for k in before] == [int(replaced)]
    # and the next request goes through (over the new pair where the old one broke)
    assert tokens(run(f"after-{kind}-{first_token}")) == healthy
    assert_clean(pd)


def test_retry_prefill_recovers_a_failed_transfer(pd, healthy):
    handle("Router").inject_faults.remote({}, retry_prefill=True).result()
    try:
        handle("EngineServer-prefill-0").inject_transfer_faults.remote({"retried": "corrupt_header"}).result()
        events = run("retried")
        assert not any(isinstance(e, EngineError) for e in events)
        assert tokens(events) == healthy  # the first token once, then the rest after the second prefill
    finally:
        handle("Router").inject_faults.remote({}, retry_prefill=False).result()
    assert_clean(pd)


def test_client_gone_between_prefill_and_decode(pd, healthy):
    handle("Router").inject_faults.remote({"gone": "pause_before_decode"}).result()
    stream = handle("Router").options(stream=True).generate.remote(request("gone", 400, first_token=True))
    first = next(iter(stream))
    assert isinstance(first, EngineChunk) and first.samples[0].token_ids == healthy[:1]
    # the KV lands on the decode side (prefill's pages freed) and decoding starts there, though nobody streams it
    # yet (the router waits): past 96 tokens (90 prompt + 7 decoded) it holds a 7th page
    deadline = time.monotonic() + 20
    while not (pages_in_use(pd)["prefill-0"] == 0 and pages_in_use(pd)["decode-0"] > 6):
        assert time.monotonic() < deadline, pages_in_use(pd)
        time.sleep(0.05)
    stream.cancel()  # the client leaves
    assert_clean(pd)
    handle("Router").inject_faults.remote({}).result()


def test_decode_runs_ahead_of_a_late_stream(pd, healthy):
    """The decode replica starts when the KV lands (the first token rides in its header), not when the decode
    stream is opened: a stream that comes late gets everything decoded meanwhile, in order, and nothing twice."""
    want = tokens(run("ahead-ref", max_tokens=60))
    assert len(want) == 60
    handle("Router").inject_faults.remote({"ahead-5": "delay_before_decode",
                                           "ahead-60": "delay_before_decode"}).result()
    since = time.time()
    try:
        # first-token path: the hold comes after the first token, so the KV is on its way while it lasts
        assert tokens(run("ahead-5", first_token=True)) == healthy  # finished on decode before its stream came
        assert tokens(run("ahead-60", max_tokens=60, first_token=True)) == want
    finally:
        handle("Router").inject_faults.remote({}).result()
    timeline = handle("EngineServer-decode-0").debug_timeline.remote(since).result()
    activated = {rid: t for t, kind, rid, _ in timeline["marks"] if kind == "activated"}
    opened = {rid: t for t, rid, kind, _ in timeline["serve_marks"] if kind == "decode"}
    for rid in ("ahead-5", "ahead-60"):
        assert activated[rid] < opened[rid], (rid, activated.get(rid), opened.get(rid))
    assert_clean(pd)


def test_decode_replica_without_free_pages(pd, healthy):
    decode = handle("EngineServer-decode-0")
    free = pd.engine_stats()
    free = next(r["stats"]["num_pages_free"] for r in free if r["role"] == "decode")
    decode.hold_pages.remote(free - 2).result()  # the 90-token prompt needs 6
    try:
        events = run("full")
        assert len(events) == 1 and isinstance(events[0], EngineError), events
        assert events[0].status == 503 and events[0].code == "kv_capacity"
        # the same through HTTP: a 503 with the reason and a Retry-After
        with pytest.raises(openai.APIStatusError) as exc:
            pd.client().completions.create(model=pd.model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert exc.value.status_code == 503 and exc.value.response.headers.get("retry-after")
        assert "KV pages" in exc.value.message
    finally:
        decode.hold_pages.remote(0).result()
    assert_clean(pd)
    assert tokens(run("room-again")) == healthy


def test_a_full_decode_replica_admits_once_room_frees_within_the_wait(pd, healthy):
    """With `transfer.admit_wait_s` the router retries a request that finds no decode replica with room: one
    that stays without room past the wait gets the 503 `kv_capacity` after waiting; one whose room frees up
    meanwhile runs to the end with the healthy tokens. Nothing is held on either side afterwards."""
    decode, router = handle("EngineServer-decode-0"), handle("Router")
    free = next(r["stats"]["num_pages_free"] for r in pd.engine_stats() if r["role"] == "decode")
    decode.hold_pages.remote(free - 2).result()  # the 90-token prompt needs 6
    try:
        router.inject_faults.remote({}, admit_wait_s=0.4).result()
        t0 = time.monotonic()
        events = run("stays-full")
        assert len(events) == 1 and isinstance(events[0], EngineError) and events[0].code == "kv_capacity"
        assert time.monotonic() - t0 >= 0.3  # it tried again before answering
        router.inject_faults.remote({}, admit_wait_s=60.0).result()
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(events=run("waits-for-room")))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # still waiting for room
        decode.hold_pages.remote(0).result()
        waiter.join(60)
        assert not waiter.is_alive() and tokens(got["events"]) == healthy
    finally:
        decode.hold_pages.remote(0).result()
        router.inject_faults.remote({}, admit_wait_s=0.0).result()
    assert_clean(pd)
