"""The engine's actor path: a real `ShardWorker` Ray actor owns the model and KV pages and runs the steps; the
greedy tokens equal the in-process runner's. Run in a child process so its private Ray head never meets another
test's `ray.init`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = r'''
import json, random, sys, time
import ray
from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams

ckpt = sys.argv[1]
ray.init(address="local", num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
         log_to_driver=False, configure_logging=False)
try:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (4, 37, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    result = {}
    for kind in ("ray", "local"):
        eng = Engine(ckpt, engine_config=EngineConfig(num_pages=32), executor=kind)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = [o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs]]
        steps = eng.pop_step_stats()
        result[kind] = {"outs": outs, "free": eng.stats().num_pages_free, "total": eng.stats().num_pages_total,
                        "decode_overhead_ms": 1e3 * min(s.host_overhead for s in steps if s.num_prefill_tokens == 0),
                        "actor": type(eng.executor).__name__}
        if kind == "ray":
            result[kind]["actor_alive"] = ray.get(eng.executor.actor.ping.remote()) == "ok"
        eng.shutdown()
    print("RESULT " + json.dumps(result))
finally:
    ray.shutdown()
'''


def test_ray_shard_worker_runs_the_same_steps(tiny_ckpt):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_ckpt)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["ray"]["actor"] == "RayExecutor" and res["local"]["actor"] == "LocalExecutor" and res["ray"]["actor_alive"]
    assert res["ray"]["outs"] == res["local"]["outs"]
    assert len(res["ray"]["outs"]) == 3 and all(len(v[0]) == 5 for v in res["ray"]["outs"].values())
    for kind in ("ray", "local"):
        assert res[kind]["free"] == res[kind]["total"] == 32
    print(f"host overhead per decode step: ray {res['ray']['decode_overhead_ms']:.2f} ms, "
          f"local {res['local']['decode_overhead_ms']:.2f} ms")
