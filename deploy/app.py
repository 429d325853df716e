"""`build_app`: the one place that wires the deployments together.

Used by `m3serve serve`, by `serve run deploy.app:build_app ...`, by Ray Serve config files
(`import_path: deploy.app:build_app` with `args`) and by the Helm chart. `args` is
`{"config": {...ServeConfig fields...}}` and/or `{"config_file": "configs/serve/x.yaml"}`, plus optional
`{"overrides": {...}}` applied on top (nested keys merge).

Graph: Ingress (HTTP, tokenization) -> Router (replica choice) -> EngineServer-<role>-<i> (one deployment per
engine replica, so the router can address each one); MetricsHub, where the ingress and router replicas' series
meet for the API port's /metrics (deploy/metrics_hub.py). Roles: `unified`, or `prefill` + `decode` with
`disaggregate: true` (the router moves each request's KV from a prefill replica to a decode replica).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.serve import Application

from deploy.config import ConfigError, ServeConfig, engine_deployment, load_serve_config
from deploy.ingress import Ingress, model_name_for
from deploy.metrics_hub import HUB_NAME, HUB_NUM_CPUS, MetricsHub
from deploy.router import Router
from deploy.server import EngineServer, resolve_model_dir
from deploy.stream.chunks import replica_actor_options
from workers.configio import REPO_ROOT, read_yaml

ARG_KEYS = ("config", "config_file", "overrides")

# Ray resources of the light deployments; they mostly wait on I/O.
INGRESS_NUM_CPUS = 0.1
ROUTER_NUM_CPUS = 0.1


def config_from_args(args: dict[str, Any] | None) -> ServeConfig:
    """A ServeConfig from `build_app` args; unknown keys are an error naming them."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(ARG_KEYS))
    if unknown:
        raise ConfigError(f"build_app args: {unknown[0]}: unknown key (allowed: {', '.join(ARG_KEYS)})")
    data: dict[str, Any] = {}
    if args.get("config_file"):
        data = read_yaml(_find_config_file(args["config_file"]))
    # `config` on top of the file, then `overrides`: the CLI passes flags as overrides of a --config file.
    data = _deep_merge(data, args.get("config") or {})
    return load_serve_config(data, args.get("overrides") or {})


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _find_config_file(name: str | Path) -> Path:
    """A config path as given, else relative to the repository (Serve may build the app in another cwd)."""
    path = Path(name).expanduser()
    if path.is_file() or path.is_absolute():
        return path
    return REPO_ROOT / path


# How often Serve checks a stopping replica for requests still in flight before it lets it exit (its default: every
# 2 s, the first check after the first wait). On Ctrl-C / SIGTERM the ingress drain has ended them already
# (deploy/serve_cmd.py), so that wait was idle time: `m3serve serve` took 10.5 s to stop on 2 CPUs, 6.6 s at this.
SHUTDOWN_POLL_S = 0.2


def engine_options(config: ServeConfig, role: str, index: int) -> dict[str, Any]:
    group = config.groups()[role]
    actor: dict[str, Any] = {"num_cpus": group.num_cpus_per_shard}
    if config.device == "cuda" and group.parallel.world_size == 1:
        actor["num_gpus"] = 1  # a single-shard engine runs its model in the replica process itself
    # Let every request reach the engine, which answers 429 beyond its waiting bound (Serve would queue them).
    max_ongoing = config.engine.max_num_seqs + config.engine.max_waiting + 64
    return {"name": engine_deployment(role, index), "num_replicas": 1,
            "ray_actor_options": replica_actor_options(**actor), "max_ongoing_requests": max_ongoing,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S}


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application for `args` (see the module docstring). One parameter: Serve's application
    builders take the args alone."""
    return wire_app(args, engine_server=EngineServer, router=Router)


def wire_app(args: dict[str, Any] | None, *, engine_server, router, ingress=Ingress) -> Application:
    """`build_app` with the engine server, router and ingress deployments to bind (tests bind the drill
    deployments of deploy/testing.py; production binds `EngineServer`, `Router` and `Ingress`)."""
    config = config_from_args(args)
    model_dir = str(resolve_model_dir(config))
    model_name = model_name_for(config, model_dir)
    engines = {
        role: [engine_server.options(**engine_options(config, role, i)).bind(config, model_dir, role, i, model_name)
               for i in range(group.replicas)]
        for role, group in config.groups().items()
    }
    hub = MetricsHub.options(name=HUB_NAME, ray_actor_options={"num_cpus": HUB_NUM_CPUS},
                             graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S).bind()
    router_app = router.options(name="Router", num_replicas=config.router_replicas,
                                ray_actor_options=replica_actor_options(num_cpus=ROUTER_NUM_CPUS),
                                graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S).bind(
        engines, config, metrics_hub=hub, model_name=model_name)
    return ingress.options(name="Ingress", num_replicas=config.ingress_replicas,
                           ray_actor_options=replica_actor_options(num_cpus=INGRESS_NUM_CPUS),
                           graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S).bind(
        router_app, config, model_dir, model_name)
