"""Sharded forwards over real gloo process groups (one OS process per rank, loopback) equal the single-shard model.

Every case runs the same workload: concurrent requests of different lengths with chunked prefill (a prompt split
over two steps, long enough that MSA block selection is active), decode rows in the same steps as prefill
chunks, greedy decoding from the model's own logits. With dp = 2 each dp rank gets its own requests, and dp
rank 1 runs out of work first and runs empty steps while dp rank 0 still decodes. The reference is the
single-shard model running each dp rank's requests alone. All cases run in one launch of 4 processes (each case
builds and tears down its own process groups), so the file pays for 4 interpreter starts, not 30.

The "capacity" cases run the fixed-capacity EP dispatch (msa/moe.py) and must equal the same reference, with
routing skewed to one expert, with every token routed to one ep rank's experts (its peers receive only padding
rows), and with dp ranks of different step sizes and an idle dp rank (the largest dp step's count sizes the
buffers, `moe_group_tokens`, as the worker side exchanges it). Every case also counts the host reads of device
values inside the MoE forwards: none for "capacity", some for the exact-split all-to-all (its split sizes).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# name -> (tp, ep, dp, moe_dispatch, skew): skew = how many experts (0, 1, ...) the router is biased towards;
# 1: expert 0 wins a slot for every token; 2 = top-k: experts 0 and 1 take every slot, so every pair goes to ep
# rank 0 (it holds both at ep 2 and ep 4) and the other ep ranks receive none
CASES = {
    "tp2": (2, 1, 1, "alltoall", 0),
    "tp4-kv-replicated": (4, 1, 1, "alltoall", 0),
    "tp2-ep2": (2, 2, 1, "alltoall", 0),
    "tp2-ep2-allreduce": (2, 2, 1, "allreduce", 0),
    "tp4-ep4-skewed": (4, 4, 1, "alltoall", 1),
    "tp4-ep2": (4, 2, 1, "alltoall", 0),
    "dp2-ep2": (1, 2, 2, "alltoall", 0),
    "dp2-ep2-allreduce": (1, 2, 2, "allreduce", 0),
    "tp2-dp2-ep4-skewed": (2, 4, 2, "alltoall", 1),
    "tp2-dp2-ep2": (2, 2, 2, "alltoall", 0),
    "tp2-ep2-all-to-one": (2, 2, 1, "alltoall", 2),
    "tp2-ep2-capacity": (2, 2, 1, "capacity", 0),
    "tp2-ep2-all-to-one-capacity": (2, 2, 1, "capacity", 2),
    "tp4-ep4-skewed-capacity": (4, 4, 1, "capacity", 1),
    "tp4-ep2-capacity": (4, 2, 1, "capacity", 0),
    "dp2-ep2-capacity": (1, 2, 2, "capacity", 0),
    "tp2-dp2-ep4-all-to-one-capacity": (2, 4, 2, "capacity", 2),
}
WORLD = 4
SEED = 0

# Prompt lengths; a step is a list of (request, prefill token count | None for a decode row), prefills first.
PROMPTS = {"A": 90, "B": 37, "C": 70, "D": 20}
# dp = 1: one rank runs everything
SCHEDULE_DP1 = [
    [("A", 48), ("B", 37)],
    [("A", 42), ("C", 40), ("B", None)],
    [("C", 30), ("A", None), ("B", None)],
    [("A", None), ("C", None)],
    [("A", None), ("C", None)],
]
# dp = 2: dp rank 0 runs A and C, dp rank 1 runs B and D and is idle (empty batch) from step 3 on
SCHEDULE_DP2 = [
    [[("A", 48)], [("B", 37)]],
    [[("A", 42), ("C", 40)], [("D", 20), ("B", None)]],
    [[("C", 30), ("A", None)], [("B", None), ("D", None)]],
    [[("A", None), ("C", None)], []],
    [[("A", None), ("C", None)], []],
]


def schedule_of(dp: int, dp_rank: int) -> list[list[tuple[str, int | None]]]:
    return SCHEDULE_DP1 if dp == 1 else [step[dp_rank] for step in SCHEDULE_DP2]


def skew_router(model, num_experts: int) -> None:
    """Make experts 0 .. num_experts - 1 win top-k slots for every token (sigmoid scores are < 1, the bias adds
    10: more than the checkpoint's own biases separate), so the ep rank holding them receives far more (token, expert) pairs than the others (all of them when
    num_experts = top-k)."""
    from msa.moe import SparseMoE

    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.gate.e_score_correction_bias.data[:num_experts] += 10.0


class HostReads:
    """Counts host reads of tensor values (tolist, item, bool/int/float conversion, nonzero, numpy) made inside
    any `SparseMoE.forward` while installed: each is a device-to-host sync on CUDA, which a CUDA graph cannot
    hold. Counting rather than raising keeps the ranks' collectives matched when the exact-split path reads."""

    METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "numpy")

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0
        self._saved = {}

    def __enter__(self) -> HostReads:
        from msa.moe import SparseMoE

        def counting(name, original):
            def wrapper(*args, **kwargs):
                if self._depth:
                    self.count += 1
                return original(*args, **kwargs)
            return wrapper

        for name in self.METHODS:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        self._saved[(torch, "nonzero")] = torch.nonzero
        torch.nonzero = counting("torch.nonzero", torch.nonzero)
        original_forward = SparseMoE.forward
        self._saved[(SparseMoE, "forward")] = original_forward

        def forward(moe, *args, **kwargs):
            self._depth += 1
            try:
                return original_forward(moe, *args, **kwargs)
            finally:
                self._depth -= 1

        SparseMoE.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def run_schedule(model, schedule, num_pages: int = 24) -> dict:
    """Drive `model` through `schedule` with greedy decoding. -> {"logits": [per step fp32 [N, V]],
    "tokens": {request: generated ids}}. Requests get disjoint, scrambled page tables."""
    import dataclasses

    from msa.kv_cache import KVCache
    from msa.metadata import ChunkSpec, build_metadata
    from msa.parallel import dp_token_counts

    cfg = model.config
    ps = cfg.page_size
    kv = KVCache.allocate(cfg, num_pages, ctx=model.ctx)
    gen = torch.Generator().manual_seed(SEED)
    prompts = {name: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for name, n in PROMPTS.items()}
    pool = torch.randperm(num_pages, generator=gen).tolist()
    tables, cached, generated = {}, {}, {name: [] for name in PROMPTS}
    for name in PROMPTS:
        need = -(-(PROMPTS[name] + 8) // ps)
        tables[name], pool = pool[:need], pool[need:]
        cached[name] = 0
    logits_per_step = []
    for step in schedule:
        chunks, ids, finishing = [], [], []
        for name, n in step:
            seq = prompts[name] + generated[name]
            start = cached[name]
            count = 1 if n is None else n
            ids.extend(seq[start:start + count])
            chunks.append(ChunkSpec(tables[name], start, count, n is None))
            cached[name] = start + count
            finishing.append(name if cached[name] == len(seq) else None)
        meta = build_metadata(chunks, ps)
        ctx = model.ctx
        if ctx.moe_dispatch == "capacity" and ctx.dp_ranks_in_lockstep:
            # dp ranks of different step sizes share the ep group's buffers: size them from the largest step
            # (what the worker side exchanges before a lockstep step)
            meta = dataclasses.replace(meta, moe_group_tokens=max(dp_token_counts(len(ids), ctx)))
        hidden = model(torch.tensor(ids, dtype=torch.int64), meta, kv)
        logits = model.compute_logits(hidden[meta.logits_indices])
        for row, name in enumerate(finishing):
            if name is not None:
                generated[name].append(int(logits[row].argmax()))
        logits_per_step.append(logits)
    return {"logits": logits_per_step, "tokens": generated}


def _rank_main(rank: int, spec_file: str) -> None:
    """One rank: run every case it is part of, each in its own freshly initialised process groups."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from msa.model import load_model
    from msa.moe import SparseMoE
    from msa.parallel import all_gather_counts, destroy_parallel, init_parallel

    spec = json.loads(Path(spec_file).read_text())
    out = Path(spec["out"])
    for name, (tp, ep, dp, mode, skew) in spec["cases"].items():
        world = tp * dp
        if rank >= world:
            continue
        ctx = init_parallel(rank, world, tp=tp, ep=ep, dp=dp, init_method=f"file://{out}/{name}.init",
                            backend="gloo", moe_dispatch=mode, timeout_s=120)
        try:
            model = load_model(spec["ckpt"], ctx=ctx)
            if skew:
                skew_router(model, skew)
            with HostReads() as reads:
                result = run_schedule(model, schedule_of(dp, ctx.dp_rank))
            result["moe_host_reads"] = reads.count
            moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
            received = sum(sum(m.received_pairs) for m in moes)
            result["received_by_rank"] = all_gather_counts(received, ctx, "world")
            result["dp_rank"], result["tp_rank"] = ctx.dp_rank, ctx.tp_rank
            torch.save(result, out / f"{name}.rank{rank}.pt")
        finally:
            destroy_parallel(ctx)


@pytest.fixture(scope="module")
def sharded_runs(ckpts, tiny_cfg, tmp_path_factory):
    """Launch the 4 rank processes once for every case; -> the directory holding each rank's results."""
    out = tmp_path_factory.mktemp("parallel")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "ckpt": str(ckpts.path(tiny_cfg, SEED, "hub")), "cases": CASES}))
    from tests.ranks import run_ranks

    run_ranks(__file__, spec, WORLD)
    return out


@pytest.fixture(scope="module")
def single_shard(ckpts, tiny_cfg):
    """(dp, dp_rank, skew) -> the single-shard model's run of that dp rank's requests."""
    cache = {}

    def get(dp: int, dp_rank: int, skew: int) -> dict:
        key = (dp, dp_rank, skew)
        if key not in cache:
            model = ckpts.model(tiny_cfg, SEED, "hub")
            if skew:
                skew_router(model, skew)
            cache[key] = run_schedule(model, schedule_of(dp, dp_rank))
        return cache[key]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forward_equals_single_shard(sharded_runs, single_shard, case):
    tp, ep, dp, mode, skew = CASES[case]
    results = [torch.load(sharded_runs / f"{case}.rank{r}.pt") for r in range(tp * dp)]
    for res in results:
        want = single_shard(dp, res["dp_rank"], skew)
        assert res["tokens"] == want["tokens"], f"rank {res['tp_rank']}/{res['dp_rank']}: greedy tokens differ"
        assert len(res["logits"]) == len(want["logits"])
        for step, (got, ref) in enumerate(zip(res["logits"], want["logits"])):
            assert got.shape == ref.shape, f"step {step}"
            if ref.numel():
                err = float((got - ref).abs().max())
                assert err <= 1e-4 * max(1.0, float(ref.abs().max())), f"step {step}: max |diff| {err:.2e}"
    if dp == 2:
        idle = [res for res in results if res["dp_rank"] == 1]
        assert all(res["logits"][-1].shape[0] == 0 for res in idle), "dp rank 1 should run empty final steps"
    received = results[0]["received_by_rank"]
    if ep > 1 and mode == "alltoall":
        assert sum(received) > 0
        if skew == 1:
            # each ep group's rank holding expert 0 receives every token of its group at least once
            assert max(received) >= 2.5 * min(received), f"uneven split expected, got {received}"
        if skew == 2:
            # every pair goes to ep rank 0 of each ep group: its peers receive nothing
            assert all(n == 0 for r, n in enumerate(received) if r % ep), f"all-to-one expected, got {received}"
    reads = [res["moe_host_reads"] for res in results]
    if ep > 1 and mode == "capacity":
        assert reads == [0] * len(results), f"the capacity dispatch read device values on the host: {reads}"
    elif ep > 1:
        # the exact-split dispatch needs its split sizes on the host: the probe sees them (it can fail)
        assert all(n > 0 for n in reads), f"host reads of the exact-split dispatch not seen: {reads}"


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2])
    # done, group destroyed: skip the interpreter's teardown (see tests/msa/test_model_parity.py's __main__)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
