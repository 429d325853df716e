"""One Ray instance and one Serve app (the built-in tiny model) for every serving test of this package.

`ray.init` + `serve.run` + `serve.shutdown` + `ray.shutdown` cost 10+ s on two cores, so the package's tests
share them: tests must leave the app serving and the engines idle (every request finished or aborted).
`serve_app.deploy_extra(...)` adds another application to the same Serve instance under its own route prefix.
It goes down after this package's last test, not at the session's end: even idle, the instance and its apps
kept ~25-40% of a core busy (the controller, the replicas' metrics ticks) under every later test of the run.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.http_front import free_port, free_ports

API_KEY = "test-key"
APP_NAME = "m3"
# Small limits so the queue bound and the context bound are reachable in tests, yet 32 concurrent streams fit:
# 16 running + 16 waiting is the most a 32-client burst can produce.
TEST_CONFIG: dict[str, Any] = {
    "model": None,
    "api_key": API_KEY,
    "engine": {"max_model_len": 512, "max_num_seqs": 16, "max_waiting": 32, "max_num_batched_tokens": 512,
               "num_pages": 512},
    "unified": {"num_cpus_per_shard": 0.5},
}
READY_TIMEOUT_S = 180


def wait_healthy(base_url: str, timeout: float = READY_TIMEOUT_S, expect: int = 200) -> httpx.Response:
    """Poll `/health` until it answers `expect` (503 while loading); returns the last response."""
    deadline = time.monotonic() + timeout
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{base_url}/health", timeout=10)
            if last.status_code == expect:
                return last
            if expect == 200 and "failed to load" in last.text:  # it will never become ready
                raise RuntimeError(f"{base_url}/health: {last.text}")
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base_url}/health never answered {expect}; last: "
                       f"{None if last is None else (last.status_code, last.text)}")


@dataclass
class ServeApp:
    """The running test app: where it listens, how to call it, and how to look at its engines."""

    base_url: str  # http://127.0.0.1:<port>
    api_key: str
    model: str
    model_dir: Path
    config: dict[str, Any]
    port: int
    extra_apps: list[str] = field(default_factory=list)
    metrics_port: int | None = None  # Ray's metrics export port (every replica's metrics; Prometheus scrapes it)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=120, **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=120, **kw)

    def engine_stats(self) -> list[dict]:
        """Every engine replica's stats, through the ingress's /admin/stats route."""
        r = httpx.get(f"{self.base_url}/admin/stats", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["engines"]

    def wait_idle(self, timeout: float = 30.0) -> list[dict]:
        """Wait until no request runs or waits and every KV page is free; returns the stats (fails on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.engine_stats()
            if all(_idle(r) for r in rows):
                return rows
            if time.monotonic() > deadline:
                raise AssertionError(f"engines not idle after {timeout} s: {rows}")
            time.sleep(0.1)

    def router(self):
        from ray import serve

        return serve.get_deployment_handle("Router", app_name=APP_NAME)

    def pop_request_stats(self) -> list:
        return self.router().pop_request_stats.remote().result()

    def deploy_extra(self, name: str, config: dict[str, Any]) -> str:
        """Deploy another app (same Serve instance) at route prefix `/<name>`; returns its base URL."""
        from ray import serve

        from deploy.testing import build_drill_app

        serve.run(build_drill_app({"config": config}), name=name, route_prefix=f"/{name}",
                  logging_config={"enable_access_log": False})
        self.extra_apps.append(name)
        return f"{self.base_url}/{name}"

    @staticmethod
    def wait_healthy_at(base_url: str, timeout: float = READY_TIMEOUT_S) -> None:
        wait_healthy(base_url, timeout)

    def delete_extra(self, name: str) -> None:
        from ray import serve

        serve.delete(name, _blocking=False)  # its replicas stop in the background; nothing waits on them
        self.extra_apps.remove(name)


def _idle(row: dict) -> bool:
    s = row["stats"]
    return (s is not None and row["inflight"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
            and s["num_pages_free"] == s["num_pages_total"])


@pytest.fixture(scope="session")
def serve_helpers():
    """`free_port()` and `wait_healthy(base_url, timeout)` for tests that start servers of their own."""
    import types

    return types.SimpleNamespace(free_port=free_port, wait_healthy=wait_healthy)


@pytest.fixture(scope="package")
def serve_app() -> ServeApp:
    import ray
    from ray import serve

    from deploy.testing import build_drill_app
    from deploy.ingress import model_name_for
    from deploy.app import config_from_args
    from deploy.server import resolve_model_dir

    cfg = config_from_args({"config": TEST_CONFIG})
    model_dir = resolve_model_dir(cfg)  # writes the tiny model once, before the replicas race for it
    # Workers report metrics to the node's agent every 10 s by default; the Prometheus test would wait that long.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "500")
    metrics_port, port = free_ports(2)
    # address="local": never join a cluster someone started with `ray start` on this machine.
    ray.init(address="local", num_cpus=4, object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=bool(os.environ.get("M3SERVE_TEST_RAY_LOGS")), configure_logging=False,
             _metrics_export_port=metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        serve.run(build_drill_app({"config": TEST_CONFIG}), name=APP_NAME, route_prefix="/",
                  logging_config={"enable_access_log": False})
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        yield ServeApp(base_url=base, api_key=API_KEY, model=model_name_for(cfg, model_dir), model_dir=model_dir,
                       config=TEST_CONFIG, port=port, metrics_port=metrics_port)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
