"""Fused MoE benchmark on one GPU: one MoE layer of m3-slice shapes and the whole m3-slice decode step, fused
kernel (kernels/fused_moe.py) against the torch loop over experts it replaces.

The random m3-slice model (4 layers, 3 of them MoE with 128 experts of H 6144 / I 3072, a shared expert of
I 3072, top-4, bf16) is drawn on the device exactly as benchmarks/bench_parallel.py does (build_random_model).

  layer:  B = 1, 16, 64, 256 tokens of random hidden states through SparseMoE (router + shared + routed
          experts). The loop ("ref" backend, one host sync) is timed eagerly; the fused block eagerly and as a
          CUDA graph; the routed experts and the shared expert alone as graphs. Each timed call rotates over the
          3 MoE layers (independent weights), so a call never finds the previous call's experts in L2.
          Floor = (touched experts + shared expert) weight bytes / 4.3 TB/s (router weights included).
  sweep:  tile options of the two grouped GEMMs (routed experts alone, graph), per B; best vs the default.
  model:  decode step (forward + LM head) at B = 1, 16, 64 with every request at 2048 cached tokens (random KV):
          loop (eager), fused (eager), fused (whole step in one CUDA graph). Floor = weights read (every
          non-expert weight but the embedding table, B embedding rows, touched experts at uniform routing) + KV.

  PYTHONPATH=$PWD python3 benchmarks/kernels/bench_moe.py --out $OUT
Writes bench_moe.json to --out after every phase; prints the tables last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # graph_timing.py, beside this script
from graph_timing import eager_event_ms, graph_replay_ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (bench_parallel)

HBM = 4.3e12  # bytes/s, the measured copy ceiling (PERF.md)
# the fused path's backend: None = Triton on CUDA; the CPU smoke run forces Triton through the interpreter
FUSED = {"backend": None}
PERF_FLOOR_MS = {1: 1.28, 16: 5.02, 64: 9.89}  # PERF.md's m3-slice decode floors


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--model-batches", default="1,16,64")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--experts", type=int, default=None, help="override num_local_experts (memory)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny preset in fp32 (CPU smoke run: no graphs, "
                                                         "Triton through the interpreter)")
    p.add_argument("--phases", default="layer,model,sweep")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip sweep points once this much time has passed")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    a.model_batches = [int(b) for b in a.model_batches.split(",")]
    a.phases = a.phases.split(",")
    return a


# ---- timing -----------------------------------------------------------------------------------------------------

def graph_ms(fn, replays: int = 20) -> float:
    """Median ms of one replay of a graph holding one call of fn (after eager warm-up); eager without CUDA."""
    if not torch.cuda.is_available():
        return eager_ms(fn)
    return graph_replay_ms(fn, replays)


def eager_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    if not torch.cuda.is_available():  # CPU smoke run: one timed call (the interpreter is slow)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return eager_event_ms(fn, reps, warmup)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- the model --------------------------------------------------------------------------------------------------

def build(args, device):
    import dataclasses

    from bench_parallel import build_random_model
    from msa.config import M3Config
    from msa.moe import SparseMoE
    from msa.parallel import ParallelContext
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", "tiny" if args.tiny else "m3-slice"), M3Config)
    if args.experts:
        cfg = dataclasses.replace(cfg, num_local_experts=args.experts)
    model = build_random_model(cfg, ParallelContext.single(), args.dtype, device, seed=0)
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    return cfg, model, moes


def set_backend(moes, backend) -> None:
    """backend "ref": the torch loop; "fused": the fused kernel."""
    backend = FUSED["backend"] if backend == "fused" else backend
    for m in moes:
        m.experts.backend = backend


# ---- phase 1: one MoE layer -------------------------------------------------------------------------------------

def layer_phase(cfg, moes, batches, device, dtype) -> list[dict]:
    from kernels import fused_moe as fm

    h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    expert_bytes = 3 * i * h * 2
    shared_bytes = 3 * cfg.shared_intermediate_size * h * 2
    router_bytes = e * h * 4 + e * 4
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for b in batches:
        xs = [torch.randn(b, h, generator=gen, device=device).to(dtype) for _ in moes]
        with torch.no_grad():
            routes = [m.gate(x) for m, x in zip(moes, xs)]
        touched = statistics.mean(ids.unique().numel() for ids, _ in routes)
        floor_bytes = touched * expert_bytes + shared_bytes + router_bytes
        routed_floor_bytes = touched * expert_bytes
        ex = moes[0].experts
        ids, w = routes[0]
        with torch.no_grad():
            fused = fm.fused_moe(xs[0], ids, w, ex.gate_up_proj, ex.down_proj, alpha=ex.alpha, limit=ex.limit,
                                 backend=FUSED["backend"])
            loop = fm.fused_moe_ref(xs[0], ids, w, ex.gate_up_proj, ex.down_proj, alpha=ex.alpha, limit=ex.limit)
            truth = fm.fused_moe_ref(xs[0], ids, w, ex.gate_up_proj, ex.down_proj, alpha=ex.alpha, limit=ex.limit,
                                     acc_dtype=torch.float32)

        def whole():
            for m, x in zip(moes, xs):
                m(x)

        def routed():
            for m, x, (ids_, w_) in zip(moes, xs, routes):
                m.experts(x, ids_, w_)

        def shared():
            for m, x in zip(moes, xs):
                m.shared_experts(x)

        n = len(moes)
        with torch.no_grad():
            set_backend(moes, "ref")
            loop_ms = eager_ms(whole, reps=10 if b <= 64 else 5) / n
            set_backend(moes, "fused")
            fused_eager_ms = eager_ms(whole) / n
            fused_graph_ms = graph_ms(whole) / n
            routed_ms = graph_ms(routed) / n
            shared_ms = graph_ms(shared) / n
        row = {"B": b, "touched_experts": touched, "floor_us": floor_bytes / HBM * 1e6,
               "routed_floor_us": routed_floor_bytes / HBM * 1e6,
               "loop_eager_us": loop_ms * 1e3, "fused_eager_us": fused_eager_ms * 1e3,
               "fused_graph_us": fused_graph_ms * 1e3, "routed_graph_us": routed_ms * 1e3,
               "shared_graph_us": shared_ms * 1e3,
               "layer_GBps": floor_bytes / (fused_graph_ms * 1e-3) / 1e9,
               "routed_GBps": routed_floor_bytes / (routed_ms * 1e-3) / 1e9,
               "fused_vs_fp32_rel": rel(fused, truth), "loop_vs_fp32_rel": rel(loop, truth)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---- phase 2: tile sweep (routed experts alone) -------------------------------------------------------------------

TILES = [(32, 128, 4, 4), (64, 128, 4, 3), (16, 256, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3),
         (64, 128, 8, 4)]


def sweep_phase(cfg, moes, batches, device, dtype, deadline: float) -> list[dict]:
    from kernels import fused_moe as fm

    h = cfg.hidden_size
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for b in batches:
        xs = [torch.randn(b, h, generator=gen, device=device).to(dtype) for _ in moes]
        with torch.no_grad():
            routes = [m.gate(x) for m, x in zip(moes, xs)]
        k = routes[0][0].shape[1]
        default = fm.default_config(b * k, cfg.num_local_experts, h, cfg.intermediate_size)
        aligns = [fm.moe_align(ids, cfg.num_local_experts, default.block_m) for ids, _ in routes]
        acts = [fm.launch_gate_up(x, m.experts.gate_up_proj, a, k, m.experts.alpha, m.experts.limit, default.gate_up)
                for m, x, a in zip(moes, xs, aligns)]
        result = {"B": b, "block_m": default.block_m, "gate_up": {}, "down": {}}
        for tile in TILES:
            if time.monotonic() > deadline:
                result["cut_short"] = True
                break
            t = fm.GemmTile(block_n=tile[0], block_k=tile[1], num_warps=tile[2], num_stages=tile[3])
            try:
                gu = graph_ms(lambda: [fm.launch_gate_up(x, m.experts.gate_up_proj, a, k, m.experts.alpha,
                                                         m.experts.limit, t, act)
                                       for m, x, a, act in zip(moes, xs, aligns, acts)]) / len(moes)
                dn = graph_ms(lambda: [fm.launch_down(act, m.experts.down_proj, w, a, t)
                                       for m, (_, w), a, act in zip(moes, routes, aligns, acts)]) / len(moes)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is reported
                result["gate_up"][str(tile)] = result["down"][str(tile)] = f"failed: {type(exc).__name__}"
                continue
            result["gate_up"][str(tile)] = gu * 1e3
            result["down"][str(tile)] = dn * 1e3
        for kind in ("gate_up", "down"):
            t = getattr(default, kind)
            result[f"default_{kind}"] = str((t.block_n, t.block_k, t.num_warps, t.num_stages))
        print(json.dumps(result), flush=True)
        rows.append(result)
    return rows


# ---- phase 3: the model's decode step -----------------------------------------------------------------------------

def model_floor_bytes(model, cfg, b: int, context: int) -> float:
    """Weights read once (no embedding table: only B rows of it), experts touched at uniform routing, and KV."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    expert_params = 3 * cfg.intermediate_size * cfg.hidden_size
    total = 0
    for name, p in model.named_parameters():
        if "experts.gate_up_proj" in name or "experts.down_proj" in name or "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    total += b * cfg.hidden_size * 2
    touched = e * (1 - (1 - k / e) ** b)
    total += len(cfg.moe_layers) * touched * expert_params * 2
    kv_tok = cfg.num_key_value_heads * cfg.head_dim * 2 * 2  # K and V, bf16
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_sparse(layer):
            total += b * (context * cfg.index_head_dim * 2 + min(context, 16 * 128) * kv_tok)
        else:
            total += b * context * kv_tok
    return total


def model_phase(cfg, model, moes, batches, context: int, device, dtype) -> list[dict]:
    from msa.kv_cache import KVCache
    from msa.metadata import ChunkSpec, build_metadata

    ps = cfg.page_size
    rows = []
    for b in batches:
        per_req = -(-(context + 1) // ps)
        kv = KVCache.allocate(cfg, b * per_req, device=device, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(2)
        for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        tables = [list(range(r * per_req, (r + 1) * per_req))[::-1] for r in range(b)]
        meta = build_metadata([ChunkSpec(t, context, 1, True) for t in tables], ps, device)
        ids = torch.randint(0, cfg.vocab_size, (b,), device=device, generator=gen)

        def step():
            return model.compute_logits(model(ids, meta, kv)[meta.logits_indices])

        row = {"B": b, "context": context, "floor_ms": model_floor_bytes(model, cfg, b, context) / HBM * 1e3,
               "perf_md_floor_ms": PERF_FLOOR_MS.get(b)}
        with torch.no_grad():
            set_backend(moes, "ref")
            loop_logits = step()
            row["loop_eager_ms"] = eager_ms(step, reps=8)
            set_backend(moes, "fused")
            fused_logits = step()
            row["fused_eager_ms"] = eager_ms(step, reps=8)
            row["fused_vs_loop_logits_rel"] = rel(fused_logits, loop_logits)
            row["argmax_agreement"] = (fused_logits.argmax(-1) == loop_logits.argmax(-1)).float().mean().item()
            try:
                row["fused_graph_ms"] = graph_ms(step, replays=10)
            except Exception as exc:  # noqa: BLE001 - report why the step is not capturable
                row["fused_graph_ms"] = None
                row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                sync()
        print(json.dumps(row), flush=True)
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# ---- driver -----------------------------------------------------------------------------------------------------

def save(args, result) -> None:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
            json.dump(result, f, indent=1)


def print_tables(result) -> None:
    print("\n== one MoE layer (us per layer; graph = CUDA graph replay; floor = touched experts + shared at 4.3 TB/s)")
    print(f"{'B':>4} {'experts':>7} {'floor':>7} {'loop':>8} {'fused':>7} {'graph':>7} {'routed':>7} "
          f"{'shared':>7} {'GB/s':>6} {'floor/graph':>11} {'speedup':>7} {'err fused/loop':>15}")
    for r in result.get("layer", []):
        print(f"{r['B']:>4} {r['touched_experts']:>7.1f} {r['floor_us']:>7.0f} {r['loop_eager_us']:>8.0f} "
              f"{r['fused_eager_us']:>7.0f} {r['fused_graph_us']:>7.0f} {r['routed_graph_us']:>7.0f} "
              f"{r['shared_graph_us']:>7.0f} {r['layer_GBps']:>6.0f} {r['floor_us'] / r['fused_graph_us']:>11.2f} "
              f"{r['loop_eager_us'] / r['fused_graph_us']:>7.1f} "
              f"{r['fused_vs_fp32_rel']:.1e}/{r['loop_vs_fp32_rel']:.1e}")
    for s in result.get("sweep", []):
        best = {kind: min(((v, t) for t, v in s[kind].items() if isinstance(v, float)), default=(None, None))
                for kind in ("gate_up", "down")}
        print(f"sweep B={s['B']} bm={s['block_m']}: gate_up default {s['default_gate_up']} "
              f"{s['gate_up'].get(s['default_gate_up'])} best {best['gate_up']}; down default {s['default_down']} "
              f"{s['down'].get(s['default_down'])} best {best['down']}")
    print("\n== m3-slice decode step (ms; forward + LM head)")
    print(f"{'B':>4} {'floor':>6} {'PERF':>5} {'loop':>7} {'fused':>7} {'graph':>7} {'floor/best':>10} "
          f"{'logit rel':>9}")
    for r in result.get("model", []):
        best = min(x for x in (r["fused_eager_ms"], r["fused_graph_ms"]) if x is not None)
        g = f"{r['fused_graph_ms']:>7.2f}" if r["fused_graph_ms"] is not None else f"{'fail':>7}"
        print(f"{r['B']:>4} {r['floor_ms']:>6.2f} {r['perf_md_floor_ms'] or 0:>5.2f} {r['loop_eager_ms']:>7.2f} "
              f"{r['fused_eager_ms']:>7.2f} {g} {r['floor_ms'] / best:>10.2f} {r['fused_vs_loop_logits_rel']:>9.1e}")
        if "graph_error" in r:
            print("   graph capture failed:", r["graph_error"])
    for f in result.get("failures", []):
        print("FAILED", f)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    start = time.monotonic()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    FUSED["backend"] = "triton" if args.device == "cpu" else None
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {"meta": {"device": name, "torch": torch.__version__, "model": "tiny" if args.tiny else "m3-slice",
                       "triton": __import__("triton").__version__, "hbm_Bps": HBM}, "failures": []}
    t0 = time.monotonic()
    cfg, model, moes = build(args, device)
    sync()
    result["meta"].update({"build_s": time.monotonic() - t0, "num_local_experts": cfg.num_local_experts,
                           "gpu_mem_GB": torch.cuda.memory_allocated() / 1e9 if args.device == "cuda" else 0})
    print(json.dumps(result["meta"]), flush=True)
    dt = args.dtype
    phases = [("layer", lambda: layer_phase(cfg, moes, args.batches, device, dt)),
              ("model", lambda: model_phase(cfg, model, moes, args.model_batches, args.context, device, dt)),
              ("sweep", lambda: sweep_phase(cfg, moes, args.batches, device, dt, start + args.budget_s))]
    for name, run in phases:
        if name not in args.phases:
            continue
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 - keep the other phases' results
            traceback.print_exc()
            result["failures"].append(f"{name}: {type(exc).__name__}: {exc}")
            set_backend(moes, "fused")
        result["meta"]["elapsed_s"] = time.monotonic() - start
        save(args, result)
        print_tables(result)  # after every phase: a run cut short by its time limit still shows its tables
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
