"""Building blocks against the reference modules and hand-computed values; metadata and cache layout."""
from __future__ import annotations

import math

import pytest
import torch

from msa.config import M3Config
from msa.kv_cache import KVCache
from msa.layers import RMSNorm, RotaryEmbedding, apply_rope, rms_norm, swiglu_oai
from msa.metadata import ChunkSpec, build_metadata
from msa.moe import SparseMoE
from msa.parallel import ParallelContext
from workers.configio import load_yaml, preset_path

ref_mod = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")


def test_rms_norm_is_gemma_style():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 3
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 0.3
    ref = ref_mod.MiniMaxM3VLRMSNorm(32, eps=1e-6)
    ref.weight.data.copy_(w)
    ours = RMSNorm(32, 1e-6, dtype=torch.float32, device="cpu")
    ours.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)
    # a stored 0 is the identity scale: unit RMS output
    y = rms_norm(x, torch.zeros(32), 1e-6)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(5), rtol=1e-4, atol=1e-4)
    # fused residual add returns the normed sum and the sum
    r = torch.randn(5, 32)
    normed, summed = ours(x, r)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(normed, ref(x + r), rtol=1e-6, atol=1e-6)
    # bf16 in, computed in fp32, bf16 out
    assert ours(x.bfloat16()).dtype == torch.bfloat16


def test_partial_rope_matches_reference_and_rotates_only_rotary_dims():
    head_dim, rotary_dim, theta = 32, 16, 10000.0
    rope = RotaryEmbedding(rotary_dim, theta, device="cpu")
    # frequencies run over rotary_dim, not head_dim
    assert torch.allclose(rope.inv_freq, theta ** (-torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    pos = torch.tensor([0, 1, 7, 130, 4095])
    q = torch.randn(5, 4, head_dim, generator=torch.Generator().manual_seed(2))
    k = torch.randn(5, 2, head_dim, generator=torch.Generator().manual_seed(3))
    cos, sin = rope.cos_sin(pos)
    ref_q, ref_k = ref_mod.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    out = apply_rope(q, cos, sin)
    assert torch.equal(out[..., rotary_dim:], q[..., rotary_dim:])  # pass-through dims untouched
    assert torch.equal(out[0], q[0])  # position 0 is the identity
    # NeoX half split: dims i and i + rotary_dim/2 rotate together by angle p * inv_freq_i
    p, i = 7, 3
    ang = p * rope.inv_freq[i]
    x1, x2 = q[2, 0, i], q[2, 0, i + rotary_dim // 2]
    torch.testing.assert_close(out[2, 0, i], x1 * torch.cos(ang) - x2 * torch.sin(ang))
    # 1-D index-K rows [T, D] rotate like one head
    torch.testing.assert_close(apply_rope(k[:, 0], cos, sin), ref_k[0, 0], rtol=1e-6, atol=1e-6)


def test_swiglu_oai_clamps_gate_upper_only_and_shifts_up():
    alpha, limit = 1.702, 7.0
    g = torch.tensor([-20.0, -1.0, 0.5, 9.0])
    u = torch.tensor([-9.0, 0.3, 8.0, -0.5])
    want = []
    for gi, ui in zip(g.tolist(), u.tolist()):
        gc = min(gi, limit)
        uc = max(min(ui, limit), -limit)
        want.append(gc / (1 + math.exp(-alpha * gc)) * (uc + 1))
    torch.testing.assert_close(swiglu_oai(g, u, alpha, limit), torch.tensor(want))
    # the gate is not clamped from below: a very negative gate still shrinks the output towards 0 smoothly
    assert swiglu_oai(torch.tensor([-20.0]), torch.tensor([0.0]), alpha, limit).abs() < 1e-12


def _tiny_hf_config(cfg: M3Config):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(**cfg.to_hf_text_dict())


def test_moe_matches_reference_block_and_bias_only_selects():
    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    gen = torch.Generator().manual_seed(4)
    ref = ref_mod.MiniMaxM3VLSparseMoeBlock(_tiny_hf_config(cfg)).eval()
    h, e, i = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    with torch.no_grad():
        ref.gate.weight.copy_(torch.randn(e, h, generator=gen) / math.sqrt(h))
        ref.gate.e_score_correction_bias.copy_(torch.randn(e, generator=gen) * 0.2)
        ref.experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=gen) * 3 / math.sqrt(h))
        ref.experts.down_proj.copy_(torch.randn(e, h, i, generator=gen) / math.sqrt(i))
        ref.shared_experts.gate_up_proj.weight.copy_(torch.randn(2 * i, h, generator=gen) / math.sqrt(h))
        ref.shared_experts.down_proj.weight.copy_(torch.randn(h, i, generator=gen) / math.sqrt(i))
    ours = SparseMoE(cfg, ParallelContext.single(), dtype=torch.float32, device="cpu")
    ours.gate.weight.weight_loader(ours.gate.weight, ref.gate.weight.data)
    ours.gate.e_score_correction_bias.weight_loader(ours.gate.e_score_correction_bias,
                                                    ref.gate.e_score_correction_bias.data)
    ours.experts.gate_up_proj.weight_loader(ours.experts.gate_up_proj, ref.experts.gate_up_proj.data)
    ours.experts.down_proj.weight_loader(ours.experts.down_proj, ref.experts.down_proj.data)
    sh = ours.shared_experts
    sh.gate_up_proj.weight.weight_loader(sh.gate_up_proj.weight, ref.shared_experts.gate_up_proj.weight.data)
    sh.down_proj.weight.weight_loader(sh.down_proj.weight, ref.shared_experts.down_proj.weight.data)

    x = torch.randn(40, h, generator=gen)
    with torch.no_grad():
        want = ref(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ids, weights = ours.gate(x)
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), cfg.routed_scaling_factor))
    scores = torch.sigmoid(x @ ours.gate.weight.T)
    unbiased_ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1).indices
    changed = (ids.sort(-1).values != unbiased_ids.sort(-1).values).any(-1)
    assert changed.any(), "the correction bias should change some selections in this test"
    # the weights come from the unbiased scores of the chosen experts
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_build_metadata_layout():
    ps = 16
    chunks = [ChunkSpec([5, 2, 9], 20, 15, False, all_logits=True),   # positions 20..34 (pages 2 then 9)
              ChunkSpec([7], 0, 3, False),
              ChunkSpec([4, 1], 16, 1, True)]                          # decode at position 16 (page 1)
    m = build_metadata(chunks, ps)
    assert m.num_prefill_tokens == 18 and m.num_tokens == 19 and m.num_decode_tokens == 1
    assert m.positions.tolist() == list(range(20, 35)) + [0, 1, 2] + [16]
    assert m.slot_mapping.tolist() == ([2 * ps + o for o in range(4, 16)] + [9 * ps + o for o in range(3)]
                                       + [7 * ps, 7 * ps + 1, 7 * ps + 2] + [1 * ps + 0])
    assert m.row_seq.tolist() == [0] * 15 + [1] * 3 + [2]
    assert m.page_tables.tolist() == [[5, 2, 9], [7, 0, 0], [4, 1, 0]] and m.page_tables.dtype == torch.int32
    assert m.query_start_loc.tolist() == [0, 15, 18, 19]
    assert m.context_lens.tolist() == [35, 3, 17]
    assert m.logits_indices.tolist() == list(range(15)) + [17, 18]
    assert m.positions.dtype == torch.int64 and m.slot_mapping.dtype == torch.int64 and m.row_seq.dtype == torch.int32


@pytest.mark.parametrize("chunks,match", [
    ([ChunkSpec([0], 0, 1, True), ChunkSpec([1], 0, 4, False)], "prefill chunks must come before"),
    ([ChunkSpec([0], 10, 7, False)], "page_table has 1 pages, 2 needed"),
    ([ChunkSpec([0, 1], 3, 2, True)], "exactly one token"),
])
def test_build_metadata_rejects_bad_chunks(chunks, match):
    with pytest.raises(ValueError, match=match):
        build_metadata(chunks, 16)


def test_kv_cache_layout_and_bytes():
    m3 = load_yaml(preset_path("models", "m3"), M3Config)
    # M3_SPEC.md §4: 137,472 B per token in bf16 for the full model; a page is 128 tokens
    assert KVCache.bytes_per_page(m3, torch.bfloat16) == 137_472 * 128
    tiny = load_yaml(preset_path("models", "tiny"), M3Config)
    kv = KVCache.allocate(tiny, 6, dtype=torch.float32)
    assert kv.k[0].shape == (6, 16, 2, 32) and kv.index_k[0] is None
    assert kv.index_k[1].shape == (6, 16, 32)
    total = sum(t.numel() * t.element_size() for t in kv.k + kv.v + [t for t in kv.index_k if t is not None])
    assert total == 6 * KVCache.bytes_per_page(tiny, torch.float32)
