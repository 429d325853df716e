"""deploy/app.py's wiring without starting Ray: every Ingress, Router and EngineServer replica runs its code on
Serve's own event loop (deploy/stream/chunks.py `REPLICA_ENV_VARS` in its runtime_env; docs/benchmarks.md S4 of
session 16: behind HAProxy, with user code on a thread of its own, each SSE chunk crossed threads)."""
from __future__ import annotations

import pytest

from deploy.app import build_app
from deploy.stream.chunks import REPLICA_ENV_VARS


def _deployments(app) -> dict[str, dict]:
    """{deployment name: ray_actor_options} of the graph build_app binds (Ingress -> Router -> engines)."""
    ingress = app._bound_deployment
    router = ingress.init_args[0]._bound_deployment
    engines = [e._bound_deployment for group in router.init_args[0].values() for e in group]
    return {d.name: d.ray_actor_options for d in (ingress, router, *engines)}


@pytest.mark.parametrize("disaggregate", [False, True])
def test_every_replica_runs_its_code_on_serves_loop(disaggregate):
    options = _deployments(build_app({"config": {"model": None, "device": "cpu", "disaggregate": disaggregate}}))
    want = {"Ingress", "Router"} | ({"EngineServer-prefill-0", "EngineServer-decode-0"} if disaggregate
                                    else {"EngineServer-unified-0"})
    assert set(options) == want, options
    for name, actor in options.items():
        assert actor["runtime_env"]["env_vars"].items() >= REPLICA_ENV_VARS.items(), (name, actor)
        assert actor["num_cpus"] > 0, (name, actor)  # the resources given beside the knobs are kept
