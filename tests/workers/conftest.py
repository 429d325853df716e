"""Fixtures for the engine tests: one tiny random checkpoint per session (transformers layout, so the
`transformers` reference loads the very same files), the reference model, and engines that must give every page
back by the end of each test."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from msa.checkpoint import write_checkpoint
from msa.config import M3Config
from workers.configio import load_yaml, preset_path


def tiny_config() -> M3Config:
    return dataclasses.replace(load_yaml(preset_path("models", "tiny"), M3Config), torch_dtype="float32")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_checkpoint(tiny_config(), tmp_path_factory.mktemp("engine-ckpt"), seed=7, layout="transformers")


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    return MiniMaxM3VLForCausalLM.from_pretrained(tiny_ckpt, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture
def make_llm(tiny_ckpt):
    """`make_llm(**engine_config_fields)` -> LLM on the session checkpoint. At teardown every engine made must
    be idle with all pages free (no leak), whatever the test did."""
    from workers.llm import LLM

    made = []

    def factory(**kw):
        llm = LLM(tiny_ckpt, **kw)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        eng = llm.engine
        assert not eng.has_unfinished(), "requests left in flight"
        st = eng.stats()
        assert st.num_pages_free == st.num_pages_total, f"leaked {st.num_pages_total - st.num_pages_free} pages"
        assert eng.pages.owners() == {}
        eng.shutdown()


@pytest.fixture
def make_async(tiny_ckpt):
    """`make_async(**engine_config_fields)` -> AsyncEngine on the session checkpoint. At teardown every engine
    made must come back to all pages free, nothing in flight, and its step thread must end."""
    from workers.async_engine import AsyncEngine
    from workers.config import EngineConfig
    from workers.engine import Engine

    made = []

    def factory(**kw):
        ae = AsyncEngine(lambda: Engine(tiny_ckpt, engine_config=EngineConfig(**kw)))
        made.append(ae)
        return ae

    yield factory
    for ae in made:
        try:
            _wait_until(lambda: ae.stats().num_pages_free == ae.stats().num_pages_total and not ae.num_in_flight)
            assert ae.engine.pages.owners() == {}
        finally:
            ae.shutdown()
        assert not ae._thread.is_alive()


def _wait_until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
