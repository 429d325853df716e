"""Router: picks the engine replica(s) for each request. The seam where prefill/decode disaggregation plugs in.

Each engine replica is its own Serve deployment (`EngineServer-<role>-<i>`, one replica each), so the router can
address a replica by name: disaggregation needs exactly that (prefill on replica A sends pages to decode
replica B). Load: the requests this router has in flight on each replica (exact, updated at once), tie-broken
by the queue the replica last reported (polled at most every `STATS_TTL_S`), then by which was used least
recently, so equal replicas take turns even when requests arrive one at a time.

Disaggregated (docs/disaggregation.md), per request: pick a prefill replica (load, queue; one with attention
DP places the request on its least loaded dp rank first) and a decode replica (load, free pages); the decode
replica admits the request and reserves its pages first (a full one passes to the next; none left = 503
`kv_capacity`) and says where the KV goes (a decode replica with attention DP: the sub-group of the dp rank that
took the request); the prefill replica runs the prompt, streams the first token (sent to the client at once) and
sends the KV into those pages, with the first token in its header; the decode replica starts when the KV lands
and streams the rest, opened right after the first token (the transfer's outcome is watched on the side). A
failed transfer frees the pages on both sides and ends the request with 503 `kv_transfer_failed` (or, with
`transfer.retry_prefill`, the router waits for the first attempt's outcome and, if it failed, runs the prefill
once more under a new transfer id and keeps the first token). The KV pairs between every (prefill, decode)
replica pair are opened by this router (decode listens, prefill connects) before the first request; a pair that
broke is replaced by a new generation, and so is one whose end restarted (`deploy/wiring.py`: a watchdog asks the
replicas who they are every second). Group names carry this router's id, so several routers never share (or
tear down) a pair.

The token stream does not pass through here for the ingress (every streamed item costs each process it crosses
CPU): `route` (unified) answers a `Redirect` to the chosen replica, `generate(direct=True)` ends with one after the
first token (to the decode replica); the router counts the request on that replica until the ingress releases it.
`generate` without `direct` relays the stream (coalesced) for other callers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy.config import ServeConfig
from deploy.metrics_endpoint import RouterMetrics
from deploy.metrics_hub import start_pushing
from deploy.owners import OWNER_CHECK_S, Owner, gone
from deploy.protocol import EngineChunk, EngineError, EngineEvent, EngineRequest, Redirect
from deploy.server import Admitted, FirstToken, TransferOutcome
from deploy.streaming import coalesce
from deploy.wiring import WATCH_S, ReplicaKey, Wiring
from workers.stats import EngineStats

logger = logging.getLogger("m3serve.router")

STATS_TTL_S = 0.5
HOLD_TTL_S = 3600.0  # a direct stream not released by then is forgotten (a last resort); see _sweep_held

RETRY_AFTER_UNWIRED_S = 2.0  # no wired pair: a replica restarts (the watchdog wires it once it is ready)


@dataclasses.dataclass(frozen=True)
class _Held:
    """A direct stream the router counts on `key` until its ingress releases it: the engine replica's request id
    (to abort it there if `owner`, the ingress replica reading it, dies first) and since when."""

    key: ReplicaKey
    since: float
    engine_rid: str
    owner: Owner | None


@serve.deployment(max_ongoing_requests=4096)
class Router:
    def __init__(self, engines: dict[str, list[DeploymentHandle]], config: ServeConfig, *,
                 metrics_hub: DeploymentHandle | None = None, model_name: str | None = None) -> None:
        """`metrics_hub`: where this replica's series go for the API port's /metrics (deploy/metrics_hub.py)."""
        self._config = config
        self._engines: dict[ReplicaKey, DeploymentHandle] = {
            (role, i): handle for role, handles in engines.items() for i, handle in enumerate(handles)}
        self._inflight: dict[ReplicaKey, int] = {key: 0 for key in self._engines}
        self._last_used: dict[ReplicaKey, int] = {key: 0 for key in self._engines}
        self._picks = 0
        self._where: dict[str, ReplicaKey] = {}  # request id -> replica, for aborts
        # direct streams (the ingress reads the engine replica's stream itself), by request id
        self._held: dict[str, _Held] = {}
        self._owner_watch: asyncio.Task | None = None  # aborts and releases what dead ingress replicas held
        self._stats: dict[ReplicaKey, EngineStats] = {}
        self._counters: dict[ReplicaKey, dict] = {}
        self._stats_time = 0.0
        self._refreshing: asyncio.Task | None = None
        # disaggregation
        self._id = uuid.uuid4().hex[:6]
        self._wiring = Wiring(self._engines, self._id, config.prefill.tp, config.prefill.dp)
        self._watchdog: asyncio.Task | None = None
        self._touched: dict[str, list[tuple[ReplicaKey, str]]] = {}  # request id -> (replica, engine id) to abort
        self._retry_prefill = config.transfer.retry_prefill
        self._admit_wait_s = config.transfer.admit_wait_s
        self._watching: set[asyncio.Task] = set()  # prefill streams read on after the decode stream started
        # decode-first requests whose prefill has not answered yet: request id -> (prefill replica, transfer id,
        # its prefill stream); a release before that (the client left) stops the prefill too
        self._prefilling: dict[str, tuple[ReplicaKey, str, object]] = {}
        self._metrics = RouterMetrics(model_name or config.model_name or "m3serve")
        start_pushing(f"router-{self._metrics.labels['replica']}", self._metric_families, metrics_hub)

    def _metric_families(self) -> list:
        return self._metrics.families(self._inflight, self._wiring.as_dict(), len(self._wiring.stale()))

    def _count_in(self, key: ReplicaKey) -> None:
        """One more request of this router's on `key` (its load, and the routed count)."""
        self._inflight[key] += 1
        self._metrics.routed(key)

    # -- choosing replicas ----------------------------------------------------------------------------------
    def _candidates(self, role: str) -> list[ReplicaKey]:
        return [key for key in self._engines if key[0] == role]

    def _pick(self, role: str, among: list[ReplicaKey] | None = None) -> ReplicaKey:
        """Least loaded replica of `role` (of `among`, when given): fewest requests in flight from here, then
        the shortest waiting queue (another router's load shows there), then the least recently chosen."""
        self._maybe_refresh_stats()

        def load(key: ReplicaKey) -> tuple[int, int, int]:
            stats = self._stats.get(key)
            return self._inflight[key], stats.num_waiting if stats else 0, self._last_used[key]

        key = min(among or self._candidates(role), key=load)
        self._picks += 1
        self._last_used[key] = self._picks
        return key

    def _maybe_refresh_stats(self) -> None:
        if time.monotonic() - self._stats_time < STATS_TTL_S:
            return
        if self._refreshing is None or self._refreshing.done():
            self._stats_time = time.monotonic()
            self._sweep_held()
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_stats())

    async def _refresh_stats(self) -> None:
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].snapshot.remote() for k in keys), return_exceptions=True)
        for key, res in zip(keys, results):
            if isinstance(res, dict):
                self._stats[key] = res["stats"]
                self._counters[key] = res["counters"]

    # -- requests -------------------------------------------------------------------------------------------
    async def route(self, req: EngineRequest, released: list[str] = (),
                    owner: Owner | None = None) -> Redirect | EngineError:
        """Unified: the replica that runs `req`, as a `Redirect` the ingress follows (see `generate(direct=True)`;
        one unary call, cheaper than a stream of one item). `released`: the caller's direct streams that ended
        since its previous call (`release`, piggybacked). `owner`: the calling ingress replica (deploy/owners.py:
        if it dies holding the stream, the request is aborted and released here)."""
        self._release_all(released)
        if self._config.disaggregate:
            return EngineError(status=500, message="route: a disaggregated request streams through generate",
                               code="internal_error")
        key = self._pick("unified")
        self._count_in(key)
        self._where[req.request_id] = key
        return self._hold(req.request_id, key, "generate", (req,), req.request_id, owner)

    async def generate(self, req: EngineRequest, direct: bool = False, released: list[str] = (),
                       owner: Owner | None = None) -> AsyncIterator[EngineEvent | Redirect]:
        """Stream a request's events from the replica chosen for it (prefill then decode when disaggregated).
        `direct` (the ingress): instead of relaying the token stream, end with a `Redirect` to the replica that
        streams it (unified: at once; disaggregated: after the first token, once the KV reached the decode
        replica); the ingress then reads that stream itself and calls `release` when it ended (or passes its
        id in `released` with a later call)."""
        self._release_all(released)
        if self._config.disaggregate:
            async for event in self._generate_disaggregated(req, direct, owner):
                yield event
            return
        key = self._pick("unified")
        self._count_in(key)
        self._where[req.request_id] = key
        if direct:
            async for event in self._redirect(req.request_id, key, "generate", (req,), req.request_id, owner):
                yield event
            return
        stream = self._engines[key].options(stream=True).generate.remote(req)
        events = coalesce(stream)  # what piled up while we were busy goes on as one chunk
        done = False
        try:
            async for event in events:
                yield event
            done = True
        finally:
            self._inflight[key] -= 1
            self._where.pop(req.request_id, None)
            if not done:  # we were cancelled (client gone) or failed: make sure the engine lets go too
                stream.cancel()
            await events.aclose()  # stops its pump

    async def _redirect(self, rid: str, key: ReplicaKey, method: str, args: tuple,
                        engine_rid: str, owner: Owner | None) -> AsyncIterator[Redirect]:
        """Yield the `Redirect` to `key`'s `method(*args)`; from then on the request's in-flight count on `key`
        is the ingress's to give back (`release`). Cancelled before it left: given back here."""
        redirect = self._hold(rid, key, method, args, engine_rid, owner)
        handed = False
        try:
            yield redirect
            handed = True
        finally:
            if not handed:
                self._release(rid)

    def _hold(self, rid: str, key: ReplicaKey, method: str, args: tuple, engine_rid: str,
              owner: Owner | None) -> Redirect:
        """Count `rid` on `key` until it is released (or its `owner` dies); the redirect to hand over."""
        handle = self._engines[key]
        self._held[rid] = _Held(key, time.monotonic(), engine_rid, owner)
        if owner is not None and (self._owner_watch is None or self._owner_watch.done()):
            self._owner_watch = asyncio.get_running_loop().create_task(self._watch_owners())
        return Redirect(app_name=handle.app_name, deployment=handle.deployment_name, method=method, args=args,
                        request_id=engine_rid, release_id=rid)

    async def release(self, request_ids: list[str] | str) -> None:
        """The ingress's direct streams of `request_ids` ended (or were cut): stop counting them on their replicas."""
        self._release_all([request_ids] if isinstance(request_ids, str) else request_ids)

    def _release_all(self, request_ids) -> None:
        for rid in request_ids:
            self._release(rid)

    def _release(self, rid: str) -> None:
        prefilling = self._prefilling.pop(rid, None)
        if prefilling is not None:  # the client left before its first token: the prefill need not run on
            p, tid, pstream = prefilling
            pstream.cancel()  # its replica aborts the request (and the watcher reads the stream's end)
            task = asyncio.get_running_loop().create_task(self._abort_on(p, tid))  # a placement not run yet
            self._watching.add(task)
            task.add_done_callback(self._watching.discard)
        held = self._held.pop(rid, None)  # once: a second release (a cancel racing the end) finds nothing
        if held is None:
            return
        self._inflight[held.key] -= 1
        if self._where.get(rid) == held.key:
            del self._where[rid]

    def _sweep_held(self) -> None:
        """Forget direct streams never released after `HOLD_TTL_S`: a last resort (a caller that named no owner
        and died); those of a dead owner go within `OWNER_CHECK_S` (`_watch_owners`)."""
        now = time.monotonic()
        for rid in [r for r, held in self._held.items() if now - held.since > HOLD_TTL_S]:
            self._release(rid)

    async def _watch_owners(self) -> None:
        """While direct streams are held: every `OWNER_CHECK_S`, abort on its engine replica and release every
        stream whose ingress replica died (deploy/owners.py); it would never be released, and its engine would
        run it on to its max_tokens."""
        while self._held:
            await asyncio.sleep(OWNER_CHECK_S)
            try:
                owners = {h.owner for h in self._held.values() if h.owner is not None}
                dead = await gone(owners) if owners else set()
                orphans = [(rid, h) for rid, h in list(self._held.items()) if h.owner in dead]
                for rid, _ in orphans:
                    self._release(rid)
                if orphans:
                    self._metrics.orphans_aborted(len(orphans))
                    logger.warning("ingress replica(s) %s died holding %d stream(s): aborted",
                                   sorted(o[1] for o in dead), len(orphans))
                await asyncio.gather(*(self._abort_on(h.key, h.engine_rid) for _, h in orphans))
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("ingress replica watch")

    async def abort(self, request_id: str) -> None:
        touched = self._touched.get(request_id)
        if touched is not None:
            await asyncio.gather(*(self._engines[k].abort.remote(eid) for k, eid in touched), return_exceptions=True)
            return
        key = self._where.get(request_id)
        targets = [self._engines[key]] if key else list(self._engines.values())
        await asyncio.gather(*(h.abort.remote(request_id) for h in targets), return_exceptions=True)

    # -- disaggregation -------------------------------------------------------------------------------------
    def _group(self, key: ReplicaKey, gen: int) -> str:
        return self._wiring.group(key, gen)

    def _start_watchdog(self) -> None:
        """Disaggregated: from the first call on, check every `WATCH_S` who the engine replicas are and re-wire
        the pairs of one that restarted (deploy/wiring.py), traffic or not."""
        if not self._config.disaggregate or (self._watchdog is not None and not self._watchdog.done()):
            return
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self._wiring.probe()
                for pair, err in await self._wiring.ensure():
                    logger.warning("opening KV pair %s -> %s failed: %r", *pair, err)
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("KV pair watchdog")
            await asyncio.sleep(WATCH_S)

    async def _ensure_pairs(self, wait: bool = True) -> None:
        """Open the KV pairs that are missing or whose end restarted (those whose ends are ready)."""
        for pair, err in await self._wiring.ensure(wait):
            logger.warning("opening KV pair %s -> %s failed: %r", *pair, err)

    async def _rewire_now(self) -> None:
        """A replica answered `kv_unwired` (it or its peer restarted, and the watchdog has not seen it yet)."""
        await self._wiring.probe()
        await self._ensure_pairs()

    async def _repair(self, p: ReplicaKey, d: ReplicaKey) -> None:
        """After a failed transfer: if either end of the pair broke, open the next generation, drop the old."""
        await self._wiring.repair(p, d)

    def _pick_decode_order(self, p: ReplicaKey) -> list[ReplicaKey]:
        """Decode replicas wired to prefill replica `p`, best first: fewest requests in flight from here, then
        most free pages."""
        self._maybe_refresh_stats()

        def load(key: ReplicaKey) -> tuple[int, int, int]:
            stats = self._stats.get(key)
            return self._inflight[key], -(stats.num_pages_free if stats else 0), self._last_used[key]

        order = sorted((d for d in self._candidates("decode") if self._wiring.generation(p, d) is not None),
                       key=load)
        if order:
            self._picks += 1
            self._last_used[order[0]] = self._picks
        return order

    async def _admit(self, req: EngineRequest, p: ReplicaKey, p_rank: int | None,
                     first_from_kv: bool = True) -> tuple[ReplicaKey, str] | EngineError:
        """Reserve the request's pages on the first decode replica with room: (that replica, the group name its
        prefill sends the KV to: the replica's, or with attention DP the admitting dp rank's sub-group).
        `p_rank`: the prefill replica's dp rank that runs it (attention DP), whose shards the decode expects.
        `first_from_kv`: the decode starts when the KV lands, with the first token from the KV header.
        While every replica is full, it tries again (backing off 10 -> 200 ms) until `transfer.admit_wait_s`.
        A replica that answers `kv_unwired` (it restarted, or `p` did, before the watchdog saw it) makes the router
        re-wire now and try once more."""
        deadline = time.monotonic() + self._admit_wait_s
        delay = 0.01
        rewired = False
        while True:
            admitted = await self._admit_once(req, p, p_rank, first_from_kv)
            if isinstance(admitted, EngineError) and admitted.code == "kv_unwired" and not rewired:
                rewired = True
                await self._rewire_now()
                continue
            if not (isinstance(admitted, EngineError) and admitted.code == "kv_capacity"):
                return admitted
            if time.monotonic() + delay > deadline:
                return admitted
            await asyncio.sleep(delay)  # a cancelled client cancels this wait: nothing is reserved yet
            delay = min(2 * delay, 0.2)

    async def _admit_once(self, req: EngineRequest, p: ReplicaKey, p_rank: int | None,
                          first_from_kv: bool) -> tuple[ReplicaKey, str] | EngineError:
        """One pass over the decode replicas, best first (see `_admit`)."""
        full = None
        for d in self._pick_decode_order(p):
            gen = self._wiring.generation(p, d)
            if gen is None:  # dropped since the order was made (a re-wire)
                continue
            try:
                res = await self._engines[d].admit.remote(req, self._group(p, gen), req.request_id,
                                                          self._group(d, gen), p_rank, first_from_kv)
            except Exception as e:  # that replica is gone: try the next
                full = EngineError(status=503, message=f"decode replica {d[1]} unreachable ({type(e).__name__})",
                                   code="engine_unavailable", retry_after=1.0)
                continue
            if isinstance(res, Admitted):
                return d, res.send_to or self._group(d, gen)
            if res.code not in ("kv_capacity", "kv_unwired"):
                return res
            if full is None or full.code != "kv_capacity":
                full = res
        if full is not None and full.code == "kv_capacity":
            return EngineError(status=503, code="kv_capacity", retry_after=full.retry_after,
                               message=f"no decode replica has room for this request's KV pages now ({full.message})")
        return full or _unwired_error()

    async def _generate_disaggregated(self, req: EngineRequest, direct: bool = False,
                                      owner: Owner | None = None) -> AsyncIterator[EngineEvent | Redirect]:
        rid = req.request_id
        if req.params.n != 1:
            yield EngineError(status=400, param="n",
                              message=f"n: disaggregated serving runs one sample per request, got n={req.params.n}")
            return
        self._start_watchdog()
        try:
            await self._ensure_pairs(wait=bool(self._wiring.want()) and not self._wiring.as_dict())
        except Exception as e:
            logger.exception("opening KV pairs failed")
            yield EngineError(status=503, message=f"KV transfer pairs could not be opened: {e}",
                              code="kv_transfer_unavailable", retry_after=5.0)
            return
        prefills = [p for p in self._candidates("prefill")
                    if any(self._wiring.generation(p, d) is not None for d in self._candidates("decode"))]
        if not prefills:  # a replica is down or restarting: nothing can carry a request's KV now
            yield _unwired_error()
            return
        # The ingress's stream (`direct`) opens on the decode replica before the prefill runs and carries the first
        # token too (it comes in the KV header): no relay through here, no stream to open after it. Not with a
        # retry (the stream would be the first attempt's) or prompt logprobs (the prefill computes those).
        decode_first = direct and not self._retry_prefill and req.params.prompt_logprobs is None
        touched: list[tuple[ReplicaKey, str]] = []
        self._touched[rid] = touched
        busy: list[ReplicaKey] = []  # in-flight counts to give back
        streams: list = []
        first: EngineChunk | None = None
        devents = None  # the decode stream, coalesced
        done = False
        try:
            attempts = 2 if self._retry_prefill else 1
            for attempt in range(attempts):
                sub = req if attempt == 0 else dataclasses.replace(req, request_id=f"{rid}#retry{attempt}")
                tid = sub.request_id
                p = self._pick("prefill", prefills)
                touched.append((p, tid))  # from here an abort must reach it (a placement is held there)
                p_rank = await self._place(p, sub)
                if isinstance(p_rank, EngineError):
                    done = True
                    yield p_rank
                    return
                # a retry's first token differs from the one the client has: the decode waits to be handed that
                admitted = await self._admit(sub, p, p_rank, first_from_kv=attempt == 0)
                if isinstance(admitted, EngineError):
                    self._metrics.handoff("refused")
                    if p_rank is not None:
                        await self._abort_on(p, tid)  # let the placement go
                    done = True
                    yield admitted
                    return
                d, send_to = admitted
                touched.append((d, tid))
                self._count_in(d)
                busy.append(d)
                self._count_in(p)
                busy.append(p)
                pstream = self._engines[p].options(stream=True).prefill.remote(sub, send_to, tid)
                if decode_first:
                    busy.remove(p)
                    self._watch_prefill(p, d, tid, pstream, rid, placed=p_rank is not None)
                    busy.remove(d)  # the ingress's from here, like a unified redirect
                    async for event in self._redirect(rid, d, "decode", (sub, None), tid, owner):
                        yield event
                    done = True
                    return
                streams.append(pstream)
                event = await _next_event(pstream, f"prefill replica {p[1]}")
                if isinstance(event, EngineError):
                    self._metrics.handoff("refused")
                    self._rewire_if_unwired(event)
                    await self._abort_on(d, tid)
                    if p_rank is not None:  # refused before it was added (queue full): its placement is held
                        await self._abort_on(p, tid)
                    done = True
                    yield event
                    return
                if first is None:
                    first = event
                    if event.finished:  # the first token ended it: nothing to decode
                        self._metrics.handoff("finished_at_prefill")
                        await self._abort_on(d, tid)
                        done = True
                        yield event
                        return
                    yield event  # the client gets the first token now, while the KV travels
                if attempt + 1 == attempts:
                    # Nothing left to retry: go on to the decode replica now, which starts when the KV lands; the
                    # transfer's outcome is watched on the side (a failure the decode side cannot see fails it).
                    busy.remove(p)
                    streams.remove(pstream)
                    self._watch_prefill(p, d, tid, pstream, rid, first=event)
                    break
                outcome = await _next_event(pstream, f"prefill replica {p[1]}")
                self._inflight[p] -= 1
                busy.remove(p)
                if isinstance(outcome, TransferOutcome) and outcome.ok:
                    self._metrics.handoff("ok")
                    break
                self._metrics.handoff("transfer_failed")
                why = outcome.reason if isinstance(outcome, TransferOutcome) else getattr(outcome, "message", outcome)
                logger.warning("request %s: KV transfer %s -> %s failed: %s", rid, p, d, why)
                await self._abort_on(d, tid)
                await self._repair(p, d)  # and run the prefill once more
            await self._before_decode(rid)
            sample = first.samples[0]
            token = FirstToken(token_id=sample.token_ids[0], logprobs=sample.logprobs[0] if sample.logprobs else None)
            if direct:  # the ingress streams the decode itself; the decode replica's count goes with it
                busy.remove(d)
                async for event in self._redirect(rid, d, "decode", (sub, token), sub.request_id, owner):
                    yield event
                done = True
                return
            dstream = self._engines[d].options(stream=True).decode.remote(sub, token)
            streams.append(dstream)
            devents = coalesce(dstream)
            async for event in devents:
                if isinstance(event, EngineError) or event.finished:
                    done = True
                yield event
            done = True
        finally:
            for key in busy:
                self._inflight[key] -= 1
            self._touched.pop(rid, None)
            if not done:  # cancelled (client gone) or failed: both sides let go of the request's pages
                for s in streams:
                    s.cancel()
                await asyncio.gather(*(self._abort_on(k, eid) for k, eid in touched), return_exceptions=True)
            if devents is not None:
                await devents.aclose()  # stops its pump

    def _watch_prefill(self, p: ReplicaKey, d: ReplicaKey, tid: str, pstream, rid: str, *,
                       first: EngineChunk | None = None, placed: bool = False) -> None:
        """In the background: the rest of the prefill replica's stream for `tid`, once the decode replica's stream
        is (or is about to be) the client's. `first`: its first event, already read; else (the decode stream
        carries the first token too) it is read here, and if the prefill answered instead of handing off (a
        refusal, or the first token ended the request) the decode replica ends its stream with that answer.
        Then the transfer's outcome: a failure fails the request on the decode replica (which frees its pages
        and ends its stream with 503 `kv_transfer_failed`), then replaces the pair if it broke; the decode side
        sees a refused or broken payload itself, but not a sender that never sent (no pairs, peer gone before the
        header) until its lease. `placed`: a placement is held on `p` for `tid` (attention DP) until it runs."""
        async def watch() -> None:
            try:
                if first is None:
                    try:
                        event = await _next_event(pstream, f"prefill replica {p[1]}")
                    finally:
                        self._prefilling.pop(rid, None)
                    if isinstance(event, EngineError) or event.finished:
                        self._metrics.handoff("refused" if isinstance(event, EngineError) else "finished_at_prefill")
                        self._rewire_if_unwired(event)
                        if isinstance(event, EngineError) and placed:
                            await self._abort_on(p, tid)  # refused before it was added: let the placement go
                        await self._fail_decode(d, tid, "the prefill answered without handing off", event)
                        return
                outcome = await _next_event(pstream, f"prefill replica {p[1]}")
            finally:
                self._inflight[p] -= 1
            if isinstance(outcome, TransferOutcome) and outcome.ok:
                self._metrics.handoff("ok")
                return
            self._metrics.handoff("transfer_failed")
            why = outcome.reason if isinstance(outcome, TransferOutcome) else getattr(outcome, "message", outcome)
            logger.warning("request %s: KV transfer %s -> %s failed: %s", tid, p, d, why)
            # first: dropping a broken pair would fail it too, under a vaguer reason ("closed")
            await self._fail_decode(d, tid, f"KV transfer failed: {why}")
            await self._repair(p, d)

        if first is None:  # registered before the redirect leaves: a release may come before the task runs
            self._prefilling[rid] = (p, tid, pstream)
        task = asyncio.get_running_loop().create_task(watch())
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    def _rewire_if_unwired(self, event: EngineEvent) -> None:
        """A prefill replica answered `kv_unwired` (it restarted before the watchdog saw it): re-wire now, in the
        background (this request has its answer; the next ones find the pair)."""
        if isinstance(event, EngineError) and event.code == "kv_unwired":
            task = asyncio.get_running_loop().create_task(self._rewire_now())
            self._watching.add(task)
            task.add_done_callback(self._watching.discard)

    async def _fail_decode(self, d: ReplicaKey, tid: str, why: str, answer: EngineEvent | None = None) -> None:
        try:
            await self._engines[d].fail_remote.remote(tid, why, answer)
        except Exception:  # the decode replica is gone: its pages went with it
            logger.warning("fail_remote of %s on %s failed", tid, d)

    async def _place(self, p: ReplicaKey, req: EngineRequest) -> int | None | EngineError:
        """The dp rank of prefill replica `p` that will run `req` (None without attention DP): the decode side
        must know it before the prefill runs, to prepare the receive from that rank's shards. The prompt length
        goes along: the replica balances its dp ranks by prompt tokens still to prefill, not by requests."""
        if self._config.prefill.dp == 1:
            return None
        try:
            return await self._engines[p].place.remote(req.request_id, len(req.prompt_token_ids))
        except Exception as e:  # that replica is gone
            return EngineError(status=503, message=f"prefill replica {p[1]} unreachable ({type(e).__name__})",
                               code="engine_unavailable", retry_after=1.0)

    async def _abort_on(self, key: ReplicaKey, engine_request_id: str) -> None:
        try:
            await self._engines[key].abort.remote(engine_request_id)
        except Exception:  # the replica is gone: its pages went with it
            logger.warning("abort of %s on %s failed", engine_request_id, key)

    async def _before_decode(self, request_id: str) -> None:
        """Between a request's first token and its decode stream. Nothing happens here; it is the seam where
        `deploy.testing.DrillRouter` pauses (a client gone meanwhile, a decode running ahead unattended)."""

    async def pairs(self) -> dict[str, int]:
        """Open KV pairs: 'prefill-i->decode-j' -> generation."""
        return self._wiring.as_dict()

    # -- state ----------------------------------------------------------------------------------------------
    async def ready(self) -> dict:
        """`{"ready": bool, "engines": [per-replica load state]}`; an unreachable replica counts as not ready, and
        so does a disaggregated app while a KV pair is not wired (an end restarted: re-wired here if it can be)."""
        keys = list(self._engines)
        results = await self._wiring.probe()
        engines = []
        for (role, idx), res in zip(keys, results):
            if isinstance(res, BaseException):
                res = {"role": role, "replica": idx, "state": "unreachable", "ready": False,
                       "error": type(res).__name__}
            engines.append(res)
        ready = all(e["ready"] for e in engines)
        if ready and self._config.disaggregate:
            self._start_watchdog()
            failed = await self._wiring.ensure()
            if failed:
                pair, err = failed[0]
                logger.warning("opening KV pair %s -> %s failed: %r", *pair, err)
                return {"ready": False, "engines": engines, "error": f"KV pairs: {err}"}
            if not self._wiring.wired:
                return {"ready": False, "engines": engines,
                        "error": f"KV pairs not wired: {self._wiring.stale()}"}
        return {"ready": ready, "engines": engines}

    async def stats(self) -> list[dict]:
        """Fresh stats of every replica: `[{"role", "replica", "stats": EngineStats, "counters", "inflight"}]`."""
        await self._refresh_stats()
        self._stats_time = time.monotonic()
        return [{"role": k[0], "replica": k[1], "stats": self._stats.get(k), "counters": self._counters.get(k),
                 "inflight": self._inflight[k]} for k in self._engines]

    async def pop_request_stats(self) -> list:
        """Finished-request stats of every replica since the last call (for the metrics exporter)."""
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].pop_request_stats.remote() for k in keys),
                                       return_exceptions=True)
        return [s for res in results if not isinstance(res, BaseException) for s in res]


def _unwired_error() -> EngineError:
    return EngineError(status=503, code="kv_unwired", retry_after=RETRY_AFTER_UNWIRED_S,
                       message="no prefill and decode replica are wired for KV transfer now (a replica is down or "
                               "restarting; the router wires it again once it is ready): retry")


async def _next_event(stream, what: str):
    """The next event of a replica's stream; its end or a transport failure becomes an EngineError."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return EngineError(status=500, message=f"{what} ended the request without a result", code="internal_error")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the replica died
        return EngineError(status=503, message=f"{what} failed ({type(e).__name__}: {e})", code="engine_unavailable",
                           retry_after=1.0)
