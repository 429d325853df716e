"""The block-major sparse prefill attention (kernels/prefill_sparse_split.py) vs `paged_attention_ref` on CPU,
through the Triton interpreter (fp32/fp16, tiny shapes): varlen requests with cached prefixes that are not page
multiples, chunks that start and end inside a block, -1 padded selections, blocks chosen by many tokens (split
over several programs) and by one, GQA groups, and the device-built work list itself.

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import attention, index_topk as itk  # noqa: E402
from kernels.prefill_sparse_split import num_programs, prefill_sparse_split, work_list  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_prefill_gpu.py)", allow_module_level=True)

PS, HKV, D, DI = 16, 2, 16, 16
CHUNKS = [(70, 45), (33, 0), (100, 90), (47, 38)]  # (context after the chunk, chunk start) per request


def _case(make, chunks, *, dtype=torch.float32, seed=0, group=4, page_size=PS):
    lens = [c for c, _ in chunks]
    rows = [(r, p) for r, (c, s) in enumerate(chunks) for p in range(s, c)]
    case = make(context_lens=lens, rows=rows, page_size=page_size, kv_heads=HKV, head_dim=D, index_dim=DI,
                dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(rows), HKV * group, D, generator=g).to(dtype)
    q_idx = torch.randn(len(rows), HKV, DI, generator=g).to(dtype)
    return case, q, q_idx


def _random_selection(positions, topk, seed, page_size=PS):
    """Ascending visible block ids per (row, KV head), own block always in, -1 tail (some rows short)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(positions), HKV, topk), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        own = p // page_size
        for h in range(HKV):
            others = torch.randperm(own, generator=g)[:int(torch.randint(0, topk, (1,), generator=g))]
            ids = sorted([own, *others.tolist()])
            out[i, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,pairs", [(4, 4), (8, 2), (8, 8), (16, 1)])
def test_split_matches_ref(paged_case, dtype, group, pairs):
    case, q, _ = _case(paged_case, CHUNKS, dtype=dtype, seed=4, group=group)
    sel = _random_selection(case.positions, 4, seed=5)
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    got = torch.full_like(q, float("nan"))
    prefill_sparse_split(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions, sel, 0.25,
                         num_requests=len(CHUNKS), out=got, launch={"pairs": pairs, "block_n": 16})
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_split_with_wide_pages_sub_tiles_and_indexer_selections(paged_case):
    # 32 keys per page read as two 16-key tiles; the real indexer's selections (ascending, -1 tail)
    case, q, q_idx = _case(paged_case, [(150, 70), (40, 0)], seed=6, page_size=32)
    sel = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 2, 1)
    assert (sel == -1).any() and (sel[:, :, 1] >= 0).any()
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    got = prefill_sparse_split(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions, sel,
                               0.25, num_requests=2, launch={"block_n": 16})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_work_list_covers_every_pair_once_in_block_runs():
    """Every selected (row, head, slot) is in exactly one program's run, a run never mixes blocks, no run is
    longer than `pairs`, and the program bound holds."""
    g = torch.Generator().manual_seed(3)
    n, topk, mp, pairs = 37, 3, 5, 4
    bid = torch.randint(-1, mp, (n, HKV, topk), generator=g, dtype=torch.int32)
    row_seq = torch.sort(torch.randint(0, 2, (n,), generator=g)).values.to(torch.int32)
    keys, perm, items = work_list(bid, row_seq, mp, 2, pairs)
    assert items.numel() == num_programs(keys.numel(), pairs, HKV * 2 * mp) + 1
    starts = [int(i) for i in items.tolist() if i >= 0]
    covered = []
    for s in starts:
        run = [s + j for j in range(pairs) if s + j < keys.numel() and keys[s + j] == keys[s]]
        covered += [int(perm[i]) for i in run]
    selected = [p for p in range(bid.numel()) if bid.reshape(-1)[p] >= 0]
    assert sorted(covered) == selected
    flat = bid.reshape(-1).long()
    for s in starts:  # the key names the pair's (head, request, block)
        p = int(perm[s])
        row, head = p // (HKV * topk), (p // topk) % HKV
        assert int(keys[s]) == head * 2 * mp + int(row_seq[row]) * mp + int(flat[p])
