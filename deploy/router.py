"""Router: picks the engine replica(s) for each request and counts them until the ingress lets go.

Each engine replica is its own Serve deployment (`EngineServer-<role>-<i>`, one replica each), so the router can
address a replica by name: disaggregation needs exactly that (prefill on replica A sends pages to decode
replica B). Load (`ReplicaLoad`): the requests this router has in flight on each replica (exact, updated at once),
tie-broken by the queue the replica last reported (polled at most every `STATS_TTL_S`), then by which was used
least recently, so equal replicas take turns even when requests arrive one at a time. Decode replicas are ordered
by in-flight requests, then free pages.

The token stream never passes through here (every streamed item costs each process it crosses CPU): `route`
(unified) answers a `Redirect` to the chosen replica, and with a single unified replica the ingress skips even that
(`direct_target`: it starts requests there itself and names them in its next `release` call, `placed`); `generate` (disaggregated) runs the prefill/decode handoff
(deploy/pd.py, a state machine: place, admit, prefill, first token, transfer, decode) and ends with a `Redirect`
to the decode replica. The router counts the request on that replica until the ingress releases it, or until the
ingress replica that owns it dies (deploy/owners.py watches). The KV pairs between every (prefill, decode) replica
pair are opened by this router and re-wired when an end restarts (deploy/wiring.py); group names carry this
router's id, so several routers never share (or tear down) a pair.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy import owners
from deploy.config import ServeConfig
from deploy.metrics_endpoint import RouterMetrics
from deploy.metrics_hub import start_pushing
from deploy.owners import Held, Owner
from deploy.pd import PrefillDecode, abort_on
from deploy.protocol import EngineError, EngineEvent, EngineRequest, Redirect
from deploy.wiring import ReplicaKey, Wiring
from workers.stats import EngineStats

logger = logging.getLogger("m3serve.router")

STATS_TTL_S = 0.5
HOLD_TTL_S = 3600.0  # a direct stream not released by then is forgotten (a last resort); see _sweep_held
EARLY_RELEASE_TTL_S = 60.0  # a release that found nothing held waits this long for its request's placement


class ReplicaLoad:
    """Replica choice: the requests this router has in flight on each engine replica, and what each replica last
    reported (polled at most every `STATS_TTL_S`)."""

    def __init__(self, engines: dict[ReplicaKey, DeploymentHandle], routed: Callable[[ReplicaKey], None],
                 on_refresh: Callable[[], None]) -> None:
        """`routed(key)`: count a request placed on `key`; `on_refresh()`: runs with each stats refresh."""
        self._engines = engines
        self._routed, self._on_refresh = routed, on_refresh
        self.inflight: dict[ReplicaKey, int] = {key: 0 for key in engines}
        self._last_used: dict[ReplicaKey, int] = {key: 0 for key in engines}
        self._picks = 0
        self.stats: dict[ReplicaKey, EngineStats] = {}
        self.counters: dict[ReplicaKey, dict] = {}
        self._stats_time = 0.0
        self._refreshing: asyncio.Task | None = None

    def count_in(self, key: ReplicaKey) -> None:
        """One more request of this router's on `key` (its load, and the routed count)."""
        self.inflight[key] += 1
        self._routed(key)

    def count_out(self, key: ReplicaKey) -> None:
        self.inflight[key] -= 1

    def pick(self, role: str, among: list[ReplicaKey] | None = None) -> ReplicaKey:
        """Least loaded replica of `role` (of `among`, when given): fewest requests in flight from here, then
        the shortest waiting queue (another router's load shows there), then the least recently chosen."""
        self._maybe_refresh()

        def load(key: ReplicaKey) -> tuple[int, int, int]:
            stats = self.stats.get(key)
            return self.inflight[key], stats.num_waiting if stats else 0, self._last_used[key]

        key = min(among or [k for k in self._engines if k[0] == role], key=load)
        self._used(key)
        return key

    def decode_order(self, p: ReplicaKey, wired: Callable[[ReplicaKey], bool]) -> list[ReplicaKey]:
        """Decode replicas `wired` to prefill replica `p`, best first: fewest requests in flight from here, then
        most free pages."""
        self._maybe_refresh()

        def load(key: ReplicaKey) -> tuple[int, int, int]:
            stats = self.stats.get(key)
            return self.inflight[key], -(stats.num_pages_free if stats else 0), self._last_used[key]

        order = sorted((d for d in self._engines if d[0] == "decode" and wired(d)), key=load)
        if order:
            self._used(order[0])
        return order

    def _used(self, key: ReplicaKey) -> None:
        self._picks += 1
        self._last_used[key] = self._picks

    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._stats_time < STATS_TTL_S:
            return
        if self._refreshing is None or self._refreshing.done():
            self._stats_time = time.monotonic()
            self._on_refresh()
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self) -> None:
        """Ask every replica for its stats now."""
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].snapshot.remote() for k in keys), return_exceptions=True)
        for key, res in zip(keys, results):
            if isinstance(res, dict):
                self.stats[key] = res["stats"]
                self.counters[key] = res["counters"]
        self._stats_time = time.monotonic()


@serve.deployment(max_ongoing_requests=4096)
class Router:
    def __init__(self, engines: dict[str, list[DeploymentHandle]], config: ServeConfig, *,
                 metrics_hub: DeploymentHandle | None = None, model_name: str | None = None) -> None:
        """`metrics_hub`: where this replica's series go for the API port's /metrics (deploy/metrics_hub.py)."""
        self._config = config
        self._engines: dict[ReplicaKey, DeploymentHandle] = {
            (role, i): handle for role, handles in engines.items() for i, handle in enumerate(handles)}
        self._metrics = RouterMetrics(model_name or config.model_name or "m3serve")
        self._load = ReplicaLoad(self._engines, self._metrics.routed, on_refresh=self._sweep_held)
        self._where: dict[str, ReplicaKey] = {}  # request id -> replica, for aborts
        # direct streams (the ingress reads the engine replica's stream itself), by request id
        self._held: dict[str, Held] = {}
        # releases that came before the placement of their direct request (`_place`), by request id -> when
        self._early_released: dict[str, float] = {}
        self._swept = 0.0
        self._direct = not config.disaggregate and sum(k[0] == "unified" for k in self._engines) == 1
        self._owner_watch: asyncio.Task | None = None  # aborts and releases what dead ingress replicas held
        # disaggregation: the pairs this router opens (its id in their names) and the handoff of each request
        self._wiring = Wiring(self._engines, uuid.uuid4().hex[:6], config.prefill.tp, config.prefill.dp)
        self._pd = PrefillDecode(self._engines, self._wiring, self._load, config.transfer, config.prefill.dp,
                                 hold=self._hold, release=self._release, handoff=self._metrics.handoff)
        start_pushing(f"router-{self._metrics.labels['replica']}", self._metric_families, metrics_hub)

    def _metric_families(self) -> list:
        return self._metrics.families(self._load.inflight, self._wiring.as_dict(), len(self._wiring.stale()))

    # -- requests -------------------------------------------------------------------------------------------
    async def route(self, req: EngineRequest, released: list[str] = (),
                    owner: Owner | None = None) -> Redirect | EngineError:
        """Unified: the replica that runs `req`, as a `Redirect` the ingress follows (one unary call, cheaper
        than a stream of one item). `released`: the caller's direct streams that ended since its previous call
        (`release`, piggybacked). `owner`: the calling ingress replica (deploy/owners.py: if it dies holding the
        stream, the request is aborted and released here)."""
        self._release_all(released)
        if self._config.disaggregate:
            return EngineError(status=500, message="route: a disaggregated request streams through generate",
                               code="internal_error")
        key = self._load.pick("unified")
        self._load.count_in(key)
        self._where[req.request_id] = key
        return self._hold(req.request_id, key, "generate", (req,), req.request_id, owner)

    async def generate(self, req: EngineRequest, released: list[str] = (),
                       owner: Owner | None = None) -> AsyncIterator[EngineEvent | Redirect]:
        """A request's events up to the `Redirect` to the replica that streams the rest, which the ingress then
        reads itself, calling `release` when it ended (or passing its id in `released` with a later call).
        Unified: the redirect at once (what `route` answers). Disaggregated (deploy/pd.py): a refusal, or the
        redirect to the decode replica, after the first token on the first-token path. The token stream itself
        never passes through here."""
        self._release_all(released)
        if self._config.disaggregate:
            async for event in self._pd.run(req, owner):
                yield event
            return
        redirect = await self.route(req, (), owner)
        try:
            yield redirect
            redirect = None
        finally:
            if redirect is not None:  # cancelled before it left: given back here
                self._release(req.request_id)

    async def direct_target(self) -> Redirect | None:
        """Unified with one engine replica there is nothing to decide per request: the ingress may start requests
        on it itself (this template, its request fields empty) and tell the router afterwards (`release`'s
        `placed`), one handle call less before the engine sees a request (docs/benchmarks.md D4). None: every
        request goes through `route` (several replicas to choose from, or disaggregated)."""
        keys = [k for k in self._engines if k[0] == "unified"]
        if self._config.disaggregate or len(keys) != 1:
            return None
        handle = self._engines[keys[0]]
        return Redirect(app_name=handle.app_name, deployment=handle.deployment_name, method="generate", args=(),
                        request_id="", release_id="")

    def _place(self, rid: str, owner: Owner | None) -> None:
        """A request the ingress started on the one unified replica itself: counted and held from now on, as if
        `route` had sent it there, unless its release already came (a later call that overtook this one)."""
        if self._early_released.pop(rid, None) is not None:
            return
        key = next(k for k in self._engines if k[0] == "unified")
        self._load.count_in(key)
        self._where[rid] = key
        self._hold(rid, key, "generate", (), rid, owner)

    def _hold(self, rid: str, key: ReplicaKey, method: str, args: tuple, engine_rid: str,
              owner: Owner | None) -> Redirect:
        """Count `rid` on `key` until it is released (or its `owner` dies); the redirect to hand over."""
        handle = self._engines[key]
        self._held[rid] = Held(key, time.monotonic(), engine_rid, owner)
        if owner is not None and (self._owner_watch is None or self._owner_watch.done()):
            self._owner_watch = asyncio.get_running_loop().create_task(owners.watch(
                self._held, self._release, lambda k, eid: abort_on(self._engines, k, eid),
                self._metrics.orphans_aborted))
        return Redirect(app_name=handle.app_name, deployment=handle.deployment_name, method=method, args=args,
                        request_id=engine_rid, release_id=rid)

    async def release(self, request_ids: list[str] | str, placed: list[str] = (),
                      owner: Owner | None = None) -> None:
        """The ingress's direct streams of `request_ids` ended (or were cut): stop counting them on their replicas.
        `placed`: requests `owner` started itself on the `direct_target` since its last call; counted first, so
        one that started and ended between two calls comes and goes in this one."""
        for rid in placed:
            self._place(rid, owner)
        self._release_all([request_ids] if isinstance(request_ids, str) else request_ids)
        if time.monotonic() - self._swept > STATS_TTL_S:  # direct requests never `pick`, whose refresh sweeps
            self._sweep_held()

    def _release_all(self, request_ids) -> None:
        for rid in request_ids:
            self._release(rid)

    def _release(self, rid: str) -> None:
        self._pd.released(rid)  # the client left before its first token: the prefill need not run on
        held = self._held.pop(rid, None)  # once: a second release (a cancel racing the end) finds nothing
        if held is None:
            if self._direct:  # maybe a direct request whose placement is still on its way: it must not count
                self._early_released[rid] = time.monotonic()
            return
        self._load.count_out(held.key)
        if self._where.get(rid) == held.key:
            del self._where[rid]

    def _sweep_held(self) -> None:
        """Forget direct streams never released after `HOLD_TTL_S`: a last resort (a caller that named no owner
        and died); those of a dead owner go within `OWNER_CHECK_S` (deploy/owners.py)."""
        now = self._swept = time.monotonic()
        for rid in [r for r, held in self._held.items() if now - held.since > HOLD_TTL_S]:
            self._release(rid)
        for rid in [r for r, since in self._early_released.items() if now - since > EARLY_RELEASE_TTL_S]:
            del self._early_released[rid]  # a second release of a request long gone, or a placement never sent

    async def abort(self, request_id: str) -> None:
        touched = self._pd.touched(request_id)
        if touched is not None:
            await asyncio.gather(*(self._engines[k].abort.remote(eid) for k, eid in touched), return_exceptions=True)
            return
        key = self._where.get(request_id)
        targets = [self._engines[key]] if key else list(self._engines.values())
        await asyncio.gather(*(h.abort.remote(request_id) for h in targets), return_exceptions=True)

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
            self._wiring.start_watchdog()
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
        await self._load.refresh()
        return [{"role": k[0], "replica": k[1], "stats": self._load.stats.get(k),
                 "counters": self._load.counters.get(k), "inflight": self._load.inflight[k]} for k in self._engines]

    async def pop_request_stats(self) -> list:
        """Finished-request stats of every replica since the last call (for the metrics exporter)."""
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].pop_request_stats.remote() for k in keys),
                                       return_exceptions=True)
        return [s for res in results if not isinstance(res, BaseException) for s in res]
