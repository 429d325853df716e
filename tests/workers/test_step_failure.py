"""A step whose execute raises (out of memory, or any error) fails exactly the requests scheduled in it, with a
clear error, frees their pages, and the engine serves on: in the engine itself, and through the async engine,
whose step thread survives (the stream of a failed request raises `StepFailedError`, even one already streaming).
The executor that fails is a test-only wrapper around the real one."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from workers.batch_delta import SeqDeltaEncoder
from workers.engine import Engine
from workers.request import SamplingParams, StepFailedError


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


class FailingExecutor:
    """Test-only: the engine's executor, raising `error` on the first step whose batch `fail(batch)` picks;
    `ran_first`: after the shard ran that step (its page-table delta applied there), else before it saw it."""

    def __init__(self, inner, fail, error: Exception, *, ran_first: bool = False) -> None:
        self.inner, self.fail, self.error, self.ran_first = inner, fail, error, ran_first
        self.failed: list = []  # the batches it failed

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch):
        if not self.failed and self.fail(batch):
            self.failed.append(batch)
            if self.ran_first:
                self.inner.execute(batch)
            raise self.error
        return self.inner.execute(batch)


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")


def prefill_from(start: int):
    """Pick the step holding a prefill chunk that starts at `start`."""
    return lambda batch: any(not c.is_decode and c.start == start for c in batch.chunks)


def run(engine: Engine) -> dict:
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


REQUESTS = {"a": (ids(20, 1), 12), "b": (ids(70, 2), 6), "c": (ids(9, 3), 5)}  # c waits: max_num_seqs = 2


def submit(engine: Engine, names=("a", "b", "c")) -> None:
    for name in names:
        prompt, k = REQUESTS[name]
        engine.add_request(name, prompt, greedy(k))


@pytest.mark.parametrize("ran_first", [False, True], ids=["before-the-shard", "after-the-shard-ran-it"])
def test_an_out_of_memory_step_fails_only_its_requests_and_the_engine_serves_on(make_llm, ran_first):
    cfg = dict(num_pages=64, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=2)
    undisturbed = make_llm(**cfg).engine
    submit(undisturbed)
    want = run(undisturbed)
    undisturbed.add_request("d", ids(30, 4), greedy(7))
    want.update(run(undisturbed))

    engine = make_llm(**cfg).engine
    # batches with per-sequence deltas, as for a shard in another process (the in-process executor gets live
    # tables): a failed step must leave the shard's mirror in step (the delta reset)
    engine.core.seq_delta = SeqDeltaEncoder()
    # step 1: a's prompt (20) + b's first 12 tokens; step 2, failed: b's next 31 tokens + a's first decode row
    engine.executor = FailingExecutor(engine.executor, prefill_from(12), oom(), ran_first=ran_first)
    submit(engine)
    got = run(engine)
    (batch,) = engine.executor.failed
    assert len(batch.chunks) == 2 and batch.chunks[1].is_decode  # b's chunk and a's decode row
    assert batch.seq_delta is not None
    for name in ("a", "b"):
        out = got[name]
        assert isinstance(out.error, StepFailedError) and out.error.out_of_memory
        assert str(out.error) == ("the engine ran out of GPU memory in this step (32 tokens, 2 requests); "
                                  "try a shorter prompt or lower max_num_batched_tokens")
        assert out.finished and [c.finish_reason for c in out.outputs] == ["error"]
    # a had its first token before the failure: its last output keeps it (the undisturbed run's first token)
    assert got["a"].outputs[0].token_ids == want["a"].outputs[0].token_ids[:1]
    assert got["b"].outputs[0].token_ids == []
    # c was waiting, never in the failed step: it runs as if nothing happened
    assert got["c"].error is None and got["c"].outputs[0].token_ids == want["c"].outputs[0].token_ids
    for lp, lp_want in zip(got["c"].outputs[0].logprobs, want["c"].outputs[0].logprobs, strict=True):
        assert lp.keys() == lp_want.keys() and list(lp.values()) == pytest.approx(list(lp_want.values()), abs=1e-5)
    assert engine.pages.num_free_pages == engine.num_pages and engine.pages.owners() == {}
    reasons = {s.request_id: (s.finished_reason, s.failure_reason) for s in engine.pop_request_stats()}
    assert reasons == {"a": ("error", "out_of_memory"), "b": ("error", "out_of_memory"), "c": ("length", None)}
    engine.add_request("d", ids(30, 4), greedy(7))  # a new request after the failure: served normally
    assert run(engine)["d"].outputs[0].token_ids == want["d"].outputs[0].token_ids


def test_any_other_step_error_fails_its_requests_too_and_names_the_cause(make_llm):
    engine = make_llm(num_pages=64, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=2).engine
    engine.executor = FailingExecutor(engine.executor, lambda b: True, ValueError("chunks[0]: bad page table"))
    engine.add_request("x", ids(10), greedy(3))
    (out,) = engine.step()
    assert not out.error.out_of_memory and out.outputs[0].finish_reason == "error"
    assert str(out.error) == ("the engine step failed (10 tokens, 1 requests): ValueError: chunks[0]: bad page "
                              "table")
    assert not engine.has_unfinished() and engine.pages.num_free_pages == engine.num_pages
    engine.add_request("y", ids(10), greedy(3))
    assert len(run(engine)["y"].outputs[0].token_ids) == 3


def test_a_dead_executor_still_stops_the_engine(make_llm):
    from workers.executor import ExecutorDeadError

    engine = make_llm(num_pages=64, max_model_len=256).engine
    engine.executor = FailingExecutor(engine.executor, lambda b: True, ExecutorDeadError("rank 1 died"))
    engine.add_request("x", ids(10), greedy(3))
    with pytest.raises(ExecutorDeadError, match="rank 1 died"):
        engine.step()
    engine.executor = engine.executor.inner
    assert engine.abort_request("x")  # the fixture's check: nothing left behind


def test_the_async_step_thread_survives_a_failed_step(make_async, make_llm):
    """A streaming request fails in its third decode step (three tokens streamed); the request queued behind
    it (max_num_seqs = 1) then runs undisturbed, and so does a request sent afterwards."""
    cfg = dict(num_pages=64, max_model_len=256, max_num_seqs=1)
    p_fail, p_wait, p_after = ids(40, 5), ids(25, 6), ids(12, 7)
    want = {o.request_id: o.outputs[0] for o in
            make_llm(**cfg).generate([{"prompt_token_ids": p} for p in (p_wait, p_after)], greedy(6))}
    ae = make_async(**cfg)
    # the step of its decode row at position 42: after its first three tokens
    ae.engine.executor = FailingExecutor(ae.engine.executor,
                                         lambda b: any(c.is_decode and c.start == 42 for c in b.chunks), oom())

    async def collect(rid: str, prompt: list[int]) -> tuple[list, BaseException | None]:
        seen = []
        try:
            async for out in ae.generate(rid, prompt, greedy(6)):
                seen.append(out)
        except StepFailedError as e:
            return seen, e
        return seen, None

    async def main():
        failing, waiting = await asyncio.gather(collect("f", p_fail), collect("w", p_wait))
        after = await collect("n", p_after)
        return failing, waiting, after

    (f_seen, f_err), (w_seen, w_err), (n_seen, n_err) = asyncio.run(main())
    assert f_err is not None and f_err.out_of_memory and "ran out of GPU memory" in str(f_err)
    assert f_seen and len(f_seen[-1].outputs[0].token_ids) == 3 and not f_seen[-1].finished
    assert w_err is None and w_seen[-1].outputs[0].token_ids == want["llm-0"].token_ids
    assert n_err is None and n_seen[-1].outputs[0].token_ids == want["llm-1"].token_ids
    assert ae._thread.is_alive() and ae._error is None
    st = ae.stats()
    assert st.num_pages_free == st.num_pages_total and ae.engine.pages.owners() == {} and not ae.num_in_flight
