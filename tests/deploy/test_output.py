"""deploy/output.py: the ingress makes the text of the engine's token ids (ChunkText over workers/text.py). Chunks
cut anywhere (one token each, or several merged) give the full decode; a stop string ends its sample at the token
that completed it, drops what the engine sent after it, is reported once (for the engine's stop), and no chunk ever
shows the start of a stop string that a later token completes. No Ray, no engine."""
from __future__ import annotations

import pytest

from deploy.output import ChunkText
from deploy.protocol import EngineChunk, SampleDelta
from workers.models import tiny_model_dir
from workers.request import SamplingParams
from workers.tokenizer import Tokenizer

TEXT = "Hello world, here is 🦀 and 漢字 then END of the story. More after END too."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir())


def chunks_of(ids: list[list[int]], *, sizes: list[int], finish: str | None = "length",
              logprobs: bool = False) -> list[EngineChunk]:
    """The engine's chunks for samples with token ids `ids[i]`, `sizes[k]` tokens per chunk (cycled); each sample
    finishes with its last token."""
    out, pos, k = [], [0] * len(ids), 0
    while any(p < len(s) for p, s in zip(pos, ids)):
        size = sizes[k % len(sizes)]
        samples = []
        for i, s in enumerate(ids):
            if pos[i] >= len(s):
                continue
            new = s[pos[i]:pos[i] + size]
            pos[i] += len(new)
            done = pos[i] == len(s)
            samples.append(SampleDelta(index=i, token_ids=new, logprobs=[{t: -1.0} for t in new] if logprobs else None,
                                       finish_reason=finish if done else None))
        out.append(EngineChunk(request_id="r", samples=samples, finished=all(p == len(s) for p, s in zip(pos, ids)),
                               prompt_token_ids=[1, 2] if k == 0 else None))
        k += 1
    return out


def run(text: ChunkText, chunks: list[EngineChunk]) -> tuple[dict[int, dict], list, list[str]]:
    """Apply every chunk until the request finished (as Stream.chunks does); per sample what the client got,
    the stops reported, and the text shown after each chunk (sample 0)."""
    got: dict[int, dict] = {}
    stops, shown = [], []
    for c in chunks:
        stops += text.apply(c)
        for s in c.samples:
            acc = got.setdefault(s.index, {"ids": [], "text": "", "lp": [], "finish": None, "stop": None})
            assert acc["finish"] is None, "a sample gained something after it finished"
            acc["ids"] += s.token_ids
            acc["text"] += s.text
            acc["lp"] += s.logprobs or []
            if s.finish_reason is not None:
                acc["finish"], acc["stop"] = s.finish_reason, s.stop_reason
        shown.append(got.get(0, {}).get("text", ""))
        if c.finished:
            break
    return got, stops, shown


@pytest.mark.parametrize("sizes", [[1], [3], [2, 5, 1], [1000]])
def test_text_equals_the_full_decode_however_the_chunks_are_cut(tokenizer, sizes):
    ids = tokenizer.encode(TEXT)
    got, stops, _ = run(ChunkText(tokenizer, [5, 6], SamplingParams(max_tokens=100)), chunks_of([ids], sizes=sizes))
    assert got[0]["text"] == tokenizer.decode(ids) == TEXT
    assert got[0]["ids"] == ids and got[0]["finish"] == "length" and stops == []


@pytest.mark.parametrize("sizes", [[1], [4], [1000]])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_sample_at_its_token(tokenizer, sizes, include):
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=100, stop=("END", "never"), include_stop_str_in_output=include)
    text = ChunkText(tokenizer, [], params)
    got, stops, shown = run(text, chunks_of([ids], sizes=sizes, logprobs=True))
    cut = TEXT.index("END")
    assert got[0]["text"] == TEXT[:cut + 3 if include else cut]
    assert (got[0]["finish"], got[0]["stop"]) == ("stop", "END") and stops == [(0, "END")]
    kept = got[0]["ids"]
    assert kept == ids[:len(kept)] and len(got[0]["lp"]) == len(kept)
    assert "END" in tokenizer.decode(kept) and "END" not in tokenizer.decode(kept[:-1])  # ends at its token
    assert text.finished
    for s in shown:  # never the start of "END" before it was known to be one: the text only grows
        assert got[0]["text"].startswith(s)


def test_one_sample_stops_the_other_goes_on(tokenizer):
    stopping = tokenizer.encode("alpha STOP beta gamma")
    going = tokenizer.encode("one two three four five six")
    text = ChunkText(tokenizer, [], SamplingParams(n=2, max_tokens=100, stop=("STOP",)))
    chunks = chunks_of([stopping, going], sizes=[1])
    got, stops, _ = run(text, chunks)
    assert got[0]["text"] == "alpha " and got[0]["finish"] == "stop" and stops == [(0, "STOP")]
    assert got[1]["text"] == "one two three four five six" and got[1]["finish"] == "length"
    assert chunks[-1].finished and text.finished


def test_engine_stop_token_is_not_a_stop_string(tokenizer):
    """The token a stop id ended the sample with keeps that reason, even if its text is a stop string."""
    ids = tokenizer.encode("abc xyz")
    last = tokenizer.decode(ids[-1:]).strip()
    assert last and last not in tokenizer.decode(ids[:-1])
    chunks = chunks_of([ids], sizes=[1000], finish="stop")
    chunks[-1].samples[0].stop_reason = ids[-1]
    got, stops, _ = run(ChunkText(tokenizer, [], SamplingParams(max_tokens=100, stop=(last,))), chunks)
    assert (got[0]["finish"], got[0]["stop"], got[0]["text"]) == ("stop", ids[-1], "abc xyz") and stops == []


class _RouterCall:
    """A router stream that already sent prefill's first token (the request is not on an engine replica yet)."""

    def __init__(self, events: list) -> None:
        self._events = events
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for e in self._events:
            yield e

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("stop_in_first", [True, False])
def test_a_stop_before_any_engine_replica_aborts_through_the_router(tokenizer, stop_in_first):
    """A stop string in a first token that came through the router (no replica to tell): the stream ends with it
    and closing it cancels the router's call (the router aborts prefill and decode). A request the engine finished
    itself is not cancelled."""
    import asyncio

    from deploy.stream.ingress_side import Stream

    ids = tokenizer.encode("abc xyz")
    first = chunks_of([ids], sizes=[1000], finish=None if stop_in_first else "length")[0]
    first.finished = not stop_in_first
    router = _RouterCall([first])
    params = SamplingParams(max_tokens=100, stop=("xyz",) if stop_in_first else ())
    stream = Stream(router, "r", None, ChunkText(tokenizer, [], params))

    async def main():
        await stream.receive_first()
        return [c async for c in stream.chunks()]

    got = asyncio.run(main())
    assert len(got) == 1 and got[0].finished and got[0].samples[0].text == ("abc " if stop_in_first else "abc xyz")
    stream.close()
    assert router.cancelled == stop_in_first
