"""One shard's end, driven by plain values (what a `ShardWorker` forwards): `TransferAgent`."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from msa.kv_cache import KVCache
from workers.kv.config import TransferConfig, TransferState
from workers.kv.endpoint import TransferResult
from workers.kv.faults import FaultyChannel
from workers.kv.receiver import KVReceiver
from workers.kv.routes import Route, kv_heads_of_rank, plan_routes
from workers.kv.sender import KVSender
from workers.kv.transport import PairChannel
from workers.kv.wire import KVHeader, Segment, plan_chunks
from workers.stats import TransferStats


class UnwiredGroupError(ValueError):
    """A request names a remote group this shard has no pairs with (never wired, or dropped since: its peer
    replica restarted and the router re-wires it under a new name). Not the client's fault: retryable."""


class TransferAgent:
    """One shard's end of disaggregation: its pairs to the shards of remote groups and its per-request sends
    or receives. Every argument and result is a plain value, so a `ShardWorker` actor can host it and forward
    the calls unchanged (`workers.kv.group_agent.GroupTransferAgent` is the engine's side of that); the engine calls one
    agent per shard with the same page ids (a group's shards share page ids).

    role "prefill" holds a `KVSender`, "decode" a `KVReceiver`. Pairs are grouped by the remote group's name
    (the router's choice, e.g. "decode-0#2": replica decode-0, pair generation 2); each pair is a peer named
    "<group>/<remote tp rank>". The routes come from `plan_routes(num_kv_heads, prefill_tp, decode_tp)`: this
    shard takes the ones whose `dst` (decode) or `src` (prefill) is its tp rank. A prefill shard that has no
    route into a group (tp > KV heads: another replica of its heads sends them) has nothing to do for it:
    its sends there are recorded as DONE at once, with 0 bytes.

    A decode replica with attention DP has one receiving tp group per dp rank; what its `listen` returns is
    tagged with the dp rank (a "dp" key in each route dict), and `connect` then makes one sub-group per dp rank,
    named `dp_group(group, dp_rank)`: a request is sent to the sub-group of the dp rank that admitted it.
    `drop`, `broken` and `wait_ready` of `group` cover its sub-groups.
    """

    def __init__(self, kv: KVCache, *, role: str, num_kv_heads: int, tp: int = 1, tp_rank: int = 0,
                 config: TransferConfig = TransferConfig(), host: str = "127.0.0.1") -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: a transfer agent is 'prefill' or 'decode', got {role!r}")
        self.role, self.tp, self.tp_rank, self.num_kv_heads = role, tp, tp_rank, num_kv_heads
        self.config, self.host = config, host
        first, _count = kv_heads_of_rank(num_kv_heads, tp, tp_rank)
        cls = KVSender if role == "prefill" else KVReceiver
        self.end: KVSender | KVReceiver = cls(kv, kv_head_start=first, config=config)
        device = kv.k[0].device
        self.backend = ("nccl" if config.nccl == "direct" else "torch-nccl") if device.type == "cuda" else "gloo"
        self.device = device
        self.faults: dict[str, str] = {}  # transfer id -> FaultyChannel kind, on this side's channels (tests)
        self._groups: dict[str, list[str]] = {}
        self._dp_groups: dict[str, list[str]] = {}  # group -> its per-dp-rank sub-groups (connect)
        self._idle: dict[str, int] = {}  # transfer id -> page count: sends this shard had no route for

    @staticmethod
    def dp_group(group: str, dp_rank: int) -> str:
        """The name of dp rank `dp_rank`'s receivers within decode group `group`."""
        return f"{group}.dp{dp_rank}"

    def _channel_timeout(self) -> float:
        # must outlast one transfer (our own deadline acts first) and the pair's opening
        return max(2 * self.config.timeout_s, self.config.connect_timeout_s)

    # --- pairs ---
    def listen(self, group: str, remote_tp: int) -> list[tuple[dict, tuple[str, int]]]:
        """Decode side: host one pair per route from prefill group `group` (tp `remote_tp`) into this shard;
        returns [(route as a dict, address)] for the prefill shards to `connect`."""
        if self.role != "decode":
            raise ValueError("listen: only a decode shard listens")
        self.drop(group)
        out, names = [], []
        for r in plan_routes(self.num_kv_heads, remote_tp, self.tp):
            if r.dst != self.tp_rank:
                continue
            ch = PairChannel.listen(host=self.host, backend=self.backend, device=self.device,
                                    timeout_s=self._channel_timeout())
            name = f"{group}/{r.src}"
            self.end.add_peer(name, ch, r)
            names.append(name)
            out.append((dict(r.__dict__), ch.address))
        self._groups[group] = names
        return out

    def connect(self, group: str, listened: Sequence[tuple[dict, tuple[str, int]]]) -> None:
        """Prefill side: join the pairs that decode group `group`'s shards listen on, for this shard's routes.
        Entries tagged with a dp rank (a "dp" key) go to that dp rank's sub-group `dp_group(group, dp)`."""
        if self.role != "prefill":
            raise ValueError("connect: only a prefill shard connects")
        self.drop(group)
        by_group: dict[str, list[tuple[Route, tuple[str, int]]]] = {}
        for route_dict, address in listened:
            fields = dict(route_dict)
            dp = fields.pop("dp", None)
            by_group.setdefault(group if dp is None else self.dp_group(group, int(dp)), []).append(
                (Route(**fields), tuple(address)))
        for name_of_group, routes in by_group.items():
            names = []
            for r, address in routes:
                if r.src != self.tp_rank:
                    continue
                ch = PairChannel.connect(address, backend=self.backend, device=self.device,
                                         timeout_s=self._channel_timeout(), local_host=self.host)
                name = f"{name_of_group}/{r.dst}"
                self.end.add_peer(name, FaultyChannel(ch, self.faults), r)
                names.append(name)
            self._groups[name_of_group] = names
        subs = [g for g in by_group if g != group]
        if subs:
            self._dp_groups[group] = subs

    def _family(self, group: str) -> list[str]:
        """`group` and its dp sub-groups, those that exist."""
        return [g for g in (group, *self._dp_groups.get(group, ())) if g in self._groups]

    def wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        """Block until the pairs (of `group` and its dp sub-groups, else all) are open."""
        peers = None if group is None else [n for g in self._family(group) for n in self._groups[g]]
        self.end.wait_ready(timeout_s, peers=peers)

    def drop(self, group: str) -> None:
        """Close every pair of `group` (and its dp sub-groups): replaced by a newer generation, or the remote
        replica is gone."""
        for g in self._family(group):
            for name in self._groups.pop(g, []):
                self.end.remove_peer(name)
        self._dp_groups.pop(group, None)

    @property
    def groups(self) -> list[str]:
        return list(self._groups)

    def broken(self, group: str) -> str | None:
        """Why a pair of `group` (or of its dp sub-groups) is broken (None if all are usable; 'unknown group'
        if there is none)."""
        family = self._family(group)
        if not family:
            return f"unknown group {group!r}"
        bad = self.end.broken_peers()
        return next((f"{n}: {bad[n]}" for g in family for n in self._groups[g] if n in bad), None)

    def set_faults(self, faults: Mapping[str, str]) -> None:
        """Inject faults by transfer id (FaultyChannel kinds) on this prefill shard's pairs; {} clears."""
        bad = {k: v for k, v in faults.items() if v not in FaultyChannel.KINDS}
        if bad:
            raise ValueError(f"faults: unknown kinds {bad}; known {FaultyChannel.KINDS}")
        self.faults.clear()
        self.faults.update(faults)

    # --- requests ---
    def _peers(self, group: str) -> list[str]:
        names = self._groups.get(group)
        if names is None:
            hint = f"; it is split by dp rank: {self._dp_groups[group]}" if group in self._dp_groups else ""
            raise UnwiredGroupError(f"group: no pairs to {group!r} on this {self.role} shard (have "
                             f"{list(self._groups)}){hint}")
        return names

    def prepare(self, transfer_id: str, page_ids: Sequence[int], group: str) -> None:
        peers = self._peers(group)
        if not peers:
            raise ValueError(f"group: {group!r} has no pairs into this decode shard")
        self.end.prepare_receive(transfer_id, page_ids, peers=peers)

    def send_many(self, items: Sequence[tuple[str, Sequence[int], dict | None]], group: str,
                  withdrawn: Sequence[str] = ()) -> None:
        """Send requests' pages (transfer id, page ids, meta) to `group` as one payload per pair (the engine sends
        what one step handed off); `withdrawn`: requests announced to `group` that are not sent after all."""
        peers = self._peers(group)
        if not peers:  # another replica of this shard's heads sends them: nothing to move from here
            busy = [t for t, _ids, _m in items if t in self._idle or t in self.end._ops]
            if busy:
                raise ValueError(f"request_id: {busy[0]!r} already has a transfer on this prefill")
            for transfer_id, page_ids, _meta in items:
                self._idle[transfer_id] = len(page_ids)
            for transfer_id in withdrawn:
                self._idle[transfer_id] = 0
            return
        self.end.send_many(items, peers=peers, withdrawn=withdrawn)

    def announce(self, items: Sequence[tuple[str, Sequence[int]]], group: str) -> None:
        """Before the prefill step that writes their last pages: the headers of requests (transfer id, page
        ids) go to `group` now (`KVSender.announce`); `send_many` must follow for each, with or `withdrawn`."""
        peers = self._peers(group)
        if peers:  # else nothing moves from this shard (see send_many)
            self.end.announce(items, peers=peers)

    def _idle_result(self, transfer_id: str) -> TransferResult:
        return TransferResult(request_id=transfer_id, state=TransferState.DONE, settled=True,
                              num_pages=self._idle[transfer_id])

    def result(self, transfer_id: str) -> TransferResult:
        if transfer_id in self._idle:
            return self._idle_result(transfer_id)
        return self.end.result(transfer_id)

    def results(self, transfer_ids: Sequence[str]) -> list[TransferResult]:
        """`result` of each id (one call for all of a poll: a remote shard answers them in one round trip)."""
        return [self.result(t) for t in transfer_ids]

    def abort(self, transfer_id: str) -> bool:
        if transfer_id in self._idle:
            return True
        return self.end.abort(transfer_id)

    def release(self, transfer_id: str) -> TransferResult:
        if transfer_id in self._idle:
            res = self._idle_result(transfer_id)
            del self._idle[transfer_id]
            return res
        return self.end.release(transfer_id)

    def transfer_ids(self) -> list[str]:
        """Requests with bookkeeping on this shard (not released yet)."""
        with self.end._cond:
            return [*self.end._ops, *self._idle]

    def pop_stats(self) -> list[TransferStats]:
        return self.end.pop_stats()

    @staticmethod
    def combine(transfer_id: str, results: Sequence[TransferResult]) -> TransferResult:
        """One request over several shards: FAILED if any failed (reasons joined), DONE only if every shard is
        DONE, else TRANSFERRING (or PENDING if none started); settled when every shard is; bytes summed,
        seconds the longest shard's, each phase mark the latest shard's."""
        if len(results) == 1:
            return results[0]
        states = [r.state for r in results]
        failed = [r for r in results if r.state is TransferState.FAILED]
        if failed:
            state = TransferState.FAILED
        elif all(s is TransferState.DONE for s in states):
            state = TransferState.DONE
        elif all(s is TransferState.PENDING for s in states):
            state = TransferState.PENDING
        else:
            state = TransferState.TRANSFERRING
        return TransferResult(request_id=transfer_id, state=state, settled=all(r.settled for r in results),
                              reason="; ".join(r.reason for r in failed if r.reason) or None,
                              num_bytes=sum(r.num_bytes for r in results),
                              seconds=max(r.seconds for r in results),
                              num_pages=max(r.num_pages for r in results),
                              marks={k: max(r.marks[k] for r in results if k in r.marks)
                                     for k in {k for r in results for k in r.marks}},
                              meta=next((r.meta for r in results if r.meta is not None), None))

    def add_listener(self, fn) -> None:
        self.end.add_listener(fn)

    def close(self) -> None:
        for group in list(self._groups):
            self.drop(group)
        self.end.close()


__all__ = ["TransferConfig", "TransferState", "TransferResult", "Route", "plan_routes", "kv_heads_of_rank",
           "KVHeader", "Segment", "plan_chunks", "KVSender", "KVReceiver", "FaultyChannel", "TransferAgent",
           "UnwiredGroupError"]
