"""Serve configuration: what `m3serve serve`, `serve deploy` files and the Helm chart all describe.

One shape for every entry point: the CLI builds it from flags (+ `--config FILE`), a Ray Serve config file passes
it as `args` of `deploy.app:build_app`, and the Helm chart renders it into `serveConfigV2`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from deploy.http_front import HttpProxy
from workers.config import EngineConfig, ParallelConfig, Role
from workers.configio import ConfigError, from_dict, read_yaml
from workers.kv.config import TransferConfig  # the one transfer config: engines and router read it as it is

__all__ = ["GroupConfig", "TransferConfig", "HttpConfig", "ServeConfig", "load_serve_config", "ConfigError", "Role"]


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """One role's engine replicas: each replica is one model instance with `tp * dp` shards."""

    replicas: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1
    num_cpus_per_shard: float = 0.5  # Ray CPU resource per ShardWorker (CPU device); GPUs take 1 GPU each
    # this role's prompt tokens per step (chunk size), over `engine.max_num_batched_tokens`; None: the engine's.
    # A prefill-only group gains from larger chunks (fewer steps, taller GEMM tiles) and has no decode rows whose
    # latency a long step would hold up (docs/operations.md, "Chunk size").
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1 (or null), got {self.max_num_batched_tokens}")
        if self.num_cpus_per_shard < 0:
            raise ValueError("num_cpus_per_shard: must be >= 0")
        self.parallel  # validates tp/ep/dp

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, ep=self.ep, dp=self.dp)


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # what answers the port before the Ingress replicas: Serve's Python proxy, or HAProxy in front of the Ingress
    # replicas' own HTTP servers (deploy/http_front.py; a setting of the Ray cluster, see docs/operations.md);
    # auto: HAProxy on a local instance where its binary is installed, else Serve's proxy
    proxy: HttpProxy = "auto"


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The whole serving system. `model: null` serves the built-in tiny model (written on first use)."""

    model: str | None = None
    model_name: str | None = None  # name clients pass as `model`; default: the model directory's name
    device: Literal["cpu", "cuda"] = "cpu"
    api_key: str | None = None  # else env M3SERVE_API_KEY; None = no auth
    # the largest request body the ingress reads (413 past it); None = 16 bytes per token of max_model_len + 1 MiB
    max_request_bytes: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    disaggregate: bool = False
    unified: GroupConfig = field(default_factory=GroupConfig)
    prefill: GroupConfig = field(default_factory=GroupConfig)
    decode: GroupConfig = field(default_factory=GroupConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    ingress_replicas: int = 1
    router_replicas: int = 1
    # chat template variables for every chat request (e.g. {"enable_thinking": true}); a request's
    # `chat_template_kwargs` are merged over them
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # `m3serve serve` on SIGTERM/SIGINT: new requests get 503 + Retry-After and /health goes not ready at once;
    # requests in flight get this long to finish, the rest end with an error event (503 `shutting_down`)
    drain_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.drain_grace_s <= 3600:
            raise ValueError(f"drain_grace_s: must be in [0, 3600], got {self.drain_grace_s}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024 (or null), got {self.max_request_bytes}")

    def engine_for(self, role: Role) -> EngineConfig:
        """The engine settings of `role`'s replicas: `engine` with the group's own overrides applied."""
        group = self.groups()[role]
        if group.max_num_batched_tokens is None:
            return self.engine
        return replace(self.engine, max_num_batched_tokens=group.max_num_batched_tokens)

    def groups(self) -> dict[Role, GroupConfig]:
        """The engine groups this config runs, by role."""
        if self.disaggregate:
            return {"prefill": self.prefill, "decode": self.decode}
        return {"unified": self.unified}

    def engine_deployments(self) -> list[str]:
        """The engine deployments' names (one replica each; deploy/app.py deploys them, the router and the
        metrics endpoint address them)."""
        return [engine_deployment(role, i) for role, group in self.groups().items() for i in range(group.replicas)]


def engine_deployment(role: Role, index: int) -> str:
    return f"EngineServer-{role}-{index}"


def load_serve_config(source: str | Path | dict[str, Any] | None = None,
                      overrides: dict[str, Any] | None = None) -> ServeConfig:
    """A ServeConfig from a YAML path or a dict, with `overrides` (nested dicts) applied on top, strictly."""
    if source is None:
        data: dict[str, Any] = {}
        where = "<defaults>"
    elif isinstance(source, dict):
        data, where = dict(source), "<args>"
    else:
        where = str(source)
        data = read_yaml(source)
    merged = _merge(data, overrides or {})
    return from_dict(ServeConfig, merged, source=where)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
