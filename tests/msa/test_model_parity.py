"""Our paged model == transformers' MiniMaxM3VLForCausalLM (fp32, eager) on prefills long enough that MSA block
selection is active (many more blocks than top-k), for checkpoints in both layouts written by msa.checkpoint."""
from __future__ import annotations

import pytest
import torch

from msa.kv_cache import KVCache

S, F = "minimax_m3_sparse", "full_attention"
# name -> (config overrides, sequence length)
CASES = {
    # the tiny preset: GQA group 4, block 16, top-4, one local block, 1 dense + 3 MoE layers
    "tiny": ({}, 200),
    # GQA group 8 (one KV head), top-2 with two forced local blocks, a sparse first layer, a dense MLP in the
    # middle, and a low swiglu_limit so the gate/up clamps fire often
    "gqa8-top2-local2": (dict(num_hidden_layers=3, num_key_value_heads=1, index_n_heads=1, index_topk_blocks=2,
                              index_local_blocks=2, swiglu_limit=1.0, layer_types=(S, F, S),
                              mlp_layer_types=("sparse", "dense", "sparse")), 160),
    # GQA group 2, block 32, top-3, head_dim 16 with rotary_dim 8, 6 experts choosing 3
    "bs32-top3": (dict(num_key_value_heads=4, index_n_heads=4, head_dim=16, rotary_dim=8, index_head_dim=16,
                       index_block_size=32, index_topk_blocks=3, num_local_experts=6, num_experts_per_tok=3), 300),
}
RUNS = [("tiny", 0), ("tiny", 1), ("gqa8-top2-local2", 2), ("bs32-top3", 3)]


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@pytest.mark.parametrize("case,seed", RUNS)
def test_prefill_logits_match_reference(ckpts, mh, case, seed, layout):
    overrides, n = CASES[case]
    cfg = mh.tiny_config(**overrides)
    # selection must be active: more visible blocks than top-k for most of the sequence
    assert n >= 2 * cfg.index_topk_blocks * cfg.index_block_size
    ids = mh.random_ids(cfg, n, seed)
    want = ckpts.reference_logits(cfg, seed, ids)

    model = ckpts.model(cfg, seed, layout)
    pages = -(-n // cfg.page_size)
    kv = KVCache.allocate(cfg, pages + 5, dtype=torch.float32)
    got = mh.prefill_logits(model, ids, kv, mh.shuffled_pages(pages + 5, pages, seed))
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = mh.max_rel_err(got, want)
    assert err <= 1e-4, f"{case}/{layout}/seed {seed}: max |diff| / max |logit| = {err:.2e}"
