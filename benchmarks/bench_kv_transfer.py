"""KV transfer benchmark: move the KV pages of one prompt between two GPUs (two processes, NCCL) with
workers.kv, next to the NCCL send/recv ceiling measured in the same run at the same sizes (PERF.md target:
>= 60% of the ceiling for an 8k-token prompt).

Shapes: configs/models/m3-slice.yaml (4 layers: K and V of 4 KV heads x 128 on every layer, index-K of dim 128
on the 3 sparse layers; page 128; bf16): 1.15 MB per page, 73.4 MB for 8k tokens. Random (never zero) pages,
shuffled page ids on both sides. The main process is the decode side (receiver, second device), a spawned child
the prefill side (sender, first device).

What is timed, on the sender, median of --reps after --warmup:
  ours:     KVSender.send(...) until the receiver's status says the pages landed (header down the pair's
            socket, one gather launch per chunk into staging, NCCL send/recv, one scatter launch per chunk into
            the receiver's pages, status back over NCCL): the round trip.
  one-way:  KVSender.send(...) called -> the receiver saw its pages written (what a decode engine waits for),
            next to the ceiling's one-way time (send posted -> the receiver saw the bytes on its device). The
            two processes' time.monotonic() is one clock (one host). The headline fraction is this one.
  split:    where ours goes, from the transfer's phase marks (time.monotonic is system-wide, so the two
            processes' marks compare): post = send() returning on the caller's thread (header put, gathers,
            sends and the status receive posted); header = send() -> the receiver holds the header (socket
            hop); payload = receiver: header -> pages written (receives, wire, scatters, stream settled);
            ack = pages written -> the sender read the status; wake = status read -> sender.wait() returned.
  modes:    "plain" as above; "announced" (what a prefill engine does, TransferConfig.announce): the header
            goes first (`KVSender.announce`), then the prefill's forward (stood in for by --forward-ms of
            sleep, the step's host sync included), and the clock starts at `send_many` with the pages ready:
            the receiver's receives were posted meanwhile, as the ceiling's are.
  ceiling:  one torch.distributed send of the whole payload as ONE message, then a 1-element ack back
            (the same round trip shape as ours, no gather/scatter, no control plane).
  ceiling@chunks: the same with the chunk sizes our plan uses (isolates the message-size effect).
  stream:   back-to-back sends of the payload then one ack (steady-state bandwidth, for reference).

  PYTHONPATH=$PWD python benchmarks/bench_kv_transfer.py                 # 2 GPUs, NCCL
  PYTHONPATH=$PWD python benchmarks/bench_kv_transfer.py --device cpu --tiny   # CPU smoke run (gloo)
Writes $OUT/bench_kv_transfer.json when OUT is set (or --out).
"""
from __future__ import annotations

import os

# NVLink multicast stays off on the lent machines (device KINDS.md); the child inherits these
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import kernels.page_copy as page_copy  # noqa: E402
from msa.config import M3Config  # noqa: E402
from msa.kv_cache import KVCache  # noqa: E402
from workers.configio import load_yaml, preset_path  # noqa: E402
from workers.kv.config import TransferConfig, TransferState  # noqa: E402
from workers.kv.receiver import KVReceiver  # noqa: E402
from workers.kv.routes import plan_routes  # noqa: E402
from workers.kv.sender import KVSender  # noqa: E402
from workers.kv.wire import plan_chunks  # noqa: E402
from workers.kv.transport import PairChannel  # noqa: E402

TARGET_FRACTION_8K = 0.60
PHASES = ("post", "header", "payload", "ack", "wake")


def phase_split(s_marks: dict, r_marks: dict, t_end: float) -> dict:
    """Seconds of each phase of one transfer from the sender's and the receiver's marks (see the docstring)."""
    return {"post": s_marks["posted"] - s_marks["called"], "header": r_marks["header"] - s_marks["called"],
            "payload": r_marks["landed"] - r_marks["header"], "ack": s_marks["acked"] - r_marks["landed"],
            "wake": t_end - s_marks["acked"]}


def timeline(s_marks: dict, r_marks: dict, t_end: float) -> dict:
    """Every mark of one transfer as seconds after the sender's send() call (s_ = sender, r_ = receiver)."""
    t0 = s_marks["t0"]
    out = {f"s_{k}": v - t0 for k, v in s_marks.items() if k != "t0"}
    out.update({f"r_{k}": v - t0 for k, v in r_marks.items()})
    out["s_wait_returned"] = t_end - t0
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--devices", default="0,1", help="sender,receiver CUDA device indices")
    p.add_argument("--tiny", action="store_true", help="tiny model shapes and sizes (CPU smoke run)")
    p.add_argument("--tokens", default=None, help="prompt lengths, comma separated (default 1024,8192,32768)")
    p.add_argument("--chunk-mib", default="64,256", help="staging chunk caps to try, MiB, comma separated")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--modes", default="plain,announced", help="plain and/or announced (see the docstring)")
    p.add_argument("--forward-ms", type=float, default=3.0, help="announced: the stand-in prefill forward")
    p.add_argument("--nccl", choices=["direct", "torch"], default="direct",
                   help="GPU data plane of both ours and the ceiling: our NCCL calls or ProcessGroupNCCL")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench_kv_transfer.json")
    a = p.parse_args(argv)
    a.tokens = [int(x) for x in (a.tokens or ("64,256,1024" if a.tiny else "1024,8192,32768")).split(",")]
    a.chunk_mib = [float(x) for x in a.chunk_mib.split(",")]
    a.reps = a.reps or (5 if a.tiny else 20)
    a.modes = a.modes.split(",")
    if not set(a.modes) <= {"plain", "announced"}:
        p.error(f"--modes: plain and/or announced, got {a.modes}")
    return a


def model_config(tiny: bool) -> tuple[M3Config, torch.dtype]:
    cfg = load_yaml(preset_path("models", "tiny" if tiny else "m3-slice"), M3Config)
    return cfg, (torch.float32 if tiny else torch.bfloat16)


def device_of(args, side: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(args.devices.split(",")[side]))


def random_cache(cfg: M3Config, num_pages: int, dtype, device, seed: int) -> KVCache:
    kv = KVCache.allocate(cfg, num_pages, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) + 0.01)
    return kv


def pages_digest(kv: KVCache, page_ids: list[int]) -> list[int]:
    """An exact, position-sensitive integer digest per (layer, family) of the listed pages (bitwise check)."""
    ids = torch.tensor(page_ids, device=kv.k[0].device)
    out = []
    for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
        words = t.index_select(0, ids).contiguous().view(torch.int16).reshape(-1).to(torch.int64)
        w = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
        out.append(int((words * w).sum().item()))
    return out


def backend_of(args, device) -> str:
    if device.type != "cuda":
        return "gloo"
    return "nccl" if args.nccl == "direct" else "torch-nccl"


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chunk_sizes(cfg: M3Config, dtype, num_pages: int, cap: int) -> list[int]:
    es = torch.empty((), dtype=dtype).element_size()
    kv_row = cfg.page_size * cfg.num_key_value_heads * cfg.head_dim * es
    rows = []
    for layer in range(cfg.num_hidden_layers):
        rows += [kv_row, kv_row] + ([cfg.page_size * cfg.index_head_dim * es] if cfg.is_sparse(layer) else [])
    chunks = plan_chunks(rows, num_pages, cap)
    return [c[-1].offset + (c[-1].page_hi - c[-1].page_lo) * rows[c[-1].piece] for c in chunks]


# ---- the raw ceiling: both sides run the same schedule ------------------------------------------------------
def ceiling_side(ch: PairChannel, sizes: list[int], reps: int, warmup: int, sending: bool, device,
                 stream_k: int = 0) -> dict:
    """Both sides run this schedule per rep: messages of `sizes` bytes one way, then a 1-element ack back.
    stream_k > 0: the message list repeated stream_k times before the ack (steady state).
    Returns the sender's median round trip ("rt", seconds) and, per timed rep, the monotonic time the sender
    posted the first message ("t_send") or the receiver saw the last one complete on its device ("t_recv"):
    t_recv - t_send is the one-way time (the sender waits 2 ms before each rep, untimed, so the receiver's
    receives are already posted, as a decode shard's are when a header arrives)."""
    bufs = [torch.ones(n, dtype=torch.uint8, device=device) for n in sizes]
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    times, stamps = [], []
    for rep in range(warmup + reps):
        sync(device)
        if sending:
            time.sleep(0.002)
        t0 = time.perf_counter()
        stamp = time.monotonic()
        deadline = stamp + 120
        works = []
        for _ in range(max(stream_k, 1)):
            works += [(ch.send(b) if sending else ch.recv(b)) for b in bufs]
        for w in works:
            ch.wait_work(w, deadline, "ceiling")
        if not sending:
            sync(device)
            stamp = time.monotonic()
        w = ch.recv(ack) if sending else ch.send(ack)
        ch.wait_work(w, deadline, "ceiling ack")
        sync(device)
        if rep >= warmup:
            times.append(time.perf_counter() - t0)
            stamps.append(stamp)
    return {"rt": statistics.median(times), "t_send" if sending else "t_recv": stamps}


def schedule(args, cfg, dtype) -> list[dict]:
    out = []
    for tokens in args.tokens:
        pages = math.ceil(tokens / cfg.page_size)
        for cap_mib in args.chunk_mib:
            cap = int(cap_mib * 2**20) if not args.tiny else max(int(cap_mib * 2**10), 1)  # tiny: KiB
            out.append({"tokens": tokens, "pages": pages, "cap": cap, "chunks": chunk_sizes(cfg, dtype, pages, cap)})
    return out


# ---- sender process -----------------------------------------------------------------------------------------
def sender_main(conn, addresses, argv) -> None:
    args = parse_args(argv)
    device = device_of(args, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg, dtype = model_config(args.tiny)
    backend = backend_of(args, device)
    plan = schedule(args, cfg, dtype)
    pool = 2 * max(p["pages"] for p in plan) + 8
    kv = random_cache(cfg, pool, dtype, device, seed=1)
    wire_timeout = 2 * args.timeout  # a channel outlives any one transfer (NCCL watchdog)
    ceil_ch = PairChannel.connect(addresses["ceiling"], backend=backend, device=device, timeout_s=wire_timeout)
    ceil_ch.open()
    sender = KVSender(kv, config=TransferConfig(timeout_s=args.timeout, nccl=args.nccl))
    route = plan_routes(cfg.num_key_value_heads, 1, 1)[0]
    sender.add_peer("d0", PairChannel.connect(addresses["kv"], backend=backend, device=device,
                                              timeout_s=wire_timeout), route)
    sender.wait_ready(args.timeout)
    gen = torch.Generator().manual_seed(2)
    while True:
        msg = conn.recv()
        if msg[0] == "ceiling":
            _, sizes, stream_k = msg
            conn.send(ceiling_side(ceil_ch, sizes, args.reps, args.warmup, True, device, stream_k))
        elif msg[0] == "transfer":
            _, rid, num_pages, cap, want_digest, mode = msg
            sender.config = dataclasses.replace(sender.config, max_chunk_bytes=cap)  # the header carries it
            ids = torch.randperm(pool, generator=gen)[:num_pages].tolist()
            sync(device)
            if mode == "announced":
                sender.announce([(rid, ids)])
                time.sleep(args.forward_ms / 1e3)  # the prefill step that writes the pages, then its host sync
            t0 = time.perf_counter()
            t0_mono = time.monotonic()
            sender.send_many([(rid, ids, {"first": 1})])
            res = sender.wait(rid, args.timeout)
            dt = time.perf_counter() - t0
            t_end = time.monotonic()
            sender.release(rid)
            fused = all(p.fused for w in sender._workers.values() for lay in w._layouts.values() for p in lay.plans)
            marks = dict(res.marks, t0=t0_mono)
            conn.send((res.state.value, res.reason, dt, res.num_bytes, pages_digest(kv, ids) if want_digest else None,
                       marks, t_end, fused))
        else:
            break
    sender.close()
    ceil_ch.close()


# ---- receiver (main) process --------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = device_of(args, 1)
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            print("needs two CUDA devices (or --device cpu)", file=sys.stderr)
            return 2
        torch.cuda.set_device(device)
    cfg, dtype = model_config(args.tiny)
    backend = backend_of(args, device)
    plan = schedule(args, cfg, dtype)
    pool = 2 * max(p["pages"] for p in plan) + 8
    kv = random_cache(cfg, pool, dtype, device, seed=3)  # overwritten by the transfers; random so stale != new
    ceil_ch = PairChannel.listen(backend=backend, device=device, timeout_s=2 * args.timeout)
    kv_ch = PairChannel.listen(backend=backend, device=device, timeout_s=2 * args.timeout)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=sender_main, args=(child, {"ceiling": ceil_ch.address, "kv": kv_ch.address}, argv), daemon=True)
    proc.start()
    receiver = KVReceiver(kv, config=TransferConfig(timeout_s=args.timeout, receive_timeout_s=2 * args.timeout,
                                                    nccl=args.nccl))
    receiver.add_peer("p0", kv_ch, plan_routes(cfg.num_key_value_heads, 1, 1)[0])
    ceil_ch.open()
    receiver.wait_ready(args.timeout)
    gen = torch.Generator().manual_seed(4)
    rows, failures = [], []

    def ceiling(sizes, stream_k=0):
        """(round trip, one-way) medians in seconds."""
        parent.send(("ceiling", sizes, stream_k))
        mine = ceiling_side(ceil_ch, sizes, args.reps, args.warmup, False, device, stream_k)
        theirs = parent.recv()
        return theirs["rt"], statistics.median(r - s for s, r in zip(theirs["t_send"], mine["t_recv"]))

    n = 0

    def run_item(item):
        """The ceilings of one size, then each mode's transfers (one row per mode)."""
        nonlocal n
        nbytes = sum(item["chunks"])
        one, one_way = ceiling([nbytes])
        chunked = ceiling(item["chunks"])[0] if len(item["chunks"]) > 1 else one
        stream = ceiling([nbytes], stream_k=4)[0] / 4
        for mode in args.modes:
            row = measure(item, mode, n)
            n += args.warmup + args.reps
            if row is not None:
                rows.append(dict(row, mode=mode, bytes=nbytes, ceiling_s=one, ceiling_gbps=nbytes / one / 1e9,
                                 fraction=one / row["ours_s"], ceiling_one_way_s=one_way,
                                 fraction_one_way=one_way / row["ours_one_way_s"],
                                 ceiling_chunked_gbps=nbytes / chunked / 1e9, stream_gbps=nbytes / stream / 1e9))

    def measure(item, mode, n):
        times, one_ways, recv_times, splits, timelines, fused = [], [], [], [], [], True
        nbytes = sum(item["chunks"])
        for rep in range(args.warmup + args.reps):
            rid = f"t{n}"
            n += 1
            ids = torch.randperm(pool, generator=gen)[:item["pages"]].tolist()
            receiver.prepare_receive(rid, ids)
            parent.send(("transfer", rid, item["pages"], item["cap"], rep == 0, mode))
            state, reason, dt, sent_bytes, digest, s_marks, t_end, fused_now = parent.recv()
            res = receiver.wait(rid, args.timeout)
            receiver.release(rid)
            if state != "done" or res.state is not TransferState.DONE:
                failures.append(f"{rid}: sender {state} ({reason}), receiver {res.state.value} ({res.reason})")
                break
            if digest is not None and digest != pages_digest(kv, ids):
                failures.append(f"{rid}: received pages differ from the sent ones")
            assert sent_bytes == nbytes, (sent_bytes, nbytes)
            if rep >= args.warmup:
                times.append(dt)
                one_ways.append(res.marks["landed"] - s_marks["t0"])
                recv_times.append(res.seconds)
                splits.append(phase_split(s_marks, res.marks, t_end))
                timelines.append(timeline(s_marks, res.marks, t_end))
                fused &= fused_now and all(p.fused for w in receiver._workers.values()
                                           for lay in w._layouts.values() for p in lay.plans)
        if not times:
            return None
        ours = statistics.median(times)
        return {"tokens": item["tokens"], "pages": item["pages"], "chunk_cap": item["cap"],
                "messages": len(item["chunks"]), "ours_s": ours, "ours_gbps": nbytes / ours / 1e9,
                "ours_one_way_s": statistics.median(one_ways),
                "timeline_ms": dict(sorted(((k, statistics.median(t[k] for t in timelines) * 1e3)
                                            for k in timelines[0]), key=lambda kv: kv[1])),
                "receiver_side_s": statistics.median(recv_times), "one_launch_per_chunk": fused,
                "split_s": {k: statistics.median(x[k] for x in splits) for k in PHASES}}

    for item in plan:
        run_item(item)
    parent.send(("stop",))
    proc.join(timeout=30)
    receiver.close()
    ceil_ch.close()

    split_lines = [f"{'mode':>9} {'tokens':>7} {'cap':>5} " + " ".join(f"{k + ' ms':>10}" for k in PHASES)
                   + "  copy"] + [
        f"{r['mode']:>9} {r['tokens']:>7} {r['chunk_cap'] / 2**(10 if args.tiny else 20):>5.0f} "
        + " ".join(f"{r['split_s'][k] * 1e3:>10.3f}" for k in PHASES)
        + ("  1 launch/chunk" if r["one_launch_per_chunk"] else "  torch per piece") for r in rows]
    unit = "KiB" if args.tiny else "MiB"
    header = (f"{'mode':>9} {'tokens':>7} {'pages':>5} {'MB':>8} {'cap ' + unit:>8} {'msgs':>4} {'ours ms':>8} {'ours GB/s':>9} "
              f"{'ceil GB/s':>9} {'of ceil':>7} {'1-way ms':>8} {'ceil 1-way':>10} {'of ceil':>7} {'ceil@chunks':>11} "
              f"{'stream':>7} {'recv ms':>8}")
    lines = [header] + [
        f"{r['mode']:>9} {r['tokens']:>7} {r['pages']:>5} {r['bytes'] / 1e6:>8.2f} {r['chunk_cap'] / 2**(10 if args.tiny else 20):>8.0f} "
        f"{r['messages']:>4} {r['ours_s'] * 1e3:>8.3f} {r['ours_gbps']:>9.2f} {r['ceiling_gbps']:>9.2f} "
        f"{r['fraction'] * 100:>6.0f}% {r['ours_one_way_s'] * 1e3:>8.3f} {r['ceiling_one_way_s'] * 1e3:>10.3f} "
        f"{r['fraction_one_way'] * 100:>6.0f}% {r['ceiling_chunked_gbps']:>11.2f} {r['stream_gbps']:>7.2f} "
        f"{r['receiver_side_s'] * 1e3:>8.3f}" for r in rows]
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": backend, "torch": torch.__version__, "model": "tiny" if args.tiny else "m3-slice",
            "dtype": str(dtype), "page_copy_triton_failure": page_copy.triton_failure, "reps": args.reps,
            "warmup": args.warmup, "forward_ms": args.forward_ms, "date": time.strftime("%Y-%m-%d %H:%M")}
    verdicts = []
    for mode in args.modes:
        at_8k = [r for r in rows if r["tokens"] == 8192 and r["mode"] == mode]
        if at_8k:
            verdicts.append(
                f"8k tokens, {mode}: best {max(r['fraction_one_way'] for r in at_8k) * 100:.0f}% of the NCCL ceiling "
                f"one-way (send() -> pages landed vs send -> received), "
                f"{max(r['fraction'] for r in at_8k) * 100:.0f}% round trip (-> sender saw the status vs -> ack) "
                f"(target {TARGET_FRACTION_8K * 100:.0f}%)")
    verdict = "\n".join(verdicts)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_kv_transfer.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "failures": failures}, f, indent=1)
    print(json.dumps(meta))
    for f_ in failures:
        print("FAILED", f_)
    if verdict:
        print(verdict)
    print("\n".join(lines))
    print("\nwhere ours goes (medians; post overlaps header):")
    print("\n".join(split_lines))
    print("\ntimeline of one transfer, ms after send() (medians; s_ sender, r_ receiver):")
    for r in rows:
        cap = r["chunk_cap"] / 2**(10 if args.tiny else 20)
        print(f"{r['mode']:>9} {r['tokens']:>7} {cap:>5.0f}  " + "  ".join(f"{k} {v:.3f}" for k, v in r["timeline_ms"].items()))
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
