"""Direct streams (what the ingress does): `Router.generate(req)` decides and orchestrates, then hands
the token stream over with a `Redirect` to the engine replica that produces it; the router counts the request on
that replica until `release`. Unified: the redirect comes at once; disaggregated: at once too, to the decode
replica (which streams the first token as well, from the KV header). The router relays no token stream. The
tokens read from the named replica equal the unified app's (reached through `route`)."""
from __future__ import annotations

import random
import time

from deploy.protocol import EngineChunk, EngineRequest, Redirect
from tests.deploy.pdapp import follow, handle as pd_handle, pages_in_use, pd_app
from workers.request import SamplingParams

PROMPT = [random.Random(8).randrange(3, 384) for _ in range(40)]


def request(rid: str, max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=PROMPT,
                         params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def tokens(events: list) -> list[int]:
    return [t for e in events if isinstance(e, EngineChunk) for s in e.samples for t in s.token_ids]


def inflight(app) -> dict[str, int]:
    return {f"{r['role']}-{r['replica']}": r["inflight"] for r in app.engine_stats()}


def unified(serve_app, req: EngineRequest) -> list[int]:
    """`req`'s tokens from the unified app, through `route` (the reference the other paths must equal)."""
    router = serve_app.router()
    redirect = router.route.remote(req).result()
    try:
        return tokens(follow(redirect))
    finally:
        router.release.remote(redirect.release_id).result()


def test_unified_redirects_at_once_and_counts_until_released(serve_app):
    serve_app.wait_idle()
    router = serve_app.router()
    want = unified(serve_app, request("routed-ref"))
    events = list(router.options(stream=True).generate.remote(request("direct")))
    assert len(events) == 1 and isinstance(events[0], Redirect)
    r = events[0]
    assert (r.deployment, r.method, r.request_id, r.release_id) == ("EngineServer-unified-0", "generate", "direct",
                                                                    "direct")
    assert inflight(serve_app) == {"unified-0": 1}  # counted on its replica while the ingress streams it
    got = follow(r)
    assert tokens(got) == want and got[-1].finished
    router.release.remote("direct").result()
    router.release.remote("direct").result()  # a second release (a cancel racing the end) changes nothing
    assert inflight(serve_app) == {"unified-0": 0}
    serve_app.wait_idle()


def test_disaggregated_redirects_to_decode_before_the_prefill_runs(serve_app):
    """The ingress's stream opens on the decode replica at once and carries the whole answer, the first token
    (from the KV header) and the prompt ids included; the prefill's stream is the router's alone."""
    pd = pd_app(serve_app)
    pd.wait_idle()
    router = pd_handle("Router")
    want = unified(serve_app, request("pd-ref"))
    events = list(router.options(stream=True).generate.remote(request("pd-direct")))
    assert [type(e) for e in events] == [Redirect]
    r = events[0]
    assert (r.deployment, r.method, r.request_id) == ("EngineServer-decode-0", "decode", "pd-direct")
    got = follow(r)
    assert tokens(got) == want and got[-1].finished and got[0].prompt_token_ids == PROMPT
    router.release.remote("pd-direct").result()
    pd.wait_idle()
    assert inflight(pd) == {"prefill-0": 0, "decode-0": 0}
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}


def test_decode_first_streams_end_with_what_the_prefill_answered(serve_app):
    """A stream opened on the decode replica before the prefill ran: if the first token ends the request, that
    chunk is the stream; if the KV never comes, the stream's one event is a 503 `kv_transfer_failed` naming why
    (no token reached the client: it may retry); both sides end with no page held."""
    pd = pd_app(serve_app)
    pd.wait_idle()
    router = pd_handle("Router")
    want = unified(serve_app, request("pd-one-ref", 1))
    (r,) = list(router.options(stream=True).generate.remote(request("pd-one", 1)))
    got = follow(r)
    assert len(got) == 1 and got[0].finished and tokens(got) == want and got[0].prompt_token_ids == PROMPT
    prefill = pd_handle("EngineServer-prefill-0")
    pairs = router.pairs.remote().result()
    prefill.inject_transfer_faults.remote({"pd-gone": "peer_gone"}).result()
    try:
        (r,) = list(router.options(stream=True).generate.remote(request("pd-gone")))
        got = follow(r)
    finally:
        prefill.inject_transfer_faults.remote({}).result()
    assert len(got) == 1 and got[0].status == 503 and got[0].code == "kv_transfer_failed", got
    assert "peer_gone" in got[0].message
    deadline = time.monotonic() + 10
    while router.pairs.remote().result() == pairs:  # the broken pair is replaced beside the error
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for rid in ("pd-one", "pd-gone"):
        router.release.remote(rid).result()
    pd.wait_idle()
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}
    assert tokens(follow(list(router.options(stream=True).generate.remote(request("pd-after")))[0])) == \
        unified(serve_app, request("pd-after-ref"))
    router.release.remote("pd-after").result()


def test_decode_first_release_before_the_first_token_cancels_the_prefill(serve_app):
    """The client leaves while its prefill has not started (held, as behind long prompts): the ingress aborts the
    decode side and releases the request at the router, which cancels the prefill too, so it never runs."""
    pd = pd_app(serve_app)
    pd.wait_idle()
    router, prefill = pd_handle("Router"), pd_handle("EngineServer-prefill-0")

    def started() -> int:
        return next(r["counters"]["started"] for r in pd.engine_stats() if r["role"] == "prefill")

    before = started()
    prefill.hold_prefills.remote({"pd-left": "hold"}).result()
    try:
        (r,) = list(router.options(stream=True).generate.remote(request("pd-left")))
        time.sleep(0.5)  # the router's watcher waits on the held prefill stream
        pd_handle("EngineServer-decode-0").abort.remote("pd-left").result()  # what the ingress does on close
        router.release.remote("pd-left").result()
        time.sleep(6)  # longer than the hold: a prefill not cancelled would have started by now
    finally:
        prefill.hold_prefills.remote({}).result()
    assert started() == before
    assert inflight(pd) == {"prefill-0": 0, "decode-0": 0}
    pd.wait_idle()
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}


def engine(serve_app):
    from ray import serve

    return serve.get_deployment_handle("EngineServer-unified-0", app_name="m3")


def counters(serve_app) -> dict:
    return serve_app.engine_stats()[0]["counters"]


def test_a_subscription_carries_every_request_started_on_it(serve_app):
    """Two requests started for one subscriber: `start` answers None (started), and all of both comes through
    the one subscription stream, first tokens included, equal to their routed streams."""
    serve_app.wait_idle()
    reqs = [request("sub-a", 12), EngineRequest(request_id="sub-b", prompt_token_ids=PROMPT[:17],
                                                params=SamplingParams(temperature=0.0, max_tokens=9,
                                                                      ignore_eos=True))]
    want = {r.request_id: unified(serve_app, EngineRequest(request_id=r.request_id + "-ref",
                                                           prompt_token_ids=r.prompt_token_ids, params=r.params))
            for r in reqs}
    server = engine(serve_app)
    sub = server.options(stream=True).subscribe.remote("test-subscriber")
    assert next(sub) == []  # subscribed
    assert [server.start.remote("test-subscriber", "generate", (r,)).result() for r in reqs] == [None, None]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: set[str] = set()
    while done != set(got):
        for rid, event in next(sub):
            got[rid] += tokens([event])
            if event.finished:
                done.add(rid)
    assert got == want
    sub.cancel()
    serve_app.wait_idle()


def test_leaving_a_subscription_aborts_its_requests_and_frees_pages(serve_app):
    serve_app.wait_idle()
    before = counters(serve_app)
    server = engine(serve_app)
    sub = server.options(stream=True).subscribe.remote("leaving")
    assert next(sub) == []
    assert server.start.remote("leaving", "generate", (request("long", 400),)).result() is None
    while not any(isinstance(e, EngineChunk) and e.samples for _rid, e in next(sub)):
        pass  # it is streaming
    sub.cancel()
    serve_app.wait_idle(timeout=30)  # aborted, pages free
    assert counters(serve_app)["aborted"] == before["aborted"] + 1


def test_abort_stops_a_subscribed_request_and_start_needs_a_subscription(serve_app):
    serve_app.wait_idle()
    server = engine(serve_app)
    refused = server.start.remote("nobody", "generate", (request("orphan"),)).result()
    assert refused.status == 503 and refused.code == "engine_unavailable"
    sub = server.options(stream=True).subscribe.remote("aborting")
    assert next(sub) == []
    server.start.remote("aborting", "generate", (request("stopped", 400),)).result()
    server.abort.remote("stopped").result()
    serve_app.wait_idle(timeout=30)
    sub.cancel()


def test_route_redirects_unified_requests_in_one_call_and_takes_releases_along(serve_app):
    serve_app.wait_idle()
    router = serve_app.router()
    r = router.route.remote(request("routed")).result()
    assert isinstance(r, Redirect) and (r.method, r.release_id) == ("generate", "routed")
    assert inflight(serve_app) == {"unified-0": 1}
    r2 = router.route.remote(request("routed-2")).result()
    assert inflight(serve_app) == {"unified-0": 2}
    # ended streams ride on the next call: here a third request's route releases both
    router.route.remote(request("routed-3"), ["routed", "routed-2"]).result()
    assert inflight(serve_app) == {"unified-0": 1}
    router.release.remote(["routed-3", r2.release_id]).result()  # a list; an id no longer held changes nothing
    assert inflight(serve_app) == {"unified-0": 0}


def test_one_unified_replica_is_a_direct_target_placed_and_released_in_one_call(serve_app):
    """With one unified replica the ingress starts requests there itself (`direct_target`) and names them in its
    next `release` call (`placed`): counted there until released, in the same call or a later one; a release that
    overtook its placement leaves nothing counted. Disaggregated apps have no direct target."""
    serve_app.wait_idle()
    router = serve_app.router()
    t = router.direct_target.remote().result()
    assert isinstance(t, Redirect) and (t.deployment, t.method, t.args) == ("EngineServer-unified-0", "generate", ())
    pd_app(serve_app)
    assert pd_handle("Router").direct_target.remote().result() is None
    router.release.remote([], ["placed-1", "placed-2"]).result()
    assert inflight(serve_app) == {"unified-0": 2}
    router.release.remote(["placed-1"], ["placed-3"]).result()  # placements first, then the releases
    assert inflight(serve_app) == {"unified-0": 2}
    router.release.remote(["placed-4", "placed-5"], ["placed-5"]).result()  # started and ended between two calls
    assert inflight(serve_app) == {"unified-0": 2}
    router.release.remote(["placed-6"]).result()  # overtook its placement ...
    router.release.remote([], ["placed-6"]).result()  # ... which then counts nothing
    router.release.remote(["placed-2", "placed-3"]).result()
    assert inflight(serve_app) == {"unified-0": 0}


def test_http_requests_are_counted_on_their_replica_until_their_stream_ends(serve_app):
    """Through the ingress (one unified replica, so it starts the request itself: the router's `direct_target`
    above) the router still counts the request on its replica while it streams (told with the batched release
    call, within its flush interval) and not after. That the ingress made no `route` call is not observed here."""
    serve_app.wait_idle()
    routed_before = sum(r["counters"].get("started", 0) for r in serve_app.engine_stats())
    client = serve_app.client()
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=200,
                                       temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    seen, counted = 0, False
    for chunk in stream:
        seen += 1
        if seen == 40:
            deadline = time.monotonic() + 5
            while not counted and time.monotonic() < deadline:
                counted = inflight(serve_app) == {"unified-0": 1}
    assert counted and seen > 40
    deadline = time.monotonic() + 5
    while inflight(serve_app) != {"unified-0": 0}:
        assert time.monotonic() < deadline, inflight(serve_app)
        time.sleep(0.05)
    assert sum(r["counters"].get("started", 0) for r in serve_app.engine_stats()) == routed_before + 1
    serve_app.wait_idle()
