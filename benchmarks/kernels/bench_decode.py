"""Decode kernel benchmark on one GPU, following ../shared/PERF.md.

CUDA-graph replay of many calls that rotate over independent input sets (L2 stays cold: each call reads pages
no recent call touched), random bf16 data, shuffled page tables, context lengths that are not multiples of the
page size, median of many replays. Each shape sweeps the split count and the launch options and reports the
best; every best configuration is checked against the torch reference in the same run.

  PYTHONPATH=$PWD python3 benchmarks/kernels/bench_decode.py --out /tmp/bench.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from kernels import attention, index_topk as itk, paged_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))  # graph_timing.py, beside this script
from graph_timing import graph_replay_ms  # noqa: E402

PS, HKV, HQ, D, HI, DI, TOPK = 128, 4, 64, 128, 4, 128, 16
HBM = 4.3e12  # bytes/s, measured device-to-device copy ceiling (PERF.md)
L2_BYTES = 60 * 2**20
# the peer by this script's method ("many": one graph of many calls over rotating inputs), ../shared/PERF.md;
# its "single" numbers (one call per replay, L2 flushed) are another method and never set beside ours
PEER = {("index", 1, 8700): 9.48, ("index", 16, 8700): 16.7, ("index", 64, 8700): 46.2,
        ("index", 16, 131072): 155.7, ("index", 64, 131072): 526.2,
        ("sparse", 1, 8700): 6.98, ("sparse", 16, 8700): 26.7, ("sparse", 64, 8700): 76.8}
# PERF.md's goals (many)
TARGET = {("index", 1, 8700): 5, ("index", 16, 8700): 12.5, ("index", 64, 8700): 36, ("index", 16, 131072): 132,
          ("index", 64, 131072): 520, ("sparse", 1, 8700): 5, ("sparse", 16, 8700): 20, ("sparse", 64, 8700): 66}


def graph_time_us(calls, replays=30) -> float:
    """Median time of one call: all `calls` captured in one graph, replayed `replays` times."""
    return graph_replay_ms(lambda: [c() for c in calls], replays) * 1e3 / len(calls)


def eager_time_us(calls, reps=20) -> float:
    """Median per-call time of launching `calls` eagerly (for paths that cannot be captured)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def lengths(batch, length, gen):
    # a little under `length`, never a multiple of the page size
    out = []
    for x in torch.randint(0, 64, (batch,), generator=gen).tolist():
        n = length - x
        out.append(n - 1 if n % PS == 0 else n)
    return out


def page_sets(num_sets, lens, pool_pages, gen):
    """num_sets page tables [B, max_pages] int32, each a fresh shuffle of the pool (distinct pages per call)."""
    need = sum(-(-n // PS) for n in lens)
    maxp = max(-(-n // PS) for n in lens)
    sets = []
    for _ in range(num_sets):
        perm = torch.randperm(pool_pages, generator=gen)[:need]
        table = torch.zeros(len(lens), maxp, dtype=torch.int32)
        used = 0
        for r, n in enumerate(lens):
            k = -(-n // PS)
            table[r, :k] = perm[used:used + k].to(torch.int32)
            used += k
        sets.append(table.cuda())
    return sets


INDEX_VARIANTS = {  # name -> (fused, select mode): scores kernel + selection kernel, or selection in its tail
    "rounds": (False, "rounds"), "rank": (False, "rank"), "fused": (True, None)}
DEADLINE = [float("inf")]  # time.time() after which sweeps stop (a device call has a hard limit)


def bench_index(batch, length, gen, log):
    lens = lengths(batch, length, gen)
    pages_per_call = sum(-(-n // PS) for n in lens)
    call_bytes = sum(lens) * DI * 2
    num_sets = max(1, min(64, math.ceil(4 * L2_BYTES / call_bytes)))
    pool = max(pages_per_call, 8192)
    cache = torch.randn(pool, PS, DI, device="cuda", dtype=torch.bfloat16)
    tables = page_sets(num_sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    row_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, HI, DI, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
    maxp = tables[0].shape[1]
    base = itk.default_kv_splits(batch, maxp, torch.device("cuda"))
    wants = [itk.index_topk_ref(qs[i], cache, tables[i], row_seq, pos, TOPK, 1) for i in range(min(2, num_sets))]

    def timed(name, splits=None, stages=3):
        fused, mode = INDEX_VARIANTS[name]
        itk.SCORE_LAUNCH.update(num_warps=4, num_stages=stages)
        calls = [lambda i=i: itk.index_topk_decode(qs[i], cache, tables[i], row_seq, pos, TOPK, 1,
                                                   num_kv_splits=splits, fused=fused, select_mode=mode)
                 for i in range(num_sets)]
        entry = {"op": "index", "B": batch, "L": length, "variant": name, "splits": splits or base, "stages": stages}
        try:
            ok = all(torch.equal(calls[i](), w) and torch.equal(calls[i](), w) for i, w in enumerate(wants))
            entry.update(us=graph_time_us(calls), correct=ok)
        except Exception as e:  # a launch option the chip cannot take: record and go on
            entry.update(error=repr(e)[:300])
        finally:
            itk.SCORE_LAUNCH.update(num_warps=4, num_stages=3)
        log.append(entry)
        return entry

    names = [v for v in INDEX_VARIANTS if not (v != "rounds" and maxp > 256)]
    variants = {name: timed(name) for name in names}
    good = [e for e in variants.values() if "us" in e and e["correct"]]
    best = min(good, key=lambda e: e["us"])
    sweep = [best]
    for splits, stages in itertools.product(sorted({max(1, base // 2), base, min(maxp, base * 2)}), (2, 3, 4)):
        if time.time() > DEADLINE[0] or (splits, stages) == (base, 3):
            continue
        e = timed(best["variant"], splits, stages)
        if "us" in e and e["correct"]:
            sweep.append(e)
    top = min(sweep, key=lambda e: e["us"])
    # the launcher with no options (the shipped defaults)
    calls = [lambda i=i: itk.index_topk(qs[i], cache, tables[i], row_seq, pos, TOPK, 1) for i in range(num_sets)]
    shipped_ok = all(torch.equal(calls[i](), w) for i, w in enumerate(wants))
    shipped = graph_time_us(calls)
    # the same launcher also writing the chosen pages beside the ids (the attention's `page_ids`: its cost set
    # against the attention's "pid" variants; off in the engine since K1, msa/indexer.py WRITE_PAGES)
    paged = [lambda i=i: itk.index_topk(qs[i], cache, tables[i], row_seq, pos, TOPK, 1, with_pages=True)
             for i in range(num_sets)]
    variants["shipped+pages"] = dict(us=graph_time_us(paged),
                                     correct=all(torch.equal(paged[i]()[0], w) for i, w in enumerate(wants)))
    # the shipped call's two kernels timed alone (the selection reads the scores the last call left)
    scores = [torch.empty(batch, HI, maxp, device="cuda") for _ in range(num_sets)]
    ids = torch.empty(batch, HI, TOPK, dtype=torch.int32, device="cuda")
    parts = {"scores": graph_time_us([lambda i=i: itk.index_block_scores(qs[i], cache, tables[i], row_seq, pos,
                                                                          scores[i]) for i in range(num_sets)]),
             "select": graph_time_us([lambda i=i: itk.select_topk(scores[i], pos, ids, TOPK, 1, PS)
                                      for i in range(num_sets)])}
    floor = batch * length * DI * 2 / HBM * 1e6
    vs = " ".join(f"{k}={e['us']:.1f}{'' if e.get('correct') else '(WRONG)'}" for k, e in variants.items() if "us" in e)
    vs += f" | alone: scores {parts['scores']:.1f}, select {parts['select']:.1f}"
    return dict(op="index", B=batch, L=length, us=shipped, best_us=top["us"], floor_us=floor, bytes=call_bytes,
                config=f"best {top['variant']} splits={top['splits']} st={top['stages']} | {vs}", parts=parts,
                default_splits=base, correct=shipped_ok and all(e.get("correct", True) for e in variants.values()),
                sets=num_sets, variants={k: e.get("us") for k, e in variants.items()})


def page_ids(sel, table, row_seq):
    """[B, Hkv, TOPK] int32: the pages of `sel`'s blocks (0 in the -1 tail), as the indexer would write them."""
    rows = table.long()[row_seq.long()]
    pages = torch.gather(rows[:, None, :].expand(-1, sel.shape[1], -1), 2, sel.clamp(min=0).long())
    return torch.where(sel >= 0, pages, 0).to(torch.int32)


def random_selection(batch, lens, gen):
    """[B, Hkv, TOPK] int32: TOPK distinct ascending visible blocks per KV head, own block included."""
    out = torch.full((batch, HKV, TOPK), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        nb = -(-n // PS)
        sc = torch.rand(HKV, nb, generator=gen)
        sc[:, nb - 1] = 2.0
        k = min(TOPK, nb)
        out[r, :, :k] = sc.topk(k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out.cuda()


# name -> (fold_merge, preload, page ids given, swap) of kernels/attention.py's decode launcher, None = its
# default. "pid": the selected blocks' page ids are an input (as if the indexer wrote them beside the block ids),
# not looked up in the kernel; "swap": the tile products as K q^T and V^T P^T
ATTN_VARIANTS = {"default": (None, None, False, None), "merge": (False, None, False, None),
                 "fold": (True, None, False, None), "no-pre": (None, False, False, None),
                 "pid": (None, None, True, None), "merge+pid": (False, None, True, None),
                 "fold+pid": (True, None, True, None), "swap": (None, None, False, True),
                 "swap+pid": (None, None, True, True)}


def bench_attention(kind, batch, length, gen, log):
    lens = lengths(batch, length, gen)
    pages_per_call = sum(-(-n // PS) for n in lens)
    sparse = kind == "sparse"
    read = sum(min(n, TOPK * PS) if sparse else n for n in lens) * HKV * D * 2 * 2
    num_sets = max(1, min(64, math.ceil(4 * L2_BYTES / read)))
    pool = max(pages_per_call, 4096)
    kc = torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = page_sets(num_sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    row_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
    sels = [random_selection(batch, lens, gen) for _ in range(num_sets)] if sparse else [None] * num_sets
    pids = [page_ids(sel, t, row_seq) for sel, t in zip(sels, tables)] if sparse else [None] * num_sets
    max_blocks = TOPK if sparse else tables[0].shape[1]
    base = attention.default_attn_splits(batch, HKV, max_blocks, torch.device("cuda"), sparse=sparse)
    scale = D ** -0.5
    want = attention.paged_attention_ref(qs[0], kc, vc, tables[0], row_seq, pos, scale, sels[0])

    def run(i, splits, fold=None, pre=None, pid=False, swap=None):
        return attention.paged_decode_attention(qs[i], kc, vc, tables[i], row_seq, pos, scale, sels[i],
                                                num_splits=splits, fold_merge=fold, preload=pre,
                                                page_ids=pids[i] if pid else None, swap=swap)

    def timed(name, splits=None, cfg=None):
        fold, pre, pid, swap = ATTN_VARIANTS[name]
        shipped = dict(attention.ATTN_LAUNCH)
        if cfg is not None:  # (warps, stages, key tile), the tile for every program
            attention.ATTN_LAUNCH.update(num_warps=cfg[0], num_stages=cfg[1], block_n=cfg[2], block_n_walk=cfg[2])
        entry = {"op": kind, "B": batch, "L": length, "variant": name, "splits": splits or base,
                 "launch": "default" if cfg is None else "w=%d st=%d tile=%d" % cfg}
        try:
            a, b = run(0, splits, fold, pre, pid, swap), run(0, splits, fold, pre, pid, swap)
            rel = ((a.float() - want.float()).norm() / want.float().norm()).item()
            entry.update(us=graph_time_us([lambda i=i: run(i, splits, fold, pre, pid, swap)
                                           for i in range(num_sets)]),
                         rel_err=rel, correct=rel < 1e-2 and bool(torch.equal(a, b)))
        except Exception as e:
            entry.update(error=repr(e)[:300])
        finally:
            attention.ATTN_LAUNCH.clear()
            attention.ATTN_LAUNCH.update(shipped)
        log.append(entry)
        return entry

    names = list(ATTN_VARIANTS) if sparse else ["default", "merge", "fold", "swap"]
    variants = {name: timed(name) for name in names}
    good = [e for e in variants.values() if "us" in e and e["correct"]]
    best = min(good, key=lambda e: e["us"])
    sweep = [best]
    split_opts = sorted({1, max(1, base // 2), base, min(max_blocks * 2, base + 1), min(max_blocks * 2, base * 2),
                         min(max_blocks * 2, base * 4)})
    configs = [(4, 3, 128), (4, 2, 64), (4, 3, 64), (4, 4, 64)] if sparse else [(4, 3, 128), (4, 3, 64)]
    for splits, cfg in itertools.product(split_opts, configs):
        if time.time() > DEADLINE[0]:
            continue
        e = timed(best["variant"], splits, cfg)
        if "us" in e and e["correct"]:
            sweep.append(e)
    top = min(sweep, key=lambda e: e["us"])
    shipped = graph_time_us([lambda i=i: run(i, None) for i in range(num_sets)])
    got = run(0, None)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    eff = min(length, TOPK * PS) if sparse else length
    floor = batch * HKV * eff * D * 2 * 2 / HBM * 1e6
    vs = " ".join(f"{k}={e['us']:.1f}{'' if e.get('correct') else '(WRONG)'}" for k, e in variants.items() if "us" in e)
    return dict(op=kind, B=batch, L=length, us=shipped, best_us=top["us"], floor_us=floor, bytes=read,
                config=f"best {top['variant']} splits={top['splits']} {top['launch']} | {vs}", default_splits=base,
                correct=rel < 1e-2 and all(e.get("correct", True) for e in variants.values()),
                rel_err=rel, sets=num_sets, variants={k: e.get("us") for k, e in variants.items()})


def bench_write(tokens, gen):
    pool = 4096
    caches = [torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(pool, PS, DI, device="cuda", dtype=torch.bfloat16)]
    sets = 32
    k = [torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    v = [torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ik = [torch.randn(tokens, DI, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    slots = [torch.randperm(pool * PS, generator=gen)[:tokens].cuda() for _ in range(sets)]
    ours = graph_time_us([lambda i=i: paged_kv.write_kv(k[i], v[i], ik[i], slots[i], *caches) for i in range(sets)])
    ref = eager_time_us([lambda i=i: paged_kv.write_kv_ref(k[i], v[i], ik[i], slots[i], *caches)
                         for i in range(sets)])
    want = [c.clone() for c in caches]
    paged_kv.write_kv_ref(k[0], v[0], ik[0], slots[0], *want)
    paged_kv.write_kv(k[0], v[0], ik[0], slots[0], *caches)
    ok = all(torch.equal(a, b) for a, b in zip(caches, want))
    moved = tokens * (2 * HKV * D + DI) * 2 * 2
    return dict(op="write_kv", B=tokens, L=0, us=ours, floor_us=moved / HBM * 1e6, bytes=moved,
                config=f"torch reference path, eager (it syncs): {ref:.1f} us", correct=ok)


def ncu_target(batch: int) -> int:
    """Three shipped calls of the indexer (scores + selection) then three of sparse attention at batch x 8.7k,
    nothing else: `ncu -k regex:"_index_scores_kernel|_select_topk_kernel|_decode_attn_kernel" -s 4 -c 4`
    profiles the third indexer call and two attention calls (docs/benchmarks.md P18)."""
    gen = torch.Generator().manual_seed(0)
    lens = lengths(batch, 8700, gen)
    pool = max(sum(-(-n // PS) for n in lens), 8192)
    index_cache = torch.randn(pool, PS, DI, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = page_sets(1, lens, pool, gen)[0]
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    row_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    q_idx = torch.randn(batch, HI, DI, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    sel = random_selection(batch, lens, gen)
    for _ in range(3):
        itk.index_topk_decode(q_idx, index_cache, table, row_seq, pos, TOPK, 1)
    for _ in range(3):
        attention.paged_decode_attention(q, kc, vc, table, row_seq, pos, D ** -0.5, sel)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds after which sweeps stop")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--ncu-target", type=int, default=0, metavar="B",
                    help="only 3 calls each of the indexer and sparse attention at B x 8.7k (for ncu -s 4)")
    args = ap.parse_args()
    if args.ncu_target:
        return ncu_target(args.ncu_target)
    DEADLINE[0] = time.time() + args.budget
    gen = torch.Generator().manual_seed(0)
    log, rows = [], []
    t0 = time.time()
    index_shapes = [(1, 8700), (16, 8700), (64, 8700), (16, 131072), (64, 131072)]
    attn_shapes = [(1, 8700), (16, 8700), (64, 8700)]
    if args.quick:
        index_shapes, attn_shapes = index_shapes[:1], attn_shapes[:1]
    jobs = [(bench_index, (b, length, gen, log)) for b, length in index_shapes]
    jobs += [(bench_attention, (kind, b, length, gen, log)) for kind in ("sparse",) + (() if args.skip_dense else ("dense",)) for b, length in attn_shapes]
    jobs += [(bench_write, (t, gen)) for t in (1, 16, 64)]
    for fn, fn_args in jobs:
        try:
            rows.append(fn(*fn_args))
            print(rows[-1], flush=True)
        except Exception:  # keep the other shapes' numbers; the traceback goes to the log
            traceback.print_exc()
        torch.cuda.empty_cache()
        if args.out:  # partial results survive a timeout
            with open(args.out, 'w') as f:
                json.dump({'rows': rows, 'sweep': log}, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "sweep": log, "seconds": time.time() - t0}, f, indent=1)
    print("\nus = the launcher's shipped defaults; best = the best of the sweep (its config on the right); "
          "peer = PERF.md's, same method, another run")
    print(f"\n{'op':9} {'B':>3} {'L':>7} {'us':>8} {'best':>6} {'floor':>7} {'target':>7} {'peer':>6} {'GB/s':>6} "
          f"{'floor/us':>8} ok  config")
    for r in rows:
        key = (r["op"], r["B"], r["L"])
        print(f"{r['op']:9} {r['B']:>3} {r['L']:>7} {r['us']:8.1f} {r.get('best_us', r['us']):6.1f} "
              f"{r['floor_us']:7.1f} "
              f"{TARGET.get(key, float('nan')):7.0f} {PEER.get(key, float('nan')):6.1f} "
              f"{r['bytes'] / r['us'] / 1e3:6.0f} {r['floor_us'] / r['us']:8.2f} {'y' if r['correct'] else 'N'}   "
              f"{r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
