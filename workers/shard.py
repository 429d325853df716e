"""`ShardWorker`: the Ray actor that owns one device and runs one shard's `ModelRunner`.

`RayExecutor` is the engine side of a one-shard group: it places the actor (a GPU when the device is CUDA, else
one CPU), waits until the model and KV pool are up, and forwards each step. A step costs one actor round trip
(about 1 ms on the GPU machine), which is why the engine runs a lone shard in-process by default; the actor path
is what multi-shard groups build on.
"""
from __future__ import annotations

from pathlib import Path

import ray

from workers.batch import StepBatch
from workers.config import EngineConfig
from workers.runner import ModelRunner, StepResult


class ShardWorker:
    """One shard: model weights and KV pages on this actor's device."""

    def __init__(self, model_dir: str, engine_config: EngineConfig, device: str = "auto") -> None:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)

    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.runner.execute(batch)

    def ping(self) -> str:
        return "ok"


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
        return ray.get(self.actor.execute.remote(batch))

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
