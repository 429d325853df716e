"""The KV pairs one router opens between its prefill and decode engine replicas, and their re-wiring.

A pair (prefill replica, decode replica) is opened by the router: the decode replica listens (`kv_listen`), the
prefill replica connects (`kv_connect`) and waits until the pairs are open (docs/disaggregation.md). Each side
knows the other by a group name that carries the router's id and a generation (`decode-0#<router>.<gen>`), so
several routers never share or tear down each other's pairs, and a replaced pair never reuses a name.

Pairs live in the replicas' processes, so they die with one. A replica that Serve restarted (after `kill -9`, a
dead step thread, a failed health check) comes back under the same deployment name with no pairs at all, and its
survivor still holds the dead pair. Each `EngineServer` has an instance id (new per process) in its `ready()`
answer; the wiring records both ends' ids when it opens a pair, and a pair whose ends changed (or went down) is
dropped on the side that is still there and opened again, at the next generation, as soon as both ends are ready.
The router runs that check every `WATCH_S` (`start_watchdog`, from its first disaggregated request or `/health`
probe on), on every `/health` probe (`ready`) and when a replica answers `kv_unwired` (a request reached it before
the watchdog did: `rewire_now`). `wired` is False while any
pair is missing: `/health` is not ready then.
"""
from __future__ import annotations

import asyncio
import logging

from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("m3serve.router")

WATCH_S = 1.0  # how often the router asks its engine replicas who they are (one cheap call per replica)

ReplicaKey = tuple[str, int]  # (role, index)
PairKey = tuple[ReplicaKey, ReplicaKey]  # (prefill replica, decode replica)


class Wiring:
    """The open KV pairs of one router, by (prefill replica, decode replica): their generation and the instance
    ids of the two ends they were opened between."""

    def __init__(self, engines: dict[ReplicaKey, DeploymentHandle], router_id: str, prefill_tp: int,
                 prefill_dp: int) -> None:
        self._engines = engines
        self._id = router_id
        self._prefill_tp, self._prefill_dp = prefill_tp, prefill_dp
        self._gens: dict[PairKey, int] = {}  # open pairs: generation
        self._ends: dict[PairKey, tuple[str, str]] = {}  # open pairs: (prefill, decode) instance ids when opened
        self._next: dict[PairKey, int] = {}  # the generation the next opening of a pair gets
        # latest known instance id of each replica while it is ready (None: down, loading or unreachable)
        self._instances: dict[ReplicaKey, str | None] = {}
        self._lock: asyncio.Lock | None = None
        self._watchdog: asyncio.Task | None = None

    # -- what is open ---------------------------------------------------------------------------------------
    def group(self, key: ReplicaKey, gen: int) -> str:
        """The name one side of a pair knows the other replica's shards by."""
        return f"{key[0]}-{key[1]}#{self._id}.{gen}"

    def want(self) -> list[PairKey]:
        return [(p, d) for p in self.prefills() for d in self._role("decode")]

    def prefills(self) -> list[ReplicaKey]:
        return self._role("prefill")

    def decodes_of(self, p: ReplicaKey) -> list[ReplicaKey]:
        """The decode replicas prefill replica `p` has an open pair with."""
        return [d for d in self._role("decode") if (p, d) in self._gens]

    def _role(self, role: str) -> list[ReplicaKey]:
        return [k for k in self._engines if k[0] == role]

    def generation(self, p: ReplicaKey, d: ReplicaKey) -> int | None:
        """The open pair's generation; None while it is not wired."""
        return self._gens.get((p, d))

    def _current(self, pair: PairKey) -> bool:
        """Open between the instances the ends have now (as far as this router knows)."""
        if pair not in self._gens:
            return False
        p, d = pair
        ends = (self._instances.get(p, self._ends[pair][0]), self._instances.get(d, self._ends[pair][1]))
        return ends == self._ends[pair]

    def stale(self) -> list[PairKey]:
        """Pairs to (re-)open: missing, or opened between instances that are gone."""
        return [pair for pair in self.want() if not self._current(pair)]

    @property
    def wired(self) -> bool:
        return not self.stale()

    def as_dict(self) -> dict[str, int]:
        return {f"{p[0]}-{p[1]}->{d[0]}-{d[1]}": g for (p, d), g in self._gens.items()}

    # -- who the replicas are -------------------------------------------------------------------------------
    def seen(self, key: ReplicaKey, state: dict | BaseException | None) -> None:
        """Record a replica's `ready()` answer (or the error calling it): its instance id while it is ready."""
        ok = isinstance(state, dict) and state.get("ready")
        self._instances[key] = state.get("instance") if ok else None

    async def probe(self) -> list[dict | BaseException]:
        """Ask every replica `ready()` now (recording who each is); the answers in `engines` order."""
        keys = list(self._engines)
        results = await asyncio.gather(*(self._engines[k].ready.remote() for k in keys), return_exceptions=True)
        for key, res in zip(keys, results):
            self.seen(key, res)
        return results

    # -- opening and replacing ------------------------------------------------------------------------------
    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def ensure(self, wait: bool = True) -> list[tuple[PairKey, BaseException]]:
        """(Re-)open every stale pair whose two ends are ready; drop those whose end went away. Returns the
        openings that failed (the pair stays unwired; the next check tries again). `wait=False` (a request):
        if a check is running already, go on with the pairs open now rather than wait for it."""
        if not self.stale() or (not wait and self._locked().locked()):
            return []
        async with self._locked():
            if any(k not in self._instances for pair in self.stale() for k in pair):
                await self.probe()  # a first call before any probe (the watchdog's or /health's)
            stale = self.stale()
            for pair in stale:
                if pair in self._gens:
                    await self._drop(pair)
            ready = [pair for pair in stale if all(self._instances.get(k) for k in pair)]
            results = await asyncio.gather(*(self._open(*pair) for pair in ready), return_exceptions=True)
        return [(pair, res) for pair, res in zip(ready, results) if isinstance(res, BaseException)]

    async def ensure_logged(self, wait: bool = True) -> None:
        """`ensure`, logging the openings that failed."""
        for pair, err in await self.ensure(wait):
            logger.warning("opening KV pair %s -> %s failed: %r", *pair, err)

    async def rewire_now(self) -> None:
        """A replica answered `kv_unwired` (it or its peer restarted, and the watchdog has not seen it yet)."""
        await self.probe()
        await self.ensure_logged()

    def start_watchdog(self) -> None:
        """From now on, every `WATCH_S`, ask who the replicas are and re-wire the pairs of one that restarted,
        traffic or not (once per router; a call while it runs changes nothing)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.probe()
                await self.ensure_logged()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("KV pair watchdog")
            await asyncio.sleep(WATCH_S)

    async def _open(self, p: ReplicaKey, d: ReplicaKey) -> None:
        pair = (p, d)
        gen = self._next.get(pair, 0)
        self._next[pair] = gen + 1  # never reused, even when this opening fails
        ends = (self._instances[p], self._instances[d])
        listened = await self._engines[d].kv_listen.remote(self.group(p, gen), self._prefill_tp, self._prefill_dp)
        try:
            await self._engines[p].kv_connect.remote(self.group(d, gen), listened)
        except BaseException:
            await self._drop_on(d, self.group(p, gen))  # the half that listened
            await self._drop_on(p, self.group(d, gen))
            raise
        self._gens[pair] = gen
        self._ends[pair] = ends
        logger.info("KV pair %s -> %s open (generation %d)", p, d, gen)

    async def _drop(self, pair: PairKey) -> None:
        """Forget an open pair and close it on both ends (an end that is gone has nothing to close)."""
        p, d = pair
        gen = self._gens.pop(pair)
        ends = self._ends.pop(pair)
        logger.warning("KV pair %s -> %s (generation %d) dropped: an end restarted or went away", p, d, gen)
        await self._close(pair, gen, ends)

    async def _close(self, pair: PairKey, gen: int, ends: tuple[str, str]) -> None:
        """Close generation `gen` of `pair` where the process that opened it still runs: a restarted end has no
        such pair, and a call to a replica that is restarting would wait until it is up."""
        p, d = pair
        await asyncio.gather(*(self._drop_on(key, self.group(other, gen))
                               for key, other, was in ((p, d, ends[0]), (d, p, ends[1]))
                               if self._instances.get(key) == was))

    async def _drop_on(self, key: ReplicaKey, group: str) -> None:
        try:
            await self._engines[key].kv_drop.remote(group)
        except Exception as e:  # noqa: BLE001 - that replica is gone or restarted: its pairs went with it
            logger.info("kv_drop of %s on %s: %r", group, key, e)

    async def repair(self, p: ReplicaKey, d: ReplicaKey) -> None:
        """After a failed transfer: if either end of the pair broke (or is gone), replace it by the next
        generation (a refused or aborted transfer leaves the pair in step: kept)."""
        pair = (p, d)
        gen = self._gens.get(pair)
        if gen is None:
            return
        broken = await asyncio.gather(self._engines[p].kv_broken.remote(self.group(d, gen)),
                                      self._engines[d].kv_broken.remote(self.group(p, gen)),
                                      return_exceptions=True)
        if not any(broken):
            return
        async with self._locked():
            if self._gens.get(pair) != gen:
                return  # someone replaced it already
            logger.warning("KV pair %s -> %s broken (%s); replacing generation %d", p, d, broken, gen)
            if any(isinstance(b, BaseException) for b in broken):  # an end is unreachable: ask who is there
                await self.probe()
            ends = self._ends[pair]
            try:
                if all(self._instances.get(k) for k in pair):
                    await self._open(p, d)
            except Exception as e:  # noqa: BLE001 - stays unwired; the watchdog tries again
                logger.warning("re-opening KV pair %s -> %s failed: %r", p, d, e)
            if self._gens.get(pair) == gen:  # not replaced: unwired until the watchdog opens it
                self._gens.pop(pair)
                self._ends.pop(pair)
            await self._close(pair, gen, ends)
