"""`m3serve serve`: start (or join) Ray, deploy `build_app`, show loading progress, serve until SIGINT/SIGTERM.

Stopping drains first (docs/operations.md): new requests get 503 + Retry-After and /health goes not ready at once,
requests in flight get `drain_grace_s` to finish, the rest end with an error event; then Serve and Ray stop.

Without `--model` it serves the built-in tiny model (written into the cache on first use). `--config` takes a
serve YAML (`configs/serve/*.yaml` or any path); flags given explicitly override it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from deploy.http_front import HAPROXY_SWITCHES, HTTP_PROXIES, local_ray_env, make_state_dir, resolve_proxy

APP_NAME = "m3serve"
# A local cluster for one machine: the object store only carries small messages (token ids, deltas).
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default is None so "not given" is distinguishable: only given flags override --config.
    add = parser.add_argument
    add("--config", help="serve YAML (e.g. configs/serve/cpu-local.yaml); flags below override it")
    add("--model", help="checkpoint directory (default: the built-in tiny model)")
    add("--model-name", help="name clients pass as `model` (default: the directory name, or m3-tiny)")
    add("--device", choices=("cpu", "cuda"), help="where the engines run (default: cpu)")
    add("--host", help="HTTP host (default: 127.0.0.1)")
    add("--port", type=int, help="HTTP port (default: 8000)")
    add("--http-proxy", choices=HTTP_PROXIES,
        help="what answers the HTTP port: HAProxy in front of the Ingress replicas' own HTTP servers (haproxy; "
             "fewer hops) or Serve's Python proxy (serve); auto (default): haproxy on a local instance where its "
             "binary is installed, else serve (docs/operations.md)")
    add("--tp", type=int, help="tensor-parallel size of each engine replica")
    add("--ep", type=int, help="expert-parallel size of each engine replica")
    add("--dp", type=int, help="attention-data-parallel size of each engine replica")
    add("--replicas", type=int, help="engine replicas")
    add("--max-model-len", type=int, help="longest prompt + completion, in tokens")
    add("--max-num-seqs", type=int, help="requests batched together per engine")
    add("--max-waiting", type=int, help="waiting-queue bound per engine; beyond it the server answers 429")
    add("--enforce-eager", action="store_true", default=None,
        help="run every step eagerly: no CUDA graphs for decode steps (default: captured at startup on CUDA)")
    add("--drain-grace", type=float,
        help="seconds requests in flight may take to finish after SIGTERM/SIGINT (default: 30); the rest end "
             "with an error")
    add("--api-key", help="require this bearer token (else env M3SERVE_API_KEY; default: no auth)")
    add("--address", help="join this Ray cluster instead of starting a local one (e.g. auto, 10.0.0.1:6379)")
    add("--num-cpus", type=float, help="CPUs of the local Ray instance (default: all)")
    add("--metrics-port", type=int,
        help="Ray's metrics export port of the local instance (ray_m3serve_* of its replicas; default: random). "
             "The API port's /metrics serves every replica's series either way")
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    pd.add_argument("--disaggregate", action="store_true", default=None,
                    help="run prompts on prefill replicas and move their KV pages to decode replicas")
    for role in ("prefill", "decode"):
        pd.add_argument(f"--{role}-replicas", type=int, help=f"{role} engine replicas")
        for axis in ("tp", "ep", "dp"):
            pd.add_argument(f"--{role}-{axis}", type=int, help=f"{axis} size of each {role} replica")
    pd.add_argument("--transfer-timeout", type=float, help="seconds one KV transfer may take before it fails")
    pd.add_argument("--transfer-lease", type=float,
                    help="seconds after which pages held for a transfer that nobody settles are freed")
    pd.add_argument("--retry-prefill", action="store_true", default=None,
                    help="run the prefill once more when its KV transfer fails (instead of a 503)")
    pd.add_argument("--admit-wait", type=float,
                    help="seconds a request waits for a decode replica with room for its KV (else 503 at once)")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as nested ServeConfig overrides."""
    out: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        if value is None:
            return
        node = out
        *heads, last = path.split(".")
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = value

    put("model", args.model)
    put("model_name", args.model_name)
    put("device", args.device)
    put("api_key", args.api_key)
    put("drain_grace_s", getattr(args, "drain_grace", None))
    put("http.host", args.host)
    put("http.port", args.port)
    put("http.proxy", getattr(args, "http_proxy", None))
    put("unified.tp", args.tp)
    put("unified.ep", args.ep)
    put("unified.dp", args.dp)
    put("unified.replicas", args.replicas)
    put("engine.max_model_len", args.max_model_len)
    put("engine.max_num_seqs", args.max_num_seqs)
    put("engine.max_waiting", args.max_waiting)
    put("engine.enforce_eager", args.enforce_eager)
    put("disaggregate", getattr(args, "disaggregate", None))
    for role in ("prefill", "decode"):
        put(f"{role}.replicas", getattr(args, f"{role}_replicas", None))
        for axis in ("tp", "ep", "dp"):
            put(f"{role}.{axis}", getattr(args, f"{role}_{axis}", None))
    put("transfer.timeout_s", getattr(args, "transfer_timeout", None))
    put("transfer.lease_s", getattr(args, "transfer_lease", None))
    put("transfer.retry_prefill", getattr(args, "retry_prefill", None))
    put("transfer.admit_wait_s", getattr(args, "admit_wait", None))
    return out


def _say(msg: str) -> None:
    print(f"m3serve: {msg}", file=sys.stderr, flush=True)


def _start_ray(args: argparse.Namespace, host: str, proxy: str) -> str | None:
    """Start (or join) Ray with what `proxy` needs. Returns the directory made for HAProxy's files, if any."""
    import ray

    # No usage reports from a serving box; loopback-only clusters stay on 127.0.0.1 (see docs/operations.md).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    asked, proxy = proxy, resolve_proxy(proxy, joining=bool(args.address))
    if asked == "auto" and not args.address:
        _say(f"HTTP front: {'HAProxy' if proxy == 'haproxy' else 'Serve proxy (no HAProxy binary here)'}")
    if args.address:
        if proxy != "serve":
            _say(f"http.proxy {proxy}: a cluster you join has its Ray processes' environment already; it takes "
                 f"effect only if `ray start` ran with {' '.join(f'{k}={v}' for k, v in HAPROXY_SWITCHES.items())}"
                 " on every node (docs/operations.md)")
        ray.init(address=args.address, log_to_driver=False)
        return None
    if host in LOOPBACK:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray's processes read these when they start, from the environment they inherit from this one. This process
    # imported Serve already and keeps the defaults it read (its handle calls need no direct ingress).
    state_dir = make_state_dir() if proxy == "haproxy" else None
    for key, value in local_ray_env(proxy, state_dir).items():
        os.environ[key] = value if key in HAPROXY_SWITCHES else os.environ.get(key, value)
    extra = {} if args.metrics_port is None else {"_metrics_export_port": args.metrics_port}
    ray.init(address="local", num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False, **extra)
    return state_dir


def _wait_ready(router: Any, stop: threading.Event) -> dict:
    """Poll the engines' load state with a progress bar until all are ready, one failed, or we are stopped."""
    from tqdm import tqdm

    state = router.ready.remote().result()
    total = len(state["engines"])
    start = time.monotonic()
    with tqdm(total=total, desc="loading engines", unit="replica", file=sys.stderr,
              bar_format="{desc}: {n}/{total} {bar} {elapsed} {postfix}") as bar:
        while not stop.is_set():
            done = sum(e["ready"] for e in state["engines"])
            bar.n = done
            loading = [e for e in state["engines"] if not e["ready"]]
            bar.set_postfix_str(", ".join(f"{e['role']}-{e['replica']}: {e['state']}" for e in loading[:3]))
            bar.refresh()
            if state["ready"] or any(e["state"] in ("failed", "unreachable") for e in state["engines"]):
                break
            stop.wait(0.5)
            state = router.ready.remote().result()
    state["seconds"] = time.monotonic() - start
    return state


def usage_text(base: str, model: str, api_key: bool) -> str:
    key = "$M3SERVE_API_KEY" if api_key else "EMPTY"
    auth = f' -H "Authorization: Bearer {key}"' if api_key else ""
    return (
        f"serving '{model}' at {base}/v1 (health: {base}/health)\n"
        + ("  (export M3SERVE_API_KEY=<the key> for the examples below)\n" if api_key else "") +
        f"  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{key}'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}], "
        f"max_tokens=16).choices[0].message.content)\"\n"
        f"Ctrl-C stops the server."
    )


def metrics_text(base: str, host: str, args: argparse.Namespace) -> str:
    """Where to scrape: the API port's /metrics (every replica), and Ray's export port of this node."""
    import ray

    if args.address and args.metrics_port is not None:
        _say("--metrics-port is ignored with --address: the cluster's nodes chose their ports at `ray start`")
    try:
        ray_port = ray._private.worker.global_worker.node.metrics_export_port
    except Exception:  # Ray's internals moved: the API port is the documented place anyway
        ray_port = None
    ray_part = f"; Ray's export of this node: http://{host}:{ray_port}/metrics (ray_m3serve_*)" if ray_port else ""
    return f"metrics: {base}/metrics (every replica, vLLM names){ray_part}"


def run(args: argparse.Namespace) -> int:
    from deploy.app import build_app, config_from_args
    from deploy.config import ConfigError
    from deploy.ingress import model_name_for
    from deploy.server import resolve_model_dir

    build_args = {"config_file": args.config, "overrides": overrides_from_args(args)}
    try:
        config = config_from_args(build_args)
        if config.model is None:
            _say("preparing the built-in tiny model (written once into the cache)")
        model_dir = resolve_model_dir(config)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _say(f"error: {e}")
        return 2

    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum, _frame) -> None:
        if stop.is_set():  # a second Ctrl-C: give up waiting for a graceful shutdown
            raise KeyboardInterrupt
        _say(f"{signal.Signals(signum).name}: shutting down")
        stop.set()

    from ray import serve

    host, port = config.http.host, config.http.port
    # Ours from the start: a signal while Ray starts only sets `stop`, and we stop once it is up (before, a Ctrl-C
    # there was lost and the server came up anyway). Again after: `ray.init` sets its own SIGTERM handler.
    for sig in previous:
        signal.signal(sig, on_signal)
    code, state_dir, deployed = 0, None, False
    try:
        _say(f"starting Ray ({'joining ' + args.address if args.address else 'local instance'})")
        state_dir = _start_ray(args, host, config.http.proxy)
        for sig in previous:
            signal.signal(sig, on_signal)
        if stop.is_set():
            return 0
        serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
        _say(f"deploying {model_dir} on {config.device}")
        app = build_app(build_args)
        deployed = True
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config={"enable_access_log": False})
        router = serve.get_deployment_handle("Router", app_name=APP_NAME)
        state = _wait_ready(router, stop)
        if stop.is_set():
            return 0
        if not state["ready"]:
            bad = next(e for e in state["engines"] if not e["ready"])
            _say(f"error: engine {bad['role']}-{bad['replica']} {bad['state']}: {bad.get('error')}")
            return 1
        _say(f"ready in {state['seconds']:.1f} s")
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        api_key = config.api_key or os.environ.get("M3SERVE_API_KEY")
        print(usage_text(f"http://{shown_host}:{port}", model_name_for(config, model_dir), bool(api_key)),
              flush=True)
        _say(metrics_text(f"http://{shown_host}:{port}", shown_host, args))
        stop.wait()
        _drain(config)
    except KeyboardInterrupt:
        code = 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _shutdown(args, deployed)
        if state_dir is not None:
            shutil.rmtree(state_dir, ignore_errors=True)
    return code


def _drain(config: Any) -> None:
    """Drain every ingress replica (`Ingress.drain`). A handle call reaches one replica of Serve's choice, so a
    few per replica go out together and the distinct replicas that answered are counted."""
    from ray import serve

    ingress = serve.get_deployment_handle("Ingress", app_name=APP_NAME)
    grace = config.drain_grace_s
    _say(f"draining: no new requests; those in flight get {grace:g} s to finish (a second signal stops at once)")
    calls = [ingress.drain.remote(grace) for _ in range(2 * config.ingress_replicas)]
    answers = {}
    for call in calls:
        try:
            answer = call.result(timeout_s=grace + 30)
            answers[answer["replica"]] = answer
        except Exception as e:  # a replica gone already has nothing to drain
            _say(f"drain: {type(e).__name__}: {e}")
    ended = sum(a["ended"] for a in answers.values())
    finished = sum(a["open"] - a["ended"] for a in answers.values())
    _say(f"drained {len(answers)} of {config.ingress_replicas} ingress replica(s): {finished} request(s) finished, "
         f"{ended} ended with an error after the grace period")


def _shutdown(args: argparse.Namespace, deployed: bool) -> None:
    import ray
    from ray import serve

    try:
        if args.address:
            if deployed:  # a shared cluster: remove only our app, and only if we deployed it
                serve.delete(APP_NAME)
        else:
            serve.shutdown()
    except Exception as e:  # best effort; ray.shutdown below ends the local instance anyway
        _say(f"serve shutdown: {type(e).__name__}: {e}")
    ray.shutdown()
    _say("stopped")
