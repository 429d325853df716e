"""Executors: what runs an engine's steps on its shard(s). They import the shard and runner, never the engine.

  base.py       the `Executor` protocol, `ExecutorDeadError` (the engine stops), `GroupError`
  local.py      `LocalExecutor`: one shard in this process
  ray_shard.py  `RayExecutor`: one `ShardWorker` actor
  ray_group.py  `WorkerGroup` (tp * dp shard actors, placement, rendezvous, dispatch), `GroupExecutor` (dp = 1),
                `GroupOptions`
`make_executor` picks one from the engine's settings.
"""
from __future__ import annotations

from typing import Literal

from workers.config import EngineConfig, ParallelConfig
from workers.executor.base import Executor, ExecutorDeadError, GroupError
from workers.executor.local import LocalExecutor

ExecutorKind = Literal["auto", "local", "ray"]


def make_executor(kind: ExecutorKind, model_dir, *, engine_config: EngineConfig, parallel: ParallelConfig,
                  device: str) -> Executor:
    if parallel.world_size > 1 or not isinstance(kind, str):
        # a worker group of tp * dp shards, an executor given ready-made, or a group's placement options
        from workers.executor.ray_group import make_group_executor

        return make_group_executor(kind, model_dir, engine_config=engine_config, parallel=parallel, device=device)
    if kind in ("auto", "local"):
        return LocalExecutor(model_dir, engine_config=engine_config, device=device)
    if kind == "ray":
        from workers.executor.ray_shard import RayExecutor

        return RayExecutor(model_dir, engine_config=engine_config, device=device)
    raise ValueError(f"executor: unknown kind {kind!r} (auto | local | ray)")


__all__ = ["Executor", "ExecutorDeadError", "ExecutorKind", "GroupError", "LocalExecutor", "make_executor"]
