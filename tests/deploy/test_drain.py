"""SIGTERM with requests in flight (issue 22, item 6), as an operator stops it: `m3serve serve` in a subprocess of its
own (its own Ray instance), signalled by pid. From the signal on, new requests get 503 + Retry-After and readiness is
503 while liveness stays 200; a request that can finish within the grace period finishes; one that cannot ends with
an SSE error event (503 `shutting_down`) and then `[DONE]`; the process then exits on its own, with status 0.
Before: streams were cut after 0.3 s without an error event, and the process took 32.6 s to exit."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.deploy.test_metrics_api_e2e import _Server

GRACE_S = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


class _Reader(threading.Thread):
    """A streamed completion read to its end in the background: its `data:` payloads, in order."""

    def __init__(self, base: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.headers = base, body, headers or {}
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", headers=self.headers, timeout=120,
                              json={**self.body, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=30)


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    """Through Serve's proxy; through HAProxy the same check runs in tests/deploy/test_http_haproxy.py, on the server
    that file already started."""
    server = _Server(tmp_path, "--drain-grace", str(GRACE_S), "--http-proxy", "serve")
    try:
        server.wait_ready()
        check_sigterm_drain(server)
    finally:
        server.stop()


def check_sigterm_drain(server: _Server) -> None:
    """SIGTERM `server` (started with `--drain-grace GRACE_S`, idle) while a short and a long stream run; every
    promise of the module docstring, up to the process's exit with status 0."""
    model = _get(f"{server.base}/v1/models").json()["data"][0]
    common = {"model": model["id"], "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    # short: a few tokens, done well within the grace period; long: the whole context, minutes on CPU
    short = _Reader(server.base, {**common, "max_tokens": 24})
    long = _Reader(server.base, {**common, "max_tokens": model["max_model_len"] - len(PROMPT)})
    long.start()
    assert long.first.wait(120) and long.error is None, long.error
    short.start()
    assert short.first.wait(120) and short.error is None, short.error
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + 30
    while (ready := _get(f"{server.base}/health/ready")).status_code == 200:
        assert time.monotonic() < deadline, "readiness never went 503 after SIGTERM"
        time.sleep(0.1)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down", ready.text
    assert _get(f"{server.base}/health").status_code == 503
    live = _get(f"{server.base}/health/live")
    assert live.status_code == 200 and live.json()["draining"] is True
    refused = httpx.post(f"{server.base}/v1/completions", json={**common, "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert refused.json()["error"]["code"] == "shutting_down"

    assert_short_finished_long_ended(short, long)
    assert sum('"choices"' in e for e in long.events) > 1
    # and the process exits on its own: within the grace period plus a bound (before: 32.6 s at best)
    assert server.proc.wait(timeout=GRACE_S + 40) == 0, server.log_path.read_text()[-3000:]
    log = server.log_path.read_text(errors="replace")
    assert "failed to shut down" not in log, log[-3000:]
    print(f"exit {time.monotonic() - signalled:.1f} s after SIGTERM (grace {GRACE_S} s)")


def assert_short_finished_long_ended(short: _Reader, long: _Reader) -> None:
    """After a drain: the short stream finished normally; the long one ended with the `shutting_down` error event
    (grace period over), then [DONE]."""
    short.join(60)
    long.join(60)
    assert short.error is None and long.error is None, (short.error, long.error)
    assert short.events[-1] == "[DONE]" and not any('"error"' in e for e in short.events), short.events[-3:]
    assert json.loads(short.events[-2])["choices"][0]["finish_reason"] == "length"
    assert long.events[-1] == "[DONE]", long.events[-3:]
    error = json.loads(long.events[-2])["error"]
    assert error["code"] == "shutting_down" and "grace period" in error["message"], error
