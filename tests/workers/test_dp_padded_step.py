"""The padded attention-DP step (issue 24) on CPU: two dp ranks in lockstep over one ep group (dp2 x ep2,
gloo, one OS process per rank on loopback) with the capacity MoE dispatch, each a real `ModelRunner` and
`EngineCore` of its own requests. Decode steps go through the runner's graph path with the replay run eagerly
(`EagerReplay`: the captured work minus the graph): the ranks exchange their step sizes, every rank replays the
group's bucket, padding up to it, and a rank with no requests left replays a bucket of padding rows only. Mixed
steps run eagerly with the MoE buffers sized for the largest dp step. Each rank's greedy tokens must equal the
single-shard engine's on the same requests (padded rows never reach real rows), with no page left in use.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

# dp rank -> (prompt length, max tokens) of its requests: rank 0 decodes 3 rows (then 2) for long, rank 1 one
# short request, so rank 1 pads 1 row up to rank 0's bucket of 4, then replays padding only while rank 0 goes on
REQUESTS = {0: [(23, 12), (9, 10), (40, 12)], 1: [(17, 4)]}
SIZES = (1, 2, 4, 8)


def prompt_of(dp_rank: int, i: int, n: int) -> list[int]:
    return [3 + (dp_rank * 131 + i * 37 + j * 7) % 380 for j in range(n)]


def _rank_main(rank: int, spec_file: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    torch.set_num_threads(1)
    from msa.parallel import all_gather_counts, destroy_parallel, init_parallel
    from workers.batch import StepBatch
    from workers.config import EngineConfig
    from workers.core import EngineCore
    from workers.cuda_graph import DecodeGraphs
    from workers.request import SamplingParams
    from workers.runner import ModelRunner

    class EagerReplay(DecodeGraphs):
        def replay(self, bucket: int) -> torch.Tensor:
            self.replayed.append(bucket)
            return self.forward(bucket)

    spec = json.loads(Path(spec_file).read_text())
    ctx = init_parallel(rank, 2, tp=1, ep=2, dp=2, init_method=f"file://{spec['out']}/init", backend="gloo",
                        moe_dispatch="capacity", timeout_s=120)
    try:
        config = EngineConfig(num_pages=48, max_num_seqs=8, max_model_len=256)
        runner = ModelRunner(spec["ckpt"], engine_config=config, ctx=ctx)
        assert runner.graphs is None  # CPU: nothing captured; the graph path runs through EagerReplay
        runner.graphs = EagerReplay(runner.model, runner.kv, sizes=SIZES, max_model_len=256, device="cpu")
        runner.graphs.replayed = []
        core = EngineCore(config, num_pages=runner.num_pages, page_size=runner.page_size,
                          vocab_size=runner.config.vocab_size)
        for i, (n, m) in enumerate(REQUESTS[ctx.dp_rank]):
            core.add_request(f"r{i}", prompt_of(ctx.dp_rank, i, n),
                             SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        empty = StepBatch(input_ids=[], chunks=[], sample_chunks=[], rows=[], released_seq_ids=[],
                          prompt_logprob_chunks=[])
        tokens: dict[str, list[int]] = {}
        # step while any dp rank has work: every rank runs every step (the lockstep the worker group keeps)
        while any(all_gather_counts(int(core.has_unfinished()), ctx, "dp")):
            batch = core.schedule()
            result = runner.execute(batch if batch is not None else empty)
            if batch is not None:
                for out in core.update(result):
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps({
            "tokens": tokens, "replayed": runner.graphs.replayed, "graph_steps": runner.num_graph_steps,
            "idle": runner.num_idle_forwards, "free": core.pages.num_free_pages, "total": runner.num_pages}))
    finally:
        destroy_parallel(ctx)


@pytest.fixture(scope="module")
def ranks(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp-padded")
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "ckpt": str(tiny_ckpt)}))
    from tests.ranks import run_ranks

    run_ranks(__file__, spec, 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_padded_dp_steps_replay_one_bucket_and_equal_the_single_shard(ranks, make_llm):
    from workers.request import SamplingParams

    llm = make_llm(num_pages=48, max_num_seqs=8, max_model_len=256)
    for d, res in enumerate(ranks):
        prompts = [{"prompt_token_ids": prompt_of(d, i, n)} for i, (n, _) in enumerate(REQUESTS[d])]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in REQUESTS[d]]
        want = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(llm.generate(prompts, params))}
        assert res["tokens"] == want, f"dp rank {d}: greedy tokens differ from the single shard"
        assert res["free"] == res["total"], f"dp rank {d}: pages left in use"
    r0, r1 = ranks
    # both ranks replayed the same buckets in the same steps: rank 0's rows set it (3 -> 4, then 2 when its
    # 10-token request is done), rank 1 padded up to it
    assert r0["replayed"] == r1["replayed"] and set(r0["replayed"]) == {4, 2}
    assert r0["graph_steps"] == r1["graph_steps"] == len(r0["replayed"]) >= 9
    # rank 1 ran its decode steps padded (1 row in a bucket of 4), then idle steps of padding only (each a
    # replay: they count as graph steps and idle forwards both)
    assert r0["idle"] == 0 and r1["idle"] >= 5


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
