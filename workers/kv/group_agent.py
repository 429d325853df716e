"""`GroupTransferAgent`: the engine's pair wiring over a tp group's shards.

Each `ShardWorker` hosts the `TransferAgent` of its own KV pages (workers/kv/agent.py) and a `KVWorker` that runs
each step's KV commands on it (workers/kv/worker.py): per-request transfer work rides the step. What is left to
call on the shards directly are the per-pair calls (listen, connect, wait_ready, drop, broken), the test fault
channel and the bookkeeping check; this class fans them out (docs/disaggregation.md). It needs nothing of the
executors but the error a dead shard raises.
"""
from __future__ import annotations

from collections.abc import Sequence

import ray

from workers.executor.base import GroupError, cause_of
from workers.kv.config import TransferConfig


def _unwrap(e: BaseException, what: str) -> BaseException:
    """The error a shard's transfer call raised, as itself (ValueError, KeyError... with their own message),
    so the engine handles it as it would an in-process agent's; a dead shard becomes a `GroupError`."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and not isinstance(e, ray.exceptions.RayActorError):
        return cause
    return GroupError(f"{what}: {cause_of(e)}")


class GroupTransferAgent:
    """The pair calls of a `TransferAgent`, for the shards of one tp group (`ShardWorker` actors sharing page
    ids), every call fanned out to all shards at once (one round trip). Each shard hosts its own agent over its
    KV pages (its tp rank's heads), so pages never leave the process that holds them.

    Pairs: `listen` returns every shard's routes and addresses (rank order); `connect` hands the whole list
    to every shard, and each joins the routes whose source is its tp rank. Settle listeners cannot cross
    processes (`add_listener` records nothing): the engine learns of settled transfers from its steps' KV events.
    """

    def __init__(self, actors: Sequence, *, role: str, num_kv_heads: int, config: TransferConfig) -> None:
        self.actors = list(actors)
        self.role = role
        self.config = config
        self.shards = self._fan("kv_init", role, num_kv_heads, config)  # [{"tp", "tp_rank", "host"}]

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
                errors.append(_unwrap(e, f"tp rank {rank}: transfer call {args[0] if args else method}"))
        return out, errors

    def _fan(self, method: str, *args) -> list:
        out, errors = self._fan_each(method, *args)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return out

    def _control(self, method: str, *args) -> list:
        return self._fan("kv_control", method, *args)

    # ---- pairs ----------------------------------------------------------------------------------------------
    def listen(self, group: str, remote_tp: int) -> list:
        return [x for shard in self._control("listen", group, remote_tp) for x in shard]

    def connect(self, group: str, listened: Sequence) -> None:
        self._control("connect", group, list(listened))

    def wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        self._control("wait_ready", timeout_s, group)

    def drop(self, group: str) -> None:
        self._control("drop", group)

    def broken(self, group: str) -> str | None:
        return next((f"rank {r}: {why}" for r, why in enumerate(self._control("broken", group)) if why), None)

    def set_faults(self, faults: dict[str, str]) -> None:
        self._control("set_faults", dict(faults))

    def transfer_ids(self) -> list[list[str]]:
        """Per shard, the requests with transfer bookkeeping there (tests: none may be left)."""
        return self._control("transfer_ids")

    def add_listener(self, fn) -> None:
        pass  # settles happen in the shards' processes; the engine hears of them through its steps

    def close(self) -> None:
        self._fan_each("kv_close")  # a dead shard has nothing left to close
