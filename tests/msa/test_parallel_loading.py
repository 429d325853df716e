"""Weight loading shards on load: each rank of a tp=2 x ep=2 group reads only its slices, so its peak host memory
grows by about its shard size, not by the model size. Measured on a ~80 MB fp32 checkpoint (big enough that the
two differ by tens of MB) with the kernel's peak-RSS counter reset just before loading, in fresh processes.

What else the peak holds: safetensors reads through a memory map, so the pages of the open checkpoint file a rank
touches count in its RSS until the file is closed (page cache, not heap: at most one file's worth, less for a
rank that skips other ranks' experts); and a few MB of code pages the first forward-free load pulls in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MB = 2**20


def _big_config():
    from msa.config import M3Config
    from workers.configio import load_yaml, preset_path

    import dataclasses

    tiny = load_yaml(preset_path("models", "tiny"), M3Config)
    # experts dominate (16 x 3 x 512 x 512 fp32 = 50 MB), as in the real model; vocab 4096 x 512 x 2 = 17 MB
    return dataclasses.replace(tiny, torch_dtype="float32", vocab_size=4096, hidden_size=512, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                               intermediate_size=512, shared_intermediate_size=256, dense_intermediate_size=1024,
                               num_local_experts=16, index_n_heads=2, index_head_dim=64,
                               layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank_main(rank: int, world: int, tp: int, ep: int, init: str, ckpt: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from msa.model import load_model
    from msa.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank, world, tp=tp, ep=ep, dp=world // tp, init_method=f"file://{init}", backend="gloo")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (the peak RSS) to the current RSS
        before = _status_kb("VmRSS")
        model = load_model(ckpt, ctx=ctx)
        peak = _status_kb("VmHWM")
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        Path(out).write_text(json.dumps({"growth": (peak - before) * 1024, "shard": shard}))
    finally:
        destroy_parallel(ctx)


def _launch(world: int, tp: int, ep: int, ckpt: Path, tmp: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp / f"w{world}-r{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(tp), str(ep), str(tmp / f"init{world}"),
                               str(ckpt), str(outs[r])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for r in range(world)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_each_rank_peak_memory_tracks_its_shard(tmp_path):
    from msa.checkpoint import write_checkpoint

    ckpt = write_checkpoint(_big_config(), tmp_path / "ckpt", seed=0, layout="hub", num_shards=8)
    largest_file = max(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    full_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert full_bytes > 70 * MB
    (single,) = _launch(1, 1, 1, ckpt, tmp_path)
    ranks = _launch(2, 2, 2, ckpt, tmp_path)
    # the single shard holds everything the checkpoint's text tower has, and its peak shows it
    assert single["shard"] > 0.9 * full_bytes
    assert single["growth"] > 0.9 * single["shard"]
    for r, m in enumerate(ranks):
        # tp halves attention, dense MLP, shared expert and vocab; ep halves the experts; norms/router replicated
        assert m["shard"] < 0.55 * single["shard"], f"rank {r}: shard {m['shard'] / MB:.1f} MB"
        # peak growth near the shard: its parameters, plus at most the mapped pages of one open file and slack
        # (allocator arenas and process-group buffers vary by a few MB from run to run: 16 MB of slack; a rank
        # that materialised the whole model would grow by the full 83 MB plus its shard)
        assert m["growth"] < m["shard"] + largest_file + 16 * MB, (f"rank {r}: peak grew {m['growth'] / MB:.1f} MB for a "
                                                   f"{m['shard'] / MB:.1f} MB shard of a {full_bytes / MB:.1f} MB model")
        assert m["growth"] < 0.75 * single["growth"], (r, m["growth"] / MB, single["growth"] / MB)


if __name__ == "__main__":
    a = sys.argv[1:]
    _rank_main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4], a[5], a[6])
    # done, group destroyed: skip the interpreter's teardown (see tests/msa/test_model_parity.py's __main__)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
