"""Fixtures for the model tests: tiny configs, random checkpoints (both layouts, cached per session), the
transformers reference loaded from the same files, and a helper to run our model over the paged cache."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from msa.checkpoint import write_checkpoint
from msa.config import M3Config
from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata
from msa.model import load_model
from workers.configio import load_yaml, preset_path


def tiny_config(**overrides) -> M3Config:
    """The built-in tiny preset (fp32) with field overrides."""
    base = load_yaml(preset_path("models", "tiny"), M3Config)
    return dataclasses.replace(base, **{"torch_dtype": "float32", **overrides})


class Checkpoints:
    """Writes each (config, seed, layout) checkpoint once per session and loads models/references from it."""

    def __init__(self, root):
        self.root = root
        self._dirs = {}
        self._refs = {}

    def path(self, cfg: M3Config, seed: int, layout: str):
        key = (cfg, seed, layout)
        if key not in self._dirs:
            d = self.root / f"ckpt{len(self._dirs)}-{layout}-s{seed}"
            self._dirs[key] = write_checkpoint(cfg, d, seed=seed, layout=layout, num_shards=2)
        return self._dirs[key]

    def model(self, cfg: M3Config, seed: int = 0, layout: str = "transformers", **kw):
        return load_model(self.path(cfg, seed, layout), **kw)

    def reference(self, cfg: M3Config, seed: int = 0):
        """transformers' MiniMaxM3VLForCausalLM (eager attention, fp32) from the transformers-layout files."""
        key = (cfg, seed)
        if key not in self._refs:
            from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

            ref = MiniMaxM3VLForCausalLM.from_pretrained(self.path(cfg, seed, "transformers"),
                                                         attn_implementation="eager", dtype=torch.float32)
            self._refs[key] = ref.eval()
        return self._refs[key]

    @torch.no_grad()
    def reference_logits(self, cfg: M3Config, seed: int, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> fp32 logits [T, vocab] of one full forward of the reference."""
        return self.reference(cfg, seed)(ids[None]).logits[0].float()


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("msa-ckpts"))


@pytest.fixture(scope="session")
def tiny_cfg() -> M3Config:
    return tiny_config()


def random_ids(cfg: M3Config, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def shuffled_pages(num_pages: int, need: int, seed: int) -> list[int]:
    """`need` distinct page ids drawn in random order from a pool of `num_pages` (not 0..need-1 in order)."""
    pool = list(range(num_pages))
    random.Random(seed).shuffle(pool)
    return pool[:need]


def prefill_logits(model, ids: torch.Tensor, kv: KVCache, page_table: list[int], start: int = 0) -> torch.Tensor:
    """Run `ids` as one prefill chunk at `start` and return fp32 logits for every token [T, vocab]."""
    device = kv.k[0].device
    meta = build_metadata([ChunkSpec(page_table, start, len(ids), False, all_logits=True)], kv.page_size, device)
    hidden = model(ids.to(device), meta, kv)
    return model.compute_logits(hidden[meta.logits_indices])


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to the logit scale max |want|."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="session")
def mh():
    """The helpers above, for test modules (conftest modules are not importable by name)."""
    import types

    return types.SimpleNamespace(tiny_config=tiny_config, random_ids=random_ids, shuffled_pages=shuffled_pages,
                                 prefill_logits=prefill_logits, max_rel_err=max_rel_err)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a shared 2-core machine their spinning made the
    decode loops ~30x slower; run each test single-threaded and restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
