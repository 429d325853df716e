"""A prefill and a decode `AsyncEngine` in one process over a real gloo pair: the decode request starts when its
KV lands (the first token comes in the KV header), before anyone streams it; `generate_remote` then picks up
what was decoded meanwhile; a request nobody comes for is stopped after the park timeout; `fail_remote` ends a
waiting request at once. Both pools hold no page afterwards."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from workers.async_engine import AsyncEngine
from workers.config import EngineConfig
from workers.engine import Engine, KVTransferFailed
from workers.request import SamplingParams
from workers.kv.config import TransferConfig

P_GROUP, D_GROUP = "prefill-0#0", "decode-0#0"


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """(prefill AsyncEngine, decode AsyncEngine, unified Engine) with one open gloo pair."""
    torch.set_num_threads(1)
    cfg = TransferConfig(timeout_s=3.0, receive_timeout_s=30.0, lease_s=30.0)
    ec = EngineConfig(max_model_len=256, num_pages=64, max_num_batched_tokens=128)
    prefill = Engine(tiny_ckpt, engine_config=ec, role="prefill", transfer=cfg)
    decode = Engine(tiny_ckpt, engine_config=ec, role="decode", transfer=cfg)
    prefill.agents[0].connect(D_GROUP, decode.agents[0].listen(P_GROUP, remote_tp=1))
    prefill.agents[0].wait_ready(10)
    decode.agents[0].wait_ready(10)
    unified = Engine(tiny_ckpt, engine_config=ec, role="unified")
    ap, ad = AsyncEngine(prefill), AsyncEngine(decode)
    yield ap, ad, unified
    ap.shutdown()
    ad.shutdown()
    unified.shutdown()


def reference(unified: Engine, rid: str, ids: list[int], params: SamplingParams):
    unified.add_request(rid, ids, params)
    while unified.has_unfinished():
        for o in unified.step():
            if o.finished:
                return o.outputs[0]
    raise AssertionError("no output")


async def prefill_and_send(ap: AsyncEngine, ad: AsyncEngine, rid: str, ids: list[int], params: SamplingParams):
    """Admit on decode, run the prefill (handing off); returns the prefill's first-token output once the KV
    transfer settled OK."""
    pages = await ad.call(lambda e: e.admit_remote(rid, ids, params, group=P_GROUP))
    assert pages is not None
    first = None
    async for out in ap.generate(rid, ids, params, handoff_to=D_GROUP):
        first = out
    assert await ap.transfer_outcome(rid, 10.0) == (True, None)
    return first


async def until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def pages_free(ae: AsyncEngine) -> bool:
    st = ae.stats()
    return st.num_pages_free == st.num_pages_total and ae.engine.pages.owners() == {}


def test_a_late_stream_gets_what_was_decoded_meanwhile(engines):
    ap, ad, unified = engines
    ids = prompt(70, seed=1)
    want_short = reference(unified, "u-short", ids, greedy(4))
    want_long = reference(unified, "u-long", ids, greedy(120))

    async def main():
        # finished before anyone attached: the stream is that one output
        first = await prefill_and_send(ap, ad, "short", ids, greedy(4))
        await until(lambda: "short" in ad._parked and ad._parked["short"][0].finished)
        c = first.outputs[0]
        outs = [o async for o in ad.generate_remote("short", c.token_ids[0], c.logprobs[0])]
        assert len(outs) == 1 and outs[0].finished
        got = outs[0].outputs[0]
        assert got.token_ids == want_short.token_ids and got.text == want_short.text
        # still running when the stream attaches: its first output holds the tokens so far, the rest follow
        first = await prefill_and_send(ap, ad, "long", ids, greedy(120))
        await until(lambda: "long" in ad._parked and len(ad._parked["long"][0].outputs[0].token_ids) >= 3)
        c = first.outputs[0]
        outs = [o async for o in ad.generate_remote("long", c.token_ids[0], c.logprobs[0])]
        assert len(outs[0].outputs[0].token_ids) >= 3
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(counts) and outs[-1].finished
        got = outs[-1].outputs[0]
        assert got.token_ids == want_long.token_ids and got.text == want_long.text
        for a, b in zip(got.logprobs, want_long.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)

    asyncio.run(main())
    assert not ad._parked
    assert pages_free(ad) and pages_free(ap)


def test_parked_requests_are_stopped_by_abort_and_by_the_park_timeout(engines):
    ap, ad, _ = engines
    ids = prompt(50, seed=2)

    async def main():
        await prefill_and_send(ap, ad, "left", ids, greedy(150))
        await until(lambda: "left" in ad._parked)
        ad.abort("left")  # the router aborts it: the client left before the decode stream opened
        await until(lambda: pages_free(ad))
        assert "left" not in ad._parked
        old = ad.park_timeout_s
        ad.park_timeout_s = 0.2
        try:  # nobody ever comes for it (the ingress died): stopped once parked longer than the timeout
            await prefill_and_send(ap, ad, "orphan", ids, greedy(150))
            await until(lambda: "orphan" in ad._parked)
            await until(lambda: pages_free(ad))
        finally:
            ad.park_timeout_s = old
        assert "orphan" not in ad._parked
        with pytest.raises(KVTransferFailed):
            async for _ in ad.generate_remote("orphan", 5):
                pass

    asyncio.run(main())
    assert pages_free(ad) and pages_free(ap)


def test_fail_remote_ends_a_waiting_stream_at_once(engines):
    ap, ad, _ = engines
    ids = prompt(40, seed=3)

    async def main():
        assert await ad.call(lambda e: e.admit_remote("doomed", ids, greedy(5), group=P_GROUP)) is not None
        outputs = ad.generate_remote("doomed", 7)
        waiting = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0.1)
        assert not waiting.done()  # no KV yet: it waits
        assert await ad.fail_remote("doomed", "KV transfer failed: peer_gone: injected") is True
        with pytest.raises(KVTransferFailed, match="peer_gone"):
            await asyncio.wait_for(waiting, 5)
        assert await ad.fail_remote("doomed", "again") is False

    asyncio.run(main())
    assert pages_free(ad) and pages_free(ap)
