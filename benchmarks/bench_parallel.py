"""Parallel forward benchmark: TP=2 and EP=2 (and attention-DP) against one device, on a random m3-slice model.

Each configuration runs in fresh processes (one per rank, NCCL on GPU / gloo on CPU, a free loopback port picked
here), builds its shard of the same random model directly on its device (no checkpoint on disk: every tensor is
drawn on the device from a per-key seed and narrowed by the parameter's weight loader, exactly as a checkpoint
load would narrow it), then:

  equality: 4 requests of different lengths prefilled in one step, then --eq-steps decode steps. The single
            device decodes greedily; every sharded run is fed the single device's tokens (teacher forcing, so
            one bf16 near-tie does not derail the rest) and its per-step logits and argmax are compared.
  timing:   decode steps at each batch size B (--batches) with every request at --context tokens of random KV;
            median over --reps after --warmup of forward + LM head, device-synchronised, on rank 0. With dp > 1
            the B requests are split over the dp ranks (B=1: one dp rank runs an empty batch).

Configurations (--configs): single (1 device), tp2 (tp=2), ep2 (tp=2 attention, experts split over 2 ranks with
all-to-all dispatch), ep2-allreduce (the gather + all-reduce dispatch), dp2-ep2 (attention-DP 2, experts over 2).

  PYTHONPATH=$PWD python benchmarks/bench_parallel.py                       # 2 GPUs, NCCL, m3-slice shapes
  PYTHONPATH=$PWD python benchmarks/bench_parallel.py --experts 64          # fewer experts (memory)
  PYTHONPATH=$PWD python benchmarks/bench_parallel.py --device cpu --tiny   # CPU smoke run (gloo, tiny model)
Writes $OUT/bench_parallel.json when OUT is set (or --out); prints a table last.
"""
from __future__ import annotations

import os

# NVLink multicast stays off on the lent machines (device KINDS.md); the children inherit these
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

CONFIGS = {  # name -> (tp, ep, dp, moe_dispatch)
    "single": (1, 1, 1, "alltoall"),
    # one device in fp32: the truth that sizes bf16's own rounding error (equality only, not timed)
    "single-fp32": (1, 1, 1, "alltoall"),
    "tp2": (2, 1, 1, "alltoall"),
    "ep2": (2, 2, 1, "alltoall"),
    "ep2-allreduce": (2, 2, 1, "allreduce"),
    "dp2-ep2": (1, 2, 2, "alltoall"),
}
EQ_PROMPTS = (300, 211, 129, 64)  # prompt lengths of the equality requests (full size); tiny uses a quarter


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny preset, fp32 (CPU smoke run)")
    p.add_argument("--configs", default="single,tp2,ep2,ep2-allreduce,dp2-ep2")
    p.add_argument("--experts", type=int, default=None, help="override num_local_experts (memory)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64; tiny 1,4)")
    p.add_argument("--context", type=int, default=None, help="tokens in the cache per request (default 2048)")
    p.add_argument("--eq-steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seed-sharded", type=int, default=None,
                   help="self-test: draw the sharded runs' weights from this seed (they must then be reported unequal)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench_parallel.json")
    a = p.parse_args(argv)
    a.configs = a.configs.split(",")
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown or "single" not in a.configs:
        p.error(f"--configs: unknown {unknown} (known: {list(CONFIGS)}); 'single' is the reference and required")
    a.configs = ["single"] + [c for c in a.configs if c != "single"]
    a.batches = [int(x) for x in (a.batches or ("1,4" if a.tiny else "1,16,64")).split(",")]
    a.context = a.context or (80 if a.tiny else 2048)
    a.reps = a.reps or (3 if a.tiny else 20)
    return a


def model_config(args):
    from msa.config import M3Config
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", "tiny" if args.tiny else "m3-slice"), M3Config)
    if args.experts:
        cfg = dataclasses.replace(cfg, num_local_experts=args.experts)
    return cfg, (torch.float32 if args.tiny else torch.bfloat16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one rank ---------------------------------------------------------------------------------------------------

def build_random_model(cfg, ctx, dtype, device, seed: int):
    """This rank's shard of the random model: each checkpoint tensor drawn whole on `device` from a per-key seed
    (same on every rank), then narrowed by its parameter's weight loader."""
    from msa.checkpoint import HUB_PREFIX, checkpoint_tensors
    from msa.model import M3ForCausalLM
    from msa.weights import load_plan

    model = M3ForCausalLM(cfg, ctx=ctx, dtype=dtype, device=device)
    plan = load_plan(model, "hub")
    params = dict(model.named_parameters())
    filled = set()
    gen = torch.Generator(device=device)
    for out in checkpoint_tensors(cfg, "hub", dtype=dtype):
        key = out.key[len(HUB_PREFIX):] if out.key.startswith(HUB_PREFIX) else None
        if key not in plan:
            continue  # vision / projector / MTP stand-ins
        gen.manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
        parts = [torch.randn(d.shape, generator=gen, device=device).mul_(d.std).add_(d.mean) for d in out.draws]
        full = torch.cat(parts).reshape(out.shape).to(out.dtype)
        name, shard = plan[key]
        params[name].weight_loader(params[name], full, shard)
        filled.add(key)
        del full, parts
    missing = set(plan) - filled
    if missing:
        raise RuntimeError(f"random model: no tensor drawn for {sorted(missing)[:5]}")
    return model.eval()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def equality_run(model, cfg, requests: list[int], prompts: list[list[int]], teacher, steps: int, device):
    """Prefill `requests` (indices into prompts) in one step, then `steps` decode steps. -> (logits [steps+1, b, V]
    fp32 on the host, greedy tokens [steps+1, b]). Decode inputs come from `teacher` [steps+1, all requests] when
    given, else from this run's own argmax."""
    from msa.kv_cache import KVCache
    from msa.metadata import ChunkSpec, build_metadata

    ps = cfg.page_size
    need = [-(-(len(prompts[r]) + steps + 1) // ps) for r in requests]
    kv = KVCache.allocate(cfg, max(1, sum(need)), device=device, dtype=model.dtype, ctx=model.ctx)
    tables, first = [], 0
    for n in need:
        tables.append(list(range(first, first + n))[::-1])
        first += n
    logits_steps, tokens_steps = [], []
    fed = None
    for step in range(steps + 1):
        if step == 0:
            chunks = [ChunkSpec(t, 0, len(prompts[r]), False) for r, t in zip(requests, tables)]
            ids = [tok for r in requests for tok in prompts[r]]
        else:
            chunks = [ChunkSpec(t, len(prompts[r]) + step - 1, 1, True) for r, t in zip(requests, tables)]
            ids = fed
        meta = build_metadata(chunks, ps, device)
        hidden = model(torch.tensor(ids, dtype=torch.int64, device=device), meta, kv)
        logits = model.compute_logits(hidden[meta.logits_indices])
        greedy = logits.argmax(-1).tolist()
        fed = [teacher[step][r] for r in requests] if teacher is not None else greedy
        logits_steps.append(logits.cpu())
        tokens_steps.append(greedy)
    return torch.stack(logits_steps) if requests else torch.empty(steps + 1, 0, cfg.vocab_size), tokens_steps


def decode_timing(model, cfg, ctx, batch: int, args, device) -> list[float]:
    """Seconds per decode step (forward + LM head) for this dp rank's share of `batch` requests at `--context`
    cached tokens each (random KV)."""
    from msa.kv_cache import KVCache
    from msa.metadata import ChunkSpec, build_metadata
    from msa.parallel import barrier

    share = [batch // ctx.dp_size + (1 if d < batch % ctx.dp_size else 0) for d in range(ctx.dp_size)]
    mine = share[ctx.dp_rank]
    ps = cfg.page_size
    steps = args.warmup + args.reps
    per_req = -(-(args.context + steps) // ps)
    kv = KVCache.allocate(cfg, max(1, mine * per_req), device=device, dtype=model.dtype, ctx=ctx)
    gen = torch.Generator(device=device).manual_seed(1)
    for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
        t.copy_(torch.randn(t.shape, generator=gen, device=device))
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(mine)]
    ids = torch.randint(0, cfg.vocab_size, (mine,), device=device)
    times = []
    for step in range(steps):
        meta = build_metadata([ChunkSpec(t, args.context + step, 1, True) for t in tables], ps, device)
        sync(device)
        barrier(ctx)
        t0 = time.perf_counter()
        hidden = model(ids, meta, kv)
        model.compute_logits(hidden[meta.logits_indices])
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def rank_main(args, name: str, rank: int, port: int, work: str) -> None:
    from msa.parallel import destroy_parallel, init_parallel

    tp, ep, dp, mode = CONFIGS[name]
    world = tp * dp
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        device = torch.device("cpu")
    backend = "nccl" if args.device == "cuda" else "gloo"
    ctx = init_parallel(rank, world, tp=tp, ep=ep, dp=dp, init_method=f"tcp://127.0.0.1:{port}", backend=backend,
                        moe_dispatch=mode, device=device, timeout_s=args.timeout)
    try:
        cfg, dtype = model_config(args)
        if name.endswith("-fp32"):
            dtype = torch.float32
        t0 = time.perf_counter()
        seed = args.seed if name == "single" or args.seed_sharded is None else args.seed_sharded
        model = build_random_model(cfg, ctx, dtype, device, seed)
        sync(device)
        build_s = time.perf_counter() - t0
        scale = 4 if args.tiny else 1
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, cfg.vocab_size, (n // scale,), generator=gen).tolist() for n in EQ_PROMPTS]
        teacher = None if name == "single" else torch.load(Path(work) / "single.dp0.pt")["tokens"]
        per = len(prompts) // dp
        requests = list(range(ctx.dp_rank * per, (ctx.dp_rank + 1) * per))
        logits, tokens = equality_run(model, cfg, requests, prompts, teacher, args.eq_steps, device)
        batches = [] if name.endswith("-fp32") else args.batches
        timing = {b: decode_timing(model, cfg, ctx, b, args, device) for b in batches}
        if ctx.tp_rank == 0:
            mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            torch.save({"requests": requests, "logits": logits, "tokens": tokens, "timing": timing,
                        "build_s": build_s, "max_memory_allocated": mem},
                       Path(work) / f"{name}.dp{ctx.dp_rank}.pt")
    finally:
        destroy_parallel(ctx)


def rank_process(args, name: str, rank: int, port: int, work: str) -> None:
    """A rank process's whole life: `rank_main`, then leave without the interpreter's teardown. A gloo thread
    still being joined there aborted a rank that had finished and written its results ("terminate called without
    an active exception", exit -6, a fresh-clone CI run in session 12; the same as tests/msa/test_model_parity.py's
    ranks). An error still exits 1 with its traceback."""
    import traceback

    code = 0
    try:
        rank_main(args, name, rank, port, work)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the driver ---------------------------------------------------------------------------------------------------

def run_config(args, name: str, work: str) -> None:
    tp, ep, dp, _ = CONFIGS[name]
    port = free_port()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=rank_process, args=(args, name, r, port, work)) for r in range(tp * dp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if alive or any(codes):
        raise RuntimeError(f"{name}: ranks exited {codes}" + (" (timed out)" if alive else ""))


def merge(name: str, work: str, dp: int) -> dict:
    """The dp ranks' results put back in request order."""
    parts = [torch.load(Path(work) / f"{name}.dp{d}.pt") for d in range(dp)]
    logits = torch.cat([p["logits"] for p in parts], dim=1)
    tokens = [sum((p["tokens"][s] for p in parts), []) for s in range(len(parts[0]["tokens"]))]
    return {"logits": logits, "tokens": tokens, "timing": parts[0]["timing"], "build_s": parts[0]["build_s"],
            "max_memory_allocated": parts[0]["max_memory_allocated"]}


def compare(got: dict, ref: dict) -> dict:
    diff = (got["logits"] - ref["logits"]).abs()
    scale = ref["logits"].abs().amax()
    agree = (got["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
    return {"max_abs_diff": diff.max().item(), "max_rel_diff": (diff.max() / scale).item(),
            "median_row_rel_diff": (diff.amax(-1) / scale).median().item(), "argmax_agreement": agree}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        need = max(CONFIGS[c][0] * CONFIGS[c][2] for c in args.configs)
        if torch.cuda.device_count() < need:
            print(f"needs {need} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    cfg, dtype = model_config(args)
    # bf16: a row's argmax may flip on a near-tie; the logits must stay within bf16 rounding of the reference
    tol = 1e-4 if dtype == torch.float32 else 0.03
    results, failures = {}, []
    with tempfile.TemporaryDirectory() as work:
        for name in args.configs:
            tp, ep, dp, _ = CONFIGS[name]
            try:
                run_config(args, name, work)
                results[name] = merge(name, work, dp)
            except Exception as e:  # noqa: BLE001 - report and continue with the other configurations
                failures.append(f"{name}: {e}")
                print(f"FAILED {failures[-1]}", file=sys.stderr)
                if name == "single":
                    break
    rows = []
    ref = results.get("single")
    truth = results.get("single-fp32")
    # With an fp32 truth, a sharded bf16 run is "equal" when it is as close to the truth as one bf16 device is
    # (bf16 rounding differs with the reduction order, so sharded and single bf16 differ by about that much).
    single_err = compare(ref, truth) if truth is not None and ref is not None else None
    for name, res in results.items():
        tp, ep, dp, mode = CONFIGS[name]
        eq = compare(res, ref) if name != "single" else None
        res_err = compare(res, truth) if truth is not None and not name.endswith("-fp32") else None
        if name in ("single", "single-fp32"):
            ok = True
        elif single_err is not None and dtype != torch.float32:
            ok = (res_err["median_row_rel_diff"] <= 2 * single_err["median_row_rel_diff"]
                  and res_err["argmax_agreement"] >= single_err["argmax_agreement"] - 0.1)
        else:
            ok = eq["max_rel_diff"] <= tol and eq["argmax_agreement"] >= (1.0 if tol < 1e-3 else 0.9)
        if not ok:
            failures.append(f"{name}: not equal to one device: {eq} (vs fp32: {res_err}, single vs fp32: "
                            f"{single_err})")
        rows.append({"config": name, "tp": tp, "ep": ep, "dp": dp, "moe_dispatch": mode, "equality": eq,
                     "vs_fp32": res_err,
                     "equal": ok, "build_s": res["build_s"], "max_memory_allocated": res["max_memory_allocated"],
                     "decode_ms": {str(b): statistics.median(t) * 1e3 for b, t in res["timing"].items()}})
    meta = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "model": "tiny" if args.tiny else "m3-slice",
            "num_local_experts": cfg.num_local_experts, "dtype": str(dtype), "context": args.context,
            "batches": args.batches, "reps": args.reps, "eq_steps": args.eq_steps, "rel_tolerance": tol}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_parallel.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "failures": failures}, f, indent=1)
    print(json.dumps(meta))
    head = f"{'config':<14} {'equal':<6} {'max rel':>9} {'argmax':>7} {'med/fp32':>9} {'arg/fp32':>8} " + " ".join(
        f"{'B=' + str(b) + ' ms':>10}" for b in args.batches)
    print(head)
    for r in rows:
        eq = r["equality"]
        print(f"{r['config']:<14} {str(r['equal']):<6} {(eq['max_rel_diff'] if eq else 0):>9.2e} "
              f"{(eq['argmax_agreement'] if eq else 1):>7.3f} "
              f"{(r['vs_fp32']['median_row_rel_diff'] if r['vs_fp32'] else 0):>9.2e} "
              f"{(r['vs_fp32']['argmax_agreement'] if r['vs_fp32'] else 1):>8.3f} "
              + " ".join(f"{r['decode_ms'].get(str(b), float('nan')):>10.2f}" for b in args.batches))
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
