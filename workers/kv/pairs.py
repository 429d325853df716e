"""`KVPairs`: an engine core's pair wiring to remote groups, over its shards' transfer agents.

Pairs are per (remote group, shard pair), not per request, so they stay control calls on the agents (a worker
group's go through `GroupTransferAgent`); each shard's agent takes the routes of its tp rank, and the lists here
cover every shard. The router wires them (deploy/wiring.py) through the engine's `kv_listen` / `kv_connect` /
`kv_drop` / `kv_broken`.
"""
from __future__ import annotations

from collections.abc import Sequence

from workers.kv.agent import TransferAgent


class KVPairs:
    """The pairs of one engine core (or dp rank) with remote groups, by the names requests use."""

    def __init__(self, agents: Sequence) -> None:
        self.agents = list(agents)
        # decode: prefill group -> its per-prefill-dp-rank sub-groups (a prefill with attention DP, listen)
        self._split: dict[str, list[str]] = {}
        # the remote groups this engine has pairs with, by every name a request may give (a group and its dp
        # sub-groups): the replica answers "not wired" before it starts a request that names another (its peer
        # restarted and the router has not re-wired it yet), instead of failing it half way
        self._wired: dict[str, set[str]] = {}

    def listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        """Decode role: open the pairs from prefill group `group` (tp `remote_tp`); returns what its shards
        `connect` to: [(route as a dict, (host, port))].

        A prefill group with attention DP (`remote_dp` > 1) sends each request from the shards of the dp rank
        that ran it, so each of its dp ranks needs pairs of its own: they are opened under the sub-group
        `TransferAgent.dp_group(group, q)` and each entry is tagged "src_dp": q (the prefill engine hands dp
        rank q its entries). A request that prefill dp rank q computes is admitted under that sub-group;
        `drop`, `broken` and `wait_ready` of `group` cover all of them."""
        if remote_dp == 1:
            out = [x for agent in self.agents for x in agent.listen(group, remote_tp)]
            self._wired[group] = {group}
            return out
        self.drop(group)  # a previous listen of this name (split or not)
        subs = [TransferAgent.dp_group(group, q) for q in range(remote_dp)]
        self._split[group] = subs
        out = [({**route, "src_dp": q}, address) for q, sub in enumerate(subs) for agent in self.agents
               for route, address in agent.listen(sub, remote_tp)]
        self._wired[group] = {group, *subs}
        return out

    def _family(self, group: str) -> list[str]:
        """The pair groups behind the name `group`: its prefill-dp sub-groups when split, else itself."""
        return self._split.get(group, [group])

    def connect(self, group: str, listened: list) -> None:
        """Prefill role: join the pairs decode group `group` listens on (returns at once; see wait_ready)."""
        tagged = sorted({route["src_dp"] for route, _address in listened if "src_dp" in route})
        if tagged:  # the decode side opened pairs per prefill dp rank: a DPEngine hands each rank its own
            raise ValueError(f"listened: pairs for prefill dp ranks {tagged}, but this prefill engine has dp=1 "
                             f"(the decode side must listen with remote_dp=1)")
        for agent in self.agents:
            agent.connect(group, listened)
        dps = {int(route["dp"]) for route, _address in listened if "dp" in route}
        self._wired[group] = {group, *(TransferAgent.dp_group(group, d) for d in dps)}

    def wired(self, group: str) -> bool:
        """Whether this engine has pairs with `group` (by its name or a dp sub-group's); a replica that
        restarted has none until the router wires it again. Reads a dict only: safe off the step thread."""
        return any(group in names for names in list(self._wired.values()))

    def wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        for g in [None] if group is None else self._family(group):
            for agent in self.agents:
                agent.wait_ready(timeout_s, g)

    def drop(self, group: str) -> None:
        self._wired.pop(group, None)
        for g in self._split.pop(group, [group]):
            for agent in self.agents:
                agent.drop(g)

    def broken(self, group: str) -> str | None:
        return next((why for g in self._family(group) for agent in self.agents if (why := agent.broken(g))), None)

