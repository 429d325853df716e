"""Per-token cost of the Serve streaming path, on CPU, at GPU-like token rates.

The engine's forward is replaced by `PacedExecutor`: each step sleeps `--step-ms` (the GPU's forward: the GIL is
released, no CPU used) and picks token ids by a fixed rule; everything else is real (scheduler, detokenizer,
AsyncEngine, EngineServer, Router, Ingress, Serve's HTTP proxy, SSE, the benchmark client of
bench_serving_pd.py). So 16 streams at 5 ms steps push ~3k tokens/s through the path, as the H200 does, and
what the Serve path costs per token shows up here on two CPU cores.

Per mode (serve: HTTP -> Ingress -> Router -> EngineServer; inproc: the same engine driven by AsyncEngine in
this process, bench_serving_pd's in-process client) it reports the client's TPOT/ITL and tokens per chunk, the
engine's step p50, and per process the CPU it burnt during the measured run: ms of CPU per 1k output tokens and
% of one core (a process near 100% is the stage that saturates on a machine with a core per process).
`--py-spy SECONDS` also samples every Serve process (py-spy record, raw folded stacks) during the measured
run and prints each one's top frames.

  python benchmarks/bench_serve_stream.py                       # 16 streams x 64 tokens, 5 ms steps
  python benchmarks/bench_serve_stream.py --concurrency 32 --step-ms 3 --py-spy 4
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving_pd as pd  # noqa: E402  (sets Ray's loopback/no-usage env before ray is imported)
from serving_drivers import http_driver, inproc_driver  # noqa: E402
import serving_trace  # noqa: E402

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

APP = "stream_bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class PacedExecutor:
    """An executor without a model: a step sleeps `step_s` (a GPU forward's wall time, no CPU) and samples
    token id 3 + (seq_id * 7 + its sample count) % (vocab - 3), with a one-entry logprob dict when asked."""

    def __init__(self, *, page_size: int, num_pages: int, vocab_size: int, step_s: float) -> None:
        self.page_size, self.num_pages, self.vocab, self.step_s = page_size, num_pages, vocab_size, step_s
        self._count: collections.Counter = collections.Counter()  # samples drawn per sequence

    def info(self) -> dict:
        return {"num_pages": self.num_pages, "page_size": self.page_size, "dtype": "float32", "device": "cpu",
                "kv_bytes": 0, "rank": 0, "tp_rank": 0, "dp_rank": 0, "ep_rank": 0, "cuda_graph_sizes": [],
                "cuda_graph_capture_s": None}

    def execute(self, batch):
        from workers.runner import StepResult

        if batch.chunks:
            time.sleep(self.step_s)
        for sid in batch.released_seq_ids:
            self._count.pop(sid, None)
        tokens = []
        for r in batch.rows:
            tokens.append(3 + (r.seq_id * 7 + self._count[r.seq_id]) % (self.vocab - 3))
            self._count[r.seq_id] += 1
        lps = [None if r.params.logprobs is None else {t: -1.0} for r, t in zip(batch.rows, tokens)]
        return StepResult(token_ids=tokens, logprobs=lps, forward_time=self.step_s if batch.chunks else 0.0,
                          sample_time=0.0, prompt_logprobs=[[] for _ in batch.prompt_logprob_chunks])

    def shutdown(self) -> None:
        pass


def paced_engine(model_dir: str, engine_config, step_s: float):
    from msa.config import load_config
    from workers.engine import Engine

    cfg = load_config(model_dir)
    executor = PacedExecutor(page_size=cfg.index_block_size, num_pages=engine_config.num_pages or 4096,
                             vocab_size=cfg.vocab_size, step_s=step_s)
    return Engine(model_dir, engine_config=engine_config, device="cpu", executor=executor)


def serve_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": None, "device": "cpu",
            "engine": {"max_model_len": 1024, "max_num_seqs": max(64, 2 * args.concurrency),
                       "max_num_batched_tokens": 2048, "max_waiting": 256, "num_pages": 4096},
            "unified": {"num_cpus_per_shard": 0.5}}


def build_paced_app(args: argparse.Namespace):
    """Ingress -> Router -> one EngineServer whose engine runs on `PacedExecutor` (the app of deploy/app.py with
    the model swapped out)."""
    from ray import serve

    from deploy.app import config_from_args, engine_options
    from deploy.ingress import Ingress, model_name_for
    from deploy.router import Router
    from deploy.server import EngineServer, resolve_model_dir

    step_s = args.step_ms / 1e3

    class PacedServer(EngineServer.func_or_class):
        def _load(self) -> None:
            try:
                from workers.async_engine import AsyncEngine

                self._engine = AsyncEngine(paced_engine(self._model_dir, self._config.engine, step_s))
                self._start_metrics()
                self._state, self._load_seconds = "ready", time.monotonic() - self._load_started
            except Exception as e:
                self._state, self._error = "failed", f"{type(e).__name__}: {e}"

    def actor(options: dict) -> dict:  # deploy/stream/chunks.py's replica knobs, unless --serve-threads default
        if args.serve_threads == "default":
            return options
        from deploy.stream.chunks import replica_actor_options

        return replica_actor_options(**options)

    config = config_from_args({"config": serve_config(args)})
    model_dir = str(resolve_model_dir(config))
    name = model_name_for(config, model_dir)
    engine_opts = engine_options(config, "unified", 0)
    engine_opts["ray_actor_options"] = actor(engine_opts["ray_actor_options"])
    engine = serve.deployment(PacedServer).options(**engine_opts).bind(config, model_dir, "unified", 0, name)
    router = Router.options(ray_actor_options=actor({"num_cpus": 0.1})).bind({"unified": [engine]}, config)
    ingress = Ingress.options(ray_actor_options=actor({"num_cpus": 0.1}))
    return ingress.bind(router, config, model_dir, name), model_dir


# -- CPU accounting -----------------------------------------------------------------------------------------------
def serve_processes() -> dict[str, int]:
    """pid of each Serve process of the app and of this Ray instance's HTTP proxy or HAProxy (by process title;
    other Ray instances on the host, e.g. a test run, are not descendants of this process)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith(f"ray::ServeReplica:{APP}:"):
            out[title.split(":")[-1].split()[0].split(".")[0]] = int(d.name)  # "<name>.<method running>"
        elif title.startswith("ray::ProxyActor") and _descends_from(int(d.name), os.getpid()):
            out["ProxyActor"] = int(d.name)
        elif title.endswith("/haproxy") and _descends_from(int(d.name), os.getpid()):  # --http-proxy haproxy
            out["HAProxy"] = int(d.name)
    return out


RAY_DIRECT_INGRESS_PORTS = range(30000, 31001)  # Serve's default HTTP port range for direct ingress replicas


def listening_port(pid: int, ports: range) -> int:
    """A TCP port in `ports` that process `pid` listens on (its sockets' inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        port = int(f[1].split(":")[1], 16)
        if f[3] == "0A" and f[9] in inodes and port in ports:  # 0A: LISTEN
            return port
    raise RuntimeError(f"process {pid} listens on no port in {ports.start}-{ports.stop - 1}")


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process so far (all threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t = os.times()
    snap["client"] = t.user + t.system
    return snap


def cpu_report(before: dict, after: dict, seconds: float, tokens: int) -> dict[str, dict]:
    return {name: {"ms_per_1k_tokens": round(1e6 * (after[name] - before[name]) / max(1, tokens), 1),
                   "core_pct": round(100 * (after[name] - before[name]) / seconds, 1)}
            for name in before}


# -- py-spy -------------------------------------------------------------------------------------------------------
def start_py_spy(pids: dict[str, int], seconds: float, out_dir: str) -> list[tuple[str, subprocess.Popen, str]]:
    exe = Path(sys.executable).with_name("py-spy")
    procs = []
    for name, pid in pids.items():
        path = os.path.join(out_dir, f"{name}.folded")
        cmd = [str(exe), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
               "--format", "raw", "--nonblocking", "--threads", "-o", path]
        procs.append((name, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
    return procs


def top_frames(path: str, n: int = 12) -> list[tuple[str, float]]:
    """Share of samples whose stack passes through each (file:function) frame, idle waits excluded."""
    counts: collections.Counter = collections.Counter()
    total = 0
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        stack, _, num = line.rpartition(" ")
        k = int(num)
        frames = stack.split(";")
        if any(w in frames[-1] for w in ("select", "epoll", "wait (threading", "_wait_for_tstate_lock",
                                         "sleep", "poll (")):
            continue  # blocked, not burning CPU
        total += k
        for f in set(frames[1:]):
            counts[f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if "/" in f else f] += k
    return [(f, c / total) for f, c in counts.most_common(n)] if total else []


# -- the runs -----------------------------------------------------------------------------------------------------
def client_summary(run) -> dict[str, Any]:
    from deploy.bench import summarize

    s = summarize(run.short, run.duration, percentiles=[50.0, 90.0, 99.0])
    chunks = sum(len(r.chunk_times) for r in run.short)
    return {"tpot_p50_ms": round(s["median_tpot_ms"], 2), "tpot_p90_ms": round(s["p90_tpot_ms"], 2),
            "itl_p50_ms": round(s["median_itl_ms"], 2), "ttft_p50_ms": round(s["median_ttft_ms"], 2),
            "tokens": s["total_output_tokens"], "failed": s["failed"],
            "tokens_per_chunk": round(s["total_output_tokens"] / max(1, chunks), 2),
            "tok_per_s": round(s["output_throughput"]), "duration_s": round(run.duration, 2)}


def ttft_split(run, timeline: dict) -> dict[str, float]:
    """p50 (ms) of where each request's first token spent its time: client send -> the engine server's generate
    call (Serve hops in) -> start of the engine step that sampled it (queueing, admission) -> that step's end ->
    the server's yield (serve mark) -> arrival at the client."""
    first_step: dict[str, tuple[float, float]] = {}
    for s in timeline.get("steps", []):
        for rid, n in s[-1]:
            if n >= 1 and rid not in first_step:
                first_step[rid] = (s[0], s[1])
    marks: dict[str, float] = {}
    arrive: dict[str, float] = {}
    for t, rid, kind, _ in timeline.get("serve_marks", []):
        if kind == "chunk" and rid not in marks:
            marks[rid] = t
        elif kind == "arrive":
            arrive[rid] = t
    parts: dict[str, list[float]] = collections.defaultdict(list)
    wall = lambda t: run.wall0 + (t - run.perf0)  # noqa: E731  (client perf_counter -> wall clock)
    for r in run.short:
        rid = r.request_id
        if not r.chunk_times or rid not in first_step:
            continue
        start, end = first_step[rid]
        if rid in arrive:
            parts["to_server"].append(arrive[rid] - wall(r.start))
            parts["server_to_step"].append(start - arrive[rid])
        else:
            parts["to_step"].append(start - wall(r.start))
        parts["step"].append(end - start)
        if rid in marks:
            parts["to_server_yield"].append(marks[rid] - end)
            parts["to_client"].append(wall(r.chunk_times[0]) - marks[rid])
        else:  # in-process: the consumer is the client
            parts["to_client"].append(wall(r.chunk_times[0]) - end)
    return {k: round(1e3 * sorted(v)[len(v) // 2], 2) for k, v in parts.items() if v}


def step_p50(timeline: dict) -> float | None:
    steps = sorted(s[1] - s[0] for s in timeline.get("steps", []) if s[3] > 0 and s[2] == 0)
    return round(1e3 * steps[len(steps) // 2], 2) if steps else None


def measure(args, drive, timelines, pids: dict[str, int] | None) -> dict[str, Any]:
    from deploy.bench import make_requests

    warm = make_requests(num_prompts=args.concurrency, input_len=args.input_len, output_len=8, seed=1)
    asyncio.run(drive(warm, [], [], 60.0))
    reqs = make_requests(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                         seed=2)
    spies = []
    if pids and args.py_spy:
        spies = start_py_spy(pids, args.py_spy, args.spy_dir)
        time.sleep(0.5)  # py-spy attaches
    before, wall0, t0 = cpu_snapshot(pids or {}), time.time(), time.perf_counter()
    run = asyncio.run(drive(reqs, [], [], 120.0))
    seconds = time.perf_counter() - t0
    out = client_summary(run)
    out["cpu"] = cpu_report(before, cpu_snapshot(pids or {}), seconds, out["tokens"])
    timeline = next(iter(timelines(wall0).values()))
    out["engine_step_p50_ms"] = step_p50(timeline)
    replica = serving_trace.Replica(timeline, wall0)
    dur = [s["end"] - s["start"] for s in replica.steps if s["prefill_tokens"] == 0]
    out["decode_step_ms"] = serving_trace.dist_ms(dur)  # slow steps: beside a collection? (gc)
    out["gc"] = serving_trace.gc_summary(replica)
    out["ttft_split_p50_ms"] = ttft_split(run, timeline)
    for name, proc, path in spies:
        proc.wait()
        out.setdefault("py_spy", {})[name] = [(f, round(share, 3)) for f, share in top_frames(path)]
    return out


def run_serve(args) -> dict[str, Any]:
    import ray
    from ray import serve

    # Serve reads its knobs when a process imports it: set here (after this driver imported it with the
    # defaults, which its synchronous handle calls need), they reach only the Ray processes started below.
    from deploy.http_front import local_ray_env, make_state_dir, resolve_proxy

    state_dir = make_state_dir()
    args.http_proxy = resolve_proxy(args.http_proxy, joining=False)
    os.environ.update(local_ray_env(args.http_proxy, state_dir))
    for item in args.serve_env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    ray.init(address="local", num_cpus=4, object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        port = pd.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        app, _ = build_paced_app(args)
        serve.run(app, name=APP, route_prefix="/", logging_config={"enable_access_log": False})
        router = serve.get_deployment_handle("Router", app_name=APP)
        state = pd.wait_ready(router, 120)
        if not state["ready"]:
            raise RuntimeError(f"not ready: {state}")
        server = serve.get_deployment_handle("EngineServer-unified-0", app_name=APP)
        timelines = lambda since: {"unified": server.debug_timeline.remote(since).result(timeout_s=30)}  # noqa
        pids = serve_processes()
        if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" and os.environ.get(
                "RAY_SERVE_ENABLE_HA_PROXY") != "1":  # the ingress replica serves HTTP itself; no HAProxy before it
            port = listening_port(pids["Ingress"], RAY_DIRECT_INGRESS_PORTS)
        return measure(args, http_driver(f"http://127.0.0.1:{port}", args.concurrency), timelines, pids)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(state_dir, ignore_errors=True)


def run_inproc(args) -> dict[str, Any]:
    from deploy.app import config_from_args
    from deploy.server import resolve_model_dir
    from workers.async_engine import AsyncEngine

    config = config_from_args({"config": serve_config(args)})
    engine = AsyncEngine(paced_engine(str(resolve_model_dir(config)), config.engine, args.step_ms / 1e3))
    try:
        return measure(args, inproc_driver(engine, args.concurrency),
                       lambda since: {"inproc": engine.debug_timeline(since)}, None)
    finally:
        engine.shutdown()


def format_result(args, res: dict) -> str:
    lines = [f"{args.concurrency} streams x {args.output_len} tokens ({args.num_prompts} requests), "
             f"{args.step_ms} ms paced steps, HTTP front {args.http_proxy}"]
    for mode, r in res.items():
        lines.append(f"[{mode}] TPOT p50/p90 {r['tpot_p50_ms']}/{r['tpot_p90_ms']} ms, ITL p50 {r['itl_p50_ms']}, "
                     f"TTFT p50 {r['ttft_p50_ms']}, step p50 {r['engine_step_p50_ms']} ms, "
                     f"{r['tok_per_s']} tok/s, {r['tokens_per_chunk']} tok/chunk, failed {r['failed']}")
        st, gcs = r.get("decode_step_ms") or {}, r.get("gc")
        lines.append(f"    decode steps p99/max {st.get('p99')}/{st.get('max')} ms" + ("" if not gcs else (
            f"; gc: {gcs['n']} collections ({gcs['gen2']} full), max {gcs['max_ms']:.1f} ms, steps over 10 ms "
            f"{gcs['slow_steps']}, {gcs['slow_with_gc']} beside a collection, {gcs.get('slow_with_tick')} beside a "
            f"metrics tick (max {gcs.get('tick_max_ms', 0):.1f} ms, CPU max {gcs.get('tick_cpu_max_ms', 0):.1f})")))
        lines.append("    TTFT split p50 (ms): " + ", ".join(f"{k} {v}" for k, v in r["ttft_split_p50_ms"].items()))
        lines.append("    CPU ms per 1k tokens (% of a core): " + ", ".join(
            f"{n} {c['ms_per_1k_tokens']} ({c['core_pct']}%)" for n, c in r["cpu"].items()))
        for name, frames in r.get("py_spy", {}).items():
            lines.append(f"    py-spy {name}: " + "; ".join(f"{f} {100 * s:.0f}%" for f, s in frames[:8]))
    if "serve" in res and "inproc" in res:
        a, b = res["serve"]["tpot_p50_ms"], res["inproc"]["tpot_p50_ms"]
        lines.append(f"Serve vs inproc TPOT p50: {a} vs {b} ms ({100 * (a / b - 1):+.0f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="serve,inproc")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--py-spy", type=float, default=0.0, help="seconds of py-spy sampling of each Serve process")
    p.add_argument("--http-proxy", choices=("auto", "serve", "haproxy"), default="auto",
                   help="what answers the HTTP port (deploy/http_front.py), as `m3serve serve --http-proxy` sets it "
                        "(auto, its default: HAProxy where it is installed)")
    p.add_argument("--serve-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="environment of the Ray processes only (Serve knobs, e.g. "
                        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0)")
    p.add_argument("--serve-threads", choices=("app", "default"), default="app",
                   help="app: the replicas run user code on Serve's loop (deploy/stream/chunks.REPLICA_ENV_VARS); "
                        "default: Serve's default (user code on a thread of its own)")
    p.add_argument("--out", default=None, help="result JSON")
    args = p.parse_args(argv)
    args.spy_dir = tempfile.mkdtemp(prefix="bench_serve_stream.")
    res = {}
    for mode in args.modes.split(","):
        res[mode] = run_serve(args) if mode == "serve" else run_inproc(args)
    print(format_result(args, res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "modes": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
