"""deploy/stream/ (chunks, engine_side, ingress_side): a lagging consumer of a token stream gets fewer, larger
chunks that carry exactly what the single chunks carried (tokens, text, logprobs, finish reasons, the prompt);
errors keep their place. No Ray, no timing: the lag is made by yielding to the event loop a fixed number of
times."""
from __future__ import annotations

import asyncio

import pytest

from deploy.protocol import EngineChunk, EngineError, SampleDelta
from deploy.stream.chunks import merge_chunks, merge_runs


def chunk(step: int, *, n: int = 2, finish_at: int | None = None, logprobs: bool = True) -> EngineChunk:
    """Step `step`'s delta of a request with `n` samples; sample i finishes at step `finish_at` + i."""
    samples = []
    for i in range(n):
        if finish_at is not None and step > finish_at + i:
            continue  # finished earlier: no more deltas for it
        done = finish_at is not None and step == finish_at + i
        samples.append(SampleDelta(index=i, token_ids=[100 * i + step], text=f"<{i}.{step}>",
                                   logprobs=[{100 * i + step: -0.5 * step}] if logprobs else None,
                                   finish_reason="stop" if done else None, stop_reason=2 if done else None))
    last = finish_at is not None and step >= finish_at + n - 1
    return EngineChunk(request_id="r", samples=samples, finished=last,
                       prompt_token_ids=[1, 2, 3] if step == 0 else None,
                       prompt_logprobs=[None, {2: -1.0}, {3: -2.0}] if step == 0 else None)


def flatten(chunks: list[EngineChunk]) -> dict[int, dict]:
    """Per sample: everything the chunks carry, concatenated, as a client accumulates it."""
    out: dict[int, dict] = {}
    for c in chunks:
        for s in c.samples:
            acc = out.setdefault(s.index, {"ids": [], "text": "", "lp": [], "finish": None, "stop": None})
            acc["ids"] += s.token_ids
            acc["text"] += s.text
            acc["lp"] += s.logprobs or []
            if s.finish_reason is not None:
                acc["finish"], acc["stop"] = s.finish_reason, s.stop_reason
    return out


def test_merge_concatenates_every_sample_and_keeps_the_prompt():
    chunks = [chunk(s, finish_at=4) for s in range(6)]
    merged = merge_chunks(chunks)
    assert flatten([merged]) == flatten(chunks)
    assert merged.finished and merged.prompt_token_ids == [1, 2, 3] and merged.prompt_logprobs[2] == {3: -2.0}
    assert [s.index for s in merged.samples] == [0, 1]
    assert chunks[0].samples[0].token_ids == [0]  # the inputs are left as they were (the ingress keeps the first)
    later = merge_chunks(chunks[2:4])
    assert later.prompt_token_ids is None and not later.finished and later.samples[0].token_ids == [2, 3]


def test_merge_runs_never_moves_a_chunk_past_an_error():
    err = EngineError(status=503, message="gone")
    out = merge_runs([chunk(0), chunk(1), err, chunk(2)])
    assert [type(e) for e in out] == [EngineChunk, EngineError, EngineChunk]
    assert out[0].samples[0].token_ids == [0, 1] and out[2].samples[0].token_ids == [2]


async def produce(chunks: list, *, error: BaseException | None = None, closed: list | None = None):
    """A source that hands over one event per event-loop turn, like a stream fed by another process."""
    try:
        for c in chunks:
            await asyncio.sleep(0)
            yield c
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


async def consume(events, lag_turns: int) -> list:
    """Read everything, giving the loop `lag_turns` turns after each event (the consumer's own work)."""
    got = []
    async for e in events:
        got.append(e)
        for _ in range(lag_turns):
            await asyncio.sleep(0)
    return got


def test_event_queue_hands_over_what_piled_up_merged_then_its_error():
    from deploy.stream.chunks import EventQueue

    async def main():
        q = EventQueue()
        for s in range(3):
            q.put(chunk(s))
        it = q.__aiter__()
        first = await it.__anext__()
        q.put(chunk(3))
        q.fail(RuntimeError("subscription broke"))
        second = await it.__anext__()
        with pytest.raises(RuntimeError, match="subscription broke"):
            await it.__anext__()
        return first, second

    first, second = asyncio.run(main())
    assert first.samples[0].token_ids == [0, 1, 2] and second.samples[0].token_ids == [3]


def test_outbox_sends_one_merged_chunk_per_request_and_keeps_errors_apart():
    from deploy.stream.engine_side import Outbox

    async def main():
        box = Outbox()
        box.put("a", chunk(0))
        box.put("b", chunk(0))
        box.put("a", chunk(1))
        box.put("b", EngineError(status=503, message="kv"))
        assert box.wake.is_set()
        batch = box.take()
        assert box.take() == []
        return batch

    batch = asyncio.run(main())
    assert [rid for rid, _ in batch] == ["a", "b", "b"]
    assert batch[0][1].samples[0].token_ids == [0, 1] and isinstance(batch[2][1], EngineError)


def test_publisher_serves_each_subscriber_its_requests_and_closing_or_cancelling_ends_their_streams():
    """The engine replica's subscriptions (deploy/stream/engine_side.py `Publisher`): a subscriber's stream opens
    with an empty item, then carries its requests' events merged per request; `cancel` (an abort) and the stream's
    end (the subscriber left) close each request's engine stream, which is what aborts it in the engine."""
    from deploy.stream.engine_side import Publisher

    closed: list[str] = []

    async def engine_stream(rid: str, feed: asyncio.Queue):
        try:
            while True:
                yield await feed.get()
        finally:
            closed.append(rid)

    async def main():
        pub = Publisher()
        sub = pub.serve("ingress-1")
        assert await sub.__anext__() == [] and pub.serves("ingress-1") and not pub.serves("ingress-2")
        feeds = {rid: asyncio.Queue() for rid in ("a", "b")}
        for rid, feed in feeds.items():
            pub.start("ingress-1", rid, engine_stream(rid, feed))
        for s in range(2):
            feeds["a"].put_nowait(chunk(s))
        feeds["b"].put_nowait(chunk(0))
        got: dict[str, list[int]] = {}
        while sum(len(v) for v in got.values()) < 3:
            for rid, event in await sub.__anext__():
                got.setdefault(rid, []).extend(event.samples[0].token_ids)
        pub.cancel("a")
        for _ in range(3):
            await asyncio.sleep(0)
        assert closed == ["a"]
        await sub.aclose()
        for _ in range(3):
            await asyncio.sleep(0)
        return got, pub.serves("ingress-1")

    got, still_served = asyncio.run(main())
    assert got == {"a": [0, 1], "b": [0]}
    assert closed == ["a", "b"] and not still_served


def test_chunk_encoder_writes_what_the_pydantic_chunks_write():
    """The SSE events written from plain dicts parse to the pydantic models' JSON (fields, order, values; a -inf
    logprob is null as pydantic writes it), unicode and escapes included."""
    import json

    from deploy.protocol import (
        ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatLogprobEntry, ChatLogprobs, ChunkEncoder,
        CompletionChoice, CompletionChunk, CompletionLogprobs, TopLogprob, UsageInfo, chat_chunk_choice,
        completion_choice, sse_event,
    )

    def same(ours: str, theirs: str) -> None:
        assert ours.startswith("data: ") and ours.endswith("\n\n")
        a, b = json.loads(ours[6:]), json.loads(theirs[6:])
        b["created"] = a["created"]
        assert a == b and list(a) == list(b) and list(a["choices"][0] if a["choices"] else {}) == \
            list(b["choices"][0] if b["choices"] else {})

    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    lp = CompletionLogprobs(tokens=["a", "é"], token_logprobs=[-0.5, None], top_logprobs=[{"a": -0.5}, None],
                            text_offset=[0, 1])
    enc = ChunkEncoder(id="cmpl-1", object="text_completion", model="m3-tiny")
    kw = dict(index=1, text='aé\n"', logprobs=lp, finish_reason="stop", stop_reason="\n", token_ids=[4, 5],
              prompt_token_ids=[1, 2, 3])
    same(enc.event([completion_choice(**kw)], usage),
         sse_event(CompletionChunk(id="cmpl-1", model="m3-tiny", choices=[CompletionChoice(**kw)], usage=usage)))
    same(enc.event([], usage), sse_event(CompletionChunk(id="cmpl-1", model="m3-tiny", choices=[], usage=usage)))

    chat = ChatLogprobs(content=[ChatLogprobEntry(token="x", logprob=float("-inf"), bytes=[120],
                                                  top_logprobs=[TopLogprob(token="x", logprob=-1.0, bytes=[120])])])
    enc = ChunkEncoder(id="chatcmpl-1", object="chat.completion.chunk", model="m")
    same(enc.event([chat_chunk_choice(index=0, content="x", logprobs=chat, finish_reason="length", token_ids=[7])],
                   None, prompt_token_ids=None),
         sse_event(ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatChunkChoice(
             index=0, delta=ChatDelta(content="x"), logprobs=chat, finish_reason="length", token_ids=[7])])))
    same(enc.event([chat_chunk_choice(index=0, role="assistant", content="")], None, prompt_token_ids=[1, 2]),
         sse_event(ChatCompletionChunk(id="chatcmpl-1", model="m", prompt_token_ids=[1, 2], choices=[
             ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))])))


class _FakeEngine:
    """A stand-in for an EngineServer handle: `subscribe` streams what the test feeds it; `start` answers a first
    chunk at once."""

    def __init__(self) -> None:
        self.feeds: list[asyncio.Queue] = []

    def options(self, stream: bool = False):
        return self

    @property
    def subscribe(self):
        engine = self

        class _Call:
            def remote(self, subscriber):
                feed: asyncio.Queue = asyncio.Queue()
                engine.feeds.append(feed)
                feed.put_nowait([])  # subscribed

                class _Gen:
                    cancelled = False

                    def __aiter__(self):
                        return self

                    async def __anext__(self):
                        item = await feed.get()
                        if isinstance(item, BaseException):
                            raise item
                        return item

                    def cancel(self):
                        feed.put_nowait(RuntimeError("cancelled"))

                return _Gen()
        return _Call()

    @property
    def start(self):
        class _Call:
            def remote(self, subscriber, method, args):
                async def answer():
                    return chunk(0)
                return answer()
        return _Call()


def test_a_subscription_hands_each_request_its_events_and_a_broken_one_fails_only_its_own():
    from deploy.stream.ingress_side import Subscription as _Subscription
    from deploy.protocol import Redirect
    from deploy.stream.chunks import EventQueue

    def redirect(rid: str) -> Redirect:
        return Redirect(app_name="a", deployment="e", method="generate", args=(), request_id=rid, release_id=rid)

    async def main():
        engine = _FakeEngine()
        old = _Subscription(engine, "me")
        qa, qb = EventQueue(), EventQueue()
        assert (await old.start(redirect("a"), qa)).samples[0].token_ids == [0]
        await old.start(redirect("b"), qb)
        engine.feeds[0].put_nowait([("a", chunk(1)), ("b", chunk(1)), ("a", chunk(2))])
        a_events, b_events = qa.__aiter__(), qb.__aiter__()
        assert (await a_events.__anext__()).samples[0].token_ids == [1, 2]
        assert (await b_events.__anext__()).samples[0].token_ids == [1]
        new = _Subscription(engine, "me")  # opened while the old one still runs
        qc = EventQueue()
        await new.start(redirect("c"), qc)
        engine.feeds[0].put_nowait(RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            await a_events.__anext__()
        assert old.broken and not new.broken
        engine.feeds[1].put_nowait([("c", chunk(1, finish_at=1, n=1))])
        last = await qc.__aiter__().__anext__()
        assert last.finished and last.samples[0].token_ids == [1]

    asyncio.run(main())


def test_a_delta_never_counts_a_token_it_did_not_carry():
    """The engine's outputs share its live token list; a token appended after the output was made (its logprobs
    snapshot is shorter) goes out with the next chunk, with its logprob, instead of being skipped."""
    from deploy.stream.engine_side import DeltaTracker
    from workers.request import CompletionOutput, RequestOutput

    live = [10, 11]
    lps = [{10: -0.1}, {11: -0.2}]

    def out(n_lp: int, text: str, finished: bool = False) -> RequestOutput:
        comp = CompletionOutput(index=0, token_ids=live, text=text, logprobs=list(lps[:n_lp]),
                                finish_reason="length" if finished else None)
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[comp], finished=finished)

    tracker = DeltaTracker()
    first = out(2, "ab")
    live.append(12)  # the step thread moved on before `first` was sent
    lps.append({12: -0.3})
    a = tracker.chunk(first)
    b = tracker.chunk(out(3, "abc", finished=True))
    assert a.samples[0].token_ids == [10, 11] and a.samples[0].logprobs == [{10: -0.1}, {11: -0.2}]
    assert b.samples[0].token_ids == [12] and b.samples[0].logprobs == [{12: -0.3}] and b.finished
