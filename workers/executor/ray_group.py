"""A worker group: one model instance spread over `tp * dp` `ShardWorker` actors (docs/parallelism.md).

`WorkerGroup` places the shards (a placement group, one bundle per shard), assigns world ranks (rank r is tp
rank r % tp of dp rank r // tp), wires the rendezvous (rank 0 serves a TCPStore on a free port of its node),
has every rank join the process groups and load its own weight slices, and runs steps: each dp rank gets its
own batch, every tp rank of a dp rank the same one, and the result of each dp rank's tp rank 0 (the one that
samples) comes back. A step is one Ray call per rank; the batch of a dp rank is pickled once, not once per rank.

`GroupExecutor` is the engine's executor for dp = 1 (tp and/or ep > 1): the engine is unchanged, its one
batch goes to every rank. dp > 1 is `workers.dp.DPEngine`, over one `WorkerGroup`.
"""
from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray

from msa.parallel import MOE_DISPATCH_MODES
from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig
from workers.executor.base import GroupError, cause_of
from workers.executor.local import LocalExecutor
from workers.kv.commands import combine_events
from workers.kv.group_agent import GroupTransferAgent
from workers.runner import StepResult
from workers.kv.config import TransferConfig

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DISPATCH_MODES = ("compiled", "rpc")


class GroupStartError(RuntimeError):
    """A worker group could not start: its placement was not granted in time, or a rank failed to start."""


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """How a worker group is placed and started.

    num_cpus_per_shard: Ray CPUs per shard bundle (a GPU shard takes one GPU besides). strategy: placement
    strategy; None = STRICT_PACK (every shard on one node) when some node can hold the whole group, else PACK.
    placement_timeout_s: how long to wait for the cluster to grant the bundles. start_timeout_s: how long the
    ranks may take to join the process group and load their weights. collective_timeout_s: the process
    groups' timeout (a collective stuck longer fails). moe_dispatch: "alltoall" | "allreduce" | "capacity" (ep > 1;
    msa/moe.py: "capacity" is the all-to-all a CUDA graph can hold).
    dispatch: how a step reaches the ranks. "compiled" (default): a Ray Compiled Graph over every rank,
    compiled once at start; a step writes each dp rank's batch into shared-memory channels (measured ~0.2 ms
    for two ranks on CPU vs ~1.5 ms for plain calls). "rpc": one plain actor call per rank per step; a rank
    that fails is reported at once, where with "compiled" a rank that raises leaves its peers in their
    collective until collective_timeout_s (a rank that dies is still reported at once).
    """

    num_cpus_per_shard: float = 1.0
    strategy: str | None = None
    placement_timeout_s: float = 60.0
    start_timeout_s: float = 600.0
    collective_timeout_s: float = 600.0
    moe_dispatch: str = "alltoall"
    dispatch: str = "compiled"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch: {self.dispatch!r} is not one of {DISPATCH_MODES}")
        if self.num_cpus_per_shard < 0:
            raise ValueError(f"num_cpus_per_shard: must be >= 0, got {self.num_cpus_per_shard}")
        if self.strategy is not None and self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {PLACEMENT_STRATEGIES}")
        for name in ("placement_timeout_s", "start_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.moe_dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe_dispatch: {self.moe_dispatch!r} is not one of {MOE_DISPATCH_MODES}")


def _fits_one_node(bundles: list[dict[str, float]]) -> bool:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return any(n.get("Alive") and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in need.items())
               for n in ray.nodes())


class WorkerGroup:
    """`parallel.world_size` ShardWorker actors running one model instance. Raises `GroupStartError` (naming
    the rank and its cause, or the placement) when it cannot start; everything it made is released then."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, parallel: ParallelConfig,
                 device: str = "cpu", options: GroupOptions = GroupOptions()) -> None:
        if not ray.is_initialized():
            raise RuntimeError(f"parallel: a worker group of {parallel.world_size} shards needs ray.init() first")
        self.parallel = parallel
        self.options = options
        self.world_size = parallel.world_size
        self.device = device
        self.lockstep = parallel.dp > 1 and parallel.ep > parallel.tp  # == ParallelContext.dp_ranks_in_lockstep
        self.actors: list = []
        self.placement_group = None
        self._dag = None  # the compiled step graph (dispatch="compiled")
        self._broken: str | None = None
        self._empty_payload = pickle.dumps(StepBatch(input_ids=[], chunks=[], sample_chunks=[], rows=[],
                                                     released_seq_ids=[]), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._place()
            self._spawn(str(model_dir), engine_config)
            self.rank_info = self._start()
            if options.dispatch == "compiled":
                self._dag = self._compile()
        except BaseException:
            self.shutdown()
            raise
        self.num_pages = min(i["num_pages"] for i in self.rank_info)
        self.page_size = self.rank_info[0]["page_size"]

    # ---- start ------------------------------------------------------------------------------------------
    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.options.num_cpus_per_shard)} if self.options.num_cpus_per_shard else {}
        if self.device.startswith("cuda"):
            bundle["GPU"] = 1.0
        return bundle or {"CPU": 0.001}  # a bundle must ask for something

    def _place(self) -> None:
        from ray.util.placement_group import placement_group

        bundles = [self._bundle() for _ in range(self.world_size)]
        strategy = self.options.strategy or ("STRICT_PACK" if _fits_one_node(bundles) else "PACK")
        self.placement_group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=self.options.placement_timeout_s)
        if not ready:
            raise GroupStartError(
                f"placement: {self.world_size} shards of {bundles[0]} ({strategy}) were not granted within "
                f"{self.options.placement_timeout_s:g} s; the cluster has {ray.available_resources()} free")

    def _spawn(self, model_dir: str, engine_config: EngineConfig) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.shard import ShardWorker

        bundle = self._bundle()
        actor_cls = ray.remote(ShardWorker)
        # Ray gives each GPU actor its own device as cuda:0 (CUDA_VISIBLE_DEVICES)
        actor_device = "cuda" if self.device.startswith("cuda") else self.device
        p = self.parallel
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=rank)
            actor = actor_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                      scheduling_strategy=strategy,
                                      name=None).remote(model_dir, engine_config, actor_device, rank=rank,
                                                        parallel=p, moe_dispatch=self.options.moe_dispatch,
                                                        collective_timeout_s=self.options.collective_timeout_s)
            self.actors.append(actor)

    def _start(self) -> list[dict]:
        deadline = time.monotonic() + self.options.start_timeout_s
        host, port = self._wait({self.actors[0].open_rendezvous.remote(): 0}, deadline, "open the rendezvous")[0]
        calls = {a.start.remote(host, port): r for r, a in enumerate(self.actors)}
        return self._wait(calls, deadline, "start")

    def _wait(self, calls: dict, deadline: float | None, what: str) -> list:
        """Results of `calls` (ref -> rank) in rank order. The first failure raises at once, naming its rank,
        instead of waiting for peers that may be stuck in a collective with it."""
        results: dict[int, object] = {}
        pending = dict(calls)
        while pending:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                ranks = sorted(pending.values())
                raise GroupStartError(f"rank {ranks[0]}: did not {what} within {self.options.start_timeout_s:g} s "
                                      f"(ranks {ranks} still pending)")
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as e:
                    err = GroupStartError if deadline is not None else GroupError
                    raise err(f"rank {rank} of {self._describe()} failed to {what}: {cause_of(e)}") from e
        return [results[r] for r in sorted(results)]

    def _compile(self):
        """The step as a compiled graph: input = one pickled batch per dp rank; every rank reads its dp rank's
        and returns its result (None but on tp rank 0). Every rank runs every step: an idle dp rank gets the
        empty batch (an empty forward when in lockstep, else an immediate return)."""
        from ray.dag import InputNode, MultiOutputNode

        tp = self.parallel.tp
        with InputNode() as inp:
            dag = MultiOutputNode([a.execute_pickled.bind(inp[r // tp]) for r, a in enumerate(self.actors)])
        return dag.experimental_compile()

    def _describe(self) -> str:
        p = self.parallel
        return f"the worker group (tp={p.tp}, ep={p.ep}, dp={p.dp})"

    # ---- steps ------------------------------------------------------------------------------------------
    def execute(self, batches: Sequence[StepBatch | None]) -> list[StepResult | None]:
        """Run one step: `batches[d]` on every tp rank of dp rank d (None = dp rank d has no work). -> the
        result of each dp rank (None where it had no work)."""
        p = self.parallel
        if len(batches) != p.dp:
            raise ValueError(f"batches: {len(batches)} for dp={p.dp}")
        if self._broken is not None:
            raise GroupError(f"worker group unusable: {self._broken}")
        if all(b is None for b in batches):
            return [None] * p.dp
        kv_only = not any(b is not None and b.chunks for b in batches)
        if kv_only:  # no dp rank computes: only those with KV commands are called, and none runs a forward
            batches = [None if b is None else dataclasses.replace(b, kv=dataclasses.replace(b.kv, forward=False))
                       for b in batches]
        payloads = [self._empty_payload if b is None else pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)
                    for b in batches]
        if self._dag is not None and not kv_only:
            by_rank = dict(enumerate(self._execute_compiled(payloads)))
        else:
            calls: dict = {}
            for d, batch in enumerate(batches):
                if batch is None and (kv_only or not self.lockstep):
                    continue  # nobody waits on this dp rank's collectives
                for r in range(d * p.tp, (d + 1) * p.tp):
                    calls[self.actors[r].execute_pickled.remote(payloads[d])] = r
            try:
                by_rank = dict(zip(sorted(calls.values()), self._wait(calls, None, "run a step")))
            except GroupError as e:
                self._broken = str(e)
                raise
        return [self._result_of(d, by_rank) if batches[d] is not None else None for d in range(p.dp)]

    def _result_of(self, d: int, by_rank: dict) -> StepResult | None:
        """Dp rank d's result: its sampling rank's, carrying the KV events of all its tp ranks as one."""
        tp = self.parallel.tp
        result = by_rank.get(d * tp)
        if tp == 1 or result is None or result.kv is None:
            return result
        events = combine_events([getattr(by_rank.get(r), "kv", None) for r in range(d * tp, (d + 1) * tp)])
        return dataclasses.replace(result, kv=events)

    def _execute_compiled(self, payloads: list[bytes]) -> list[StepResult | None]:
        try:
            refs = self._dag.execute(*payloads)
            return ray.get(refs, timeout=self.options.collective_timeout_s)
        except Exception as e:
            self._broken = self._diagnose(e)
            raise GroupError(self._broken) from e

    def _diagnose(self, e: BaseException) -> str:
        """Name the rank behind a failed compiled step: a dead rank (its ping fails), or the rank whose actor
        the error came from."""
        try:
            self.ping(timeout_s=5.0)
        except GroupError as dead:
            return f"{dead} ({self._describe()}; the step failed: {cause_of(e)})"
        actor_id = getattr(getattr(e, "cause", None), "actor_id", None) or getattr(e, "actor_id", None)
        for r, a in enumerate(self.actors):
            if actor_id is not None and a._actor_id.hex() == str(actor_id):
                return f"rank {r} of {self._describe()} failed to run a step: {cause_of(e)}"
        return f"{self._describe()} failed to run a step: {cause_of(e)}"

    def ping(self, timeout_s: float = 30.0) -> list[str]:
        """Health check: every rank answers (after any step it is running). Raises `GroupError` naming the
        first rank that is dead or does not answer in time."""
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for r, ref in enumerate(refs):
            if ref not in ready:
                raise GroupError(f"rank {r}: no answer to a ping within {timeout_s:g} s")
            try:
                out.append(ray.get(ref))
            except Exception as e:
                raise GroupError(f"rank {r}: {cause_of(e)}") from e
        return out

    def call(self, method: str, *args) -> list:
        """Call `method` on every rank (tests, diagnostics); results in rank order."""
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def shutdown(self) -> None:
        """Kill the actors and release the placement. No graceful group teardown: a peer may be dead or stuck
        in a collective, and killing every rank ends all of it."""
        if self._dag is not None:
            dag, self._dag = self._dag, None
            try:
                dag.teardown()
            except Exception:
                pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None


class GroupExecutor:
    """The engine's executor for one dp rank spread over tp (and ep) ranks: every rank runs the same batch."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, parallel: ParallelConfig,
                 device: str = "cpu", options: GroupOptions = GroupOptions()) -> None:
        if parallel.dp != 1:
            raise ValueError(f"dp: GroupExecutor runs one dp rank (dp={parallel.dp} needs DPEngine)")
        self.group = WorkerGroup(model_dir, engine_config=engine_config, parallel=parallel, device=device,
                                 options=options)

    def info(self) -> dict:
        return {**self.group.rank_info[0], "num_pages": self.group.num_pages}

    def execute(self, batch: StepBatch) -> StepResult:
        return self.group.execute([batch])[0]

    def transfer_agents(self, role: str, num_kv_heads: int, config: TransferConfig) -> list:
        """The disaggregation end of this group: one agent over all its shards (one tp group)."""
        return [GroupTransferAgent(self.group.actors, role=role, num_kv_heads=num_kv_heads, config=config)]

    def shutdown(self) -> None:
        self.group.shutdown()


def make_group_executor(kind, model_dir: str | Path, *, engine_config: EngineConfig, parallel: ParallelConfig,
                        device: str):
    """The executor `Engine` builds when `parallel` spans several shards or `kind` is not a plain kind name:
    an executor object is used as given (a dp rank's core); `GroupOptions` place a group; "auto"/"ray" place
    one with the default options; "local" cannot hold several shards."""
    if not isinstance(kind, (str, GroupOptions)):
        return kind
    if parallel.world_size == 1:  # GroupOptions for a lone shard: the in-process runner, as "auto" would
        return LocalExecutor(model_dir, engine_config=engine_config, device=device)
    if kind == "local":
        raise ValueError(f"executor: 'local' runs one shard in this process; tp * dp = {parallel.world_size} "
                         f"shards need a worker group ('auto' or 'ray')")
    if isinstance(kind, str) and kind not in ("auto", "ray"):
        raise ValueError(f"executor: unknown kind {kind!r} (auto | local | ray)")
    options = kind if isinstance(kind, GroupOptions) else GroupOptions()
    return GroupExecutor(model_dir, engine_config=engine_config, parallel=parallel, device=device, options=options)
