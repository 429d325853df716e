"""Prefill kernels on one GPU at M3 shapes: the indexer, sparse and dense prefill attention, and the routed MoE
at prefill sizes.

Shapes (PERF.md): 64 query heads over 4 KV heads, head_dim 128, 4 index heads of 128, page = block = 128, top-16,
bf16. A case is one request of T new tokens after ctx - T cached ones (shuffled page table, random caches, never
zeros). Method (PERF.md's prefill method, the one the peer's numbers were taken by): eager calls on the same
inputs, CUDA events around each call, median of --reps after a warm-up call; the torch references check the
kernels in the same run (phase `check`).

Phases (--phases, comma separated):
  check  kernels vs references at T = 2,048, ctx = 8,192 (selections equal, attention rel. error < 1e-2)
  sweep  launch options of the three kernels at a few cases (--sweep-cases); the best per case is printed
  table  every case of --cases with the defaults (PREFILL_LAUNCH / PREFILL_INDEX_LAUNCH) and, where the sweep
         ran, its best; "ours sparse" is what the dispatch ships (kernels/attention.py `prompt_attention`: dense,
         token-major or block-major, its kind printed beside), the token-major kernel beside it; torch SDPA (flash,
         contiguous, causal, GQA) for T = ctx; FLOP floors at 790 TFLOP/s; the peer's numbers from PERF.md
  split  the block-major sparse kernel (kernels/prefill_sparse_split.py) on every case of --cases: its rel. error
         vs the token-major kernel, the work list alone, split + merge alone, the total, beside the token-major
         and the shipped times; a launch sweep capped by --split-budget-s (options, then W for the best two)
  profile the block-major kernel per case of --cases: a few launches timed (PROFILE_OPTIONS), the host time to
         issue one call, and the device time by kernel (torch profiler) of the default, the best and the
         token-major kernel
  moe    the routed experts of one m3-slice MoE layer (128 experts of 6144 x 3072, top-4) at T tokens: the
         fused kernel with its default and swept tiles, and torch._grouped_mm (CUTLASS) where torch has it
  PYTHONPATH=$PWD python3 benchmarks/kernels/bench_prefill.py --out $OUT
Writes bench_prefill.json to --out after every phase; prints the tables last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # graph_timing.py, beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: kernels/
from graph_timing import eager_event_ms  # noqa: E402

HQ, HKV, D, HI, DI, PS, TOPK = 64, 4, 128, 4, 128, 128, 16
PEAK = 790e12  # bf16 dense matmul, measured (PERF.md)
HBM = 4.3e12
# PERF.md, same GPU, same method: (index, sparse attention, SDPA dense) ms
PEER = {(2048, 2048): (0.147, 0.701, 0.190), (2048, 8192): (0.190, 1.324, None),
        (8192, 8192): (0.235, 4.196, 1.836), (2048, 32768): (0.381, 1.315, None)}
CASES = "2048:2048,2048:8192,8192:8192,2048:32768,8192:32768,2048:131072,8192:131072"

SPARSE_SWEEP = [dict(tokens=t, block_n=n, num_warps=w, num_stages=s) for t in (1, 2, 4, 8)
                for n, w, s in ((64, 4, 3), (128, 4, 2), (128, 8, 3))]
DENSE_SWEEP = [dict(tokens=t, heads=h, block_n=n, num_warps=w, num_stages=s)
               for t, h in ((8, 16), (16, 8), (128, 1))
               for n, w, s in ((128, 8, 3), (64, 4, 3), (128, 8, 4))]
INDEX_SWEEP = ([dict(rows=r, num_warps=w, num_stages=s) for r in (32, 64, 128) for w, s in ((4, 2), (4, 3))]
               + [dict(splits=s) for s in (1, 2, 3, 4)])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phases", default="check,sweep,table,moe")
    p.add_argument("--cases", default=CASES, help="T:ctx,...")
    p.add_argument("--sweep-cases", default="8192:8192,2048:32768")
    p.add_argument("--sweep-kinds", default="index,sparse,dense")
    p.add_argument("--moe-tokens", default="2048,8192")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=400.0, help="skip sweep points past this much wall time")
    p.add_argument("--split-budget-s", type=float, default=180.0, help="the split phase's sweep time, all cases")
    p.add_argument("--profile-options", default=None,
                   help="the profile phase's launches as a JSON list of launch dicts (default PROFILE_OPTIONS)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    a.cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",") if c]
    a.sweep_cases = [tuple(int(x) for x in c.split(":")) for c in a.sweep_cases.split(",") if c]
    a.moe_tokens = [int(t) for t in a.moe_tokens.split(",") if t]
    a.phases = a.phases.split(",")
    a.sweep_kinds = a.sweep_kinds.split(",")
    return a


def event_ms(fn, reps: int) -> float:
    """Median ms of one eager call (CUDA events around each), after one warm-up call."""
    return eager_event_ms(fn, reps, warmup=1)


def make_case(t: int, ctx: int, seed: int = 0) -> dict:
    """One request: ctx - t cached tokens, t new (the step's rows), its pages shuffled in a pool with spares."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-ctx // PS)
    pool = pages + 8
    table = torch.randperm(pool, device="cuda", generator=g)[:pages].to(torch.int32).view(1, pages)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    return {"t": t, "ctx": ctx, "table": table,
            "k": rnd(pool, PS, HKV, D), "v": rnd(pool, PS, HKV, D), "ik": rnd(pool, PS, DI),
            "q": rnd(t, HQ, D), "qi": rnd(t, HI, DI),
            "pos": torch.arange(ctx - t, ctx, device="cuda"),
            "qsl": torch.tensor([0, t], dtype=torch.int32, device="cuda"),
            "row_seq": torch.zeros(t, dtype=torch.int32, device="cuda")}


def run_index(c, launch=None):
    from kernels.prefill_index import prefill_index_topk

    return prefill_index_topk(c["qi"], c["ik"], c["table"], c["qsl"], c["pos"], TOPK, 1, num_requests=1,
                              max_len=c["t"], launch=launch)


def run_attn(c, sel, launch=None):
    from kernels.prefill_attention import prefill_attention

    return prefill_attention(c["q"], c["k"], c["v"], c["table"], c["qsl"], c["pos"], D ** -0.5, sel,
                             num_requests=1, max_len=c["t"], launch=launch)


def run_shipped(c, sel):
    """What a sparse layer's prompt rows run today: the dispatch's pick (`prompt_kind`)."""
    from kernels.attention import prompt_attention

    return prompt_attention(c["q"], c["k"], c["v"], c["table"], c["qsl"], c["pos"], D ** -0.5, sel,
                            num_requests=1, max_len=c["t"])


def shipped_kind(c, sel) -> str:
    from kernels.attention import prompt_kind

    return prompt_kind(c["t"], 1, c["table"].shape[1], sel, HKV)


def run_split(c, sel, launch=None):
    from kernels.prefill_sparse_split import prefill_sparse_split

    return prefill_sparse_split(c["q"], c["k"], c["v"], c["table"], c["qsl"], c["pos"], D ** -0.5, sel,
                                num_requests=1, max_len=c["t"], launch=launch)


def run_sdpa(c, expand: bool):
    """torch SDPA (flash) on contiguous q/k/v of the same data, causal (t == ctx only): GQA through
    enable_gqa, or (expand) with K/V repeated to the 64 query heads before the timing, as plain MHA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = c["k"][c["table"][0].long()].reshape(-1, HKV, D)[:c["ctx"]].transpose(0, 1)[None]
    v = c["v"][c["table"][0].long()].reshape(-1, HKV, D)[:c["ctx"]].transpose(0, 1)[None]
    q = c["q"].transpose(0, 1)[None].contiguous()
    if expand:
        k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    k, v = k.contiguous(), v.contiguous()

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand)

    return call


def floors(t: int, ctx: int) -> dict:
    prefix = ctx - t
    return {"sparse_floor": 4 * t * HQ * D * min(ctx, 2048) / PEAK * 1e3,
            "dense_floor": 4 * t * HQ * D * (prefix + t / 2) / PEAK * 1e3,
            "index_floor": 2 * t * HI * DI * (prefix + t / 2) / PEAK * 1e3}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- phases ----------------------------------------------------------------------------------------------------

def check_phase(args) -> dict:
    from kernels.attention import paged_attention_ref
    from kernels.index_topk import index_topk_ref

    c = make_case(2048, 8192, seed=1)
    want = index_topk_ref(c["qi"], c["ik"], c["table"], c["row_seq"], c["pos"], TOPK, 1)
    got = run_index(c)
    mismatch = int((got != want).any(-1).sum())
    out = {"index_rows_differing": mismatch, "rows": 2048 * HI}
    sparse_want = paged_attention_ref(c["q"], c["k"], c["v"], c["table"], c["row_seq"], c["pos"], D ** -0.5, want)
    out["sparse_rel"] = rel(run_attn(c, want), sparse_want)
    out["sparse_shipped_kind"] = shipped_kind(c, want)
    out["sparse_shipped_rel"] = rel(run_shipped(c, want), sparse_want)
    del sparse_want
    dense_want = paged_attention_ref(c["q"], c["k"], c["v"], c["table"], c["row_seq"], c["pos"], D ** -0.5)
    out["dense_rel"] = rel(run_attn(c, None), dense_want)
    out["ok"] = (mismatch == 0 and out["sparse_rel"] < 1e-2 and out["sparse_shipped_rel"] < 1e-2
                 and out["dense_rel"] < 1e-2)
    print("check", json.dumps(out), flush=True)
    return out


def _best(times: dict) -> tuple[str, float] | None:
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return min(ok.items(), key=lambda kv: kv[1]) if ok else None


def sweep_phase(args, deadline: float) -> list[dict]:
    rows = []
    for t, ctx in args.sweep_cases:
        c = make_case(t, ctx, seed=2)
        sel = run_index(c)
        res = {"T": t, "ctx": ctx, "index": {}, "sparse": {}, "dense": {}}
        for kind, configs, fn in (("index", INDEX_SWEEP, lambda l: run_index(c, l)),
                                  ("sparse", SPARSE_SWEEP, lambda l: run_attn(c, sel, l)),
                                  ("dense", DENSE_SWEEP, lambda l: run_attn(c, None, l))):
            if kind not in args.sweep_kinds:
                continue
            for launch in configs:
                if time.monotonic() > deadline:
                    res["cut_short"] = True
                    break
                try:
                    res[kind][json.dumps(launch)] = event_ms(lambda: fn(launch), max(5, args.reps // 2))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    res[kind][json.dumps(launch)] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            best = _best(res[kind])
            res[f"best_{kind}"] = best
            print(f"sweep T={t} ctx={ctx} {kind}: best {best}", flush=True)
        rows.append(res)
        del c, sel
        torch.cuda.empty_cache()
    return rows


def table_phase(args, sweep: list[dict]) -> list[dict]:
    best = {(s["T"], s["ctx"]): s for s in sweep}
    rows = []
    for t, ctx in args.cases:
        try:
            c = make_case(t, ctx, seed=3)
            sel = run_index(c)
            row = {"T": t, "ctx": ctx, **floors(t, ctx)}
            row["index"] = event_ms(lambda: run_index(c), args.reps)
            row["sparse"] = event_ms(lambda: run_shipped(c, sel), args.reps)
            row["sparse_kind"] = shipped_kind(c, sel)
            row["sparse_token_major"] = event_ms(lambda: run_attn(c, sel), args.reps)
            row["dense"] = event_ms(lambda: run_attn(c, None), args.reps)
            if t == ctx:
                row["sdpa_gqa"] = event_ms(run_sdpa(c, False), args.reps)
                row["sdpa"] = event_ms(run_sdpa(c, True), args.reps)
            s = best.get((t, ctx))
            for kind in ("index", "sparse", "dense") if s else ():
                if s.get(f"best_{kind}"):
                    row[f"{kind}_best"] = s[f"best_{kind}"]
            peer = PEER.get((t, ctx))
            if peer:
                row["peer_index"], row["peer_sparse"], row["peer_sdpa"] = peer
            print("table", json.dumps(row), flush=True)
            rows.append(row)
            del c, sel
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - one case failing (memory) must not lose the others
            traceback.print_exc()
            rows.append({"T": t, "ctx": ctx, "error": traceback.format_exc(limit=1)})
    return rows


# block-major launches: kernel options at W = 64 first, then W for the best two, then the mask always applied
# and smaller row slices for the best. 8 pairs (128 rows) only with 8 warps and one stage: more spills or leaves
# one program per SM (ptxas, sm_90: 202 registers, 96 KB of shared memory)
SPLIT_OPTIONS = ([dict(pairs=64, sub=s, block_n=n, num_warps=w, num_stages=st)
                  for s in (4, 2) for n in (128, 64) for w in (4, 8) for st in (2, 1)]
                 + [dict(pairs=64, sub=8, block_n=n, num_warps=8, num_stages=1) for n in (128, 64)])


def _split_parts(c, sel, launch):
    """(work lists alone, split + merge alone) of one call of the block-major kernel, as callables."""
    from kernels import prefill_sparse_split as sp

    opts = sp.split_options(launch, HQ // HKV, PS, False)
    t, width, rows = c["t"], c["table"].shape[1], min(c["t"], opts["max_rows"])
    slices = [(a, min(t, a + opts["max_rows"])) for a in range(0, t, opts["max_rows"])]

    def lists():
        return [sp.build_work_list(sel[a:b], c["qsl"], a, 1, width, opts["pairs"]) for a, b in slices]

    works = lists()
    part_o = torch.empty((rows * HKV * TOPK * (HQ // HKV), D), dtype=c["q"].dtype, device=c["q"].device)
    part_lse = torch.empty((rows * HKV * TOPK * (HQ // HKV),), dtype=torch.float32, device=c["q"].device)
    out = torch.empty_like(c["q"])

    def kernels():
        for (a, b), w in zip(slices, works):
            sp.split_merge(c["q"][a:b], c["k"], c["v"], c["table"], c["pos"][a:b], sel[a:b], D ** -0.5, w, out[a:b],
                           part_o, part_lse, opts)

    return lists, kernels


def _time_split(c, sel, launch, ref, reps) -> dict:
    try:
        got = run_split(c, sel, launch)
        res = {"rel_vs_token_major": rel(got, ref), "total": event_ms(lambda: run_split(c, sel, launch), reps)}
        del got
        return res
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
        return {"failed": f"{type(exc).__name__}: {str(exc)[:120]}"}


def split_phase(args) -> list[dict]:
    """The block-major kernel beside the token-major one and the shipped dispatch, per case of --cases."""
    start, rows = time.monotonic(), []
    reps = max(5, args.reps // 2)
    for i, (t, ctx) in enumerate(args.cases):
        c = make_case(t, ctx, seed=3)
        sel = run_index(c)
        ref = run_attn(c, sel)  # the token-major kernel: checked against the torch reference in phase check
        row = {"T": t, "ctx": ctx, "peer": PEER.get((t, ctx), (None,) * 3)[1], "kind": shipped_kind(c, sel),
               "sparse_floor": floors(t, ctx)["sparse_floor"]}
        row["token_major"] = event_ms(lambda: run_attn(c, sel), args.reps)
        row["shipped"] = event_ms(lambda: run_shipped(c, sel), args.reps)
        default = _time_split(c, sel, None, ref, args.reps)
        row["default"] = default
        if "failed" not in default:
            lists, kernels = _split_parts(c, sel, None)
            row["work_list"] = event_ms(lists, args.reps)
            row["split_merge"] = event_ms(kernels, args.reps)
        # this case's share of what is left of the sweep's time
        deadline = time.monotonic() + (start + args.split_budget_s - time.monotonic()) / (len(args.cases) - i)
        sweep = {}

        def tried(launch):
            if time.monotonic() < deadline:
                sweep[json.dumps(launch)] = _time_split(c, sel, launch, ref, reps)

        for launch in SPLIT_OPTIONS:
            tried(launch)
        ranked = sorted((v["total"], k) for k, v in sweep.items() if "total" in v and v["rel_vs_token_major"] < 1e-2)
        for _, key in ranked[:2]:
            for w in (32, 128):
                tried({**json.loads(key), "pairs": w})
        ranked = sorted((v["total"], k) for k, v in sweep.items() if "total" in v and v["rel_vs_token_major"] < 1e-2)
        if ranked:
            tried({**json.loads(ranked[0][1]), "mask_branch": False})
            tried({**json.loads(ranked[0][1]), "max_rows": 2048})
        ranked = sorted((v["total"], k) for k, v in sweep.items() if "total" in v and v["rel_vs_token_major"] < 1e-2)
        row["best"] = ranked[0] if ranked else None
        row["sweep"] = sweep
        row["cut_short"] = time.monotonic() >= deadline
        print("split", json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        rows.append(row)
        c = sel = ref = None  # free the case before the next one is made
        torch.cuda.empty_cache()
    return rows


# the block-major kernel's launches timed beside its default: the work list and split fused into one persistent
# launch or launched apart, partials stored evict-first or not, pairs per program, stages
PROFILE_OPTIONS = [{}, {"fuse_split": True}, {"fused": False}, {"evict_first": False}, {"fused": False, "evict_first": False},
                   {"pairs": 128}, {"fused": False, "pairs": 128}, {"num_stages": 1}]


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """Device microseconds per call of `fn`, by kernel name (torch profiler; one warm-up call first)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us:
            out[e.key[:60]] = round(us / calls, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def host_ms(fn, calls: int = 20) -> float:
    """Host milliseconds to issue one call of `fn` (launches only; timed with the queue kept busy by the calls
    before it, synchronised once at the end)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return host


def profile_phase(args) -> list[dict]:
    """Per case of --cases: the block-major kernel's launches (PROFILE_OPTIONS) timed, and the default's and the
    best's device time by kernel (work list, split, merge) beside the token-major kernel's."""
    options = json.loads(args.profile_options) if args.profile_options else PROFILE_OPTIONS
    rows = []
    for t, ctx in args.cases:
        c = make_case(t, ctx, seed=3)
        sel = run_index(c)
        ref = run_attn(c, sel)
        row = {"T": t, "ctx": ctx, "token_major": event_ms(lambda: run_attn(c, sel), args.reps),
               "launches": {json.dumps(o): _time_split(c, sel, o or None, ref, args.reps) for o in options}}
        ok = sorted((v["total"], k) for k, v in row["launches"].items()
                    if "total" in v and v["rel_vs_token_major"] < 1e-2)
        row["host_ms"] = {"token_major": host_ms(lambda: run_attn(c, sel)),
                          "block_major": host_ms(lambda: run_split(c, sel))}
        row["kernels_token_major"] = kernel_times(lambda: run_attn(c, sel))
        row["kernels_default"] = kernel_times(lambda: run_split(c, sel))
        if ok:
            best = json.loads(ok[0][1]) or None
            row["best"] = ok[0]
            row["kernels_best"] = kernel_times(lambda: run_split(c, sel, best))
        print("profile", json.dumps(row), flush=True)
        rows.append(row)
        c = sel = ref = None
        torch.cuda.empty_cache()
    return rows


def print_profile(rows) -> None:
    print("\nblock-major launches, ms (eager, CUDA events, median)")
    for r in rows:
        cells = "; ".join(f"{k} {_f(v.get('total', v.get('failed')))}" for k, v in r["launches"].items())
        print(f"{r['T']} x {r['ctx']}: token-major {_f(r['token_major'])} | {cells} | host ms per call "
              f"{json.dumps({k: round(v, 3) for k, v in r['host_ms'].items()})}")
        for name in ("kernels_token_major", "kernels_default", "kernels_best"):
            if name in r:
                print(f"  {name}: " + "; ".join(f"{k} {v} us" for k, v in list(r[name].items())[:6]))


# (block_m, gate_up (block_n, block_k, warps, stages, group_m, tma, half_tail), down (same))
_GU, _DN = (128, 64, 8, 4, 1), (256, 64, 8, 3, 1)
MOE_TILES = [(128, _GU + (False, False), _DN + (False, False)),  # 9659e99's default
             (128, _GU + (True, False), _DN + (True, False)), (128, _GU + (False, True), _DN + (False, True)),
             (128, _GU + (True, True), _DN + (True, True)), (128, (128, 64, 8, 3, 1, True, True), _DN + (True, True)),
             (128, _GU + (True, True), (128, 64, 8, 4, 1, True, True)),
             (128, (128, 64, 8, 4, 2, True, True), (256, 64, 8, 3, 2, True, True)),
             (128, (128, 128, 8, 2, 1, True, True), _DN + (True, True)),
             (64, _GU + (True, False), _DN + (True, False)), (64, (128, 64, 4, 4, 1, True, False), _DN + (True, False))]


def moe_phase(args, deadline: float) -> list[dict]:
    from kernels import fused_moe as fm

    h, inter, e, k = 6144, 3072, 128, 4
    g = torch.Generator(device="cuda").manual_seed(4)
    w_gu = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    rows = []
    for t in args.moe_tokens:
        x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(t, e, device="cuda", generator=g)
        wts, ids = torch.topk(torch.sigmoid(logits), k, dim=-1)
        ids = ids.to(torch.int32)
        flop = t * k * 2 * h * 3 * inter
        wbytes = (w_gu.numel() + w_dn.numel()) * 2
        row = {"T": t, "flop_floor": flop / PEAK * 1e3, "byte_floor": wbytes / HBM * 1e3}
        default = fm.default_config(t * k, e, h, inter)
        row["fused_default"] = event_ms(lambda: fm.fused_moe(x, ids, wts, w_gu, w_dn, alpha=1.702, limit=7.0),
                                        args.reps)
        want = fm.fused_moe(x, ids, wts, w_gu, w_dn, alpha=1.702, limit=7.0).float()
        row["default_config"] = repr(default)
        for bm, gu, dn in MOE_TILES:
            if time.monotonic() > deadline:
                row["cut_short"] = True
                break

            def tile(o):
                return fm.GemmTile(block_n=o[0], block_k=o[1], num_warps=o[2], num_stages=o[3], group_m=o[4],
                                   tma=o[5], half_tail=o[6])

            cfg = fm.MoEConfig(block_m=bm, gate_up=tile(gu), down=tile(dn))
            key = f"bm{bm} gu{gu} dn{dn}"
            try:
                row[key] = event_ms(lambda: fm.fused_moe(x, ids, wts, w_gu, w_dn, alpha=1.702, limit=7.0,
                                                         config=cfg), args.reps)
                got = fm.fused_moe(x, ids, wts, w_gu, w_dn, alpha=1.702, limit=7.0, config=cfg).float()
                row[key + " rel_err_vs_default"] = ((got - want).norm() / want.norm()).item()
            except Exception as exc:  # noqa: BLE001
                row[key] = f"failed: {type(exc).__name__}"
        if hasattr(torch, "_grouped_mm"):
            try:
                row["grouped_mm"] = event_ms(_grouped_mm_moe(x, ids, wts, w_gu, w_dn, e), args.reps)
            except Exception as exc:  # noqa: BLE001
                row["grouped_mm"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        print("moe", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _grouped_mm_moe(x, ids, wts, w_gu, w_dn, e):
    """The same MoE through torch._grouped_mm (gather by expert, two grouped GEMMs, SwiGLU-OAI, weighted
    scatter): a measure of what a CUTLASS grouped GEMM reaches here, not a production path."""
    from kernels.fused_moe import swiglu_oai_ref

    k = ids.shape[1]
    w_gu_t, w_dn_t = w_gu.transpose(1, 2), w_dn.transpose(1, 2)

    def call():
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        xs = x[order // k]
        gu = torch._grouped_mm(xs, w_gu_t, offs=offs)
        act = swiglu_oai_ref(gu, 1.702, 7.0).to(x.dtype)
        y = torch._grouped_mm(act, w_dn_t, offs=offs)
        y = y * wts.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x)
        return out.index_add_(0, order // k, y)

    return call


# ---- main ------------------------------------------------------------------------------------------------------

def save(args, result) -> None:
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_prefill.json").write_text(json.dumps(result, indent=1, default=str))


def _f(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else ("-" if x is None else str(x))


def print_split(rows) -> None:
    print("\nblock-major sparse prefill attention, ms (eager, CUDA events, median); shipped = the dispatch's pick")
    print("| T x ctx | token-major | shipped (kind) | block-major default | best total | best options | work list | "
          "split + merge | rel vs token-major | peer | best / peer | floor |")
    for r in rows:
        best = r.get("best") or (None, "-")
        peer = r.get("peer")
        ratio = best[0] / peer if peer and best[0] else None
        print(f"| {r['T']} x {r['ctx']} | {_f(r['token_major'])} | {_f(r['shipped'])} ({r['kind']}) "
              f"| {_f(r['default'].get('total', r['default'].get('failed')))} | {_f(best[0])} | {best[1]} "
              f"| {_f(r.get('work_list'))} | {_f(r.get('split_merge'))} "
              f"| {_e(r['default'].get('rel_vs_token_major'))} | {_f(peer)} | {_f(ratio)} | {_f(r['sparse_floor'])} |")
    for r in rows:  # every swept launch: a config far off the token-major output is a miscompile, not a result
        bad = {k: v for k, v in r["sweep"].items() if "failed" in v or v["rel_vs_token_major"] >= 1e-2}
        if bad:
            print(f"split {r['T']} x {r['ctx']}: launches failed or off: {json.dumps(bad)}")


def _e(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else ("-" if x is None else str(x))


def print_tables(result) -> None:
    print("\nprefill kernels, ms (eager, CUDA events, median); floors at 790 TFLOP/s")
    print("| T | ctx | peer index | ours index | peer sparse | ours sparse | sdpa dense (mha / gqa) | ours dense | "
          "sparse floor | dense floor | index floor |")
    for name in ("check", "sweep", "table", "moe", "split", "profile"):
        if isinstance(result.get(name), dict) and "error" in result[name]:
            print(f"phase {name} failed: {result[name]['error'][-300:]}")
            result[name] = [] if name != "check" else result[name]
    for r in result.get("table", []):
        if "error" in r:
            print(f"| {r['T']} | {r['ctx']} | error |")
            continue
        print(f"| {r['T']} | {r['ctx']} | {_f(r.get('peer_index'))} | {_f(r['index'])} | {_f(r.get('peer_sparse'))} "
              f"| {_f(r['sparse'])} ({r.get('sparse_kind')}; token-major {_f(r.get('sparse_token_major'))}) "
              f"| {_f(r.get('sdpa'))} / {_f(r.get('sdpa_gqa'))} | {_f(r['dense'])} "
              f"| {_f(r['sparse_floor'])} "
              f"| {_f(r['dense_floor'])} | {_f(r['index_floor'])} |")
    for s in result.get("sweep", []):
        print(f"sweep T={s['T']} ctx={s['ctx']}: " + "; ".join(f"{k} {s.get('best_' + k)}"
                                                              for k in ("index", "sparse", "dense")))
    for m in result.get("moe", []):
        tiles = {k: v for k, v in m.items() if k.startswith("bm") and "rel_err" not in k}
        print(f"moe T={m['T']}: fused default {_f(m['fused_default'])} ms, best {_best(tiles)}, grouped_mm "
              f"{_f(m.get('grouped_mm'))}, floors flop {_f(m['flop_floor'])} bytes {_f(m['byte_floor'])}")
        for k, v in tiles.items():
            print(f"  {_f(v)} ms  rel.err {_f(m.get(k + ' rel_err_vs_default'))}  {k}")
    if result.get("split"):
        print_split(result["split"])
    if isinstance(result.get("profile"), list):
        print_profile(result["profile"])
    if "check" in result:
        print("check", result["check"])


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name()}
    phases = [("check", lambda: check_phase(args)),
              ("sweep", lambda: sweep_phase(args, start + args.budget_s)),
              ("table", lambda: table_phase(args, result.get("sweep", []))),
              ("moe", lambda: moe_phase(args, start + args.budget_s + 60)),
              ("split", lambda: split_phase(args)),
              ("profile", lambda: profile_phase(args))]
    for name, fn in phases:
        if name not in args.phases:
            continue
        t0 = time.monotonic()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - keep the other phases' results
            traceback.print_exc()
            result[name] = {"error": traceback.format_exc(limit=2)}
        print(f"phase {name}: {time.monotonic() - t0:.1f} s", flush=True)
        save(args, result)
    print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
