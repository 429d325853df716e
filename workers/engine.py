"""The engine of one model instance: an engine core plus the executor that runs its steps.

A step is three calls (workers/engine_api.py holds the loop, shared with `DPEngine`):
  schedule: the core's scheduler picks chunks (continuous batching, chunked prefill, preemption) -> StepBatch;
  execute:  the executor builds attention metadata, runs the forward and samples (in-process for one shard, a
            `ShardWorker` Ray actor, or a worker group) -> StepResult;
  update:   the core appends the tokens and checks stops -> EngineCoreOutputs; the output processor turns them
            into text (stop strings) and RequestOutputs.
Everything outside the forward is host overhead; each step's is measured and kept in `StepStats`.

Roles (docs/disaggregation.md): "unified" runs requests start to end. "prefill" runs a request's prompt and
samples its first token; a request added with `handoff_to=<decode group>` then keeps its pages, sends them to
that decode group and frees them once the transfer settled (or its lease expired): `workers/kv/handoff.py`.
"decode" reserves a request's pages first (`admit_remote`), receives the prompt's KV into them, and decodes from
there as soon as they landed (`workers/kv/remote.py`). The KV work rides the steps: each step's batch carries
the connector's commands to the shards and its result brings their events back (`workers/engine_kv.py`); with no
batch to run, a KV-only step moves pending transfers on. It never blocks on a transfer.

`make_engine` builds the engine a parallel layout needs: an `Engine` (one core), or with attention data
parallelism (dp > 1) a `DPEngine` (workers/dp.py: one core per dp rank around one group execute).
"""
from __future__ import annotations

import logging
from pathlib import Path

from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig, Role
from workers.engine_api import EngineAPI, role_engine_config
from workers.executor import ExecutorKind, LocalExecutor, make_executor
from workers.kv.config import TransferConfig
from workers.kv.connector import KVTransferFailed
from workers.runner import StepResult
from workers.warmup import warm_up

__all__ = ["Engine", "KVTransferFailed", "make_engine", "role_engine_config"]

logger = logging.getLogger("m3serve.engine")


class Engine(EngineAPI):
    """One engine core and its executor (see the module docstring); the API is `EngineAPI`'s."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: Role = "unified",
                 executor: ExecutorKind = "auto", transfer: TransferConfig | None = None) -> None:
        if parallel.dp > 1:
            raise ValueError(f"parallel: dp={parallel.dp} runs one core per dp rank: build it with make_engine "
                             f"(a DPEngine)")
        self._setup(model_dir, engine_config, role, transfer)
        self.executor = make_executor(executor, model_dir, engine_config=self.engine_config, parallel=parallel,
                                      device=device)
        agents = []
        if role in ("prefill", "decode"):
            make_agents = getattr(self.executor, "transfer_agents", None)
            if make_agents is None:
                self.executor.shutdown()
                raise NotImplementedError(f"role: {role!r} needs shards with KV transfer agents "
                                          f"({type(self.executor).__name__} has none yet)")
            agents = make_agents(role, self.model_config.num_key_value_heads, self.transfer_config)
        # an in-process shard takes the live page tables; one in another process, what changed (batch_delta.py)
        info = self.executor.info()
        rank = self._add_rank(info, agents, seq_deltas=not isinstance(self.executor, LocalExecutor))
        self.core, self.kv = rank.core, rank.kv
        self.warmup_report = None  # workers/warmup.py's report, where the warm-up ran
        warm = self.engine_config.warmup
        if role == "unified" and (warm or (warm is None and str(info.get("device", "")).startswith("cuda"))):
            self.warmup_report = r = warm_up(self)
            logger.info("warm-up: %d requests in %d steps (%d mixed), %.1f s", r.requests, r.steps, r.mixed_steps,
                        r.seconds)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def pages(self):
        return self.core.pages

    @property
    def marks(self):
        """Handoff marks of disaggregated requests (`AsyncEngine.debug_timeline`)."""
        return self.kv.marks

    def _execute(self, batches: list[StepBatch | None]) -> list[StepResult | None]:
        (batch,) = batches
        return [self.executor.execute(batch)]

    def _runs_async(self) -> bool:
        return self.engine_config.async_scheduling and self.role == "unified" and hasattr(self.executor, "launch")

    def _launch(self, batch: StepBatch):
        return self.executor.launch(batch)

    # ---- requests and disaggregation on the one core ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, params, *, prompt: str | None = None,
                    arrival_time: float | None = None, handoff_to: str | None = None,
                    transfer_id: str | None = None) -> None:
        """`handoff_to` (prefill role): the decode group that receives the request's KV after its first token
        (under `transfer_id`, default the request id; the decode engine must have admitted it already)."""
        self._add_to(self.ranks[0], request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time,
                     handoff_to=handoff_to, transfer_id=transfer_id)

    def admit_remote(self, request_id: str, prompt_token_ids, params, *, group: str, transfer_id: str | None = None,
                     prompt: str | None = None, arrival_time: float | None = None,
                     first_from_kv: bool = True) -> list[int] | None:
        """Decode role: reserve the pages of a prompt computed by prefill group `group` and expect its KV
        (under `transfer_id`, default the request id). Returns the page ids, or None when the pool has no room
        now; ValueError (naming the field) for a request that can never be served here. `first_from_kv`: the
        first token comes in the KV header and decoding starts when the pages land (else at `continue_remote`)."""
        return self._admit_on(self.ranks[0], request_id, prompt_token_ids, params, group=group,
                              transfer_id=transfer_id, prompt=prompt, arrival_time=arrival_time,
                              first_from_kv=first_from_kv)

    def kv_listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        return self.kv.pairs.listen(group, remote_tp, remote_dp)

    def kv_connect(self, group: str, listened: list) -> None:
        self.kv.pairs.connect(group, listened)

    def kv_wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        self.kv.pairs.wait_ready(timeout_s, group)

    def kv_drop(self, group: str) -> None:
        self.kv.pairs.drop(group)

    def kv_broken(self, group: str) -> str | None:
        return self.kv.pairs.broken(group)

    def shutdown(self) -> None:
        self._shutdown_connectors()
        self.executor.shutdown()


def make_engine(model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: Role = "unified",
                executor: ExecutorKind = "auto", transfer: TransferConfig | None = None) -> EngineAPI:
    """The engine for a parallel layout: with attention data parallelism (dp > 1) a `DPEngine` (one core per dp
    rank over one worker group), else an `Engine`. Both have the `EngineAPI`."""
    if parallel.dp > 1:
        # imported here: a DPEngine drives a Ray worker group, and an in-process engine must not need ray
        from workers.dp import DPEngine

        cls = DPEngine
    else:
        cls = Engine
    return cls(model_dir, engine_config=engine_config, parallel=parallel, device=device, role=role,
               executor=executor, transfer=transfer)
