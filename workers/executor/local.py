"""`LocalExecutor`: one shard in this process (tp = ep = dp = 1), no RPC on the step path."""
from __future__ import annotations

from pathlib import Path

from workers.batch import StepBatch
from workers.config import EngineConfig
from workers.runner import StepResult
from workers.kv.agent import TransferAgent
from workers.kv.config import TransferConfig


class LocalExecutor:
    """One shard in this process (tp = ep = dp = 1): no RPC on the step path."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str) -> None:
        from workers.runner import ModelRunner

        self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)

    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.runner.execute(batch)

    def transfer_agents(self, role: str, num_kv_heads: int, config: TransferConfig) -> list[TransferAgent]:
        """The disaggregation end of each shard (one here), in shard (tp rank) order."""
        return [TransferAgent(self.runner.kv, role=role, num_kv_heads=num_kv_heads, config=config)]

    def shutdown(self) -> None:
        self.runner = None
