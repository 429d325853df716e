"""`RayExecutor`: the engine side of a one-shard group.

It places one `ShardWorker` actor (a GPU when the device is CUDA, else one CPU), waits until the model and KV
pool are up, and forwards each step. A step costs one actor round trip (about 1 ms on the GPU machine), which is
why the engine runs a lone shard in-process by default; the actor path is what multi-shard groups build on
(`workers.executor.ray_group.WorkerGroup`).
"""
from __future__ import annotations

from pathlib import Path

import ray

from workers.batch import StepBatch
from workers.config import EngineConfig
from workers.executor.base import ExecutorDeadError
from workers.kv.group_agent import GroupTransferAgent
from workers.runner import StepResult
from workers.shard import ShardWorker


class RayExecutor:
    """Runs the engine's steps on one `ShardWorker` actor."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str = "cpu",
                 actor_options: dict | None = None) -> None:
        if not ray.is_initialized():
            raise RuntimeError("executor: 'ray' needs ray.init() first")
        opts = {"num_gpus": 1, "num_cpus": 1} if device.startswith("cuda") else {"num_cpus": 1}
        opts.update(actor_options or {})
        # The actor sees its own GPU as cuda:0 (Ray sets CUDA_VISIBLE_DEVICES).
        actor_device = "cuda" if device.startswith("cuda") else device
        self.actor = ray.remote(ShardWorker).options(**opts).remote(str(model_dir), engine_config, actor_device)
        self._info = ray.get(self.actor.info.remote())  # surfaces a failed start here, with its traceback

    def info(self) -> dict:
        return self._info

    def execute(self, batch: StepBatch) -> StepResult:
        """The shard's step; its own error (out of memory...) comes back as Ray's task error wrapping it (the
        engine fails that step's requests), a dead actor as `ExecutorDeadError` (the engine stops)."""
        try:
            return ray.get(self.actor.execute.remote(batch))
        except ray.exceptions.RayActorError as e:
            raise ExecutorDeadError(f"the shard actor died: {e}") from e

    def transfer_agents(self, role: str, num_kv_heads: int, config) -> list:
        """The disaggregation end of the lone shard, hosted in its actor."""
        return [GroupTransferAgent([self.actor], role=role, num_kv_heads=num_kv_heads, config=config)]

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
