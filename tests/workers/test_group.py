"""Worker-group configuration and selection that need no Ray: option validation, executor choice, and the
errors a bad combination gives before anything is placed. (The groups themselves run in
test_parallel_engine.py.)"""
from __future__ import annotations

import pytest

from workers.config import EngineConfig, ParallelConfig
from workers.dp import DPEngine
from workers.engine import Engine, make_engine
from workers.executor import LocalExecutor
from workers.executor.ray_group import GroupOptions, make_group_executor


@pytest.mark.parametrize("kw, field", [
    ({"num_cpus_per_shard": -1}, "num_cpus_per_shard"),
    ({"strategy": "PACKED"}, "strategy"),
    ({"placement_timeout_s": 0}, "placement_timeout_s"),
    ({"start_timeout_s": -5}, "start_timeout_s"),
    ({"moe_dispatch": "broadcast"}, "moe_dispatch"),
    ({"dispatch": "broadcast"}, "dispatch"),
])
def test_group_options_name_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        GroupOptions(**kw)


@pytest.mark.parametrize("kw, msg", [
    ({"tp": 2, "ep": 3}, "ep: 3 must divide tp \\* dp = 2"),
    ({"tp": 0}, "tp: must be >= 1"),
    ({"dp": 2, "ep": 4, "tp": 1}, "ep: 4 must divide tp \\* dp = 2"),
])
def test_parallel_layouts_are_validated(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelConfig(**kw)


def test_llm_validates_tp_ep_dp_before_loading(tiny_ckpt):
    from workers.llm import LLM

    with pytest.raises(ValueError, match="ep: 3 must divide tp \\* dp = 4"):
        LLM(tiny_ckpt, tp=2, dp=2, ep=3)


def test_local_executor_cannot_hold_several_shards(tiny_ckpt):
    with pytest.raises(ValueError, match="executor: 'local' runs one shard in this process; tp \\* dp = 2"):
        Engine(tiny_ckpt, parallel=ParallelConfig(tp=2), executor="local")
    with pytest.raises(ValueError, match="executor: 'local'.*dp=2 needs a worker group"):
        make_engine(tiny_ckpt, parallel=ParallelConfig(dp=2), executor="local")


def test_make_engine_builds_a_dp_engine_for_dp(tiny_ckpt, monkeypatch):
    """`make_engine(..., parallel=dp>1)` is a DPEngine (so callers need not know) for every role; its layout is
    checked before anything is placed. `Engine` itself is one core: it refuses dp > 1."""
    for role in ("unified", "prefill", "decode"):
        with pytest.raises(ValueError, match="executor: 'local'.*dp=2 needs a worker group"):
            make_engine(tiny_ckpt, parallel=ParallelConfig(dp=2, ep=2), role=role, executor="local")
        with pytest.raises(ValueError, match="parallel: dp=2 runs one core per dp rank: build it with make_engine"):
            Engine(tiny_ckpt, parallel=ParallelConfig(dp=2, ep=2), role=role, executor="local")
    built = []
    monkeypatch.setattr(DPEngine, "__init__", lambda self, *a, **kw: built.append(kw["parallel"].dp))
    assert isinstance(make_engine(tiny_ckpt, parallel=ParallelConfig(dp=2, ep=2)), DPEngine) and built == [2]


def test_executor_selection_for_one_shard(tiny_ckpt):
    """Group options on a one-shard layout give the in-process runner; a ready executor object is used as is
    (how a dp rank's engine core gets its executor)."""
    ec = EngineConfig(num_pages=8)
    ex = make_group_executor(GroupOptions(), tiny_ckpt, engine_config=ec, parallel=ParallelConfig(), device="cpu")
    assert isinstance(ex, LocalExecutor) and ex.info()["num_pages"] == 8
    eng = Engine(tiny_ckpt, engine_config=ec, executor=ex)
    assert eng.executor is ex and eng.num_pages == 8
    eng.shutdown()
