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


# ---- sharded forward: real gloo process groups on loopback, one process per rank -----------------------------

def _sharded_worker(rank: int, world: int, axis: str, init_file: str, ckpt_dir: str, out_file: str) -> None:
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from msa.metadata import ChunkSpec, build_metadata
    from msa.model import load_model
    from msa.parallel import ParallelContext

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        ctx = (ParallelContext(tp_size=world, tp_rank=rank, tp_group=group) if axis == "tp"
               else ParallelContext(ep_size=world, ep_rank=rank, ep_group=group))
        model = load_model(ckpt_dir, ctx=ctx)
        cfg = model.config
        kv = KVCache.allocate(cfg, 12, ctx=ctx)
        ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(9))
        table = list(range(12))[::-1]
        logits = []
        for chunks, tokens in [([ChunkSpec(table, 0, 140, False, all_logits=True)], ids[:140]),
                               ([ChunkSpec(table, 140, 1, True)], ids[140:141]),
                               ([ChunkSpec(table, 141, 1, True)], ids[141:142])]:
            meta = build_metadata(chunks, cfg.page_size)
            logits.append(model.compute_logits(model(tokens, meta, kv)[meta.logits_indices]))
        if rank == 0:
            torch.save(torch.cat(logits), out_file)
        dist.barrier()  # no rank tears the group down while another is still inside a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("axis,world", [("tp", 2), ("tp", 4), ("ep", 2)])
def test_sharded_forward_matches_single_shard(ckpts, mh, tiny_cfg, tmp_path, axis, world):
    """tp=2 splits KV heads, tp=4 replicates each of the 2 KV heads on two ranks, ep=2 splits the experts;
    each matches the single-shard model on a prefill with active selection plus two decode steps."""
    import subprocess
    import sys

    d = ckpts.path(tiny_cfg, 0, "hub")
    out = tmp_path / "logits.pt"
    # one OS process per rank, running this file as a script (see the __main__ block below)
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), axis, str(tmp_path / "init"), str(d),
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    sharded = torch.load(out)

    model = ckpts.model(tiny_cfg, 0, "hub")
    ids = torch.randint(0, tiny_cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(9))
    kv = KVCache.allocate(tiny_cfg, 12)
    table = list(range(12))[::-1]
    single = [mh.prefill_logits(model, ids[:140], kv, table)]
    for p in (140, 141):
        single.append(mh.prefill_logits(model, ids[p:p + 1], kv, table, start=p))
    single = torch.cat(single)
    assert sharded.shape == single.shape
    assert mh.max_rel_err(sharded, single) <= 1e-5


if __name__ == "__main__":
    import os
    import sys

    rank_, world_, axis_, init_, ckpt_, out_ = sys.argv[1:]
    _sharded_worker(int(rank_), int(world_), axis_, init_, ckpt_, out_)
    # The work is done and the group destroyed: leave without the interpreter's teardown, where a gloo thread
    # still being joined once aborted a rank ("terminate called without an active exception", a fresh-clone CI
    # run in session 3) after it had finished. An error above still exits non-zero with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_bf16_model_is_as_close_to_fp32_as_the_reference_bf16(ckpts, mh, tiny_cfg):
    """bf16 weights and cache (router kept fp32, logits returned fp32): per-position error against the fp32
    reference is small and no worse than transformers' own bf16 run of the same checkpoint."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    ids = mh.random_ids(tiny_cfg, 100, 4)
    want = ckpts.reference_logits(tiny_cfg, 0, ids)
    ref16 = MiniMaxM3VLForCausalLM.from_pretrained(ckpts.path(tiny_cfg, 0, "transformers"),
                                                   attn_implementation="eager", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16_logits = ref16(ids[None]).logits[0].float()
    model = ckpts.model(tiny_cfg, 0, "hub", dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    kv = KVCache.allocate(tiny_cfg, 7, dtype=torch.bfloat16)
    got = mh.prefill_logits(model, ids, kv, list(range(7)))
    assert got.dtype == torch.float32

    def per_pos(x):
        return (x - want).abs().amax(-1) / want.abs().max()

    ours, theirs = per_pos(got).median().item(), per_pos(ref16_logits).median().item()
    assert ours <= 0.05, f"median per-position error of the bf16 model: {ours:.3f}"
    assert ours <= 1.5 * theirs + 0.01, f"bf16: ours {ours:.4f} vs transformers' {theirs:.4f}"
