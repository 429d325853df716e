"""MSA lightning-indexer block scores and top-k block selection over the paged index-K cache.

Semantics (M3_SPEC.md §3, one row = one query token at absolute position p of its request):
  score(r, b) = max over keys j in block b with j <= p of <q_idx[r], index_k[j]>   (fp32, no scale)
  the local blocks b >= p // bs - local_blocks + 1 are forced in (score +inf);
  the top min(topk, p // bs + 1) blocks are selected per index head r.
Output layout (the one explicit top-k layout of the project): int32 [N, n_idx, topk], the selected *logical*
block ids of the request in ascending order, -1 padding at the tail. Ties in score go to the lower block id.

Decode path (Triton, two launches): `_index_scores_kernel` on a grid (decode rows, num_kv_splits) computes the
block maxima; split s takes blocks s, s + S, s + 2S, ... of its row, so the work spreads over the splits whatever
the row's real length is (a batch of 1 at 8.7k tokens keeps 68 programs busy instead of 1). A block maximum is
written by exactly one program and max is exact, so the scores, hence the selection, do not depend on the split
count. The selection forces the local blocks in, takes the top-k in the reference's stable-sort order (higher
score first, ties to the lower block id) and emits the chosen ids in ascending order. Rows of up to
RANK_MAX_BLOCKS blocks select by rank (`_select_topk_kernel`: block i is chosen iff fewer than k blocks beat it,
all compares in parallel); longer rows by k serial arg-max rounds (`_select_rounds_kernel`), cheaper there than
the O(nb^2) compares.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels._paged import gather_context, gather_row_contexts, prefill_layout, request_rows
from kernels._triton import (arrival_counters, next_pow2, num_sms, pdl_enter, pdl_launch, runnable, step_jit,
                             use_triton)
from kernels.prefill_index import prefill_index_topk


def index_topk_ref(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor,
                   row_seq: torch.Tensor, positions: torch.Tensor, topk: int, local_blocks: int) -> torch.Tensor:
    """q_idx [N, Hi, Di]; index_k_cache [P, ps, Di]; page_tables [R, max_pages]; row_seq [N]; positions [N]."""
    n, hi, _ = q_idx.shape
    ps = index_k_cache.shape[1]
    out = torch.full((n, hi, topk), -1, dtype=torch.int32, device=q_idx.device)
    for r, rows in request_rows(row_seq):
        pos = positions[rows].to(torch.long)
        ctx = int(pos.max()) + 1
        keys = gather_context(index_k_cache, page_tables[r], ctx).float()  # [L, Di]
        scores = torch.einsum("nhd,ld->nhl", q_idx[rows].float(), keys)
        out[rows] = select_topk_blocks(_forced_block_scores(scores, pos, ps, local_blocks), topk)
    return out


def _forced_block_scores(scores: torch.Tensor, pos: torch.Tensor, ps: int, local_blocks: int) -> torch.Tensor:
    """Key scores [n, Hi, L] of rows at positions pos [n] -> block scores [n, Hi, ceil(L / ps)]: the max over each
    block's keys j <= pos (-inf where none), +inf on the row's local blocks."""
    n, hi, length = scores.shape
    future = torch.arange(length, device=scores.device)[None, :] > pos[:, None]  # [n, L]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    nb = -(-length // ps)
    scores = torch.nn.functional.pad(scores, (0, nb * ps - length), value=float("-inf"))
    block_scores = scores.view(n, hi, nb, ps).amax(-1)
    own = pos // ps
    blocks = torch.arange(nb, device=scores.device)
    local = (blocks[None, :] >= (own - local_blocks + 1)[:, None]) & (blocks[None, :] <= own[:, None])
    return block_scores.masked_fill(local[:, None, :], float("inf"))


def index_topk_decode_torch(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor,
                            row_seq: torch.Tensor, positions: torch.Tensor, topk: int,
                            local_blocks: int) -> torch.Tensor:
    """The CPU serving path for decode rows: `index_topk_ref`'s selection for rows that each stand alone (shapes
    as there), every row at once (one gather up to the longest row, one einsum; the reference loops over
    requests). Blocks past a row's own are -inf, hence never chosen: the same ids as the reference's narrower
    per-request scores. One host sync."""
    n, hi, _ = q_idx.shape
    ps = index_k_cache.shape[1]
    if n == 0:
        return torch.empty((0, hi, topk), dtype=torch.int32, device=q_idx.device)
    pos = positions.to(torch.long)
    nb = int(pos.max()) // ps + 1
    keys = gather_row_contexts(index_k_cache, page_tables, row_seq, nb * ps).float()  # [N, nb * ps, Di]
    scores = torch.einsum("nhd,nld->nhl", q_idx.float(), keys)
    return select_topk_blocks(_forced_block_scores(scores, pos, ps, local_blocks), topk)


def select_topk_blocks(block_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., nb] fp32 scores (-inf = not visible) -> [..., topk] int32 ascending block ids, -1 tail padding."""
    nb = block_scores.shape[-1]
    # stable descending sort keeps the lower block id first among equal scores
    order = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = torch.gather(block_scores, -1, order)
    ids = torch.where(chosen == float("-inf"), torch.full_like(order, nb), order)
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids == nb, torch.full_like(ids, -1), ids).to(torch.int32)
    if ids.shape[-1] < topk:
        pad = torch.full((*ids.shape[:-1], topk - ids.shape[-1]), -1, dtype=torch.int32, device=ids.device)
        ids = torch.cat([ids, pad], dim=-1)
    return ids




@triton.jit
def _forced_scores(row_ptr, blk, own, local_blocks, ok):
    """Block scores of one row at block ids `blk` (any shape; row_ptr broadcasts against it): -inf past the own
    block or where `ok` is false, +inf on the local blocks. `.cg`: the scores may come from other programs of
    the same launch (fused path), so the read must skip L1."""
    sc = tl.load(row_ptr + blk, mask=(blk <= own) & ok, other=float("-inf"), cache_modifier=".cg")
    return tl.where((blk >= own - local_blocks + 1) & (blk <= own) & ok, float("inf"), sc)


@triton.jit
def _select_by_rank(sc_row, out_row, h, h_ok, sc_st_h, out_st_h, own, local_blocks, pt_row, pg_row,
                    TOPK: tl.constexpr, HP: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr,
                    BLOCK_K: tl.constexpr, PAGES: tl.constexpr):
    # heads h [HP] of one row. Block i is chosen iff fewer than TOPK blocks beat it, where j beats i when its
    # score is higher, or equal with a lower id: the reference's stable-sort order, computed in parallel (no
    # serial arg-max rounds). O(nb^2) compares: for rows of up to a few hundred blocks. PAGES: the chosen
    # blocks' pages (pt_row[i]) go to the same slots of pg_row (strides of out_row), the -1 tail left as is.
    i = tl.arange(0, BLOCK_NB)
    rows = sc_row + h[:, None] * sc_st_h  # [HP, 1]
    si = _forced_scores(rows, i[None, :], own, local_blocks, h_ok[:, None])  # [HP, NB]
    rank = tl.zeros([HP, BLOCK_NB], tl.int32)
    # tile j0 + BLOCK_J's scores load before tile j0's compares: each iteration's rank sum crosses warps through
    # shared memory (two barriers), so a load issued in the same iteration made every tile wait its L2 round trip
    jj = tl.arange(0, BLOCK_J)
    sj = _forced_scores(rows, jj[None, :], own, local_blocks, h_ok[:, None])  # [HP, BJ]
    for j0 in range(0, own + 1, BLOCK_J):
        sj_next = _forced_scores(rows, (j0 + BLOCK_J + jj)[None, :], own, local_blocks, h_ok[:, None])
        j = j0 + jj
        a = si[:, :, None]
        b = sj[:, None, :]
        beats = (b > a) | ((b == a) & (j[None, None, :] < i[None, :, None]))
        rank += tl.sum(beats.to(tl.int32), axis=2)
        sj = sj_next
    chosen = (rank < TOPK) & (si > float("-inf"))
    _emit_ascending(out_row + h[:, None] * out_st_h, i[None, :] + 0 * rank, chosen, h_ok, HP, TOPK, BLOCK_K)
    if PAGES:
        pages = tl.load(pt_row + i, mask=i <= own, other=0)  # [NB]: one read of the row's table for all heads
        slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
        tl.store(pg_row + h[:, None] * out_st_h + slot, pages[None, :] + 0 * rank, mask=chosen)


@triton.jit
def _emit_ascending(outs, ids, chosen, h_ok, HP: tl.constexpr, TOPK: tl.constexpr, BLOCK_K: tl.constexpr):
    # ids/chosen [HP, M] in ascending id order: the c-th chosen id goes to slot c, slots past the count get -1
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
    tl.store(outs + slot, ids.to(tl.int32), mask=chosen)
    count = tl.sum(chosen.to(tl.int32), axis=1)
    k = tl.arange(0, BLOCK_K)
    tl.store(outs + k[None, :], tl.full([HP, BLOCK_K], -1, tl.int32),
             mask=h_ok[:, None] & (k[None, :] >= count[:, None]) & (k[None, :] < TOPK))


@step_jit(ints=("pt_st_r", "sc_st_n", "sc_st_h", "num_splits"), ptrs=("row_seq_ptr", "pos_ptr", "pt_ptr"))
def _index_scores_kernel(q_ptr, kc_ptr, pt_ptr, row_seq_ptr, pos_ptr, sc_ptr,
                         q_st_n, q_st_h, kc_st_p, kc_st_o, pt_st_r, sc_st_n, sc_st_h,
                         num_splits, cnt_ptr, out_ptr, out_st_n, out_st_h, local_blocks,
                         HI: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr, BLOCK_H: tl.constexpr,
                         DOT_FP32: tl.constexpr, FUSED: tl.constexpr, TOPK: tl.constexpr,
                         BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                         HP: tl.constexpr, PDL: tl.constexpr):
    # program (n, s): decode row n, blocks s, s + S, ... of its request; writes sc[n, :, b] for those blocks
    pdl_enter(PDL)
    n = tl.program_id(0)
    s = tl.program_id(1)
    req = tl.load(row_seq_ptr + n).to(tl.int64)
    p = tl.load(pos_ptr + n).to(tl.int64)
    nb = p // PS + 1
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, DI)
    t = tl.arange(0, PS)
    q = tl.load(q_ptr + n.to(tl.int64) * q_st_n + h[:, None] * q_st_h + d[None, :], mask=(h < HI)[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    for b in range(s, nb, num_splits):
        page = tl.load(pt_ptr + req * pt_st_r + b).to(tl.int64)
        # K^T tile [DI, PS] of one page
        kt = tl.load(kc_ptr + page * kc_st_p + t[None, :] * kc_st_o + d[:, None])
        if DOT_FP32:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt.to(q.dtype))
        qk = tl.where((b * PS + t)[None, :] <= p, qk, float("-inf"))
        tl.store(sc_ptr + n.to(tl.int64) * sc_st_n + h * sc_st_h + b, tl.max(qk, axis=1), mask=h < HI)
    if FUSED:
        # the last of the row's programs to arrive selects, by rank (no serial rounds), all heads at once. The
        # barrier + release add publish this program's scores; the counter is reset for the next call.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            tl.atomic_xchg(cnt_ptr + n, 0)
            hs = tl.arange(0, HP)
            _select_by_rank(sc_ptr + n.to(tl.int64) * sc_st_n, out_ptr + n.to(tl.int64) * out_st_n, hs, hs < HI,
                            sc_st_h, out_st_h, p // PS, local_blocks, pt_ptr, out_ptr, TOPK, HP, BLOCK_NB,
                            BLOCK_J, BLOCK_K, False)


@step_jit(ints=("sc_st_n", "sc_st_h", "pt_st_r"), ptrs=("pos_ptr", "row_seq_ptr", "pt_ptr"))
def _select_topk_kernel(sc_ptr, pos_ptr, out_ptr, sc_st_n, sc_st_h, out_st_n, out_st_h, local_blocks, num_heads,
                        row_seq_ptr, pt_ptr, pt_st_r, pg_ptr,
                        PS: tl.constexpr, TOPK: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_K: tl.constexpr,
                        HP: tl.constexpr, BLOCK_J: tl.constexpr, PAGES: tl.constexpr, PDL: tl.constexpr):
    # program (n, hb): the top-k blocks of decode row n for index heads hb*HP, ..., hb*HP + HP - 1
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HP + tl.arange(0, HP)
    own = tl.load(pos_ptr + n).to(tl.int64) // PS
    pt_row = pt_ptr
    if PAGES:
        pt_row = pt_ptr + tl.load(row_seq_ptr + n).to(tl.int64) * pt_st_r
    _select_by_rank(sc_ptr + n * sc_st_n, out_ptr + n * out_st_n, h, h < num_heads, sc_st_h, out_st_h, own,
                    local_blocks, pt_row, pg_ptr + n * out_st_n, TOPK, HP, BLOCK_NB, BLOCK_J, BLOCK_K, PAGES)


@step_jit(ints=("sc_st_n", "sc_st_h", "pt_st_r"), ptrs=("pos_ptr", "row_seq_ptr", "pt_ptr"))
def _select_rounds_kernel(sc_ptr, pos_ptr, out_ptr, sc_st_n, sc_st_h, out_st_n, out_st_h, local_blocks,
                          row_seq_ptr, pt_ptr, pt_st_r, pg_ptr,
                          PS: tl.constexpr, TOPK: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_K: tl.constexpr,
                          PAGES: tl.constexpr, PDL: tl.constexpr):
    # top-k by TOPK serial arg-max rounds (ties to the lowest index): O(k * nb), for long rows where the rank
    # selection's O(nb^2) compares cost more than the rounds' latency
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + n).to(tl.int64)
    own = p // PS
    b = tl.arange(0, BLOCK_NB)
    sc = tl.load(sc_ptr + n * sc_st_n + h * sc_st_h + b, mask=b <= own, other=float("-inf"))
    sc = tl.where((b >= own - local_blocks + 1) & (b <= own), float("inf"), sc)
    chosen = b < 0
    for _ in range(TOPK):
        _, idx = tl.max(sc, axis=0, return_indices=True, return_indices_tie_break_left=True)
        chosen = chosen | ((b == idx) & (sc > float("-inf")))
        sc = tl.where(b == idx, float("-inf"), sc)
    rank = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    k = tl.arange(0, BLOCK_K)
    match = (rank[None, :] == k[:, None]) & chosen[None, :]
    ids = tl.sum(tl.where(match, b[None, :], 0), axis=1)
    ids = tl.where(tl.sum(match.to(tl.int32), axis=1) > 0, ids, -1)
    tl.store(out_ptr + n * out_st_n + h * out_st_h + k, ids.to(tl.int32), mask=k < TOPK)
    if PAGES:  # the chosen blocks' pages beside their ids (the -1 tail left as is)
        req = tl.load(row_seq_ptr + n).to(tl.int64)
        pages = tl.load(pt_ptr + req * pt_st_r + ids, mask=ids >= 0, other=0)
        tl.store(pg_ptr + n * out_st_n + h * out_st_h + k, pages, mask=(k < TOPK) & (ids >= 0))


# launch options (benchmarks/kernels/bench_decode.py sweeps them on the GPU). SELECT["mode"]: "auto" (rank up to
# RANK_MAX_BLOCKS blocks, rounds above: H200, 1 x 8.7k 6.5 vs 7.5 us, 16 x 131k 158.9 vs 138.2 us), "rank" or
# "rounds"; SELECT["heads"]: index heads per rank program.
SCORE_LAUNCH = {"num_warps": 4, "num_stages": 3}
TOPK_LAUNCH = {"num_warps": None}  # None: by the selection and the block count
SELECT = {"mode": "auto", "heads": 1}
RANK_MAX_BLOCKS = 256
_COMPARES = 4096  # elements of one rank-compare tile per program (bounds the registers it takes)


def default_kv_splits(num_rows: int, max_blocks: int, device: torch.device) -> int:
    """Splits of the block axis: rows * splits ~ 4x the SMs, capped by the blocks there are (H200 sweep,
    docs/benchmarks.md: 68/34/10 splits were best at B = 1/16/64, both 8.7k and 131k tokens)."""
    want = -(-4 * num_sms(device) // max(num_rows, 1))
    return max(1, min(want, max_blocks))


# tables up to this many blocks would select inside the scores kernel (one launch). Off (0): slower on the H200
# both with the arg-max tail (B=1 x 8.7k: 11.5 vs 8.0 us) and with the rank tail (12.2 vs 6.5 us; B=64: 59.9 vs
# 43.0): the last program of a row selects for all heads alone, after every other program (docs/benchmarks.md).
FUSED_MAX_BLOCKS = 0
def _rank_tiles(heads: int, block_nb: int) -> int:
    """BLOCK_J of a rank selection: compare tiles [heads, block_nb, BLOCK_J] of about _COMPARES elements."""
    return max(1, min(block_nb, _COMPARES // (heads * block_nb)))


def index_block_scores(q_idx, index_k_cache, page_tables, row_seq, positions, scores, *, num_kv_splits=None,
                       select_into=None, topk=0, local_blocks=1, counters=None):
    """Block maxima of the decode rows into scores [N, Hi, max_pages] fp32; entries past a row's own block are
    left unwritten (the selection masks them). With `select_into` ([N, Hi, topk] int32) and `counters`, the
    last program of each row also selects (fused)."""
    n, hi, di = q_idx.shape
    ps = index_k_cache.shape[1]
    max_pages = page_tables.shape[1]
    splits = num_kv_splits or default_kv_splits(n, max_pages, q_idx.device)
    dot_fp32 = torch.float32 in (q_idx.dtype, index_k_cache.dtype)
    fused = select_into is not None
    out = select_into if fused else scores
    block_nb = max(16, next_pow2(max_pages))
    hp = next_pow2(hi)
    pdl_opts, pdl = pdl_launch(q_idx.device, "index", n)
    runnable(_index_scores_kernel, q_idx.device)[(n, splits)](
        q_idx, index_k_cache, page_tables, row_seq, positions, scores,
        q_idx.stride(0), q_idx.stride(1), index_k_cache.stride(0), index_k_cache.stride(1), page_tables.stride(0),
        scores.stride(0), scores.stride(1), splits,
        counters if fused else scores, out, out.stride(0) if fused else 0, out.stride(1) if fused else 0,
        local_blocks,
        HI=hi, DI=di, PS=ps, BLOCK_H=max(16, next_pow2(hi)), DOT_FP32=dot_fp32, FUSED=fused, TOPK=max(topk, 1),
        BLOCK_NB=block_nb if fused else 16, BLOCK_J=_rank_tiles(hp, block_nb) if fused else 1,
        BLOCK_K=max(16, next_pow2(topk)), HP=hp, PDL=pdl, **SCORE_LAUNCH, **pdl_opts)


def select_topk(scores, positions, out, topk, local_blocks, page_size, *, mode=None, pages_out=None,
                page_tables=None, row_seq=None):
    """scores [N, Hi, max_pages] -> out [N, Hi, topk] int32 (ascending ids, -1 tail, local blocks forced). With
    `pages_out` (out's shape and strides) also the chosen blocks' pages, page_tables[row_seq[n], id], beside
    their ids (nothing written in the -1 tail)."""
    n, hi, max_pages = scores.shape
    pages = pages_out is not None
    pg = (row_seq, page_tables, page_tables.stride(0), pages_out) if pages else (positions, positions, 0, out)
    block_nb = max(16, next_pow2(max_pages))
    block_k = max(16, next_pow2(topk))
    mode = mode or SELECT["mode"]
    pdl_opts, pdl = pdl_launch(scores.device, "index", n)
    if mode == "auto":
        mode = "rank" if block_nb <= RANK_MAX_BLOCKS else "rounds"
    if mode == "rounds":
        # one warp while the row fits in a few registers per lane: the rounds are then shuffles only
        runnable(_select_rounds_kernel, scores.device)[(n, hi)](
            scores, positions, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), local_blocks,
            *pg, PS=page_size, TOPK=topk, BLOCK_NB=block_nb, BLOCK_K=block_k, PAGES=pages, PDL=pdl,
            num_warps=TOPK_LAUNCH.get("num_warps") or (1 if block_nb <= 256 else 4), **pdl_opts)
        return
    hp = min(next_pow2(hi), SELECT["heads"])
    runnable(_select_topk_kernel, scores.device)[(n, -(-hi // hp))](
        scores, positions, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), local_blocks, hi,
        *pg, PS=page_size, TOPK=topk, BLOCK_NB=block_nb, BLOCK_K=block_k, HP=hp, BLOCK_J=_rank_tiles(hp, block_nb),
        PAGES=pages, PDL=pdl, num_warps=TOPK_LAUNCH.get("num_warps") or 4, **pdl_opts)


def index_topk_decode(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor,
                      row_seq: torch.Tensor, positions: torch.Tensor, topk: int, local_blocks: int, *,
                      out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                      scores: torch.Tensor | None = None, fused: bool | None = None,
                      select_mode: str | None = None, pages_out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton decode path for rows [0, N) of its inputs (any rows work; shapes as in `index_topk_ref`).

    `out` [N, Hi, topk] int32 may be a view (the decode suffix of a mixed batch); `scores` [N, Hi, max_pages]
    fp32 an optional scratch buffer (a graph-stable one). No host syncs, fixed grid for fixed shapes.
    fused None: one launch (selection by each row's last program) when the table has <= FUSED_MAX_BLOCKS
    blocks, else scores then selection; True/False force it (fused needs topk <= the power-of-two block width).
    `select_mode` picks the separate selection kernel (see SELECT). `pages_out` (out's shape and strides): the
    chosen blocks' pages beside their ids (`select_topk`; the attention kernel's `page_ids`), never fused.
    """
    n, hi, di = q_idx.shape
    ps = index_k_cache.shape[1]
    max_pages = page_tables.shape[1]
    if out is None:
        out = torch.empty((n, hi, topk), dtype=torch.int32, device=q_idx.device)
    if n == 0:
        return out
    if q_idx.stride(-1) != 1 or index_k_cache.stride(-1) != 1 or page_tables.stride(-1) != 1:
        raise ValueError("index_topk: q_idx, index_k_cache and page_tables need a unit last stride")
    if di & (di - 1) or ps & (ps - 1) or di < 16 or ps < 16:
        raise ValueError(f"index_topk: index_head_dim {di} and page_size {ps} must be powers of two >= 16")
    if scores is None:
        scores = torch.empty((n, hi, max_pages), dtype=torch.float32, device=q_idx.device)
    counters = None
    if pages_out is None and (fused if fused is not None else max_pages <= FUSED_MAX_BLOCKS):
        counters = arrival_counters("index_topk", n, q_idx.device)
    if counters is not None:
        index_block_scores(q_idx, index_k_cache, page_tables, row_seq, positions, scores,
                           num_kv_splits=num_kv_splits, select_into=out, topk=topk, local_blocks=local_blocks,
                           counters=counters)
    else:
        index_block_scores(q_idx, index_k_cache, page_tables, row_seq, positions, scores,
                           num_kv_splits=num_kv_splits)
        select_topk(scores, positions, out, topk, local_blocks, ps, mode=select_mode, pages_out=pages_out,
                    page_tables=page_tables, row_seq=row_seq)
    return out


def index_topk(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor, row_seq: torch.Tensor,
               positions: torch.Tensor, topk: int, local_blocks: int, *, num_prefill_rows: int = 0,
               backend: str | None = None, num_kv_splits: int | None = None,
               fused: bool | None = None, prefill: tuple[torch.Tensor, int, int] | None = None,
               with_pages: bool = False):
    """Public launcher -> int32 [N, Hi, topk]; with `with_pages`, (ids, pages): pages [N, Hi, topk] int32 holds
    the decode rows' chosen pages beside their ids on the Triton path (rows [0, num_prefill_rows) and the -1 tails
    unwritten: `paged_decode_attention`'s `page_ids`), None on the others. When `backend` resolves to Triton
    (None: on CUDA tensors; "triton" forces it, on CPU through the interpreter), rows [0, num_prefill_rows)
    (prompt chunks) take the prefill indexer (kernels/prefill_index.py) and rows [num_prefill_rows, N) (decode
    rows, the batch suffix) the decode kernels here. Both spans are views of the inputs and of the output:
    nothing is copied. `prefill` as in kernels.attention.dense_attention (None: derived from row_seq, one host
    sync). None off CUDA: prompt rows by the reference, decode rows by `index_topk_decode_torch` (the same ids);
    "ref": the reference for all rows."""
    _check(q_idx, index_k_cache, page_tables, row_seq, positions, topk, num_prefill_rows)
    n, hi, _ = q_idx.shape
    npf = num_prefill_rows
    if not use_triton(q_idx.device, backend):
        if backend == "ref":
            out = index_topk_ref(q_idx, index_k_cache, page_tables, row_seq, positions, topk, local_blocks)
            return (out, None) if with_pages else out
        # off CUDA by default: prompt rows by the reference, decode rows all at once
        out = torch.cat([index_topk_ref(q_idx[:npf], index_k_cache, page_tables, row_seq[:npf], positions[:npf],
                                         topk, local_blocks),
                          index_topk_decode_torch(q_idx[npf:], index_k_cache, page_tables, row_seq[npf:],
                                                  positions[npf:], topk, local_blocks)])
        return (out, None) if with_pages else out
    # ids and pages from one allocation (the same strides, as the attention kernel's page_ids wants)
    both = torch.empty((2 if with_pages else 1, n, hi, topk), dtype=torch.int32, device=q_idx.device)
    out, pages = both[0], (both[1] if with_pages else None)
    if npf:
        qsl, num_requests, max_len = prefill if prefill is not None else prefill_layout(row_seq, npf)
        prefill_index_topk(q_idx[:npf], index_k_cache, page_tables, qsl, positions[:npf], topk, local_blocks,
                           num_requests=num_requests, max_len=max_len, out=out[:npf])
    index_topk_decode(q_idx[npf:], index_k_cache, page_tables, row_seq[npf:], positions[npf:], topk, local_blocks,
                      out=out[npf:], num_kv_splits=num_kv_splits, fused=fused,
                      pages_out=None if pages is None else pages[npf:])
    return (out, pages) if with_pages else out


def _check(q_idx, index_k_cache, page_tables, row_seq, positions, topk, num_prefill_rows) -> None:
    if q_idx.dim() != 3 or index_k_cache.dim() != 3 or q_idx.shape[-1] != index_k_cache.shape[-1]:
        raise ValueError(f"index_topk: q_idx {tuple(q_idx.shape)} / index_k_cache {tuple(index_k_cache.shape)}")
    if row_seq.shape != positions.shape or row_seq.shape[0] != q_idx.shape[0]:
        raise ValueError("index_topk: row_seq and positions must be [N] with N = q_idx.shape[0]")
    if page_tables.dim() != 2 or page_tables.dtype != torch.int32 or row_seq.dtype != torch.int32:
        raise ValueError("index_topk: page_tables [R, max_pages] and row_seq [N] must be int32")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index_topk: positions must be int32/int64, got {positions.dtype}")
    if topk < 1 or not 0 <= num_prefill_rows <= q_idx.shape[0]:
        raise ValueError(f"index_topk: topk {topk} / num_prefill_rows {num_prefill_rows} out of range")
