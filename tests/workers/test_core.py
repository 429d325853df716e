"""EngineCore with a fake executor: schedule/update on exact token ids, finish reasons, aborts that free pages,
step failures, preemption, stop strings reported back, handoffs and remote requests. Pure Python: no model."""
from __future__ import annotations

import pytest

from workers.config import EngineConfig
from workers.core import EngineCore, EngineCoreOutput
from workers.request import SamplingParams
from workers.runner import StepResult

from tests.workers.test_batch_delta import ShardTables

EOS = 96


class FakeExecutor:
    """Samples token `base + number of tokens the sequence holds`, so every token is known in advance and a
    recomputed (preempted) sequence samples the same tokens again. `eos_at`: seq id -> output count at which EOS
    comes instead."""

    def __init__(self, base: int = 10, eos_at: dict[int, int] | None = None) -> None:
        self.base = base
        self.eos_at = eos_at or {}
        self.batches = []
        self.tables = ShardTables()  # the page tables as a shard resolves them from the batches' deltas

    def execute(self, batch) -> StepResult:
        self.batches.append(batch)
        tokens = []
        for row in batch.rows:
            n = row.num_output_tokens
            tokens.append(EOS if self.eos_at.get(row.seq_id) == n else self.base + n)
        lps = [None if r.params.logprobs is None else {t: -0.5} for r, t in zip(batch.rows, tokens)]
        return StepResult(token_ids=tokens, logprobs=lps, forward_time=0.0, sample_time=0.0,
                          prompt_logprobs=[[{t: -1.0} for t in pc.target_ids] for pc in batch.prompt_logprob_chunks])


def make_core(num_pages=16, page_size=4, *, budget=64, max_seqs=8, max_len=128) -> EngineCore:
    cfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                       num_pages=num_pages, enable_prefix_caching=False, admission_watermark=0.0)
    return EngineCore(cfg, num_pages=num_pages, page_size=page_size, eos_token_ids=(EOS,), vocab_size=97)


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(core: EngineCore, ex: FakeExecutor, batch) -> StepResult:
    """The batch on the fake shard, after checking the page tables it resolves from the batch's delta."""
    ex.tables.check(core, batch)
    return ex.execute(batch)


def step(core: EngineCore, ex: FakeExecutor) -> list[EngineCoreOutput]:
    batch = core.schedule()
    return [] if batch is None else core.update(run(core, ex, batch))


def brief(outs: list[EngineCoreOutput]) -> list[tuple]:
    return [(o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in outs]


def test_schedule_update_exact_tokens_and_length_finish():
    core, ex = make_core(), FakeExecutor()
    core.add_request("a", [1, 2, 3, 4, 5], greedy(3))
    core.add_request("b", [7, 8], greedy(2))
    batch = core.schedule()
    assert batch.input_ids == [1, 2, 3, 4, 5, 7, 8] and batch.sample_chunks == [0, 1]
    assert [c.page_table for c in ex.tables.check(core, batch)] == [[0, 1], [2]]  # the first batch: whole tables
    assert brief(core.update(ex.execute(batch))) == [("a", 0, [10], None), ("b", 0, [10], None)]
    assert brief(step(core, ex)) == [("a", 0, [11], None), ("b", 0, [11], "length")]
    assert core.holds("a") and not core.holds("b")
    assert brief(step(core, ex)) == [("a", 0, [12], "length")]
    assert not core.has_unfinished() and core.pages.num_free_pages == 16
    stats = {s.request_id: s for s in core.pop_request_stats()}
    assert (stats["a"].finished_reason, stats["a"].generation_tokens) == ("length", 3)
    assert (stats["b"].finished_reason, stats["b"].generation_tokens) == ("length", 2)
    # a finished sequence reaches the shards with the next batch (they drop its sampler state)
    assert [b.released_seq_ids for b in ex.batches] == [[], [], [1]]
    core.add_request("c", [3], greedy(1))
    assert core.schedule().released_seq_ids == [0]


def test_eos_finishes_with_stop_and_logprobs_ride_along():
    core, ex = make_core(), FakeExecutor(eos_at={0: 1})
    core.add_request("a", [1, 2], greedy(8, logprobs=0))
    (first,) = step(core, ex)
    assert (first.new_token_ids, first.new_logprobs, first.finish_reason) == ([10], [{10: -0.5}], None)
    (second,) = step(core, ex)
    assert (second.new_token_ids, second.finish_reason) == ([EOS], "stop")
    assert core.pop_request_stats()[0].finished_reason == "stop"


def test_prompt_logprobs_come_once_complete():
    core, ex = make_core(budget=4), FakeExecutor()
    core.add_request("a", [1, 2, 3, 4, 5, 6], greedy(1, prompt_logprobs=0))
    assert step(core, ex) == []  # a 4-token chunk: nothing sampled yet
    (out,) = step(core, ex)
    assert out.prompt_logprobs == [None, {2: -1.0}, {3: -1.0}, {4: -1.0}, {5: -1.0}, {6: -1.0}]


def test_abort_frees_pages_in_any_state():
    core, ex = make_core(num_pages=8), FakeExecutor()
    core.add_request("run", [1] * 6, greedy(8))
    core.add_request("wait", [2] * 3, greedy(8))
    step(core, ex)
    assert core.pages.num_free_pages == 8 - 3
    assert core.abort_request("run") is not None and core.abort_request("wait") is not None
    assert core.pages.num_free_pages == 8 and not core.has_unfinished()
    assert core.abort_request("run") is None and core.abort_request("nobody") is None
    assert [s.finished_reason for s in core.pop_request_stats()] == ["abort", "abort"]
    assert core.schedule() is None


def test_a_failed_step_ends_exactly_its_requests():
    core, ex = make_core(max_seqs=1), FakeExecutor()
    core.add_request("a", [1, 2, 3], greedy(4))
    core.add_request("b", [4, 5], greedy(2))  # waits: one sequence at a time
    core.schedule()
    (out,) = core.fail_step("step")
    assert (out.request_id, out.finish_reason, out.new_token_ids) == ("a", "error", [])
    (stats,) = core.pop_request_stats()
    assert (stats.finished_reason, stats.failure_reason) == ("error", "step")
    assert brief(step(core, ex)) == [("b", 0, [10], None)]
    assert brief(step(core, ex)) == [("b", 0, [11], "length")]
    assert core.pages.num_free_pages == 16


def test_a_failed_step_hands_its_released_sequences_on():
    """Sequences released into a batch that failed still reach the shards with the next one."""
    core, ex = make_core(), FakeExecutor()
    core.add_request("a", [1, 2], greedy(1))
    step(core, ex)  # a finishes: its sequence (0) goes with the next batch
    core.add_request("b", [3, 4], greedy(1))
    assert core.schedule().released_seq_ids == [0]
    core.fail_step("step")
    core.add_request("c", [5, 6], greedy(1))
    assert core.schedule().released_seq_ids == [0, 1]


def test_update_needs_a_scheduled_step():
    core, ex = make_core(), FakeExecutor()
    with pytest.raises(RuntimeError, match="no step is scheduled"):
        core.update(StepResult(token_ids=[], logprobs=[], forward_time=0.0, sample_time=0.0))
    core.add_request("a", [1], greedy(1))
    batch = core.schedule()
    with pytest.raises(AssertionError, match="schedule\\(\\) twice"):
        core.schedule()
    core.update(run(core, ex, batch))


def test_preemption_recomputes_and_samples_the_same_tokens():
    # 4 pages of 4 tokens: two 6-token prompts take 2 pages each; the first decode past 8 tokens preempts b
    core, ex = make_core(num_pages=4), FakeExecutor()
    core.add_request("a", [1] * 6, greedy(6))
    core.add_request("b", [2] * 6, greedy(6))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    preempted = 0
    for _ in range(100):
        if not core.has_unfinished():
            break
        batch = core.schedule()
        preempted += len(core.scheduled.preempted) if batch is not None else 0
        for out in ([] if batch is None else core.update(run(core, ex, batch))):
            tokens[out.request_id] += out.new_token_ids
    assert preempted >= 1
    assert tokens == {"a": [10, 11, 12, 13, 14, 15], "b": [10, 11, 12, 13, 14, 15]}
    assert core.pages.num_free_pages == 4
    stats = {s.request_id: s for s in core.pop_request_stats()}
    assert stats["b"].num_preemptions >= 1


def test_a_stop_string_from_the_text_layer_finishes_the_sample():
    core, ex = make_core(), FakeExecutor()
    core.add_request("a", [1, 2], greedy(8))
    step(core, ex)
    core.stop_sequence("a", 0, "END")
    assert not core.holds("a") and core.pages.num_free_pages == 16
    (stats,) = core.pop_request_stats()
    assert stats.finished_reason == "stop"
    # the length limit ended it in the same step: the stop string wins, in the stats too
    core.add_request("b", [1, 2], greedy(1))
    (out,) = step(core, ex)
    assert out.finish_reason == "length"
    core.stop_sequence("b", 0, "END")
    assert core.pop_request_stats()[0].finished_reason == "stop"


def test_a_handoff_keeps_its_pages_until_freed():
    core, ex = make_core(), FakeExecutor()
    req = core.add_request("h", [1, 2, 3, 4, 5], greedy(8), handoff=True)
    (out,) = step(core, ex)
    assert (out.new_token_ids, out.finish_reason) == ([10], "handoff")
    assert not core.holds("h") and core.pages.num_free_pages == 16 - 2
    core.free_pages(req.seqs[0].seq_id)
    assert core.pages.num_free_pages == 16


def test_a_remote_request_decodes_from_its_first_token():
    core, ex = make_core(), FakeExecutor()
    req = core.add_remote("r", [1, 2, 3, 4, 5], greedy(3))
    assert core.pages.page_table(req.seqs[0].seq_id) == [0, 1] and core.schedule() is None
    assert brief(core.activate_remote("r", 42, None)) == [("r", 0, [42], None)]
    batch = core.schedule()
    assert batch.input_ids == [42] and batch.chunks[0].start == 5
    assert brief(core.update(run(core, ex, batch))) == [("r", 0, [11], None)]
    assert brief(step(core, ex)) == [("r", 0, [12], "length")]
    assert core.pages.num_free_pages == 16
    # an admission whose receive could not be prepared is withdrawn without a trace
    core.add_remote("x", [1, 2], greedy(2))
    core.withdraw_remote("x")
    assert not core.holds("x") and core.pages.num_free_pages == 16
    assert [s.request_id for s in core.pop_request_stats()] == ["r"]


def test_penalty_rows_send_their_token_ids_once_then_only_new_ones():
    """A row whose penalties read its token ids carries them in the batch's delta: the prompt and outputs once,
    then the one new token per step; the shard gets the lists a batch without deltas carried (ShardTables)."""
    core, ex = make_core(num_pages=6), FakeExecutor()
    core.add_request("rep", [1, 2, 3, 4, 5], greedy(6, repetition_penalty=1.3))
    core.add_request("freq", [6, 7], greedy(6, frequency_penalty=0.5))
    core.add_request("plain", [8, 9, 10], greedy(6))
    sent = []
    for _ in range(12):
        batch = core.schedule()
        if batch is None:
            break
        sent.append([(sid, base, len(ids)) for sid, base, ids in batch.seq_delta.tokens])
        core.update(run(core, ex, batch))
    # whole prompts with the prefill step, then the one new token a step; the plain request's never (it is
    # preempted by the two others' growth, recomputed, and decodes alone at the end)
    assert sent == [[(0, 0, 5), (1, 0, 2)], *([(0, n, 1), (1, n - 3, 1)] for n in range(5, 10)), [], []]
    assert core.scheduler.num_preemptions == 1
