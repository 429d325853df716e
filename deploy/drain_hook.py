"""`python -m deploy.drain_hook`: the Helm chart's preStop hook on a worker pod. Drains the pod's own ingress
replica(s) through `POST /admin/drain` (deploy/admin_drain.py) and returns when the drain is over, so that
`ray stop` (next in the hook) kills nothing that could still finish.

Two ways to reach this pod's replicas, tried in this order:
1. Direct: with Ray Serve's direct ingress (what `http.proxy: haproxy` turns on, docs/operations.md) every Ingress
   replica runs an HTTP server of its own on a port the Serve controller hands out per node from
   `RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`-`..._MAX_HTTP_PORT` (default 30000-31000). Nothing outside the
   controller lists those ports (`serve status` and the dashboard's replica details carry no port), so the hook
   looks for listeners in that range on this pod and asks each `GET /-/routes`, which a direct-ingress replica
   answers itself with `{route_prefix: app_name}` before any app code; each one serving this app's prefix gets
   one drain call. This is the way that works behind HAProxy: the API port there is HAProxy, which spreads calls
   over every Ingress replica of the cluster (`leastconn`), so calls sent to it may never reach this pod's.
2. Through the front (Serve's per-node proxy on `--port`), when no replica of the app listens in that range
   (Serve's proxy without direct ingress) or none of them drained: several calls at once (a pod may hold more than
   one ingress replica; the proxy prefers its node's replicas), up to ROUNDS rounds.

Every call names this pod's IP, so a replica elsewhere refuses (409) instead of draining; when every call was
refused, or nothing listens, there is nothing to drain here. The hook never fails the pod's termination: whatever
happens it prints what it saw and exits 0. Standard library only (it runs before anything else in the pod stops,
in whatever Python the image has).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

POD_IP_ENV = "M3SERVE_POD_IP"  # set by the chart from the pod's status.podIP
API_KEY_ENV = "M3SERVE_API_KEY"
ROUNDS = 3  # tries through the front when every call reached a replica on another node
# Ray's own settings (ray/serve/_private/constants.py): read from the pod's environment, which is `ray start`'s.
PORT_RANGE_ENV = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
PORT_RANGE_DEFAULT = (30000, 31000)
CONNECT_TIMEOUT_S = 0.5  # a local port: refused at once, or accepted at once
ROUTES_TIMEOUT_S = 5.0  # a replica busy with requests still answers /-/routes from its event loop
SCAN_THREADS = 64  # bounds the scan at ~(range / 64) x CONNECT_TIMEOUT_S even if connects hang (a dropping firewall)


def say(msg: str) -> None:
    print(f"m3serve drain hook: {msg}", file=sys.stderr, flush=True)


def pod_ip() -> str:
    return os.environ.get(POD_IP_ENV) or socket.gethostbyname(socket.gethostname())


def port_range() -> tuple[int, int]:
    """The direct-ingress HTTP port range of this node (inclusive), as Ray reads it."""
    try:
        low, high = (int(os.environ.get(k, d)) for k, d in zip(PORT_RANGE_ENV, PORT_RANGE_DEFAULT))
    except ValueError:
        return PORT_RANGE_DEFAULT
    return (low, high) if 0 < low <= high < 65536 else PORT_RANGE_DEFAULT


def _norm_prefix(prefix: str) -> str:
    return "/" + prefix.strip("/") if prefix.strip("/") else "/"


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def _routes(host: str, port: int) -> tuple[int, object]:
    """(status, body) of `GET /-/routes` on a listener; status 0 when it does not speak HTTP."""
    conn = http.client.HTTPConnection(host, port, timeout=ROUTES_TIMEOUT_S)
    try:
        conn.request("GET", "/-/routes")
        r = conn.getresponse()
        raw = r.read(65536)
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode("utf-8", "replace")[:80]
    except (OSError, http.client.HTTPException) as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def find_replicas(prefix: str, hosts: list[str], ports: tuple[int, int] | None = None) -> tuple[str, list[int]]:
    """This pod's direct-ingress replicas of the app at `prefix`: (host, ports) on the first of `hosts` where any
    listens ((hosts[0], []) when none does). Prints every listener of the range it found and what it is."""
    low, high = ports or port_range()
    want = _norm_prefix(prefix)
    for host in hosts:
        with ThreadPoolExecutor(SCAN_THREADS) as pool:
            candidates = range(low, high + 1)
            open_ports = [p for p, up in zip(candidates, pool.map(lambda p: _listens(host, p), candidates)) if up]
            answers = list(pool.map(lambda p: _routes(host, p), open_ports))
        found = []
        for port, (status, body) in zip(open_ports, answers):
            # A direct-ingress replica answers {route_prefix: app_name} (503 "DRAINING" once Serve stops it)
            ours = status == 200 and isinstance(body, dict) and any(
                isinstance(k, str) and _norm_prefix(k) == want for k in body)
            if ours:
                found.append(port)
            say(f"{host}:{port} /-/routes: {status or 'no HTTP'} {body}" + ("" if ours else f": not {want}"))
        if found:
            return host, found
    return hosts[0], []


def _call(url: str, body: dict, key: str | None, timeout: float) -> tuple[int, dict]:
    """(status, JSON answer); status 0 when nothing answered."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError) as e:  # refused, reset, timed out: no proxy or no app here
        return 0, {"error": {"message": f"{type(e).__name__}: {e}"}}


def _body_and_timeout(grace_s: float | None, ip: str) -> tuple[dict, float]:
    body = {"node_ip": ip, **({} if grace_s is None else {"grace_s": grace_s})}
    return body, (grace_s if grace_s is not None else 3600) + 30


def _collect(answers: list[tuple[int, dict]], drained: dict, where: list[str]) -> None:
    """Adds the drained replicas' answers to `drained`; prints the other answers, each kind once with its count."""
    seen: dict[str, int] = {}
    for (status, answer), at in zip(answers, where):
        if status == 200:
            drained[answer.get("replica", at)] = answer
            continue
        why = ("409, the replica there is on another node" if status == 409
               else f"{status or 'no answer'}: {answer.get('error', answer)}")
        seen[f"{at}: {why}"] = seen.get(f"{at}: {why}", 0) + 1
    for line, n in seen.items():
        say(line + (f" (x{n})" if n > 1 else ""))


def drain_direct(host: str, ports: list[int], prefix: str, grace_s: float | None, key: str | None,
                 ip: str) -> dict:
    """One drain call to each replica's own port, all at once; returns {replica: answer} of those that drained."""
    body, timeout = _body_and_timeout(grace_s, ip)
    urls = [f"http://{host}:{p}{prefix.rstrip('/')}/admin/drain" for p in ports]
    with ThreadPoolExecutor(len(urls)) as pool:
        answers = list(pool.map(lambda u: _call(u, body, key, timeout), urls))
    drained: dict = {}
    _collect(answers, drained, [f"{host}:{p}" for p in ports])
    return drained


def drain(base: str, grace_s: float | None, calls: int, key: str | None, ip: str) -> dict:
    """Drain this node's ingress replicas through the front at `base` (Serve's per-node proxy); returns
    {replica: answer} of those that drained."""
    url = f"{base}/admin/drain"
    body, timeout = _body_and_timeout(grace_s, ip)
    drained: dict = {}
    for _ in range(ROUNDS):
        with ThreadPoolExecutor(calls) as pool:
            answers = list(pool.map(lambda _: _call(url, body, key, timeout), range(calls)))
        _collect(answers, drained, [base] * calls)
        if drained or any(status != 409 for status, _ in answers):
            break
        time.sleep(1.0)
    return drained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="the Serve HTTP port of this pod (the front)")
    p.add_argument("--prefix", default="/", help="the app's route prefix (serveApp.routePrefix)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds in-flight requests may take (default: the app's drain_grace_s)")
    p.add_argument("--calls", type=int, default=4,
                   help="calls sent at once through the front (>= ingress replicas on one pod)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    start = time.monotonic()
    key, ip = os.environ.get(API_KEY_ENV), pod_ip()
    prefix = _norm_prefix(args.prefix)
    # Loopback first: Serve binds http_options.host (the chart: 0.0.0.0); the pod's IP for a host bound to it alone
    hosts = ["127.0.0.1"] + ([ip] if ip and not ip.startswith("127.") else [])
    host, ports = find_replicas(prefix, hosts)
    drained: dict = {}
    if ports:
        say(f"direct ingress: {len(ports)} replica(s) of {prefix} on {host}: ports {', '.join(map(str, ports))}")
        drained = drain_direct(host, ports, prefix, args.grace, key, ip)
        how = "direct"
    if not drained:
        low, high = port_range()
        say(("none of them drained" if ports else f"no direct-ingress replica of {prefix} in ports {low}-{high}")
            + f": through the front on port {args.port}")
        base = f"http://127.0.0.1:{args.port}{prefix.rstrip('/')}"
        drained = drain(base, args.grace, max(1, args.calls), key, ip)
        how = f"through port {args.port}"
    finished = sum(a.get("open", 0) - a.get("ended", 0) for a in drained.values())
    ended = sum(a.get("ended", 0) for a in drained.values())
    say(f"drained {len(drained)} ingress replica(s) on this pod ({how}) in {time.monotonic() - start:.1f} s: "
        f"{finished} request(s) finished, {ended} ended after the grace period")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except Exception as e:  # noqa: BLE001 - a bug here must not hold up or fail the pod's termination
        say(f"failed: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
