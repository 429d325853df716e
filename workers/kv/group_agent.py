"""`GroupTransferAgent`: the engine's end of disaggregation over a tp group's shards.

Each `ShardWorker` hosts the `TransferAgent` of its own KV pages (workers/kv/agent.py), and the engine's transfer
calls fan out to them (docs/disaggregation.md). It needs nothing of the executors but the error a dead shard
raises.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import ray

from workers.executor.base import GroupError, cause_of
from workers.stats import TransferStats
from workers.kv.agent import TransferAgent
from workers.kv.config import TransferConfig
from workers.kv.endpoint import TransferResult


def _unwrap(e: BaseException, what: str) -> BaseException:
    """The error a shard's transfer call raised, as itself (ValueError, KeyError... with their own message),
    so the engine handles it as it would an in-process agent's; a dead shard becomes a `GroupError`."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and not isinstance(e, ray.exceptions.RayActorError):
        return cause
    return GroupError(f"{what}: {cause_of(e)}")


class GroupTransferAgent:
    """The engine's transfer agent for the shards of one tp group (`ShardWorker` actors sharing page ids):
    the `TransferAgent` API, every call fanned out to all shards at once, answers combined per request (DONE
    only when every shard is DONE, FAILED if any failed, bytes summed; `TransferAgent.combine`). Each shard
    hosts its own `TransferAgent` over its KV pages (its tp rank's heads), so pages never leave the process
    that holds them: a shard's pairs and sends run there.

    Pairs: `listen` returns every shard's routes and addresses (rank order); `connect` hands the whole list
    to every shard, and each joins the routes whose source is its tp rank.

    Cost: one round trip per call (the shards answer in parallel). `results` answers every request of an
    engine poll at once and brings back the stats records settled so far; `pop_stats` gives one record per
    released transfer (bytes summed over the shards' pairs, seconds the slowest), as an in-process single
    shard does. Settle listeners cannot cross processes: the engine polls (the AsyncEngine step loop wakes
    every TRANSFER_POLL_S while transfers are pending), so `add_listener` records nothing.
    """

    def __init__(self, actors: Sequence, *, role: str, num_kv_heads: int, config: TransferConfig) -> None:
        self.actors = list(actors)
        self.role = role
        self.config = config
        self.shards = self._fan("kv_init", role, num_kv_heads, config)  # [{"tp", "tp_rank", "host"}]
        self._records: dict[str, list[TransferStats]] = {}  # per-shard, per-pair records by transfer id
        self._ready: list[TransferStats] = []  # one combined record per released transfer

    # ---- fan-out --------------------------------------------------------------------------------------------
    def _fan_each(self, method: str, *args) -> tuple[list, list[BaseException | None]]:
        """Call `method` on every shard at once; (answers, errors) in rank order. Every call has ended when
        this returns, so no half-done call is left behind a raised error."""
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        out: list = []
        errors: list[BaseException | None] = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
                errors.append(None)
            except Exception as e:
                out.append(None)
                errors.append(_unwrap(e, f"tp rank {rank}: transfer call {method}"))
        return out, errors

    def _fan(self, method: str, *args) -> list:
        out, errors = self._fan_each(method, *args)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return out

    # ---- pairs ----------------------------------------------------------------------------------------------
    def listen(self, group: str, remote_tp: int) -> list:
        return [x for shard in self._fan("kv_listen", group, remote_tp) for x in shard]

    def connect(self, group: str, listened: Sequence) -> None:
        self._fan("kv_connect", group, list(listened))

    def wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        self._fan("kv_wait_ready", timeout_s, group)

    def drop(self, group: str) -> None:
        self._fan("kv_drop", group)

    def broken(self, group: str) -> str | None:
        return next((f"rank {r}: {why}" for r, why in enumerate(self._fan("kv_broken", group)) if why), None)

    def set_faults(self, faults: dict[str, str]) -> None:
        self._fan("kv_set_faults", dict(faults))

    # ---- requests -------------------------------------------------------------------------------------------
    def prepare(self, transfer_id: str, page_ids: Sequence[int], group: str) -> None:
        """Every shard expects its heads of the request's KV; if one cannot, the others let go again."""
        _out, errors = self._fan_each("kv_prepare", transfer_id, list(page_ids), group)
        if any(errors):
            self._undo(transfer_id, [r for r, e in enumerate(errors) if e is None])
            raise next(e for e in errors if e is not None)

    def send_many(self, items: Sequence[tuple[str, Sequence[int], dict | None]], group: str) -> None:
        """Every shard sends its routes' heads of each request's pages (after the step that wrote them), as one
        payload per pair, each request's `meta` in the header. If one shard cannot (no pairs to `group` there),
        the others' sends are aborted and waited for before this raises, so the caller may free the pages."""
        plain = [(t, list(ids), meta) for t, ids, meta in items]
        _out, errors = self._fan_each("kv_send_many", plain, group)
        if any(errors):
            ok_ranks = [r for r, e in enumerate(errors) if e is None]
            for transfer_id, _ids, _meta in plain:
                self._undo(transfer_id, ok_ranks)
            raise next(e for e in errors if e is not None)

    def _undo(self, transfer_id: str, ranks: list[int]) -> None:
        """Abort the request on these shards, wait until it settled there (bounded), release it."""
        if not ranks:
            return
        actors = [self.actors[r] for r in ranks]
        try:
            settled = ray.get([a.kv_abort.remote(transfer_id) for a in actors])
            deadline = time.monotonic() + self.config.timeout_s + 1.0
            while not all(settled) and time.monotonic() < deadline:  # an op mid-payload finishes its bytes
                time.sleep(0.01)
                settled = [res[0][0].settled for res in ray.get([a.kv_poll.remote([transfer_id]) for a in actors])]
        except Exception:
            pass  # a dead shard: nothing of it reads or writes pages any more
        for a in actors:
            try:
                ray.get(a.kv_release.remote(transfer_id))
            except Exception:
                pass  # not settled in time (or dead): that shard keeps the bookkeeping

    def results(self, transfer_ids: Sequence[str]) -> list[TransferResult]:
        """Each request's result over all shards: one round trip for all of them."""
        ids = list(transfer_ids)
        answers = self._fan("kv_poll", ids)
        for _results, records in answers:
            self._keep(records)
        return [TransferAgent.combine(tid, [results[i] for results, _ in answers]) for i, tid in enumerate(ids)]

    def result(self, transfer_id: str) -> TransferResult:
        return self.results([transfer_id])[0]

    def abort(self, transfer_id: str) -> bool:
        """Abort on every shard; True when it is settled on all of them (the pages may be freed)."""
        return all(self._fan("kv_abort", transfer_id))

    def release(self, transfer_id: str) -> TransferResult:
        out, errors = self._fan_each("kv_release", transfer_id)
        done = [x for x in out if x is not None]
        for _res, records in done:
            self._keep(records)
        records = self._records.pop(transfer_id, [])
        if records:
            self._ready.append(TransferStats(request_id=transfer_id, num_bytes=sum(s.num_bytes for s in records),
                                             seconds=max(s.seconds for s in records),
                                             num_pages=max(s.num_pages for s in records),
                                             ok=all(s.ok for s in records)))
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return TransferAgent.combine(transfer_id, [res for res, _ in done])

    def _keep(self, records: list[TransferStats]) -> None:
        for s in records:
            self._records.setdefault(s.request_id, []).append(s)

    def pop_stats(self) -> list[TransferStats]:
        out, self._ready = self._ready, []
        return out

    def transfer_ids(self) -> list[list[str]]:
        """Per shard, the requests with transfer bookkeeping there (tests: none may be left)."""
        return self._fan("kv_transfer_ids")

    def add_listener(self, fn) -> None:
        pass  # settles happen in the shards' processes; the engine polls

    def close(self) -> None:
        self._fan_each("kv_close")  # a dead shard has nothing left to close
