"""Fused MoE over a rank's local experts: grouped GEMMs over expert-sorted (token, slot) pairs, SwiGLU-OAI fused.

Weights (what msa/moe.py stores): w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I]; E = the local
experts, whose global ids are expert_start .. expert_start + E - 1. Pairs routed to other experts are skipped
(they contribute nothing: another rank adds them).

Four launches (six at prefill sizes), none of which needs the host to know how many tokens each expert received,
so the whole MoE can be captured in a CUDA graph at a fixed token count:
  1. `_align_kernel` (one program): counts the pairs of each local expert, their start in the expert-sorted
     order, the inclusive prefix sum of each expert's row blocks (cdiv(count, BLOCK_M)), and writes the pairs
     sorted by expert (stable: by pair index within an expert). No padding is materialised: a block knows its
     own row count. Above PARALLEL_ALIGN_PAIRS pairs the same result comes from three launches: per-chunk
     counts, one scan of the [chunks, experts] table, per-chunk placement.
  2. `_gate_up_kernel`: grid (max_blocks, cdiv(I, BLOCK_N)). Program (b, n) finds its expert by counting the
     block prefix sums <= b (blocks past the last used one exit), gathers the block's token rows of x, runs
     gate and up tiles over H, applies SwiGLU-OAI in fp32 and stores act [pairs, I] in the input dtype.
     At prefill sizes the weight tiles come through TMA descriptors (`_w_tile`) and an expert's last block,
     when at most half full, runs as a half-height tile (on average half of one block per expert is padding:
     a quarter of the rows at 256 pairs per expert).
  3. `_down_kernel`: grid (max_blocks, cdiv(H, BLOCK_N)): act rows @ w_down[e]^T, times the pair's routing
     weight, stored in fp32 at the pair's own row of y [T*k, H].
  4. `_combine_kernel`: out[t] = sum of the k rows y[t*k + j] whose expert is local, cast to the input dtype.
     Summing k rows in a fixed order keeps the result deterministic (no atomics) and needs no zeroed buffer.
max_blocks is a bound computed from the shapes alone: sum_e cdiv(c_e, BM) <= (N + min(E, N) (BM - 1)) / BM.

`fused_moe_ref` is the torch loop (one GEMM pair per expert that received pairs; one host sync).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, step_jit, use_triton
from kernels.swiglu import swiglu_oai_ref


# ---- torch reference ------------------------------------------------------------------------------------------

def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, *, alpha: float, limit: float, expert_start: int = 0,
                  acc_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H]; topk_ids [T, k] global expert ids; topk_weights [T, k] -> sum over the local experts [T, H].

    The pairs are sorted by expert and each local expert that received pairs runs one GEMM pair over its rows
    (unweighted output times the weight, added into its token's row). Computed in x's dtype, or in `acc_dtype`
    (weights upcast one expert at a time) for a more precise reference."""
    dtype = acc_dtype or x.dtype
    num_local = w_gate_up.shape[0]
    k = topk_ids.shape[1]
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    flat = topk_ids.reshape(-1).to(torch.long) - expert_start
    # pairs of other ranks' experts go to a bucket past the last local expert and are never run
    flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_local + 1).tolist()  # the host sync of the reference
    flat_w = topk_weights.reshape(-1)
    begin = 0
    for e, n in enumerate(counts[:num_local]):
        if n == 0:
            continue
        pairs = order[begin:begin + n]
        begin += n
        tokens = pairs // k
        act = swiglu_oai_ref(torch.nn.functional.linear(x[tokens].to(dtype), w_gate_up[e].to(dtype)), alpha, limit)
        y = torch.nn.functional.linear(act, w_down[e].to(dtype)) * flat_w[pairs, None].to(dtype)
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


# ---- Triton kernels -------------------------------------------------------------------------------------------

@step_jit(ints=("num_pairs",))
def _align_kernel(ids_ptr, num_pairs, expert_start, counts_ptr, row_start_ptr, block_end_ptr, sorted_ptr,
                  E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    real = (experts < E)[None, :]
    # pass 1: pairs per local expert (a pair outside the range matches no column)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_start
        local = tl.where(p < num_pairs, local, -1)
        hit = ((local[:, None] == experts[None, :]) & real).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    block_end = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0)
    tl.store(counts_ptr + experts, counts, mask=experts < E)
    tl.store(row_start_ptr + experts, row_end - counts, mask=experts < E)
    tl.store(block_end_ptr + experts, block_end, mask=experts < E)
    # pass 2: each pair's place = its expert's start + pairs of that expert before it (earlier chunks: `base`,
    # this chunk: the column prefix sum of the one-hot matrix)
    base = row_end - counts
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_start
        local = tl.where(p < num_pairs, local, -1)
        hit = ((local[:, None] == experts[None, :]) & real).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        dest = tl.sum(hit * (base[None, :] + before), axis=1)
        tl.store(sorted_ptr + dest, p, mask=tl.sum(hit, axis=1) > 0)
        base += tl.sum(hit, axis=0)


@triton.jit
def _chunk_hits(ids_ptr, num_pairs, expert_start, chunk, E: tl.constexpr, E_PAD: tl.constexpr,
                CHUNK: tl.constexpr):
    # one-hot [CHUNK, E_PAD] of the chunk's pairs over the local experts (a pair of another rank matches none)
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    local = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32) - expert_start
    local = tl.where(p < num_pairs, local, -1)
    return p, ((local[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)


@step_jit(ints=("num_pairs",))
def _chunk_count_kernel(ids_ptr, num_pairs, expert_start, chunk_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
                        CHUNK: tl.constexpr):
    # parallel alignment, pass 1: program c counts chunk c's pairs per local expert -> chunk_ptr[c, :]
    c = tl.program_id(0)
    _, hit = _chunk_hits(ids_ptr, num_pairs, expert_start, c, E, E_PAD, CHUNK)
    tl.store(chunk_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(hit, axis=0))


@step_jit(ints=("num_chunks",))
def _chunk_scan_kernel(chunk_ptr, num_chunks, counts_ptr, row_start_ptr, block_end_ptr, E: tl.constexpr,
                       E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, NC_PAD: tl.constexpr):
    # pass 2 (one program): totals, expert starts and block ends; chunk_ptr[c, e] becomes where chunk c's first
    # pair of expert e goes (the expert's start + the pairs of earlier chunks)
    cs = tl.arange(0, NC_PAD)
    experts = tl.arange(0, E_PAD)
    where = chunk_ptr + cs[:, None] * E_PAD + experts[None, :]
    per_chunk = tl.load(where, mask=(cs < num_chunks)[:, None], other=0)
    counts = tl.sum(per_chunk, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    tl.store(counts_ptr + experts, counts, mask=experts < E)
    tl.store(row_start_ptr + experts, row_end - counts, mask=experts < E)
    tl.store(block_end_ptr + experts, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0), mask=experts < E)
    base = (row_end - counts)[None, :] + tl.cumsum(per_chunk, axis=0) - per_chunk
    tl.store(where, base, mask=(cs < num_chunks)[:, None])


@step_jit(ints=("num_pairs",))
def _chunk_place_kernel(ids_ptr, num_pairs, expert_start, chunk_ptr, sorted_ptr, E: tl.constexpr,
                        E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # pass 3: program c writes its pairs at their expert's base for the chunk + the expert's pairs before them in
    # the chunk: stable, the same order as the one-program kernel
    c = tl.program_id(0)
    p, hit = _chunk_hits(ids_ptr, num_pairs, expert_start, c, E, E_PAD, CHUNK)
    base = tl.load(chunk_ptr + c * E_PAD + tl.arange(0, E_PAD))
    before = tl.cumsum(hit, axis=0) - hit
    dest = tl.sum(hit * (base[None, :] + before), axis=1)
    tl.store(sorted_ptr + dest, p, mask=tl.sum(hit, axis=1) > 0)


@triton.jit
def _block_rows(block_end_ptr, counts_ptr, row_start_ptr, pid_m, E: tl.constexpr, E_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Block pid_m -> (expert, first row in the sorted order, rows in the block); expert >= E: unused block."""
    experts = tl.arange(0, E_PAD)
    ends = tl.load(block_end_ptr + experts, mask=experts < E, other=2147483647)
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    e_safe = tl.minimum(e, E - 1)
    first_block = tl.load(block_end_ptr + e_safe - 1, mask=e_safe > 0, other=0)
    skip = (pid_m - first_block) * BLOCK_M
    row0 = tl.load(row_start_ptr + e_safe) + skip
    nrows = tl.minimum(tl.load(counts_ptr + e_safe) - skip, BLOCK_M)
    return e, row0, nrows


@triton.jit
def _tile_of_program(num_m, num_n, GROUP_M: tl.constexpr):
    # GROUP_M 0: grid (m blocks, n tiles), m fastest (decode: every program streams its own expert's weights).
    # GROUP_M > 0: a 1-d grid walking groups of GROUP_M row blocks, m fastest inside a group, then the group's
    # next column tile: the group's rows stay in L2 across all its column tiles (prefill: otherwise every column
    # tile re-reads every row block from HBM, 24x the activations at m3-slice shapes) and neighbouring blocks of
    # one expert share each weight tile.
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % size, local // size


@triton.jit
def _w_tile(w, e, n0, k0, n_lim, K, w_st_e, w_st_n, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
            TMA: tl.constexpr):
    """[BN, BK]: rows n0.. (valid below n_lim) and columns k0.. of expert e's weight [N, K]. TMA: w is a 3-d
    descriptor over [E, N, K] with block [1, BN, BK], read by the tensor-copy engine (rows or columns past the
    tensor read zero; rows past n_lim inside it are read and masked at the store); else w is a pointer."""
    if TMA:
        t = w.load([e, n0, k0]).reshape(BN, BK)
    else:
        n = n0 + tl.arange(0, BN)
        kk = k0 + tl.arange(0, BK)
        ptrs = w + e.to(tl.int64) * w_st_e + n[:, None].to(tl.int64) * w_st_n + kk[None, :]
        mask = (n < n_lim)[:, None]
        if not EVEN_K:
            mask = mask & (kk < K)[None, :]
        t = tl.load(ptrs, mask=mask, other=0.0)
    return t


@triton.jit
def _gate_up_block(x_ptr, w, act_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, x_st_t, w_st_e, w_st_n, act_st,
                   alpha, limit, TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    # one block of BM sorted rows (nrows of them real) x BLOCK_N columns of both gate and up
    rows = tl.arange(0, BM)
    rmask = rows < nrows
    pair = tl.load(sorted_ptr + row0 + rows, mask=rmask, other=0)
    x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * x_st_t
    n0 = pid_n * BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=rmask[:, None], other=0.0)
        else:
            x = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & (kk < H)[None, :], other=0.0)
        wg = _w_tile(w, e, n0, k0, I, H, w_st_e, w_st_n, BLOCK_N, BLOCK_K, EVEN_K, TMA)
        wu = _w_tile(w, e, I + n0, k0, 2 * I, H, w_st_e, w_st_n, BLOCK_N, BLOCK_K, EVEN_K, TMA)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
    # SwiGLU-OAI in fp32: the gate is clamped above only, the up branch on both sides and shifted by +1
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    cols = n0 + tl.arange(0, BLOCK_N)
    dst = act_ptr + (row0 + rows)[:, None].to(tl.int64) * act_st + cols[None, :]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < I)[None, :])


@step_jit(ints=("num_m",))
def _gate_up_kernel(x_ptr, w, act_ptr, sorted_ptr, counts_ptr, row_start_ptr, block_end_ptr,
                    H, I, x_st_t, w_st_e, w_st_n, act_st, alpha, limit, num_m, num_n,
                    TOP_K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                    HALF_TAIL: tl.constexpr):
    pid_m, pid_n = _tile_of_program(num_m, num_n, GROUP_M)
    e, row0, nrows = _block_rows(block_end_ptr, counts_ptr, row_start_ptr, pid_m, E, E_PAD, BLOCK_M)
    if e >= E:
        return
    # an expert's last block is on average half full: run it as a half-height tile when it fits one
    if HALF_TAIL and nrows <= BLOCK_M // 2:
        _gate_up_block(x_ptr, w, act_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, x_st_t, w_st_e, w_st_n, act_st,
                       alpha, limit, TOP_K, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
    else:
        _gate_up_block(x_ptr, w, act_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, x_st_t, w_st_e, w_st_n, act_st,
                       alpha, limit, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)


@triton.jit
def _down_block(act_ptr, w, y_ptr, weights_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, act_st, w_st_e, w_st_n,
                y_st, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr):
    rows = tl.arange(0, BM)
    rmask = rows < nrows
    pair = tl.load(sorted_ptr + row0 + rows, mask=rmask, other=0).to(tl.int64)
    n0 = pid_n * BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + (row0 + rows)[:, None].to(tl.int64) * act_st
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :], mask=rmask[:, None], other=0.0)
        else:
            a = tl.load(a_rows + kk[None, :], mask=rmask[:, None] & (kk < I)[None, :], other=0.0)
        wt = _w_tile(w, e, n0, k0, H, I, w_st_e, w_st_n, BLOCK_N, BLOCK_K, EVEN_K, TMA)
        acc = tl.dot(a, tl.trans(wt), acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + pair[:, None] * y_st + cols[None, :], acc * weight[:, None],
             mask=rmask[:, None] & (cols < H)[None, :])


@step_jit(ints=("num_m",))
def _down_kernel(act_ptr, w, y_ptr, weights_ptr, sorted_ptr, counts_ptr, row_start_ptr, block_end_ptr,
                 H, I, act_st, w_st_e, w_st_n, y_st, num_m, num_n,
                 E: tl.constexpr, E_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                 HALF_TAIL: tl.constexpr):
    pid_m, pid_n = _tile_of_program(num_m, num_n, GROUP_M)
    e, row0, nrows = _block_rows(block_end_ptr, counts_ptr, row_start_ptr, pid_m, E, E_PAD, BLOCK_M)
    if e >= E:
        return
    if HALF_TAIL and nrows <= BLOCK_M // 2:
        _down_block(act_ptr, w, y_ptr, weights_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, act_st, w_st_e, w_st_n,
                    y_st, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)
    else:
        _down_block(act_ptr, w, y_ptr, weights_ptr, sorted_ptr, e, row0, nrows, pid_n, H, I, act_st, w_st_e, w_st_n,
                    y_st, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, TMA)


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, H, expert_start, y_st, out_st,
                    TOP_K: tl.constexpr, E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + t * TOP_K + j).to(tl.int32) - expert_start
        mine = (local >= 0) & (local < E)
        acc += tl.load(y_ptr + (t * TOP_K + j) * y_st + cols, mask=cmask & mine, other=0.0)
    tl.store(out_ptr + t * out_st + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# ---- launch configuration -------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GemmTile:
    """One grouped GEMM's tile: BLOCK_N output columns, BLOCK_K reduction step, warps, pipeline stages, and the
    program order (group_m: 0 = row blocks fastest over a 2-d grid; > 0 = groups of that many row blocks, see
    `_tile_of_program`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0
    tma: bool = False  # weight tiles through the tensor-copy engine (CUDA, 16-byte aligned strides), see _w_tile
    half_tail: bool = False  # a block with at most block_m / 2 rows runs as a half-height tile


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """block_m: pair rows per block (an expert with c pairs takes cdiv(c, block_m) blocks of each GEMM)."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


def default_config(num_pairs: int, num_experts: int, hidden: int, inter: int, *, elem_bytes: int = 2) -> MoEConfig:
    """Decode (a few pairs per expert): 16-row blocks and narrow column tiles, so that the weight stream of
    even one or four experts spreads over every SM. Prefill (many pairs per expert): 128-row blocks, 128-column
    tiles over 8 warps, and the grouped program order so row blocks are read once (H200, m3-slice routed experts,
    docs/benchmarks.md: T = 2,048 6.98 -> 4.42 ms, T = 8,192 13.65 -> 10.63 ms; the down GEMM's 256-wide tiles
    over its 6144 columns gain ~5% at 8k); weight tiles through TMA and half-height tail blocks (run P4:
    T = 8,192 9.55 -> 8.79 ms in one run, T = 2,048 unchanged at its weight-bytes floor)."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:
        return MoEConfig(block_m=16, gate_up=GemmTile(block_n=32, block_k=128, num_warps=4, num_stages=4),
                         down=GemmTile(block_n=32, block_k=128, num_warps=4, num_stages=4))
    if per_expert <= 32:
        return MoEConfig(block_m=32, gate_up=GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=3),
                         down=GemmTile(block_n=64, block_k=128, num_warps=4, num_stages=3))
    if elem_bytes > 2:  # fp32 (parity runs): the bf16 stages would not fit in shared memory
        return MoEConfig(block_m=128, gate_up=GemmTile(block_n=128, block_k=32, num_warps=8, num_stages=2, group_m=1),
                         down=GemmTile(block_n=128, block_k=32, num_warps=8, num_stages=2, group_m=1))
    return MoEConfig(block_m=128,
                     gate_up=GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=1, tma=True,
                                      half_tail=True),
                     down=GemmTile(block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=1, tma=True,
                                   half_tail=True))


def _fit(tile: GemmTile, n: int, k: int) -> GemmTile:
    # small test shapes: no tile wider than the (power-of-two rounded) dimension, never under 16 (tl.dot)
    return replace(tile, block_n=max(16, min(tile.block_n, next_pow2(n))),
                   block_k=max(16, min(tile.block_k, next_pow2(k))))


def _weights_operand(w: torch.Tensor, tile: GemmTile):
    """What the GEMM kernels take as weights: a [1, block_n, block_k] TMA descriptor over [E, N, K] when the tile
    asks for one and the copy engine can address w (16-byte aligned base and strides), else the tensor itself."""
    es = w.element_size()
    ok = (tile.tma and w.stride(2) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * es) % 16 == 0
          and (w.stride(1) * es) % 16 == 0 and tile.block_k * es >= 16)
    if not ok:
        return w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, tile.block_n, tile.block_k]), True


def _grid(num_m: int, num_n: int, tile: GemmTile) -> tuple[int, ...]:
    return (num_m, num_n) if tile.group_m == 0 else (num_m * num_n,)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e cdiv(count_e, block_m) over any routing of num_pairs pairs to num_experts experts."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def _empty(shape, dtype, device) -> torch.Tensor:
    """Workspace allocation (one place, so tests can poison every workspace buffer)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- launchers ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Alignment:
    """Pairs sorted by local expert. counts / row_start / block_end [E] int32 (block_end: inclusive prefix sum of
    cdiv(count, block_m)); sorted_pairs [T*k] int32: pair indices t*k + j by expert, the first sum(counts)
    entries valid (the rest are never written)."""

    counts: torch.Tensor
    row_start: torch.Tensor
    block_end: torch.Tensor
    sorted_pairs: torch.Tensor
    block_m: int


PARALLEL_ALIGN_PAIRS = 2048  # above this many pairs, the three-launch parallel alignment
ALIGN_CHUNK_MIN = 64  # pairs per program of the parallel alignment, at least


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, expert_start: int = 0) -> Alignment:
    """Sort the (token, slot) pairs of topk_ids [T, k] by local expert (global id - expert_start in
    [0, num_experts)), on the device, in one launch, without a host sync."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64) or not topk_ids.is_contiguous():
        raise ValueError(f"moe_align: topk_ids must be a contiguous int [T, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)} strides {topk_ids.stride()}")
    dev = topk_ids.device
    n = topk_ids.numel()
    counts = _empty((num_experts,), torch.int32, dev)
    row_start = _empty((num_experts,), torch.int32, dev)
    block_end = _empty((num_experts,), torch.int32, dev)
    sorted_pairs = _empty((max(n, 1),), torch.int32, dev)
    e_pad = next_pow2(num_experts)
    if n <= PARALLEL_ALIGN_PAIRS:
        chunk = max(16, min(128, 8192 // e_pad))
        runnable(_align_kernel, dev)[(1,)](topk_ids, n, expert_start, counts, row_start, block_end, sorted_pairs,
                                            E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    else:
        # many pairs (prefill): one program walking them serially took ~2 ms for 32k pairs on the H200; count per
        # chunk in parallel, scan the [chunks, E] table in one program, place per chunk in parallel
        chunk = max(ALIGN_CHUNK_MIN, next_pow2(-(-n // 256)))  # <= 256 chunks: the scan's table fits one program
        num_chunks = -(-n // chunk)
        table = _empty((num_chunks, e_pad), torch.int32, dev)
        opts = dict(E=num_experts, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
        runnable(_chunk_count_kernel, dev)[(num_chunks,)](topk_ids, n, expert_start, table, **opts)
        runnable(_chunk_scan_kernel, dev)[(1,)](table, num_chunks, counts, row_start, block_end, E=num_experts,
                                                 E_PAD=e_pad, BLOCK_M=block_m, NC_PAD=next_pow2(num_chunks),
                                                 num_warps=8)
        runnable(_chunk_place_kernel, dev)[(num_chunks,)](topk_ids, n, expert_start, table, sorted_pairs, **opts)
    return Alignment(counts=counts, row_start=row_start, block_end=block_end, sorted_pairs=sorted_pairs,
                     block_m=block_m)


def _precision(dtype: torch.dtype) -> str:
    # fp32 models are the parity runs: no tf32 there
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, align: Alignment, top_k: int, alpha: float,
                   limit: float, tile: GemmTile, act: torch.Tensor | None = None) -> torch.Tensor:
    """act [T*k, I] (rows in the sorted order; rows past sum(counts) unwritten) = SwiGLU-OAI(x rows @ w^T)."""
    e, two_i, h = w_gate_up.shape
    inter = two_i // 2
    n = x.shape[0] * top_k
    if act is None:
        act = _empty((n, inter), x.dtype, x.device)
    tile = _fit(tile, inter, h)
    num_m, num_n = max_blocks(n, e, align.block_m), triton.cdiv(inter, tile.block_n)
    w, tma = _weights_operand(w_gate_up, tile)
    runnable(_gate_up_kernel, x.device)[_grid(num_m, num_n, tile)](
        x, w, act, align.sorted_pairs, align.counts, align.row_start, align.block_end,
        h, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), float(alpha), float(limit),
        num_m, num_n,
        TOP_K=top_k, E=e, E_PAD=next_pow2(e), BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=h % tile.block_k == 0, PRECISION=_precision(x.dtype), GROUP_M=tile.group_m, TMA=tma,
        HALF_TAIL=tile.half_tail and align.block_m >= 32, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return act


def launch_down(act: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, align: Alignment,
                tile: GemmTile, y: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*k, H] fp32: row t*k + j = weight[t, j] * (act row of that pair) @ w_down[e]^T (local pairs only)."""
    e, h, inter = w_down.shape
    n = act.shape[0]
    if y is None:
        y = _empty((n, h), torch.float32, act.device)
    tile = _fit(tile, h, inter)
    num_m, num_n = max_blocks(n, e, align.block_m), triton.cdiv(h, tile.block_n)
    w, tma = _weights_operand(w_down, tile)
    runnable(_down_kernel, act.device)[_grid(num_m, num_n, tile)](
        act, w, y, topk_weights, align.sorted_pairs, align.counts, align.row_start, align.block_end,
        h, inter, act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0), num_m, num_n,
        E=e, E_PAD=next_pow2(e), BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=inter % tile.block_k == 0, PRECISION=_precision(act.dtype), GROUP_M=tile.group_m, TMA=tma,
        HALF_TAIL=tile.half_tail and align.block_m >= 32, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return y


def launch_combine(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_start: int,
                   out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum over the local slots j of y [T*k, H] row t*k + j."""
    t, k = topk_ids.shape
    h = y.shape[1]
    block_h = min(1024, next_pow2(h))
    runnable(_combine_kernel, y.device)[(t, triton.cdiv(h, block_h))](
        y, topk_ids, out, h, expert_start, y.stride(0), out.stride(0),
        TOP_K=k, E=num_experts, BLOCK_H=block_h, num_warps=4)
    return out


def _check(x, topk_ids, topk_weights, w_gate_up, w_down, out) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused_moe: x must be fp32/fp16/bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int [T={t}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: topk_weights must be float {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
        raise ValueError(f"fused_moe: w_gate_up must be [E, 2I, H={h}], got {tuple(w_gate_up.shape)}")
    e, two_i, _ = w_gate_up.shape
    if tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w_down must be [E, H, I] = {(e, h, two_i // 2)}, got {tuple(w_down.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise ValueError(f"fused_moe: {name} dtype {w.dtype} != x dtype {x.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"fused_moe: out must be {x.dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    devices = {x.device, topk_ids.device, topk_weights.device, w_gate_up.device, w_down.device}
    if len(devices) != 1:
        raise ValueError(f"fused_moe: tensors on several devices {sorted(map(str, devices))}")


def _strided_ok(x, w_gate_up, w_down, out) -> None:
    strides = [x.stride(1), w_gate_up.stride(2), w_down.stride(2)] + ([out.stride(1)] if out is not None else [])
    if any(st != 1 for st in strides):
        raise ValueError("fused_moe: x, out and both weights need a unit stride on their last dim")


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, *, alpha: float, limit: float, expert_start: int = 0,
              config: MoEConfig | None = None, out: torch.Tensor | None = None,
              backend: str | None = None) -> torch.Tensor:
    """Public launcher: x [T, H]; topk_ids [T, k] global expert ids (distinct per token); topk_weights [T, k];
    w_gate_up [E, 2I, H]; w_down [E, H, I] for the local experts expert_start .. expert_start + E - 1
    -> sum_j weight[t, j] * Expert_{ids[t, j]}(x[t]) over the local experts, [T, H] in x's dtype.

    backend None: Triton on CUDA tensors, the torch reference elsewhere; "triton"/"ref" force one (Triton on CPU
    tensors runs in the interpreter). The Triton path has no host sync: safe inside CUDA-graph capture."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, out)
    if not use_triton(x.device, backend):
        res = fused_moe_ref(x, topk_ids, topk_weights, w_gate_up, w_down, alpha=alpha, limit=limit,
                            expert_start=expert_start)
        return res if out is None else out.copy_(res)
    _strided_ok(x, w_gate_up, w_down, out)
    t, h = x.shape
    if out is None:
        out = _empty((t, h), x.dtype, x.device)
    if t == 0:
        return out
    e, two_i, _ = w_gate_up.shape
    k = topk_ids.shape[1]
    cfg = config or default_config(t * k, e, h, two_i // 2, elem_bytes=x.element_size())
    ids = topk_ids.contiguous()
    align = moe_align(ids, e, cfg.block_m, expert_start=expert_start)
    act = launch_gate_up(x, w_gate_up, align, k, alpha, limit, cfg.gate_up)
    y = launch_down(act, w_down, topk_weights.contiguous(), align, cfg.down)
    return launch_combine(y, ids, e, expert_start, out)


__all__ = ["fused_moe", "fused_moe_ref", "swiglu_oai_ref", "moe_align", "Alignment", "MoEConfig", "GemmTile",
           "default_config", "max_blocks", "launch_gate_up", "launch_down", "launch_combine"]
