"""Router: picks the engine replica(s) for each request. The seam where prefill/decode disaggregation plugs in.

Each engine replica is its own Serve deployment (`EngineServer-<role>-<i>`, one replica each), so the router can
address a replica by name: disaggregation needs exactly that (prefill on replica A sends pages to decode
replica B). Load: the requests this router has in flight on each replica (exact, updated at once), tie-broken
by the queue the replica last reported (polled at most every `STATS_TTL_S`), then by which was used least
recently, so equal replicas take turns even when requests arrive one at a time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy.config import ServeConfig
from deploy.protocol import EngineError, EngineEvent, EngineRequest
from workers.stats import EngineStats

logger = logging.getLogger("m3serve.router")

STATS_TTL_S = 0.5

ReplicaKey = tuple[str, int]  # (role, index)


@serve.deployment(max_ongoing_requests=4096)
class Router:
    def __init__(self, engines: dict[str, list[DeploymentHandle]], config: ServeConfig) -> None:
        self._config = config
        self._engines: dict[ReplicaKey, DeploymentHandle] = {
            (role, i): handle for role, handles in engines.items() for i, handle in enumerate(handles)}
        self._inflight: dict[ReplicaKey, int] = {key: 0 for key in self._engines}
        self._last_used: dict[ReplicaKey, int] = {key: 0 for key in self._engines}
        self._picks = 0
        self._where: dict[str, ReplicaKey] = {}  # request id -> replica, for aborts
        self._stats: dict[ReplicaKey, EngineStats] = {}
        self._counters: dict[ReplicaKey, dict] = {}
        self._stats_time = 0.0
        self._refreshing: asyncio.Task | None = None

    # -- choosing replicas ----------------------------------------------------------------------------------
    def _candidates(self, role: str) -> list[ReplicaKey]:
        return [key for key in self._engines if key[0] == role]

    def _pick(self, role: str) -> ReplicaKey:
        """Least loaded replica of `role`: fewest requests in flight from here, then the shortest waiting queue
        (another router's load shows there), then the least recently chosen."""
        self._maybe_refresh_stats()

        def load(key: ReplicaKey) -> tuple[int, int, int]:
            stats = self._stats.get(key)
            return self._inflight[key], stats.num_waiting if stats else 0, self._last_used[key]

        key = min(self._candidates(role), key=load)
        self._picks += 1
        self._last_used[key] = self._picks
        return key

    def _maybe_refresh_stats(self) -> None:
        if time.monotonic() - self._stats_time < STATS_TTL_S:
            return
        if self._refreshing is None or self._refreshing.done():
            self._stats_time = time.monotonic()
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_stats())

    async def _refresh_stats(self) -> None:
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].snapshot.remote() for k in keys), return_exceptions=True)
        for key, res in zip(keys, results):
            if isinstance(res, dict):
                self._stats[key] = res["stats"]
                self._counters[key] = res["counters"]

    # -- requests -------------------------------------------------------------------------------------------
    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineEvent]:
        """Stream a request's events from the replica chosen for it."""
        if self._config.disaggregate:
            # The prefill -> KV transfer -> decode protocol lands with the disaggregation issue.
            yield EngineError(status=501, message="disaggregated serving is not available in this build",
                              code="not_implemented")
            return
        key = self._pick("unified")
        self._inflight[key] += 1
        self._where[req.request_id] = key
        stream = self._engines[key].options(stream=True).generate.remote(req)
        done = False
        try:
            async for event in stream:
                yield event
            done = True
        finally:
            self._inflight[key] -= 1
            self._where.pop(req.request_id, None)
            if not done:  # we were cancelled (client gone) or failed: make sure the engine lets go too
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        key = self._where.get(request_id)
        targets = [self._engines[key]] if key else list(self._engines.values())
        await asyncio.gather(*(h.abort.remote(request_id) for h in targets), return_exceptions=True)

    # -- state ----------------------------------------------------------------------------------------------
    async def ready(self) -> dict:
        """`{"ready": bool, "engines": [per-replica load state]}`; an unreachable replica counts as not ready."""
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].ready.remote() for k in keys), return_exceptions=True)
        engines = []
        for (role, idx), res in zip(keys, results):
            if isinstance(res, BaseException):
                res = {"role": role, "replica": idx, "state": "unreachable", "ready": False,
                       "error": type(res).__name__}
            engines.append(res)
        return {"ready": all(e["ready"] for e in engines), "engines": engines}

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
