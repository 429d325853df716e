"""`LocalExecutor`: one shard in this process (tp = ep = dp = 1), no RPC on the step path.

It alone can `launch` a step without waiting (async scheduling): the runner queues the step on the device and
the engine schedules the next one meanwhile. The Ray executors (one actor, a worker group) keep the synchronous
`execute`: their step is an actor call whose inputs travel with it, so a step ahead would need the previous
step's sampled ids kept on the shard and a second call in flight (not built)."""
from __future__ import annotations

from pathlib import Path

from workers.batch import StepBatch
from workers.config import EngineConfig
from workers.runner import StepHandle, StepResult
from workers.kv.agent import TransferAgent
from workers.kv.config import TransferConfig
from workers.kv.worker import KVWorker


class LocalExecutor:
    """One shard in this process (tp = ep = dp = 1): no RPC on the step path."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str) -> None:
        from workers.runner import ModelRunner

        self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)
        self.kv_worker: KVWorker | None = None  # the shard's KV worker side (prefill / decode roles)

    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        if self.kv_worker is None or batch.kv is None:
            return self.runner.execute(batch)
        return self.kv_worker.run_step(batch, self.runner.execute)

    def launch(self, batch: StepBatch) -> StepHandle:
        """Start the step without waiting for the device (async scheduling); `.result()` waits."""
        return self.runner.launch(batch)

    def transfer_agents(self, role: str, num_kv_heads: int, config: TransferConfig) -> list[TransferAgent]:
        """The disaggregation end of each shard (one here), in shard (tp rank) order."""
        agent = TransferAgent(self.runner.kv, role=role, num_kv_heads=num_kv_heads, config=config)
        self.kv_worker = KVWorker(agent)
        return [agent]

    def shutdown(self) -> None:
        self.runner = None
