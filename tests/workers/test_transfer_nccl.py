"""The KV transfer's GPU data plane on two CUDA devices: our own NCCL communicator (backend "nccl",
workers/kv/nccl.py) and ProcessGroupNCCL ("torch-nccl") behind PairChannel. Bytes cross intact both ways, KV pages
moved by KVSender/KVReceiver land bitwise, and a peer that aborts ends the other side's pending NCCL receive at
once (the header stream's end), not at its deadline. The peer runs in a subprocess on cuda:1; this process is
rank 0 (the listener) on cuda:0. Skipped without two CUDA devices."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from msa.config import M3Config
from msa.kv_cache import KVCache
from workers.configio import load_yaml, preset_path
from workers.kv.config import TransferConfig, TransferState
from workers.kv.receiver import KVReceiver
from workers.kv.routes import plan_routes
from workers.kv.transport import PairChannel, PeerGone

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]
SIZES = (1, 4099, 3 * 2**20 + 5)  # odd sizes: no alignment luck
BACKENDS = ("nccl", "torch-nccl")

_PEER = r'''
import json, sys, time
import torch
from msa.config import M3Config
from msa.kv_cache import KVCache
from workers.configio import load_yaml, preset_path
from workers.kv.config import TransferConfig
from workers.kv.routes import plan_routes
from workers.kv.sender import KVSender
from workers.kv.transport import PairChannel

host, port, backend, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
dev = torch.device("cuda", 1)
torch.cuda.set_device(dev)


def fill(kv, seed):
    g = torch.Generator(device=kv.k[0].device).manual_seed(seed)
    for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))


if scenario == "kv":
    spec = json.loads(sys.argv[5])
    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    kv = KVCache.allocate(cfg, spec["pool"], device=dev, dtype=torch.bfloat16)
    fill(kv, spec["seed"])
    sender = KVSender(kv, config=TransferConfig(timeout_s=30, nccl="direct" if backend == "nccl" else "torch",
                                                max_chunk_bytes=spec["chunk"]))
    sender.add_peer("d0", PairChannel.connect((host, port), backend=backend, device=dev, timeout_s=60),
                    plan_routes(cfg.num_key_value_heads, 1, 1)[0])
    sender.wait_ready(60)
    for rid, ids in spec["requests"].items():
        sender.send(rid, ids)
    print("RESULT " + json.dumps({rid: sender.wait(rid, 60).state.value for rid in spec["requests"]}), flush=True)
    sender.close()
    sys.exit(0)

ch = PairChannel.connect((host, port), backend=backend, device=dev, timeout_s=60)
ch.open()
if scenario == "bytes":
    g = torch.Generator(device=dev).manual_seed(7)
    for n in json.loads(sys.argv[5]):
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=g)
        ch.wait_work(ch.send(buf), time.monotonic() + 30, "send")
    back = torch.zeros(16, dtype=torch.uint8, device=dev)
    ch.wait_work(ch.recv(back), time.monotonic() + 30, "recv")
    torch.cuda.synchronize(dev)
    print("BACK " + json.dumps(back.tolist()), flush=True)
elif scenario == "abort":
    time.sleep(0.5)
    ch.abort()
    time.sleep(2.0)
ch.close()
'''


def _peer(address, backend: str, scenario: str, arg: str = "") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", _PEER, address[0], str(address[1]), backend, scenario, arg],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture
def dev0():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    return dev


@pytest.mark.parametrize("backend", BACKENDS)
def test_bytes_cross_the_pair_intact_both_ways(backend, dev0):
    ch = PairChannel.listen(backend=backend, device=dev0, timeout_s=60)
    proc = _peer(ch.address, backend, "bytes", json.dumps(SIZES))
    try:
        ch.open()
        g = torch.Generator(device=dev0).manual_seed(7)
        for n in SIZES:
            want = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev0, generator=g)
            got = torch.zeros_like(want)
            ch.wait_work(ch.recv(got), time.monotonic() + 30, "recv")
            torch.cuda.synchronize(dev0)
            assert torch.equal(got, want), n
        back = torch.arange(16, dtype=torch.uint8, device=dev0)
        ch.wait_work(ch.send(back), time.monotonic() + 30, "send")
        # closed before the peer is awaited: ProcessGroupNCCL's shutdown on the peer waits for this side's
        ch.close()
        out = _finish(proc)
    finally:
        ch.close()
        if proc.poll() is None:
            proc.kill()
    assert "BACK " + json.dumps(list(range(16))) in out, out[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_that_aborts_ends_a_pending_receive_at_once(backend, dev0):
    ch = PairChannel.listen(backend=backend, device=dev0, timeout_s=60)
    proc = _peer(ch.address, backend, "abort")
    try:
        ch.open()
        buf = torch.empty(2**20, dtype=torch.uint8, device=dev0)
        t0 = time.monotonic()
        with pytest.raises(PeerGone):
            ch.wait_work(ch.recv(buf), t0 + 30, "recv")  # nothing is ever sent
        assert time.monotonic() - t0 < 5
        ch.abort()  # kills our pending receive kernel
        torch.cuda.synchronize(dev0)  # the device is usable again
        _finish(proc)
    finally:
        ch.close()
        if proc.poll() is None:
            proc.kill()


def _filled(cfg: M3Config, pool: int, seed: int, dev) -> KVCache:
    kv = KVCache.allocate(cfg, pool, device=dev, dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(seed)
    for t in kv.k + kv.v + [x for x in kv.index_k if x is not None]:
        t.copy_(torch.randn(t.shape, generator=g, device=dev, dtype=torch.float32))
    return kv


@pytest.mark.parametrize("backend", ["nccl"])  # torch-nccl: the transfer benchmark checks it bitwise
@pytest.mark.parametrize("chunk", [2**30, 3000])  # one message / many chunks (more than the in-flight cap)
def test_kv_pages_land_bitwise(backend, chunk, dev0):
    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    pool = 40
    src_ids = {"a": [3, 17, 5, 0, 33], "b": [9], "c": list(range(20, 32))}
    dst_ids = {"a": [27, 1, 12, 7, 2], "b": [0], "c": list(range(39, 27, -1))}  # no page written twice
    expect = _filled(cfg, pool, 11, dev0)  # the sender's cache, rebuilt here from the same seed
    dst = _filled(cfg, pool, 12, dev0)
    receiver = KVReceiver(dst, config=TransferConfig(timeout_s=30, nccl="direct" if backend == "nccl" else "torch"))
    ch = PairChannel.listen(backend=backend, device=dev0, timeout_s=60)
    receiver.add_peer("p0", ch, plan_routes(cfg.num_key_value_heads, 1, 1)[0])
    for rid, ids in dst_ids.items():
        receiver.prepare_receive(rid, ids)
    spec = {"pool": pool, "seed": 11, "chunk": chunk, "requests": src_ids}
    proc = _peer(ch.address, backend, "kv", json.dumps(spec))
    try:
        results = {rid: receiver.wait(rid, 60) for rid in dst_ids}
        out = _finish(proc)
    finally:
        receiver.close()
        if proc.poll() is None:
            proc.kill()
    assert all(r.state is TransferState.DONE for r in results.values()), {k: r.reason for k, r in results.items()}
    assert "RESULT " + json.dumps({rid: "done" for rid in src_ids}) in out, out[-2000:]
    for rid in src_ids:
        s, d = torch.tensor(src_ids[rid], device=dev0), torch.tensor(dst_ids[rid], device=dev0)
        for name, a, b in [("k", expect.k, dst.k), ("v", expect.v, dst.v), ("index_k", expect.index_k, dst.index_k)]:
            for layer, (x, y) in enumerate(zip(a, b)):
                if x is not None:
                    assert torch.equal(x.index_select(0, s), y.index_select(0, d)), (rid, name, layer)
