"""AsyncEngine: streaming from the background step thread, early exits (client gone) abort and free pages in
prefill and in decode, bad requests and a full queue fail before the first output."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time

import pytest

from workers.async_engine import QueueFullError
from workers.request import SamplingParams


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def wait_until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


async def await_until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def test_concurrent_streams_yield_each_token_and_match_the_sync_engine(make_async, make_llm):
    prompts = [ids(n, n) for n in (5, 40, 90)]
    want = [o.outputs[0].token_ids for o in
            make_llm(num_pages=64).generate([{"prompt_token_ids": p} for p in prompts], greedy(6))]
    ae = make_async(num_pages=64)

    async def consume(rid, p):
        seen = []
        async for out in ae.generate(rid, p, greedy(6)):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    async def main():
        return await asyncio.gather(*(consume(f"r{i}", p) for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    for seen, w in zip(streams, want):
        assert seen[-1] == w
        # cumulative, one output per step the consumer kept up with (a lagging one gets the newest only)
        lens = [len(s) for s in seen]
        assert lens == sorted(set(lens)) and lens[-1] == 6 and all(s == w[:len(s)] for s in seen)
    assert [s.finished_reason for s in ae.pop_request_stats()].count("length") == 3


def test_a_lagging_consumer_gets_the_newest_output_only(make_async, make_llm):
    """Outputs are cumulative: one that is already superseded in the queue is skipped, so a consumer that fell
    behind moves several tokens at once; the tokens, text and logprobs it ends with are the same."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = make_llm(num_pages=64).generate([{"prompt_token_ids": ids(12)}], params)[0].outputs[0]
    ae = make_async(num_pages=64)

    async def main():
        seen = []
        async for out in ae.generate("lag", ids(12), params):
            seen.append(out)
            if len(seen) == 1:  # stop reading until the engine is done: every later output is queued by then
                await await_until(lambda: not ae.engine.has_unfinished())
        return seen

    seen = asyncio.run(main())
    # the first output read may already hold a second token (a step that ran before the consumer did), or on a
    # busy machine every token (the engine finished before the consumer's first read): then it is the only one
    assert seen[-1].finished and len(seen) <= 2 and not any(s.finished for s in seen[:-1])
    assert len(seen) == 1 or len(seen[0].outputs[0].token_ids) < 8
    last = seen[-1].outputs[0]
    assert (last.token_ids, last.finish_reason) == (want.token_ids, "length")
    assert last.text == "" and want.text  # the engine sends token ids; the offline LLM makes their text
    assert len(last.logprobs) == 8 and all(a.keys() == b.keys() for a, b in zip(last.logprobs, want.logprobs))


def test_newest_keeps_an_error_queued_behind_outputs():
    from workers.async_engine import _newest
    from workers.request import CompletionOutput, RequestOutput

    def out(n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                             outputs=[CompletionOutput(index=0, token_ids=list(range(n)))], finished=finished)

    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for item in (out(2), out(3), RuntimeError("gone")):
            q.put_nowait(item)
        first = _newest(q, out(1))
        assert len(first.outputs[0].token_ids) == 3  # the newest output first
        assert isinstance(_newest(q, q.get_nowait()), RuntimeError) and q.empty()  # then the error
        done = out(4, finished=True)  # a finished output is the stream's last: nothing is skipped for it
        q.put_nowait(out(5))
        assert _newest(q, done) is done and q.qsize() == 1

    asyncio.run(main())


def test_early_exit_mid_decode_and_mid_prefill_frees_pages(make_async):
    ae = make_async(num_pages=64, max_num_batched_tokens=16)

    async def main():
        # mid-decode: the client stops reading after two tokens
        async with contextlib.aclosing(ae.generate("dec", ids(10), greedy(200))) as gen:
            n = 0
            async for _ in gen:
                n += 1
                if n == 2:
                    break
        await await_until(lambda: ae.stats().num_pages_free == 64 and ae.stats().num_running == 0)
        # leaving with `break` and dropping the iterator (no explicit close) also aborts
        gen = ae.generate("dec2", ids(10, 1), greedy(200))
        async for _ in gen:
            break
        del gen
        await await_until(lambda: ae.stats().num_pages_free == 64 and ae.stats().num_running == 0)

        # mid-prefill: 300 prompt tokens at 16 per step; the consumer is cancelled before any output
        async def consume():
            async for _ in ae.generate("pre", ids(300, 2), greedy(5)):
                pass

        task = asyncio.create_task(consume())
        await await_until(lambda: 0 < ae.stats().num_pages_total - ae.stats().num_pages_free < 19)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await await_until(lambda: ae.stats().num_pages_free == 64 and not ae.engine.has_unfinished())

    asyncio.run(main())
    reasons = {s.request_id: s.finished_reason for s in ae.pop_request_stats()}
    assert reasons == {"dec": "abort", "dec2": "abort", "pre": "abort"}


def test_bad_request_and_full_queue_fail_before_the_first_output(make_async):
    ae = make_async(num_pages=64, max_num_seqs=1, max_waiting=1)

    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            async for _ in ae.generate("bad", [], greedy(1)):
                pass
        first = ae.generate("a", ids(8), greedy(100))
        await first.__anext__()  # running, holding the only seat
        second = ae.generate("b", ids(8, 1), greedy(3))
        second_task = asyncio.ensure_future(second.__anext__())  # queued: waits for the seat
        await await_until(lambda: ae.stats().num_waiting == 1)
        with pytest.raises(QueueFullError):
            await ae.generate("c", ids(8, 2), greedy(1)).__anext__()
        with pytest.raises(ValueError, match="request_id"):
            await ae.generate("a", ids(8), greedy(1)).__anext__()
        await first.aclose()  # frees the seat: b runs to completion
        out = await second_task
        async for out in second:
            pass
        assert out.finished and len(out.outputs[0].token_ids) == 3

    asyncio.run(main())


def test_debug_timeline_records_steps_with_wall_times_and_token_counts(make_async):
    ae = make_async(num_pages=64)
    since = time.time()

    async def consume(rid, p):
        return [out async for out in ae.generate(rid, p, greedy(4))]

    async def main():
        await asyncio.gather(consume("a", ids(20, 1)), consume("b", ids(7, 2)))

    asyncio.run(main())
    tl = ae.debug_timeline(since)
    steps = [dict(zip(tl["step_fields"], s)) for s in tl["steps"]]
    assert steps and all(since <= s["start"] <= s["end"] <= tl["now"] for s in steps)
    assert all(a["end"] <= b["start"] for a, b in zip(steps, steps[1:]))  # one step thread: never overlapping
    assert sum(s["prefill_tokens"] for s in steps) == 27
    # each request's output count after each step that moved it: 1, 2, 3, 4 in step order
    for rid in ("a", "b"):
        assert [n for s in steps for r, n in s["tokens"] if r == rid] == [1, 2, 3, 4]
    assert all(s["forward_s"] >= 0 and s["host_s"] >= 0 and s["publish_s"] >= 0 for s in steps)
    assert tl["marks"] == []  # unified: no handoffs
    assert ae.debug_timeline(tl["now"] + 1.0)["steps"] == []
    # the metrics feed's StepStats carry the same wall-clock starts
    assert sorted(s.start_time for s in ae.pop_step_stats())[-len(steps):] == [s["start"] for s in steps]


def test_step_thread_pins_itself_to_the_cpus_named_and_a_bad_value_fails_the_load(make_async, monkeypatch):
    """M3SERVE_STEP_CPUS / M3SERVE_STEP_NICE: the step thread runs on those CPUs at that niceness and still
    serves; the thread whose loop submitted (it publishes the tokens) takes the niceness too, not the CPUs; other
    threads keep theirs. A malformed value or an absent CPU fails the engine's construction with the variable
    named, before any thread starts."""
    from workers.step_thread import STEP_CPUS_ENV, STEP_NICE_ENV, parse_cpus

    assert parse_cpus("3, 0-1,7-7") == {0, 1, 3, 7}
    for bad in ("x", "2-1", "-1", "1-"):
        with pytest.raises(ValueError, match=STEP_CPUS_ENV):
            parse_cpus(bad)
    mine, my_nice = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cpu = max(mine)
    monkeypatch.setenv(STEP_CPUS_ENV, str(cpu))
    monkeypatch.setenv(STEP_NICE_ENV, "19")  # raising a niceness needs no privilege
    ae = make_async(num_pages=64)

    async def main():
        return [out async for out in ae.generate("a", ids(9), greedy(3))]

    caller = {}

    def submit_from_a_loop_of_its_own():  # not this thread: its niceness would stay raised for later tests
        caller["tokens"] = asyncio.run(main())[-1].outputs[0].token_ids
        caller["affinity"] = os.sched_getaffinity(0)
        caller["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=submit_from_a_loop_of_its_own)
    t.start()
    t.join()
    assert len(caller["tokens"]) == 3
    assert os.sched_getaffinity(ae._thread.native_id) == {cpu}
    assert os.getpriority(os.PRIO_PROCESS, ae._thread.native_id) == 19
    assert caller["nice"] == 19 and caller["affinity"] == mine  # the loop's thread: the niceness, not the CPUs
    assert os.sched_getaffinity(0) == mine  # a thread that did not submit is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == my_nice
    for env, value in ((STEP_CPUS_ENV, str(os.cpu_count())), (STEP_NICE_ENV, "20"), (STEP_NICE_ENV, "low")):
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=env):
            make_async(num_pages=64)
        monkeypatch.delenv(env)


def _nice_after(start: int, placement) -> int:
    """The niceness of a fresh thread started at `start` after `placement.apply()` on it."""
    got = []

    def body():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start)
        placement.apply()
        got.append(os.getpriority(os.PRIO_PROCESS, tid))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return got[0]


def test_step_thread_leaves_rays_worker_niceness_where_it_may(caplog):
    """Ray starts its workers at niceness 15; the step thread keeps it by default, goes where M3SERVE_STEP_NICE
    says, and where lowering a niceness is not permitted it stays and says why."""
    from workers.step_thread import StepPlacement, step_niceness

    assert [step_niceness(v) for v in (None, "", " 0", "7", "-3", "inherit")] == [None, None, 0, 7, -3, None]
    assert _nice_after(15, StepPlacement()) == 15
    assert _nice_after(15, StepPlacement(nice=19)) == 19
    # may this process lower a niceness? (root with CAP_SYS_NICE: yes; an unprivileged CI user: no)
    privileged = _nice_after(15, StepPlacement(nice=14)) == 14
    with caplog.at_level(logging.WARNING, logger="m3serve.engine"):
        got = _nice_after(15, StepPlacement(nice=0))
    if privileged:
        assert got == 0 and "niceness" not in caplog.text
    else:
        assert got == 15 and "stays at niceness 15, not 0" in caplog.text


def test_stop_finishes_a_sample_with_its_stop_string(make_async):
    """`stop` (a stop string found outside the engine, in the text) finishes the sample with reason "stop" between
    steps: its stream ends with that finish, the pages are free and the stats say "stop". A stop for a request
    that already ended changes nothing."""
    ae = make_async(num_pages=64)
    total = ae.engine.stats().num_pages_free

    async def main():
        outs = []
        async for out in ae.generate("s", ids(10), greedy(400)):
            outs.append(out)
            if len(outs) == 2:
                ae.stop("s", 0, "END")
        return outs

    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finished and (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", "END")
    assert len(last.outputs[0].token_ids) < 400
    ae.stop("s", 0, "END")  # gone already: nothing happens
    wait_until(lambda: ae.stats().num_pages_free == total and not ae.engine.has_unfinished())
    assert [s.finished_reason for s in ae.pop_request_stats()] == ["stop"]


def test_one_step_reaches_each_event_loop_in_one_call():
    """The step thread hands a step's outputs to an event loop in one call_soon_threadsafe (one wake-up), in order;
    a closed loop is skipped without failing the others."""
    import asyncio

    from workers.async_engine import _put_all, _Stream

    class CountingLoop(asyncio.SelectorEventLoop):
        calls = 0

        def call_soon_threadsafe(self, *args, **kw):
            CountingLoop.calls += 1
            return super().call_soon_threadsafe(*args, **kw)

    loop, closed = CountingLoop(), asyncio.new_event_loop()
    closed.close()
    try:
        queues = [asyncio.Queue() for _ in range(3)]
        streams = [_Stream(loop, q) for q in queues] + [_Stream(closed, asyncio.Queue())]
        _put_all([(streams[0], "a0"), (streams[1], "b0"), (streams[3], "x"), (streams[0], "a1"), (streams[2], "c0")])
        assert CountingLoop.calls == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [["a0", "a1"], ["b0"], ["c0"]]
    finally:
        loop.close()
