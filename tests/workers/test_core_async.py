"""EngineCore's async scheduling with a fake executor (pure Python, no model): `schedule_ahead` while a step is
in flight gives every finished request the same tokens and finishes as the synchronous schedule/update, over
random workloads with preemption (tight pools), chunked prefill, n > 1, EOS and length finishes and aborts; the
deferred input ids name exactly the previous step's sampled rows; the pool ends all free."""
from __future__ import annotations

import random

import pytest

from workers.config import EngineConfig
from workers.core import EngineCore
from workers.request import SamplingParams
from workers.runner import StepResult
from workers.scheduler import PENDING_TOKEN

from tests.workers.test_batch_delta import ShardTables

EOS = 96


class FakeExecutor:
    """Token = `10 + tokens the sequence already output` (EOS where `eos_at[seq id]` says), so a token never
    depends on timing; deferred input ids are filled from the previous step's result as the runner does, and
    recorded: `deferred[(seq id, position)]` = the id the step computed with."""

    def __init__(self, eos_at: dict[int, int]) -> None:
        self.eos_at = eos_at
        self.deferred: dict[tuple[int, int], int] = {}
        self.tables = ShardTables()  # the page tables as a shard resolves them from the batches' deltas

    def execute(self, batch, prev: StepResult | None) -> StepResult:
        ids = list(batch.input_ids)
        for pos, row in zip(batch.deferred_positions, batch.deferred_rows, strict=True):
            assert ids[pos] == PENDING_TOKEN
            ids[pos] = prev.token_ids[row]
        assert PENDING_TOKEN not in ids
        row_of_chunk = {ci: r for r, ci in enumerate(batch.sample_chunks)}
        ends = [0]
        for c in batch.chunks:
            ends.append(ends[-1] + c.num_tokens)
        for pos in batch.deferred_positions:
            ci = ends.index(pos + 1) - 1  # a deferred id is its (decode) chunk's only token
            self.deferred[(batch.rows[row_of_chunk[ci]].seq_id, batch.chunks[ci].start)] = ids[pos]
        tokens = [EOS if self.eos_at.get(r.seq_id) == r.num_output_tokens else 10 + r.num_output_tokens
                  for r in batch.rows]
        return StepResult(token_ids=tokens, logprobs=[None] * len(tokens), forward_time=0.0, sample_time=0.0)


def drive(core: EngineCore, ex: FakeExecutor, *, ahead: bool, arrivals, aborts) -> dict:
    """Step the core as `EngineAPI._step_async` does (ahead) or synchronously; -> {(rid, index): (tokens,
    finish)}. Checks that every deferred input id was the sequence's token at that position."""
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    seqs = {}
    inflight = None
    step = 0
    while step <= max(arrivals) or core.has_unfinished() or inflight is not None:
        for rid, prompt, params in arrivals.get(step, []):
            seqs.update((s.seq_id, s) for s in core.add_request(rid, prompt, params).seqs)
        for rid in aborts.get(step, []):
            core.abort_request(rid)
        step += 1
        assert step < 2000
        if inflight is None:
            batch = core.schedule()
            if batch is None:
                continue
            ex.tables.check(core, batch)
            inflight = ex.execute(batch, None)
        nxt = None
        if ahead and core.can_schedule_ahead():
            batch = core.schedule_ahead()
            if batch is not None:
                ex.tables.check(core, batch)
                nxt = ex.execute(batch, inflight)
        for out in core.update(inflight):
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[(out.request_id, out.index)] = out.finish_reason
        inflight = nxt
    assert core.pages.num_free_pages == core.pages.num_pages and core.pages.owners() == {}
    for (seq_id, pos), tok in ex.deferred.items():
        assert seqs[seq_id].token_ids[pos] == tok
    assert all(not s.pending and PENDING_TOKEN not in s.token_ids for s in seqs.values())
    return {k: (v, finish.get(k)) for k, v in tokens.items()}


def workload(seed: int):
    rng = random.Random(seed)
    arrivals, aborts, eos_at = {}, {}, {}
    seq_id = 0
    for i in range(rng.randrange(3, 9)):
        n = rng.choice([1, 1, 1, 2, 3])
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14), n=n)
        for j in range(n):
            if rng.random() < 0.3:
                eos_at[seq_id + j] = rng.randrange(0, 10)
        seq_id += n
        arrivals.setdefault(rng.randrange(0, 12), []).append(
            (f"r{i}", [rng.randrange(1, 90) for _ in range(rng.randrange(1, 30))], params))
        if rng.random() < 0.15:
            aborts.setdefault(rng.randrange(0, 20), []).append(f"r{i}")
    config = dict(max_num_seqs=rng.choice([3, 4, 8]), max_num_batched_tokens=rng.choice([4, 8, 64]),
                  num_pages=rng.choice([12, 16, 40]), enable_prefix_caching=seed % 2 == 0)
    return arrivals, aborts, eos_at, config


def make_core(ahead: bool, config: dict) -> EngineCore:
    cfg = EngineConfig(max_model_len=64, admission_watermark=0.0, async_scheduling=ahead, **config)
    return EngineCore(cfg, num_pages=cfg.num_pages, page_size=4, eos_token_ids=(EOS,), vocab_size=97)


@pytest.mark.parametrize("seed", range(80))
def test_async_core_matches_sync_on_random_workloads(seed):
    arrivals, aborts, eos_at, config = workload(seed)
    sync = drive(make_core(False, config), FakeExecutor(eos_at), ahead=False, arrivals=arrivals, aborts=aborts)
    asyn = drive(make_core(True, config), FakeExecutor(eos_at), ahead=True, arrivals=arrivals, aborts=aborts)
    # an abort by step count lands at another token count in the two loops: aborted requests agree on the
    # tokens both produced
    aborted = {rid for v in aborts.values() for rid in v}
    assert {k: v for k, v in asyn.items() if k[0] not in aborted} == \
        {k: v for k, v in sync.items() if k[0] not in aborted}
    for k in {k for k in [*sync, *asyn] if k[0] in aborted}:
        a, b = asyn.get(k, ([], None))[0], sync.get(k, ([], None))[0]
        assert a[:len(b)] == b[:len(a)], k


def test_workloads_reach_the_hard_cases(monkeypatch):
    """The random workloads above preempt, preempt a sequence whose token is in flight, fork samples after a
    sample 0 preempted with its first token in flight, and skip a row whose token in flight is its last."""
    from workers import scheduler as sched

    seen = {"preempt_pending": 0, "fork_preempted": 0}
    preempt, fork = sched.Scheduler._preempt, sched.Scheduler._fork

    def spy_preempt(self, seq):
        seen["preempt_pending"] += seq.pending
        preempt(self, seq)

    def spy_fork(self, req):
        seen["fork_preempted"] += req.seqs[0].status is not sched.SeqStatus.RUNNING
        fork(self, req)

    monkeypatch.setattr(sched.Scheduler, "_preempt", spy_preempt)
    monkeypatch.setattr(sched.Scheduler, "_fork", spy_fork)
    preempted = 0
    for seed in range(80):
        arrivals, aborts, eos_at, config = workload(seed)
        core = make_core(True, config)
        drive(core, FakeExecutor(eos_at), ahead=True, arrivals=arrivals, aborts=aborts)
        preempted += core.scheduler.num_preemptions
    assert preempted > 0 and seen["preempt_pending"] > 0, seen
    assert seen["fork_preempted"] > 0, seen
