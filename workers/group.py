"""A worker group: one model instance spread over `tp * dp` `ShardWorker` actors (docs/parallelism.md).

`WorkerGroup` places the shards (a placement group, one bundle per shard), assigns world ranks (rank r is tp
rank r % tp of dp rank r // tp), wires the rendezvous (rank 0 serves a TCPStore on a free port of its node),
has every rank join the process groups and load its own weight slices, and runs steps: each dp rank gets its
own batch, every tp rank of a dp rank the same one, and the result of each dp rank's tp rank 0 (the one that
samples) comes back. A step is one Ray call per rank; the batch of a dp rank is pickled once, not once per rank.

`GroupExecutor` is the engine's executor for dp = 1 (tp and/or ep > 1): the engine is unchanged, its one
batch goes to every rank.

`DPEngine` serves dp > 1 (attention data parallel): one engine core (scheduler + page manager + request state)
per dp rank, each new request assigned to the least loaded dp rank, and every step runs all dp ranks' batches in
one group step. A dp rank with nothing to do gets no batch; when its MoE collectives span other dp ranks
(`ep > tp`) it still runs an empty forward so its peers never wait. `Engine(..., parallel=ParallelConfig(dp=2))`
builds one. It serves every role: as decode a remote request is admitted on one dp rank (its pages, its
receiving shards); as prefill a request is placed on one dp rank first (`place_request`), so the decode side
prepares the receive from that dp rank's shards, which then send it.

`GroupTransferAgent` is the engine's end of disaggregation over a tp group's shards: each `ShardWorker` hosts
the `TransferAgent` of its own KV pages, and the engine's transfer calls fan out to them (docs/disaggregation.md).
"""
from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ray

from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig
from workers.engine import Engine, ExecutorDeadError, role_engine_config
from workers.request import RequestOutput, SamplingParams
from workers.runner import StepResult
from workers.stats import EngineStats, RequestStats, StepStats, TransferStats
from workers.transfer import TransferAgent, TransferConfig, TransferResult

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DISPATCH_MODES = ("compiled", "rpc")


class GroupStartError(RuntimeError):
    """A worker group could not start: its placement was not granted in time, or a rank failed to start."""


class GroupError(ExecutorDeadError):
    """A running worker group lost a rank (its step failed or its actor died); the group is unusable (its peers
    may be stuck in a collective with it), so the engine stops rather than failing only that step's requests."""


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """How a worker group is placed and started.

    num_cpus_per_shard: Ray CPUs per shard bundle (a GPU shard takes one GPU besides). strategy: placement
    strategy; None = STRICT_PACK (every shard on one node) when some node can hold the whole group, else PACK.
    placement_timeout_s: how long to wait for the cluster to grant the bundles. start_timeout_s: how long the
    ranks may take to join the process group and load their weights. collective_timeout_s: the process
    groups' timeout (a collective stuck longer fails). moe_dispatch: "alltoall" | "allreduce" (ep > 1).
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
        if self.moe_dispatch not in ("alltoall", "allreduce"):
            raise ValueError(f"moe_dispatch: {self.moe_dispatch!r} is not one of ('alltoall', 'allreduce')")


def _cause(e: BaseException) -> str:
    """The original error of a failed actor call, as `Type: message` (the first line of a Ray task error)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


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
                    raise err(f"rank {rank} of {self._describe()} failed to {what}: {_cause(e)}") from e
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
        payloads = [self._empty_payload if b is None else pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)
                    for b in batches]
        if self._dag is not None:
            by_rank = dict(enumerate(self._execute_compiled(payloads)))
        else:
            calls: dict = {}
            for d, batch in enumerate(batches):
                if batch is None and not self.lockstep:
                    continue  # nobody waits on this dp rank's collectives
                for r in range(d * p.tp, (d + 1) * p.tp):
                    calls[self.actors[r].execute_pickled.remote(payloads[d])] = r
            try:
                by_rank = dict(zip(sorted(calls.values()), self._wait(calls, None, "run a step")))
            except GroupError as e:
                self._broken = str(e)
                raise
        return [by_rank.get(d * p.tp) if batches[d] is not None else None for d in range(p.dp)]

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
            return f"{dead} ({self._describe()}; the step failed: {_cause(e)})"
        actor_id = getattr(getattr(e, "cause", None), "actor_id", None) or getattr(e, "actor_id", None)
        for r, a in enumerate(self.actors):
            if actor_id is not None and a._actor_id.hex() == str(actor_id):
                return f"rank {r} of {self._describe()} failed to run a step: {_cause(e)}"
        return f"{self._describe()} failed to run a step: {_cause(e)}"

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
                raise GroupError(f"rank {r}: {_cause(e)}") from e
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
        from workers.engine import LocalExecutor

        return LocalExecutor(model_dir, engine_config=engine_config, device=device)
    if kind == "local":
        raise ValueError(f"executor: 'local' runs one shard in this process; tp * dp = {parallel.world_size} "
                         f"shards need a worker group ('auto' or 'ray')")
    if isinstance(kind, str) and kind not in ("auto", "ray"):
        raise ValueError(f"executor: unknown kind {kind!r} (auto | local | ray)")
    options = kind if isinstance(kind, GroupOptions) else GroupOptions()
    return GroupExecutor(model_dir, engine_config=engine_config, parallel=parallel, device=device, options=options)


# ---- KV transfer over a tp group's shards (disaggregation) ------------------------------------------------

def _unwrap(e: BaseException, what: str) -> BaseException:
    """The error a shard's transfer call raised, as itself (ValueError, KeyError... with their own message),
    so the engine handles it as it would an in-process agent's; a dead shard becomes a `GroupError`."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception) and not isinstance(e, ray.exceptions.RayActorError):
        return cause
    return GroupError(f"{what}: {_cause(e)}")


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


# ---- attention data parallel ---------------------------------------------------------------------------------

class _Slot:
    """One dp rank's part of a group step: the batch its core produced, then the result it waits for."""

    def __init__(self) -> None:
        self.batch: StepBatch | None = None
        self.result: StepResult | None = None
        self.error: BaseException | None = None
        self.reached = threading.Event()  # the core deposited its batch, or finished its step without one
        self.go = threading.Event()  # the group step is done: result (or error) is set


class _DPRankExecutor:
    """The executor a dp rank's engine core sees: `execute` deposits the batch for the group step and blocks
    until `DPEngine.step` has run all dp ranks' batches together."""

    def __init__(self, engine: DPEngine, dp_rank: int) -> None:
        self.engine = engine
        self.dp_rank = dp_rank

    def info(self) -> dict:
        return {**self.engine.group.rank_info[self.dp_rank * self.engine.parallel.tp],
                "num_pages": self.engine.group.num_pages}

    def transfer_agents(self, role: str, num_kv_heads: int, config: TransferConfig) -> list:
        """This dp rank's disaggregation end: one agent over its tp group's shards."""
        tp = self.engine.parallel.tp
        actors = self.engine.group.actors[self.dp_rank * tp:(self.dp_rank + 1) * tp]
        return [GroupTransferAgent(actors, role=role, num_kv_heads=num_kv_heads, config=config)]

    def execute(self, batch: StepBatch) -> StepResult:
        slot = self.engine._slots[self.dp_rank]
        slot.batch = batch
        slot.reached.set()
        slot.go.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def shutdown(self) -> None:
        pass  # the group belongs to the DPEngine


@dataclass(frozen=True, slots=True)
class _Placement:
    """Prefill role: a dp rank held for a request between `place_request` and `add_request`."""

    dp_rank: int
    when: float  # time.monotonic() of the placement: it is forgotten after the transfer lease
    num_tokens: int  # the prompt tokens it will prefill there (its load until it is added)


@dataclass(frozen=True)
class _DPSchedulers:
    schedulers: list

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)


class DPEngine(Engine):
    """An engine over dp attention-data-parallel ranks (see the module docstring); the `Engine` API.

    Each dp rank has an ordinary `Engine` core (its own scheduler, page manager, requests) whose executor
    hands the batch to this engine. A step runs each core's `step()` on its own thread, one after another,
    until it hands over its batch (or returns: nothing to run); then one group step runs every batch; then each
    core finishes its step (tokens, stops, outputs) in turn. Only one core's code runs at any time.
    """

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: str = "unified",
                 executor=None, transfer=None, **unsupported) -> None:
        if unsupported:
            raise NotImplementedError(f"{sorted(unsupported)[0]}: not supported with dp={parallel.dp}")
        if executor == "local":
            raise ValueError(f"executor: 'local' runs one shard in this process; dp={parallel.dp} needs a worker "
                             f"group ('auto' or 'ray')")
        options = executor if isinstance(executor, GroupOptions) else GroupOptions()
        self.model_dir = Path(model_dir)
        self.role = role
        self.parallel = parallel
        self.group = WorkerGroup(model_dir, engine_config=role_engine_config(engine_config, role),
                                 parallel=parallel, device=device, options=options)
        self.executor = self.group
        self._slots = [_Slot() for _ in range(parallel.dp)]
        self._pool = ThreadPoolExecutor(max_workers=parallel.dp, thread_name_prefix="dp-core")
        try:
            self.cores = [Engine(model_dir, engine_config=engine_config, device=device, role=role,
                                 executor=_DPRankExecutor(self, d), transfer=transfer) for d in range(parallel.dp)]
        except BaseException:
            self.group.shutdown()
            self._pool.shutdown()
            raise
        first = self.cores[0]
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.engine_config = first.engine_config
        self.num_pages = first.num_pages  # per dp rank
        self.page_size = first.page_size
        self.eos_token_ids = first.eos_token_ids
        self.transfer_config = first.transfer_config
        # request id -> its dp rank, while in flight; prefill: request id -> its placement, not added yet. The
        # server places from its event loop while the step thread steps (through the step thread a placement
        # would wait out a whole prefill step), so both maps and their readers go under this lock.
        self._owner: dict[str, int] = {}
        self._placed: dict[str, _Placement] = {}
        self._load_lock = threading.Lock()
        self._step_stats: list[StepStats] = []
        self.num_steps = 0

    # ---- requests ---------------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.cores[0].validate_request(prompt_token_ids, params)

    def least_loaded_rank(self) -> int:
        """The least loaded dp rank: the fewest prompt tokens still to prefill (prefill role) or the fewest
        requests in flight (decode, unified), placed ones included; then the most free pages, then the lowest
        rank."""
        return self._ranks_by_load()[0]

    def _ranks_by_load(self) -> list[int]:
        # A prefill rank's step time grows with the prompt tokens it has to compute, so a 1,800-token prompt
        # weighs 360 five-token ones there. Decode and unified keep counting requests: a decoding request costs
        # one token per step whatever its prompt length (its pages are the tie-break), and a unified request
        # decodes for far longer than it prefills.
        load = self.pending_prefill_tokens() if self.role == "prefill" else self._requests_by_rank()
        return sorted(range(len(self.cores)), key=lambda d: (load[d], -self.cores[d].pages.num_free_pages, d))

    def _requests_by_rank(self) -> list[int]:
        load = [0] * len(self.cores)
        with self._load_lock:
            for d in (*self._owner.values(), *(p.dp_rank for p in self._placed.values())):
                load[d] += 1
        return load

    def pending_prefill_tokens(self) -> list[int]:
        """Per dp rank: the prompt tokens its requests have yet to compute, plus those of the requests placed
        there and not added yet (`place_request`'s `num_tokens`). Thread-safe, like `place_request`."""
        load = [0] * len(self.cores)
        with self._load_lock:
            for p in self._placed.values():
                load[p.dp_rank] += p.num_tokens
            # Read from another thread than the step thread: a dict `get` and two int attributes of the request's
            # first sequence are each atomic under the GIL (no iteration over the core's dicts, which the step
            # changes under us), and the sequence of an id in `_owner` exists (the core added it first). A count
            # one step old is fine for balancing.
            for rid, d in self._owner.items():
                req = self.cores[d].scheduler.requests.get(rid)
                if req is None:
                    # past its prompt: handed off (its KV travelling, no more compute here), finished or aborted
                    continue
                # Only sample 0 prefills the prompt (n > 1 samples fork from its pages and recompute at most a
                # page's tail); a preempted sequence is back at 0 computed tokens and weighs its whole prompt
                # again, a prefix-cache hit starts past the cached tokens; one decoding here weighs 0.
                seq = req.seqs[0]
                load[d] += max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
        return load

    def _set_owner(self, request_id: str, dp_rank: int | None) -> int | None:
        """Record (or with None drop) a request's dp rank; returns the one it had."""
        with self._load_lock:
            before = self._owner.pop(request_id, None)
            if dp_rank is not None:
                self._owner[request_id] = dp_rank
            return before

    def place_request(self, request_id: str, num_tokens: int | None = None) -> int:
        """Prefill role: choose the dp rank that will run `request_id`, a prompt of `num_tokens` tokens (the
        least loaded by prompt tokens still to prefill, `pending_prefill_tokens`), and hold it for
        `add_request`; until then the placement weighs `num_tokens` there (None: 1, for callers that do not
        say). The caller has the decode side prepare the receive from that dp rank's shards
        (`TransferAgent.dp_group(<this group's name>, rank)`) before adding the request.
        Thread-safe (the one call that may come from another thread than the one stepping). A placement that
        is neither added nor aborted within the transfer lease is forgotten (its router went away)."""
        if self.role != "prefill":
            raise ValueError(f"role: only a prefill engine places requests on a dp rank (this one is {self.role})")
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"num_tokens: a prompt has 0 or more tokens, got {num_tokens}")
        weight = 1 if num_tokens is None else num_tokens
        now = time.monotonic()
        with self._load_lock:
            if request_id in self._owner or request_id in self._placed:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            for rid, p in list(self._placed.items()):
                if now - p.when > self.transfer_config.lease_s:
                    del self._placed[rid]
        d = self._ranks_by_load()[0]
        with self._load_lock:
            self._placed[request_id] = _Placement(dp_rank=d, when=now, num_tokens=weight)
        return d

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, handoff_to: str | None = None,
                    transfer_id: str | None = None) -> None:
        """On the placed dp rank (`place_request`), else the least loaded. A request handed off to a decode
        group must have been placed: the decode side prepared its receive for one dp rank's shards."""
        with self._load_lock:
            if request_id in self._owner:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            placed = self._placed.get(request_id)
        if handoff_to is not None and placed is None and self.role == "prefill":
            raise ValueError(f"handoff_to: a prefill engine with dp={len(self.cores)} hands off only requests "
                             f"placed first (place_request): the decode side prepares the receive from the "
                             f"shards of the dp rank that runs it")
        d = placed.dp_rank if placed is not None else self.least_loaded_rank()
        try:
            self.cores[d].add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                      arrival_time=arrival_time, handoff_to=handoff_to, transfer_id=transfer_id)
        except BaseException:
            with self._load_lock:
                self._placed.pop(request_id, None)
            raise
        # The placement weighs until the core holds the request, then the owner does, in one step: a concurrent
        # `place_request` never finds the request in neither map (weightless) nor in both (counted twice).
        with self._load_lock:
            self._placed.pop(request_id, None)
            self._owner[request_id] = d

    def dp_rank_of(self, request_id: str) -> int | None:
        """The dp rank that holds the request (or has it placed)."""
        with self._load_lock:
            d = self._owner.get(request_id)
            placed = self._placed.get(request_id)
        return d if d is not None else placed.dp_rank if placed is not None else None

    def abort_request(self, request_id: str) -> bool:
        with self._load_lock:
            placed = self._placed.pop(request_id, None)
        d = self._set_owner(request_id, None)
        if d is None:
            return placed is not None  # placed and never added (its decode admission failed): nothing to free
        return self.cores[d].abort_request(request_id)

    def hands_off(self, request_id: str) -> bool:
        """Prefill role: whether `request_id` will send (or is sending) its KV from one of the dp ranks."""
        return any(core.hands_off(request_id) for core in self.cores)

    # ---- disaggregation: decode role ------------------------------------------------------------------------
    # Each dp rank is its own receiver: its tp group's shards listen for every prefill group, and a request
    # lands in the pages of the dp rank that admitted it. The prefill side sends it to that dp rank's
    # sub-group, `TransferAgent.dp_group(<this replica's group name>, dp_rank_of(request_id))`.
    def admit_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     group: str, transfer_id: str | None = None, prompt: str | None = None,
                     arrival_time: float | None = None, first_from_kv: bool = True) -> list[int] | None:
        """Reserve the prompt's pages on the least loaded dp rank with room (`dp_rank_of` says which); None
        when no dp rank has room now."""
        if self.role != "decode":
            raise ValueError(f"role: only a decode engine admits remote prefills (this one is {self.role})")
        if self.dp_rank_of(request_id) is not None:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        for d in self._ranks_by_load():
            pages = self.cores[d].admit_remote(request_id, prompt_token_ids, params, group=group,
                                               transfer_id=transfer_id, prompt=prompt, arrival_time=arrival_time,
                                               first_from_kv=first_from_kv)
            if pages is not None:
                self._set_owner(request_id, d)
                return pages
        return None

    def continue_remote(self, request_id: str, first_token: int,
                        first_logprobs: dict[int, float] | None = None) -> None:
        d = self.dp_rank_of(request_id)
        if d is None:
            raise KeyError(f"request_id: {request_id!r} is not awaiting its KV here (unknown, failed or aborted)")
        self.cores[d].continue_remote(request_id, first_token, first_logprobs)

    def fail_remote(self, request_id: str, why: str) -> bool:
        d = self.dp_rank_of(request_id)
        return d is not None and self.cores[d].fail_remote(request_id, why)

    def poll_transfers(self) -> list[RequestOutput]:
        return [out for core in self.cores for out in core.poll_transfers()]

    def kv_listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        """Open the pairs from prefill group `group` into every dp rank's shards; each entry is tagged with
        its dp rank (the prefill side makes one sub-group per dp rank of it). A prefill group with dp
        (`remote_dp` > 1) gets pairs per its own dp rank too (`Engine.kv_listen`): every (prefill dp rank,
        decode dp rank) meets."""
        return [({**route, "dp": d}, address) for d, core in enumerate(self.cores)
                for route, address in core.kv_listen(group, remote_tp, remote_dp)]

    # ---- disaggregation: prefill role -----------------------------------------------------------------------
    # Each dp rank sends the requests it ran from its own tp group's shards: the decode side listened once per
    # prefill dp rank (`kv_listen(..., remote_dp=dp)`, entries tagged "src_dp"), and each core joins the pairs
    # of its rank under the decode group's name, so `handoff_to` names the same decode group on every core.
    def kv_connect(self, group: str, listened: list) -> None:
        if self.role != "prefill":
            raise ValueError(f"role: only a prefill engine connects (this one is {self.role})")
        by_rank: dict[int | None, list] = {}
        for route, address in listened:
            fields = dict(route)
            by_rank.setdefault(fields.pop("src_dp", None), []).append((fields, address))
        if sorted(by_rank, key=str) != list(range(len(self.cores))):
            raise ValueError(f"listened: pairs for prefill dp ranks {sorted(by_rank, key=str)}, but this prefill "
                             f"engine has dp={len(self.cores)} (the decode side must listen with "
                             f"remote_dp={len(self.cores)})")
        for d, core in enumerate(self.cores):
            core.kv_connect(group, by_rank[d])

    def kv_wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        for core in self.cores:
            core.kv_wait_ready(timeout_s, group)

    def kv_drop(self, group: str) -> None:
        for core in self.cores:
            core.kv_drop(group)

    def kv_broken(self, group: str) -> str | None:
        return next((f"dp rank {d}: {why}" for d, core in enumerate(self.cores) if (why := core.kv_broken(group))),
                    None)

    def set_transfer_faults(self, faults: dict[str, str]) -> None:
        if self.role != "prefill":
            raise ValueError(f"faults: injected on the sending (prefill) side; this engine is {self.role}")
        for core in self.cores:
            core.set_transfer_faults(faults)

    def hold_pages(self, num_pages: int) -> int:
        """Take `num_pages` free pages out of the pools (filling dp ranks in order); 0 gives them back."""
        for core in self.cores:
            core.hold_pages(0)
        free = [core.pages.num_free_pages for core in self.cores]
        if num_pages > sum(free):
            raise ValueError(f"num_pages: only {sum(free)} pages are free")
        left = num_pages
        for core, n in zip(self.cores, free):
            take = min(left, n)
            if take:
                core.hold_pages(take)
            left -= take
        return num_pages

    @property
    def agents(self) -> list:
        """Every dp rank's transfer agents, in dp rank order (tests)."""
        return [a for core in self.cores for a in core.agents]

    def _forget_settled(self) -> None:
        """Drop the owner of requests a core no longer holds. A remote whose KV never came ends without an
        output (`pop_failures` reports it); a prefill's output is finished at its first token while its KV
        still travels, and its abort must still reach that core until the transfer settled."""
        with self._load_lock:
            for rid, d in list(self._owner.items()):
                core = self.cores[d]
                if rid not in core._tracked and rid not in core._remote and rid not in core._handoffs:
                    del self._owner[rid]

    def abort_all(self) -> int:
        n = sum(core.abort_all() for core in self.cores)
        with self._load_lock:
            self._owner.clear()
            self._placed.clear()
        return n

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        slots = self._slots = [_Slot() for _ in self.cores]
        futures = []
        for core, slot in zip(self.cores, slots):
            futures.append(self._pool.submit(self._core_step, core, slot))
            slot.reached.wait()  # one core at a time: the next starts once this one handed over or returned
        batches = [s.batch for s in slots]
        group_error: BaseException | None = None
        results: list[StepResult | None] = [None] * len(slots)
        t1 = time.perf_counter()
        try:
            results = self.group.execute(batches)
        except BaseException as e:
            group_error = e
        t2 = time.perf_counter()
        outputs: list[RequestOutput] = []
        error: BaseException | None = None
        for slot, result, fut in zip(slots, results, futures):
            # a core handed the group's error fails its step's requests and goes on, or re-raises it (GroupError)
            slot.result, slot.error = result, group_error
            slot.go.set()
            try:
                outputs.extend(fut.result())
            except BaseException as e:  # every core must still finish its step before this one raises
                error = error or e
        if error is not None:
            raise error
        if self.role == "unified":
            for out in outputs:
                if out.finished:
                    self._set_owner(out.request_id, None)
        else:
            self._forget_settled()
        if any(b is not None for b in batches):
            self._record_step(t0, t2 - t1, results)
        return outputs

    @staticmethod
    def _core_step(core: Engine, slot: _Slot) -> list[RequestOutput]:
        try:
            return core.step()
        finally:
            slot.reached.set()

    def _record_step(self, t0: float, group_time: float, results: list[StepResult | None]) -> None:
        """One StepStats for the group step: token counts summed over dp ranks; the forward is the slowest dp
        rank's (they run concurrently), everything else is host overhead."""
        per_core = [core.pop_step_stats() for core in self.cores]
        step_time = time.perf_counter() - t0
        forward = max((r.forward_time for r in results if r is not None), default=0.0)
        mine = [s[-1] for s in per_core if s]
        self._step_stats.append(StepStats(
            step_time=step_time, host_overhead=step_time - forward,
            num_prefill_tokens=sum(s.num_prefill_tokens for s in mine),
            num_decode_tokens=sum(s.num_decode_tokens for s in mine),
            batch_size=sum(s.batch_size for s in mine), num_preemptions=sum(s.num_preemptions for s in mine)))
        self.num_steps += 1

    @property
    def scheduler(self) -> _DPSchedulers:
        """The dp ranks' schedulers seen as one (the async step loop asks it whether work is queued)."""
        return _DPSchedulers([core.scheduler for core in self.cores])

    # ---- the disaggregation hooks the async step loop calls; a unified dp engine has no transfers -------
    def add_transfer_listener(self, fn) -> None:
        for core in self.cores:
            core.add_transfer_listener(fn)

    def has_pending_transfers(self) -> bool:
        return any(core.has_pending_transfers() for core in self.cores)

    def pop_failures(self) -> list:
        return [x for core in self.cores for x in core.pop_failures()]

    def pop_transfer_outcomes(self) -> list:
        return [x for core in self.cores for x in core.pop_transfer_outcomes()]

    def pop_transfer_stats(self) -> list:
        return [x for core in self.cores for x in core.pop_transfer_stats()]

    # ---- stats ------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Summed over dp ranks (pages: the pools of all dp ranks together)."""
        parts = [core.stats() for core in self.cores]
        summed = {f.name: sum(getattr(s, f.name) for s in parts)
                  for f in dataclasses.fields(EngineStats) if f.name != "role"}
        return EngineStats(role=self.role, **summed)

    def pop_request_stats(self) -> list[RequestStats]:
        return [s for core in self.cores for s in core.pop_request_stats()]

    def pop_step_stats(self) -> list[StepStats]:
        out, self._step_stats = self._step_stats, []
        return out

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()
        self.group.shutdown()
        self._pool.shutdown(wait=False)
