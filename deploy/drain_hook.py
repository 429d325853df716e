"""`python -m deploy.drain_hook`: the Helm chart's preStop hook on a worker pod. Drains the pod's own ingress
replica(s) through `POST /admin/drain` (deploy/admin_drain.py) on the pod's Serve proxy, and returns when the drain
is over, so that `ray stop` (next in the hook) kills nothing that could still finish.

Several calls go out at once (a pod may hold more than one ingress replica; the proxy spreads calls over its node's
replicas). Each names this pod's IP, so a replica elsewhere refuses (409) instead of draining; when every call was
refused, or nothing listens, there is nothing to drain here. The hook never fails the pod's termination: whatever
happens it prints what it saw and exits 0. Standard library only (it runs before anything else in the pod stops).
"""
from __future__ import annotations

import argparse
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
ROUNDS = 3  # tries when every call reached a replica on another node


def pod_ip() -> str:
    return os.environ.get(POD_IP_ENV) or socket.gethostbyname(socket.gethostname())


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


def drain(base: str, grace_s: float | None, calls: int, key: str | None, ip: str) -> dict:
    """Drain this node's ingress replicas (the app at `base`); returns {replica: answer} of those that drained."""
    url = f"{base}/admin/drain"
    body = {"node_ip": ip, **({} if grace_s is None else {"grace_s": grace_s})}
    timeout = (grace_s if grace_s is not None else 3600) + 30
    drained: dict = {}
    for _ in range(ROUNDS):
        with ThreadPoolExecutor(calls) as pool:
            answers = list(pool.map(lambda _: _call(url, body, key, timeout), range(calls)))
        for status, answer in answers:
            if status == 200:
                drained[answer.get("replica", "?")] = answer
            elif status != 409:
                print(f"m3serve drain hook: {status}: {answer.get('error', answer)}", file=sys.stderr)
        if drained or any(status not in (409,) for status, _ in answers):
            break
        time.sleep(1.0)
    return drained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="the Serve HTTP port of this pod")
    p.add_argument("--prefix", default="/", help="the app's route prefix (serveApp.routePrefix)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds in-flight requests may take (default: the app's drain_grace_s)")
    p.add_argument("--calls", type=int, default=4, help="calls sent at once (>= ingress replicas on one pod)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    base = f"http://127.0.0.1:{args.port}{args.prefix.rstrip('/')}"
    drained = drain(base, args.grace, max(1, args.calls), os.environ.get(API_KEY_ENV), pod_ip())
    finished = sum(a.get("open", 0) - a.get("ended", 0) for a in drained.values())
    ended = sum(a.get("ended", 0) for a in drained.values())
    print(f"m3serve drain hook: drained {len(drained)} ingress replica(s) on this pod in "
          f"{time.monotonic() - start:.1f} s: {finished} request(s) finished, {ended} ended after the grace period",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
