"""The block-major sparse prefill attention (kernels/prefill_sparse_split.py) and the prompt-row dispatch
(kernels/attention.py `prompt_kind`) vs `paged_attention_ref` on CPU, through the Triton interpreter (fp32/fp16,
tiny shapes): varlen requests with cached prefixes that are not page multiples, chunks that start and end inside
a block, -1 padded selections, programs of fewer and of more pairs than a block's segment, row slices, half-page
tiles, mixed prefill + decode steps through `sparse_attention`, and the dense route for narrow page tables.

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import attention, index_topk as itk, prefill_sparse_split as split  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_prefill_gpu.py)", allow_module_level=True)

PS, HKV, D, DI = 16, 2, 16, 16
# (context length after the chunk, chunk start) per request: prefixes of 45, 0, 90 and 38 tokens, chunks that
# start and end inside a block, one of a single block's tail
CHUNKS = [(70, 45), (33, 0), (100, 90), (47, 38)]


def _case(make, chunks, *, dtype=torch.float32, seed=0, group=4, decode=(), page_size=PS):
    """Prompt rows of `chunks` (requests in order), then one decode row per context length in `decode` ->
    (case, query_start_loc of the prompt rows, longest chunk, q, q_idx)."""
    lens = [c for c, _ in chunks] + list(decode)
    rows = [(r, p) for r, (c, s) in enumerate(chunks) for p in range(s, c)]
    rows += [(len(chunks) + i, n - 1) for i, n in enumerate(decode)]
    case = make(context_lens=lens, rows=rows, page_size=page_size, kv_heads=HKV, head_dim=D, index_dim=DI,
                dtype=dtype, seed=seed)
    qsl = [0]
    for c, s in chunks:
        qsl.append(qsl[-1] + c - s)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(rows), HKV * group, D, generator=g).to(dtype)
    q_idx = torch.randn(len(rows), HKV, DI, generator=g).to(dtype)
    return case, torch.tensor(qsl, dtype=torch.int32), max(c - s for c, s in chunks), q, q_idx


def _random_selection(positions, topk, seed, *, shuffle=False):
    """Visible block ids per (row, KV head), own block always in, -1 padded (some rows short); ascending with a
    -1 tail, or (shuffle) in any order with the -1s anywhere."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(positions), HKV, topk), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        own = p // PS
        for h in range(HKV):
            others = torch.randperm(own, generator=g)[:int(torch.randint(0, topk, (1,), generator=g))]
            ids = sorted([own, *others.tolist()])
            out[i, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            if shuffle:
                out[i, h] = out[i, h, torch.randperm(topk, generator=g)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,launch,shuffle", [
    (4, {"pairs": 3, "sub": 4}, False),  # W smaller than most segments: several programs per block
    (8, {"pairs": 64, "sub": 2, "max_rows": 23}, True),  # W larger than any segment; row slices of 23
    (16, {"pairs": 5, "sub": 1, "mask_branch": False}, False),  # a sub-tile that does not divide W, mask always
    # the work list and split as launches of their own; the split inside the persistent kernel too
    (4, {"pairs": 7, "sub": 2, "fused": False}, True),
    (8, {"pairs": 16, "sub": 2, "fused": True, "fuse_split": True, "evict_first": True}, False),
    # the default: the persistent kernel for the work list only, the split a launch of its own over its buffers
    (4, {"pairs": 5, "sub": 2, "fused": True, "fuse_split": False, "max_rows": 40}, True),
])
def test_split_matches_ref(paged_case, dtype, group, launch, shuffle):
    case, qsl, max_len, q, _ = _case(paged_case, CHUNKS, dtype=dtype, seed=4, group=group)
    sel = _random_selection(case.positions, 4, seed=5, shuffle=shuffle)
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    got = torch.full_like(q, float("nan"))
    split.prefill_sparse_split(q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25, sel,
                               num_requests=len(CHUNKS), max_len=max_len, out=got, launch=launch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_split_with_half_page_tiles_and_indexer_selections(paged_case):
    # 32 keys per page held as two 16-key halves; the real indexer's selections (ascending, -1 tail)
    case, qsl, max_len, q, q_idx = _case(paged_case, [(150, 70), (40, 0)], seed=6, page_size=32)
    sel = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 2, 1)
    assert (sel == -1).any() and (sel[:, :, 1] >= 0).any()
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    for launch in ({"block_n": 16, "pairs": 8}, {"block_n": 32, "pairs": 128}):
        got = split.prefill_sparse_split(q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25,
                                         sel, num_requests=2, max_len=max_len, launch=launch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_calls_keep_their_buffers_and_every_partial_they_read_is_fresh(paged_case):
    """The fused path keeps its work-list buffers (by shape) and partials (the largest slice) from call to call:
    a second call of the same shapes reuses them (no allocation before the launch) and, with the kept partials
    poisoned by NaN and another selection, still equals the reference; a larger slice grows the partials;
    `release_workspace` (the engine's OOM recovery) drops them."""
    split.release_workspace()
    case, qsl, max_len, q, _ = _case(paged_case, CHUNKS, dtype=torch.float16, seed=8, group=4)
    args = (q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25)

    def run(sel, launch):
        want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                             case.positions, 0.25, sel)
        got = split.prefill_sparse_split(*args, sel, num_requests=len(CHUNKS), max_len=max_len, launch=launch)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)

    run(_random_selection(case.positions, 4, seed=9), {"max_rows": 40})
    (po, pl), = split._PARTIALS.values()
    work = dict(split._WORK)
    assert po.shape[0] == pl.shape[0] == 40 * HKV * 4 * 4
    po.fill_(float("nan"))
    pl.fill_(float("nan"))
    run(_random_selection(case.positions, 4, seed=10, shuffle=True), {"max_rows": 40})
    (po2, _), = split._PARTIALS.values()
    assert po2.data_ptr() == po.data_ptr() and all(split._WORK[k] is w for k, w in work.items())
    run(_random_selection(case.positions, 4, seed=11), None)  # one slice of every row: larger partials
    (po3, _), = split._PARTIALS.values()
    assert po3.shape[0] == q.shape[0] * HKV * 4 * 4 > po.shape[0]
    split.release_workspace()
    assert not split._PARTIALS and not split._WORK


def test_the_ab_tool_loads_another_version_of_the_module_as_a_module_of_its_own(paged_case, tmp_path):
    """benchmarks/kernels/prefill_split_ab.py times a copy of another version of this module beside the shipped
    one: loaded from a file, it keeps its own kernels and buffers, and (here a copy of the shipped source) gives
    the shipped module's output bit for bit."""
    import importlib.util
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("prefill_split_ab", root / "benchmarks/kernels/prefill_split_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    copy = tmp_path / "old_split.py"
    shutil.copy(root / "kernels/prefill_sparse_split.py", copy)
    old = ab.load_module(copy)
    assert old is not split and old._split_kernel is not split._split_kernel and old._WORK is not split._WORK
    case, qsl, max_len, q, _ = _case(paged_case, CHUNKS[:2], dtype=torch.float16, seed=12, group=4)
    sel = _random_selection(case.positions, 4, seed=13)
    args = (q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25, sel)
    want = split.prefill_sparse_split(*args, num_requests=2, max_len=max_len)
    assert torch.equal(old.prefill_sparse_split(*args, num_requests=2, max_len=max_len), want)


def test_work_list_covers_every_pair_once_in_block_runs():
    """Every selected (row, head, slot) sits in exactly one program's run, a run holds one (head, request, block)
    and at most W pairs, programs past the end are marked -1, and rows of a slice past row 0 find their request.
    2,400 pairs: three count programs, the last to arrive scanning."""
    g = torch.Generator().manual_seed(3)
    n, topk, width, pairs, row0 = 400, 3, 5, 4, 6
    qsl = torch.tensor([0, 10, 300, 600], dtype=torch.int32)  # rows 6 .. 405 span all three requests
    bid = torch.randint(-1, width, (n, HKV, topk), generator=g, dtype=torch.int32)
    work = split.build_work_list(bid, qsl, row0, 3, width, pairs)
    req = torch.searchsorted(qsl[1:], torch.arange(row0, row0 + n, dtype=torch.int32), right=True)
    items = work.items.tolist()
    assert len(items) == -(-bid.numel() // pairs) + min(bid.numel(), HKV * 3 * width)
    counts = (work.seg_start[1:] - work.seg_start[:-1]).tolist()
    covered = []
    for pid, key in enumerate(items):
        if key < 0:
            assert all(k < 0 for k in items[pid:])
            break
        j = pid - (int(work.prog_end[key]) - -(-counts[key] // pairs))
        first = int(work.seg_start[key]) + j * pairs
        run = work.perm[first:first + min(pairs, counts[key] - j * pairs)].tolist()
        assert 0 < len(run) <= pairs
        for p in run:
            row, head, slot = p // (HKV * topk), (p // topk) % HKV, p % topk
            assert key == (head * 3 + int(req[row])) * width + int(bid[row, head, slot])
        covered += run
    assert sorted(covered) == [p for p in range(bid.numel()) if bid.reshape(-1)[p] >= 0]
    from kernels._triton import _ARRIVAL_COUNTERS

    assert int(_ARRIVAL_COUNTERS[("prefill_split", bid.device)].abs().sum()) == 0  # left zeroed for the next call


@pytest.fixture
def block_major_everywhere(monkeypatch):
    monkeypatch.setitem(split.BLOCK_MAJOR_RULE, "min_rows_per_request", 1)
    monkeypatch.setitem(split.BLOCK_MAJOR_RULE, "min_blocks_per_topk", 1.0)
    monkeypatch.setitem(split.BLOCK_MAJOR_RULE, "fp32", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_and_decode_rows_block_major(paged_case, block_major_everywhere, dtype):
    """Prompt rows of three requests through the block-major kernel (the dispatch's pick), three decode rows
    behind them through the decode kernel: every row equal to the reference."""
    chunks = CHUNKS[:3]
    case, qsl, max_len, q, q_idx = _case(paged_case, chunks, dtype=dtype, seed=7, decode=(20, 77, 130))
    npf = int(qsl[-1])
    assert attention.prompt_kind(npf, 3, case.page_tables.shape[1], torch.empty(1, HKV, 3), HKV) == "block_major"
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    sel = itk.index_topk_ref(q_idx.float(), case.index_k_cache.float(), case.page_tables, case.row_seq,
                             case.positions, 3, 1)
    got = attention.sparse_attention(*args, sel, 0.25, num_prefill_rows=npf, backend="triton",
                                     prefill=(qsl, len(chunks), max_len))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), attention.paged_attention_ref(*args, 0.25, sel).float(), atol=tol,
                               rtol=tol)


def test_narrow_tables_take_the_dense_kernel(paged_case):
    """Page tables at most top-k blocks wide: every visible block is selected (M3_SPEC section 3), so the prompt
    rows run dense and do not read block_ids. With a partial selection passed anyway the output is the dense
    one; with the indexer's it is both."""
    chunks = [(60, 20), (33, 0)]  # 4 and 3 blocks: tables 5 wide with the spare column
    case, qsl, max_len, q, q_idx = _case(paged_case, chunks, seed=8)
    width = case.page_tables.shape[1]
    npf = int(qsl[-1])
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    prefill = (qsl, len(chunks), max_len)
    partial = _random_selection(case.positions, width, seed=9)
    assert attention.prompt_kind(npf, 2, width, partial, HKV) == "dense"
    dense = attention.paged_attention_ref(*args, 0.25)
    got = attention.sparse_attention(*args, partial, 0.25, num_prefill_rows=npf, backend="triton", prefill=prefill)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    sel = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, width, 1)
    torch.testing.assert_close(attention.paged_attention_ref(*args, 0.25, sel), dense, atol=1e-5, rtol=1e-5)


def test_prompt_kind_rule():
    sel = torch.empty(1, 4, 16)
    assert attention.prompt_kind(2048, 1, 16, sel, 4) == "dense"
    assert attention.prompt_kind(2048, 1, 64, None, 4) == "dense"
    assert attention.prompt_kind(2048, 1, 64, sel, 4) == "block_major"
    assert attention.prompt_kind(2048, 1, 64, sel, 4, fp32=True) == "token_major"
    assert attention.prompt_kind(2048, 1, 32, sel, 4) == "token_major"  # not wider than 2 x top-k
    assert attention.prompt_kind(2048, 8, 64, sel, 4) == "token_major"  # 256 rows a request
    assert attention.prompt_kind(300, 1, 256, sel, 4) == "token_major"
    assert attention.prompt_kind(1 << 20, 64, 1024, sel, 4) == "token_major"  # 262k keys: past the scan's bound


def test_every_attention_kernel_takes_a_head_major_page_layout(paged_case):
    """benchmarks/kernels/bench_kv_layout.py times the caches held as [P, Hkv, ps, D] in memory (one KV head's page
    contiguous) through the same kernels as the shipped [P, ps, Hkv, D]: every kernel must take the caches'
    strides, not assume them. The decode kernel (sparse and dense), the prompt kernels (token-major sparse, dense,
    block-major) and the cache write give the same bits on both layouts."""
    from kernels import paged_kv
    from kernels.prefill_attention import prefill_attention

    case, qsl, max_len, q, _ = _case(paged_case, CHUNKS, dtype=torch.float16, seed=14, decode=(20, 77))
    npf = int(qsl[-1])
    sel = _random_selection(case.positions, 4, seed=15)
    layouts = {name: (f(case.k_cache), f(case.v_cache)) for name, f in
               (("nhd", lambda x: x), ("hnd", lambda x: x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)))}
    assert layouts["hnd"][0].stride()[1:3] == (D, PS * D) and torch.equal(layouts["hnd"][0], case.k_cache)
    got = {}
    for name, (kc, vc) in layouts.items():
        rows = (case.page_tables, case.row_seq[npf:], case.positions[npf:])
        got[name] = [
            attention.paged_decode_attention(q[npf:], kc, vc, *rows, 0.25, sel[npf:]),
            attention.paged_decode_attention(q[npf:], kc, vc, *rows, 0.25),
            prefill_attention(q[:npf], kc, vc, case.page_tables, qsl, case.positions[:npf], 0.25, sel[:npf],
                              num_requests=len(CHUNKS), max_len=max_len),
            prefill_attention(q[:npf], kc, vc, case.page_tables, qsl, case.positions[:npf], 0.25, None,
                              num_requests=len(CHUNKS), max_len=max_len),
            split.prefill_sparse_split(q[:npf], kc, vc, case.page_tables, qsl, case.positions[:npf], 0.25,
                                       sel[:npf], num_requests=len(CHUNKS), max_len=max_len),
        ]
        # a write of three tokens (one padding slot) into a copy of the layout, read back as [P, ps, Hkv, D]
        kw, vw = kc.clone(memory_format=torch.preserve_format), vc.clone(memory_format=torch.preserve_format)
        assert kw.stride() == kc.stride()
        new = torch.randn(3, HKV, D, generator=torch.Generator().manual_seed(16)).to(kc.dtype)
        paged_kv.write_kv(new, new + 1, None, torch.tensor([5, -1, 2 * PS + 3]), kw, vw, None, backend="triton")
        got[name] += [kw, vw]
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    torch.testing.assert_close(got["nhd"][0].float(), want[npf:].float(), atol=2e-3, rtol=2e-3)
    for a, b in zip(got["nhd"], got["hnd"]):
        assert torch.equal(a, b)
