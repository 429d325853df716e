"""KV transfer: route plan and chunk plan (pure), and real transfers over gloo pairs (CPU) - in one process
(two threads, one per side), between two plain processes and between two Ray actors. Received pages must equal
the sent ones bitwise for every layer and both page families; injected faults must end FAILED with a reason."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from msa.config import M3Config
from msa.kv_cache import KVCache
from msa.parallel import ParallelContext
from workers.configio import load_yaml, preset_path
from workers.kv.config import _HEADER_VERSION, TransferConfig, TransferState
from workers.kv.faults import FaultyChannel
from workers.kv.receiver import KVReceiver
from workers.kv.routes import Route, kv_heads_of_rank, plan_routes
from workers.kv.sender import KVSender
from workers.kv.wire import KVHeader, Segment, chunk_nbytes, plan_chunks
from workers.kv.transport import PairChannel, PeerGone

ROOT = Path(__file__).resolve().parents[2]


def _tiny() -> M3Config:
    return load_yaml(preset_path("models", "tiny"), M3Config)


def _filled_cache(num_pages: int, seed: int, dtype_name: str = "float32", heads=None) -> "KVCache":
    """A tiny-config cache whose every page holds seeded random values (identical in any process).
    heads: (first, count) to keep only those KV heads of the full cache (a tp shard's view)."""
    import torch
    from msa.config import M3Config
    from msa.kv_cache import KVCache
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    dtype = getattr(torch, dtype_name)
    full = KVCache.allocate(cfg, num_pages, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in full.k + full.v + [x for x in full.index_k if x is not None]:
        t.copy_(torch.randn(t.shape, generator=gen))
    if heads is None:
        return full
    lo, n = heads
    return KVCache(k=[x[:, :, lo:lo + n].clone() for x in full.k], v=[x[:, :, lo:lo + n].clone() for x in full.v],
                   index_k=full.index_k, num_pages=num_pages, page_size=full.page_size)


def _empty_shard(num_pages: int, heads: int) -> KVCache:
    """Zero pages of a tp shard holding `heads` KV heads of the tiny config."""
    full = KVCache.allocate(_tiny(), num_pages)
    return KVCache(k=[x[:, :, :heads].clone() for x in full.k], v=[x[:, :, :heads].clone() for x in full.v],
                   index_k=full.index_k, num_pages=num_pages, page_size=full.page_size)


def _assert_pages_equal(dst: KVCache, dst_ids, src: KVCache, src_ids, *, dst_heads=slice(None),
                        src_heads=slice(None), index=True) -> None:
    for layer in range(dst.num_layers):
        for fam in ("k", "v"):
            got = getattr(dst, fam)[layer][dst_ids][:, :, dst_heads]
            want = getattr(src, fam)[layer][src_ids][:, :, src_heads]
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                               want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), (fam, layer)
        if index and src.index_k[layer] is not None:
            assert torch.equal(dst.index_k[layer][dst_ids], src.index_k[layer][src_ids]), ("index_k", layer)


def _pair() -> tuple[PairChannel, PairChannel]:
    listener = PairChannel.listen(timeout_s=30)
    return listener, PairChannel.connect(listener.address, timeout_s=30)


def _wire(sender: KVSender, receiver: KVReceiver, route: Route, *, s_name="d0", r_name="p0", faults=None,
          wrap=None):
    """One pair between them; the sender's channel wrapped in a FaultyChannel (`faults`) or by `wrap(channel)`.
    Returns (receiver's channel, sender's channel as added)."""
    rx, tx = _pair()
    if faults:
        tx = FaultyChannel(tx, faults)
    if wrap is not None:
        tx = wrap(tx)
    receiver.add_peer(r_name, rx, route)
    sender.add_peer(s_name, tx, route)
    return rx, tx


def _ready_pair(src: KVCache, dst: KVCache, cfg: TransferConfig, *, wrap=None):
    """(sender, receiver, the sender's channel as added) over one open pair of the default route."""
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _rx, tx = _wire(sender, receiver, plan_routes(2, 1, 1)[0], wrap=wrap)
    sender.wait_ready(30), receiver.wait_ready(30)
    return sender, receiver, tx


# ---- pure plans ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,tp", [(4, 1), (4, 2), (4, 4), (4, 8), (2, 8), (1, 2), (8, 4)])
def test_kv_heads_of_rank_matches_the_model_split(heads, tp):
    for rank in range(tp):
        ctx = ParallelContext(tp_size=tp, tp_rank=rank, tp_group=None if tp == 1 else object())
        assert kv_heads_of_rank(heads, tp, rank) == ctx.kv_head_range(heads)


def test_plan_routes_exact():
    R = Route
    assert plan_routes(4, 1, 1) == [R(src=0, dst=0, head_start=0, head_end=4, with_index=True)]
    assert plan_routes(4, 2, 1) == [R(src=0, dst=0, head_start=0, head_end=2, with_index=True),
                                    R(src=1, dst=0, head_start=2, head_end=4, with_index=False)]
    assert plan_routes(4, 1, 2) == [R(src=0, dst=0, head_start=0, head_end=2, with_index=True),
                                    R(src=0, dst=1, head_start=2, head_end=4, with_index=True)]
    # tp 8 over 4 heads replicates each head on two ranks: equal layouts map rank i -> rank i
    assert plan_routes(4, 8, 8) == [R(src=d, dst=d, head_start=d // 2, head_end=d // 2 + 1, with_index=True)
                                    for d in range(8)]
    # one source per head, from the first replica
    assert plan_routes(4, 8, 1) == [R(src=2 * h, dst=0, head_start=h, head_end=h + 1, with_index=h == 0)
                                    for h in range(4)]
    assert plan_routes(4, 2, 8) == [R(src=d // 4, dst=d, head_start=d // 2, head_end=d // 2 + 1, with_index=True)
                                    for d in range(8)]


@pytest.mark.parametrize("heads,src_tp,dst_tp", [(4, a, b) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8)]
                         + [(2, 1, 2), (8, 2, 4), (8, 4, 2)])
def test_plan_routes_cover_every_head_once(heads, src_tp, dst_tp):
    routes = plan_routes(heads, src_tp, dst_tp)
    for d in range(dst_tp):
        first, count = kv_heads_of_rank(heads, dst_tp, d)
        mine = [r for r in routes if r.dst == d]
        got = sorted(h for r in mine for h in range(r.head_start, r.head_end))
        assert got == list(range(first, first + count))
        assert sum(r.with_index for r in mine) == 1
        for r in mine:  # the source really holds what it sends
            s_first, s_count = kv_heads_of_rank(heads, src_tp, r.src)
            assert s_first <= r.head_start < r.head_end <= s_first + s_count


def test_plan_chunks_exact_and_complete():
    rows = [10, 10, 4]
    assert plan_chunks(rows, 3, 25) == [[Segment(0, 0, 2, 0)], [Segment(0, 2, 3, 0), Segment(1, 0, 1, 10)],
                                        [Segment(1, 1, 3, 0), Segment(2, 0, 1, 20)], [Segment(2, 1, 3, 0)]]
    assert plan_chunks(rows, 3, 1 << 20) == [[Segment(0, 0, 3, 0), Segment(1, 0, 3, 30), Segment(2, 0, 3, 60)]]
    assert plan_chunks(rows, 2, 4) == [[Segment(0, 0, 1, 0)], [Segment(0, 1, 2, 0)], [Segment(1, 0, 1, 0)],
                                       [Segment(1, 1, 2, 0)], [Segment(2, 0, 1, 0)], [Segment(2, 1, 2, 0)]]
    assert plan_chunks(rows, 0, 25) == []
    for cap in (1, 7, 24, 33, 100):
        chunks = plan_chunks(rows, 5, cap)
        seen = [(s.piece, p) for c in chunks for s in c for p in range(s.page_lo, s.page_hi)]
        assert seen == [(piece, p) for piece in range(3) for p in range(5)]  # every row once, in payload order
        for c in chunks:
            assert chunk_nbytes(c, rows) <= cap or (len(c) == 1 and c[0].page_hi - c[0].page_lo == 1)
            for a, b in zip(c, c[1:]):
                assert b.offset == a.offset + (a.page_hi - a.page_lo) * rows[a.piece]


def test_header_round_trip_and_refusal():
    h = KVHeader(request_id="r-1", num_pages=3, num_layers=4, page_size=16, head_start=1, head_end=2, head_dim=32,
                 index_dim=32, index_layers=(1, 2, 3), dtype="torch.bfloat16", element_size=2,
                 max_chunk_bytes=1 << 20, checksum=False)
    assert KVHeader.decode(h.encode()) == h
    assert h.total_bytes() == 3 * (4 * 2 * 16 * 32 * 2 + 3 * 16 * 32 * 2)
    with pytest.raises(ValueError, match="undecodable"):
        KVHeader.decode(b'{"request_id": "x"}')
    # a batch and its meta survive the trip; the requests come out in payload order
    b = dataclasses.replace(h, num_pages=5, batch=(("a", 2, {"first": 7, "logprobs": [[7, -0.5]]}), ("b", 3, None)))
    assert KVHeader.decode(b.encode()) == b and b.items() == [("a", 2, {"first": 7, "logprobs": [[7, -0.5]]}),
                                                              ("b", 3, None)]
    # a header of the first version (no meta, no batch) still decodes, so a receiver can refuse it by its version
    old = json.loads(h.encode())
    del old["meta"], old["batch"]
    old["version"] = 1
    assert KVHeader.decode(json.dumps(old).encode()).version == 1


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="timeout_s"):
        TransferConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        TransferConfig(max_chunk_bytes=0)
    with pytest.raises(ValueError, match="nccl: must be 'direct' or 'torch'"):
        TransferConfig(nccl="mpi")
    with pytest.raises(ValueError, match="backend: must be one of gloo, nccl, torch-nccl"):
        PairChannel.listen(backend="mpi")


# ---- real transfers over gloo, both sides in this process ----------------------------------------------------
def test_many_requests_random_pages_bitwise_and_nothing_else_written():
    # several chunks each, more than may be in flight: the pair thread posts the rest as sends complete
    cfg = TransferConfig(timeout_s=20, max_chunk_bytes=40_000, max_inflight_chunks=2, verify_checksum=True)
    src = _filled_cache(24, seed=1)
    dst = KVCache.allocate(_tiny(), 40)
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _wire(sender, receiver, plan_routes(2, 1, 1)[0])
    try:
        sender.wait_ready(30)
        gen = torch.Generator().manual_seed(5)
        dst_free = torch.randperm(40, generator=gen).tolist()
        moved = []
        for i, n in enumerate([1, 5, 3, 8, 2]):
            s_ids = torch.randperm(24, generator=gen)[:n].tolist()
            d_ids, dst_free = dst_free[:n], dst_free[n:]
            receiver.prepare_receive(f"req-{i}", d_ids)
            sender.send(f"req-{i}", s_ids)
            moved.append((f"req-{i}", s_ids, d_ids))
        for rid, s_ids, d_ids in moved:
            r_res, s_res = receiver.wait(rid, 20), sender.wait(rid, 20)
            assert (r_res.state, s_res.state) == (TransferState.DONE, TransferState.DONE), (r_res, s_res)
            assert r_res.num_bytes == s_res.num_bytes == len(s_ids) * KVCache.bytes_per_page(_tiny())
            _assert_pages_equal(dst, d_ids, src, s_ids)
            receiver.release(rid), sender.release(rid)
        for layer in range(4):  # pages nobody sent to are still zero
            assert not dst.k[layer][dst_free].any() and not dst.v[layer][dst_free].any()
        stats = receiver.pop_stats()
        assert [s.request_id for s in stats] == [m[0] for m in moved] and all(s.ok for s in stats)
    finally:
        sender.close(), receiver.close()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_tp2_to_tp1_merges_heads_exactly(dtype_name):
    full = _filled_cache(10, seed=2, dtype_name=dtype_name)
    shards = [_filled_cache(10, seed=2, dtype_name=dtype_name, heads=kv_heads_of_rank(2, 2, s)) for s in range(2)]
    dst = KVCache.allocate(_tiny(), 12, dtype=getattr(torch, dtype_name))
    cfg = TransferConfig(timeout_s=20)
    receiver = KVReceiver(dst, config=cfg)
    senders = [KVSender(shards[s], kv_head_start=s, config=cfg) for s in range(2)]
    routes = plan_routes(2, 2, 1)
    for r in routes:
        _wire(senders[r.src], receiver, r, r_name=f"p{r.src}")
    try:
        s_ids, d_ids = [7, 0, 3, 9], [11, 4, 1, 6]
        receiver.prepare_receive("a", d_ids)
        for s in senders:
            s.send("a", s_ids)
        res = receiver.wait("a", 20)
        assert res.state is TransferState.DONE, res
        assert all(s.wait("a", 20).state is TransferState.DONE for s in senders)
        _assert_pages_equal(dst, d_ids, full, s_ids)
    finally:
        for s in senders:
            s.close()
        receiver.close()


def test_tp1_to_tp2_slices_heads_exactly():
    full = _filled_cache(10, seed=3)
    dsts = [_empty_shard(8, heads=1) for _ in range(2)]
    cfg = TransferConfig(timeout_s=20)
    sender = KVSender(full, config=cfg)
    receivers = [KVReceiver(dsts[d], kv_head_start=d, config=cfg) for d in range(2)]
    for r in plan_routes(2, 1, 2):
        _wire(sender, receivers[r.dst], r, s_name=f"d{r.dst}")
    try:
        s_ids, d_ids = [2, 8, 5], [0, 7, 3]
        for rc in receivers:
            rc.prepare_receive("b", d_ids)
        sender.send("b", s_ids)
        assert sender.wait("b", 20).state is TransferState.DONE
        for d, rc in enumerate(receivers):
            assert rc.wait("b", 20).state is TransferState.DONE
            _assert_pages_equal(dsts[d], d_ids, full, s_ids, src_heads=slice(d, d + 1))
    finally:
        sender.close()
        for rc in receivers:
            rc.close()


class _CountingChannel:
    """Counts the data messages a real channel sends, its header calls, and which thread sent what."""

    def __init__(self, inner):
        self.inner, self.sends, self.header_calls, self.senders = inner, 0, [], []
        self.get_delay_s = 0.0  # a slow receiver: holds each header that long before taking its payload

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, buf, *, tag=""):
        self.sends += 1
        self.senders.append((tag, threading.current_thread().name))
        return self.inner.send(buf, tag=tag)

    def post_header(self, raw, *, tag=""):
        self.header_calls.append(("post", tag))
        return self.inner.post_header(raw, tag=tag)

    def next_header(self, timeout_s, *, tag=""):
        out = self.inner.next_header(timeout_s, tag=tag)
        self.header_calls.append(("next", json.loads(out)["request_id"] if out.startswith(b"{") else out))
        time.sleep(self.get_delay_s)
        return out


def test_one_header_per_transfer_posted_from_the_callers_thread_with_phase_marks():
    """The header is the only control message (the status comes back over the backend); an idle pair posts the
    payload from the caller's thread (no hand-off), a busy one queues behind the transfer in flight; the
    receiver posts its first receive before it checks the header."""
    src, dst = _filled_cache(12, seed=12), KVCache.allocate(_tiny(), 12)
    cfg = TransferConfig(timeout_s=20, max_chunk_bytes=30_000)  # 2 chunks for 2 pages
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    rx, tx = _pair()
    rx_count, tx_count = _CountingChannel(rx), _CountingChannel(tx)
    receiver.add_peer("p0", rx_count, plan_routes(2, 1, 1)[0])
    sender.add_peer("d0", tx_count, plan_routes(2, 1, 1)[0])
    try:
        sender.wait_ready(30), receiver.wait_ready(30)
        me = threading.current_thread().name
        for rid, s_ids, d_ids in (("m-0", [1, 2], [3, 4]), ("m-1", [5, 6], [7, 8])):
            receiver.prepare_receive(rid, d_ids)
            sender.send(rid, s_ids)
            s, r = sender.wait(rid, 20), receiver.wait(rid, 20)
            assert (s.state, r.state) == (TransferState.DONE, TransferState.DONE), (s, r)
            _assert_pages_equal(dst, d_ids, src, s_ids)
            m, n = s.marks, r.marks
            assert m["called"] <= m["header"] <= m["posted"] <= m["acked"], m
            assert m["called"] <= n["header"] <= n["recv0"] <= n["claimed"] <= n["posted"] <= n["landed"] \
                <= m["acked"], (m, n)
        assert tx_count.header_calls == [("post", "m-0"), ("post", "m-1")]
        assert rx_count.header_calls == [("next", "m-0"), ("next", "m-1")]
        chunks = len(next(iter(sender._workers["d0"]._layouts.values())).sizes)
        assert chunks > 1 and tx_count.senders == [("m-0", me)] * chunks + [("m-1", me)] * chunks
        assert len(sender._workers["d0"]._layouts) == 1  # one copy plan for both (same page count)

        # three at once: the first goes out from this thread, the others (sent while the slowed receiver holds
        # the first) wait for the pair in its own thread
        rx_count.get_delay_s = 0.3
        for i in range(3):
            receiver.prepare_receive(f"q-{i}", [i])
        for i in range(3):
            sender.send(f"q-{i}", [i + 8])
        assert all(sender.wait(f"q-{i}", 20).state is TransferState.DONE for i in range(3))
        who = dict(tx_count.senders[2 * chunks:])
        assert who["q-0"] == me and who["q-1"] != me and who["q-2"] != me, who
    finally:
        sender.close(), receiver.close()


class _OldVersionChannel:
    """A sender of the first header version (no meta, no batch): its headers say version 1."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def post_header(self, raw, *, tag=""):
        d = json.loads(raw)
        del d["meta"], d["batch"], d["announced"]
        d["version"] = 1
        return self.inner.post_header(json.dumps(d).encode(), tag=tag)


def test_a_header_of_another_version_is_refused_and_the_pair_stays_in_step():
    src, dst = _filled_cache(8, seed=31), KVCache.allocate(_tiny(), 8)
    cfg = TransferConfig(timeout_s=20)
    sender, receiver, old = _ready_pair(src, dst, cfg, wrap=_OldVersionChannel)
    try:
        receiver.prepare_receive("v1", [2, 3])
        sender.send("v1", [4, 5])
        s, r = sender.wait("v1", 20), receiver.wait("v1", 20)
        assert (s.state, r.state) == (TransferState.FAILED, TransferState.FAILED)
        assert f"version 1 != {_HEADER_VERSION}" in r.reason and "rejected by receiver" in s.reason
        assert not dst.k[0][[2, 3]].any()
        old.post_header = old.inner.post_header  # the sender upgraded: the same pair carries the next one
        receiver.prepare_receive("v2", [2, 3])
        sender.send("v2", [4, 5])
        assert sender.wait("v2", 20).state is TransferState.DONE
        _assert_pages_equal(dst, [2, 3], src, [4, 5])
    finally:
        sender.close(), receiver.close()


def test_send_many_is_one_payload_and_a_refused_request_in_it_writes_nothing():
    """Several requests in one `send_many`: one header and one payload on the pair, each request its own result,
    bytes and meta; one of them aborted on the receiving side first: its pages stay untouched and its sender
    learns why, the others land, and the pair goes on."""
    src, dst = _filled_cache(16, seed=21), KVCache.allocate(_tiny(), 20)
    cfg = TransferConfig(timeout_s=20, max_chunk_bytes=30_000)  # a chunk boundary inside the batch
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _rx, tx_count = _wire(sender, receiver, plan_routes(2, 1, 1)[0], wrap=_CountingChannel)
    page = KVCache.bytes_per_page(_tiny())
    try:
        sender.wait_ready(30), receiver.wait_ready(30)
        batch = [("b-0", [3, 1], [10, 4], {"first": 7}), ("b-1", [9], [0], None), ("b-2", [2, 5, 6], [8, 2, 19], {})]
        for rid, _s, d_ids, _m in batch:
            receiver.prepare_receive(rid, d_ids)
        sender.send_many([(rid, s_ids, meta) for rid, s_ids, _d, meta in batch])
        for rid, s_ids, d_ids, meta in batch:
            s, r = sender.wait(rid, 20), receiver.wait(rid, 20)
            assert (s.state, r.state) == (TransferState.DONE, TransferState.DONE), (s, r)
            assert s.num_bytes == r.num_bytes == len(s_ids) * page and r.meta == meta
            _assert_pages_equal(dst, d_ids, src, s_ids)
            sender.release(rid), receiver.release(rid)
        assert tx_count.header_calls == [("post", "b-0|b-1|b-2")]

        untouched = [t.clone() for t in dst.k + dst.v]
        for rid, d_ids in (("c-0", [11]), ("c-1", [12, 13]), ("c-2", [14])):
            receiver.prepare_receive(rid, d_ids)
        assert receiver.abort("c-1")  # the client left before its KV came
        sender.send_many([("c-0", [1], None), ("c-1", [2, 3], None), ("c-2", [4], None)])
        assert sender.wait("c-1", 20).state is TransferState.FAILED
        assert "c-1" in sender.result("c-1").reason and "aborted" in sender.result("c-1").reason
        for rid, s_ids, d_ids in (("c-0", [1], [11]), ("c-2", [4], [14])):
            assert sender.wait(rid, 20).state is TransferState.DONE and receiver.wait(rid, 20).state \
                is TransferState.DONE
            _assert_pages_equal(dst, d_ids, src, s_ids)
        for now, before in zip(dst.k + dst.v, untouched):
            assert torch.equal(now[[12, 13]], before[[12, 13]])  # the aborted request's pages
        # the pair is still in step
        receiver.prepare_receive("after", [15])
        sender.send("after", [7])
        assert sender.wait("after", 20).state is TransferState.DONE
        _assert_pages_equal(dst, [15], src, [7])
    finally:
        sender.close(), receiver.close()


def _landed_states(end, rids) -> list[TransferState]:
    return [end.result(r).state for r in rids]


def test_announced_payload_receives_posted_before_the_pages_meta_in_the_trailer_and_withdrawal():
    """`announce` sends the header while the pages are still being written: the receiver has claimed the
    requests (TRANSFERRING) before any page is released. `send_many` then moves the pages (bitwise) with each
    request's meta in a trailer; a `withdrawn` request's bytes travel but its receiver waits again (PENDING, not
    written as far as it knows) and a later ordinary send of it lands; the pair stays in step."""
    src, dst = _filled_cache(16, seed=41), KVCache.allocate(_tiny(), 20)
    cfg = TransferConfig(timeout_s=20, max_chunk_bytes=30_000)
    sender, receiver, tx = _ready_pair(src, dst, cfg, wrap=_CountingChannel)
    try:
        plan = {"a-0": ([3, 1], [10, 4]), "a-1": ([9], [0]), "a-2": ([2, 5, 6], [8, 2, 19])}
        for rid, (_s, d_ids) in plan.items():
            receiver.prepare_receive(rid, d_ids)
        sender.announce([(rid, s_ids) for rid, (s_ids, _d) in plan.items()])
        deadline = time.monotonic() + 20
        while _landed_states(receiver, plan) != [TransferState.TRANSFERRING] * 3:
            assert time.monotonic() < deadline, _landed_states(receiver, plan)
            time.sleep(0.01)
        time.sleep(0.2)  # nothing lands before the pages are released
        assert _landed_states(receiver, plan) == [TransferState.TRANSFERRING] * 3
        assert sender.result("a-0").state is TransferState.TRANSFERRING
        sender.send_many([("a-0", [3, 1], {"first": 5}), ("a-2", [2, 5, 6], {"first": 6})], withdrawn=["a-1"])
        for rid, meta in (("a-0", {"first": 5}), ("a-2", {"first": 6})):
            s, r = sender.wait(rid, 20), receiver.wait(rid, 20)
            assert (s.state, r.state) == (TransferState.DONE, TransferState.DONE) and r.meta == meta
            _assert_pages_equal(dst, plan[rid][1], src, plan[rid][0])
            sender.release(rid), receiver.release(rid)
        s = sender.wait("a-1", 20)
        assert s.state is TransferState.FAILED and "withdrawn" in s.reason
        assert receiver.result("a-1").state is TransferState.PENDING and receiver.result("a-1").meta is None
        with pytest.raises(ValueError, match="sent or withdrawn already"):
            sender.send_many([("a-1", [9], None)])
        assert tx.header_calls == [("post", "a-0|a-1|a-2"), ("post", "a-0|a-1|a-2")]  # header, trailer
        sender.release("a-1")
        sender.send("a-1", [11])  # e.g. its prefill retried: the waiting receive takes it
        assert receiver.wait("a-1", 20).state is TransferState.DONE
        _assert_pages_equal(dst, [0], src, [11])
    finally:
        sender.close(), receiver.close()


def test_announce_on_a_busy_pair_goes_the_ordinary_way_in_order():
    """A second announce while the first payload waits for its pages posts nothing ahead: `send_many` sends
    it after the first. Withdrawing a request whose header never went ahead sends nothing for it."""
    src, dst = _filled_cache(12, seed=42), KVCache.allocate(_tiny(), 12)
    cfg = TransferConfig(timeout_s=20)
    sender, receiver, tx = _ready_pair(src, dst, cfg, wrap=_CountingChannel)
    try:
        for rid, d_ids in (("x", [1]), ("y", [2, 3]), ("z", [4])):
            receiver.prepare_receive(rid, d_ids)
        sender.announce([("x", [5])])
        sender.announce([("y", [6, 7]), ("z", [8])])  # the pair waits for x's pages: nothing goes ahead
        sender.send_many([("y", [6, 7], {"n": 2})], withdrawn=["z"])  # queued behind x
        assert sender.result("z").state is TransferState.FAILED and "withdrawn" in sender.result("z").reason
        time.sleep(0.2)
        assert receiver.result("y").state is TransferState.PENDING
        sender.send_many([("x", [5], {"n": 1})])
        for rid, s_ids, d_ids, meta in (("x", [5], [1], {"n": 1}), ("y", [6, 7], [2, 3], {"n": 2})):
            assert receiver.wait(rid, 20).state is TransferState.DONE and receiver.result(rid).meta == meta
            assert sender.wait(rid, 20).state is TransferState.DONE
            _assert_pages_equal(dst, d_ids, src, s_ids)
        assert receiver.result("z").state is TransferState.PENDING
        assert [c for c in tx.header_calls if c[0] == "post"] == [("post", "x"), ("post", "x"), ("post", "y")]
    finally:
        sender.close(), receiver.close()


def test_announced_pages_late_go_the_ordinary_way_and_the_pair_stays_in_step():
    """An announced payload whose pages are not released within `announce_wait_s` (a forward compiling its
    kernels): it goes out withdrawn (the receiver's receives matched, its requests waiting again) and the
    requests are back to PENDING on both sides; when the pages do come, they go as an ordinary payload."""
    src, dst = _filled_cache(8, seed=43), KVCache.allocate(_tiny(), 8)
    cfg = TransferConfig(timeout_s=20, announce_wait_s=0.3)
    sender, receiver, tx = _ready_pair(src, dst, cfg, wrap=_CountingChannel)
    try:
        receiver.prepare_receive("late", [1, 2])
        receiver.prepare_receive("late-2", [5])
        sender.announce([("late", [3, 4]), ("late-2", [6])])
        deadline = time.monotonic() + 20
        while len(tx.header_calls) < 2:  # header, then (at the wait's end) the withdrawn payload's trailer
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while _landed_states(receiver, ["late", "late-2"]) != [TransferState.PENDING] * 2:
            assert time.monotonic() < deadline, _landed_states(receiver, ["late", "late-2"])
            time.sleep(0.02)
        assert sender.result("late").state is TransferState.PENDING and not sender.broken_peers()
        sender.send_many([("late", [3, 4], {"first": 9})], withdrawn=["late-2"])
        assert receiver.wait("late", 20).state is TransferState.DONE and receiver.result("late").meta == {"first": 9}
        assert sender.wait("late", 20).state is TransferState.DONE
        _assert_pages_equal(dst, [1, 2], src, [3, 4])
        assert "withdrawn" in sender.wait("late-2", 20).reason  # its header never went ahead again: nothing sent
        assert receiver.result("late-2").state is TransferState.PENDING
        assert [c for c in tx.header_calls if c[0] == "post"] == [("post", "late|late-2")] * 2 + [("post", "late")]
    finally:
        sender.close(), receiver.close()


def test_coalesced_is_the_default_and_per_page_messages_are_measured():
    """Default config: one message per request here. The same transfer with one message per page per layer
    (and family) is timed next to it and printed; no timing assertion (shared CI cores)."""
    src = _filled_cache(64, seed=4)
    dst = KVCache.allocate(_tiny(), 64)
    ids = list(range(64))
    row = src.page_size * 32 * 4  # the smallest page row (index-K, fp32): every page of every piece travels alone
    timings = {}
    for label, cfg in (("coalesced (default)", TransferConfig()),
                       ("one message per page per layer", TransferConfig(max_chunk_bytes=row))):
        sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
        _rx, counting = _wire(sender, receiver, plan_routes(2, 1, 1)[0], wrap=_CountingChannel)
        try:
            sender.wait_ready(30)
            best = float("inf")
            for rep in range(3):
                dst.k[0].zero_()
                rid = f"{label}-{rep}"
                t0 = time.perf_counter()
                receiver.prepare_receive(rid, ids)
                sender.send(rid, ids)
                assert sender.wait(rid, 60).state is TransferState.DONE
                best = min(best, time.perf_counter() - t0)
                assert receiver.wait(rid, 60).state is TransferState.DONE
            _assert_pages_equal(dst, ids, src, ids)
            timings[label] = (best, counting.sends // 3)
        finally:
            sender.close(), receiver.close()
    nbytes = 64 * KVCache.bytes_per_page(_tiny())
    for label, (sec, msgs) in timings.items():
        print(f"\n{label}: {msgs} messages, {sec * 1e3:.1f} ms, {nbytes / sec / 1e6:.0f} MB/s for {nbytes} B")
    assert timings["coalesced (default)"][1] == 1
    assert timings["one message per page per layer"][1] == 64 * (4 * 2 + 3)


def test_injected_faults_end_failed_with_reasons_and_the_pair_survives_refusals():
    src = _filled_cache(16, seed=6)
    dst = KVCache.allocate(_tiny(), 16)
    cfg = TransferConfig(timeout_s=1.5, receive_timeout_s=1.0, verify_checksum=True)
    faults = {"bad-header": "corrupt_header", "bad-bytes": "corrupt_payload", "dropped": "drop_payload"}
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _wire(sender, receiver, plan_routes(2, 1, 1)[0], faults=faults)
    try:
        sender.wait_ready(30)

        def run(rid, s_ids, d_ids):
            receiver.prepare_receive(rid, d_ids)
            sender.send(rid, s_ids)
            return sender.wait(rid, 10), receiver.wait(rid, 10)

        s, r = run("bad-header", [1, 2], [3, 4])
        assert (s.state, r.state) == (TransferState.FAILED, TransferState.FAILED)
        assert "header mismatch: dtype" in r.reason and "rejected by receiver" in s.reason
        assert not dst.k[0][[3, 4]].any()  # refused data never lands

        s, r = run("bad-bytes", [1, 2], [3, 4])
        assert "checksum mismatch" in r.reason and "checksum mismatch" in s.reason

        s, r = run("page-count", [1, 2, 5], [3, 4])  # a real disagreement, no fake needed
        assert "num_pages 3 != 2" in r.reason and s.state is TransferState.FAILED

        receiver.prepare_receive("aborted", [6])  # client gone before prefill sent anything
        assert receiver.abort("aborted") is True and receiver.state("aborted") is TransferState.FAILED
        sender.send("aborted", [6])
        s = sender.wait("aborted", 10)
        assert "aborted" in s.reason and "rejected by receiver" in s.reason

        s, r = run("ok-after-refusals", [7, 8], [9, 10])  # the pair stayed in step through all of that
        assert (s.state, r.state) == (TransferState.DONE, TransferState.DONE)
        _assert_pages_equal(dst, [9, 10], src, [7, 8])

        receiver.prepare_receive("never-sent", [11])  # prefill never comes: the receive times out
        time.sleep(1.1)
        r = receiver.wait("never-sent", 1)
        assert r.state is TransferState.FAILED and r.reason.startswith("p0: timeout: no KV arrived")

        s, r = run("dropped", [1], [12])  # header, then silence: a dead peer mid-transfer breaks the pair
        assert s.state is TransferState.FAILED and s.reason.startswith("d0: timeout")
        assert r.state is TransferState.FAILED and r.reason.startswith("p0: timeout")
        assert receiver.broken_peers() and sender.broken_peers()

        s, r = run("after-break", [2], [13])  # fails fast on both sides
        assert "pair_broken" in s.reason and "pair_broken" in r.reason
        for rid in ("bad-header", "bad-bytes", "page-count", "ok-after-refusals", "dropped", "after-break"):
            assert sender.release(rid).settled and receiver.release(rid).settled
    finally:
        sender.close(), receiver.close()


def test_peer_gone_before_the_header():
    """The sender cannot deliver the header: its pair breaks, and breaking shuts the header stream, so the
    receiver's prepared receive fails at once as pair_broken (not at its receive timeout, 60 s here)."""
    src, dst = _filled_cache(4, seed=8), KVCache.allocate(_tiny(), 4)
    cfg = TransferConfig(timeout_s=2, receive_timeout_s=60)
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _wire(sender, receiver, plan_routes(2, 1, 1)[0], faults={"x": "peer_gone"})
    try:
        sender.wait_ready(30)
        receiver.prepare_receive("x", [0])
        sender.send("x", [1])
        s = sender.wait("x", 5)
        assert s.state is TransferState.FAILED and "peer_gone" in s.reason
        r = receiver.wait("x", 5)
        assert r.state is TransferState.FAILED and "pair_broken" in r.reason and "closed by the peer" in r.reason
        assert receiver.broken_peers()
    finally:
        sender.close(), receiver.close()


class _NeverDone:
    """Stands in for an NCCL work whose peer will never match it (no GPU here)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        return True


def test_a_peer_that_aborts_ends_the_other_sides_waits_at_once():
    """`abort` shuts the header stream: the other side's `peer_closed` turns true (an unread header is not an
    end), and an NCCL-style wait on it raises PeerGone within milliseconds rather than at its deadline."""
    rx, tx = _pair()
    threads = [threading.Thread(target=ch.open) for ch in (rx, tx)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        tx.post_header(b"{}")
        time.sleep(0.05)
        assert not rx.peer_closed() and not tx.peer_closed()  # a header waiting to be read is not an end
        rx.abort()  # the receiver breaks the pair (a timeout, a device error)
        deadline = time.monotonic() + 5
        while not tx.peer_closed():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tx.backend = "nccl"  # the polling wait of the NCCL branch, on a work that never completes
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="closed the pair"):
            tx.wait_work(_NeverDone(), time.monotonic() + 20, "status")
        assert time.monotonic() - t0 < 5
        # an op of a channel this side aborted completes (NCCL kills its kernel) but must not read as done
        done = _NeverDone()
        done.is_completed = lambda: True
        rx.backend = "nccl"
        with pytest.raises(PeerGone, match="aborted"):
            rx.wait_work(done, time.monotonic() + 20, "recv")
    finally:
        tx.backend = rx.backend = "gloo"
        tx.close(), rx.close()


def test_listener_closing_fails_pending_receives():
    dst = KVCache.allocate(_tiny(), 4)
    receiver = KVReceiver(dst, config=TransferConfig())
    sender = KVSender(_filled_cache(4, seed=9), config=TransferConfig())
    _wire(sender, receiver, plan_routes(2, 1, 1)[0])
    sender.wait_ready(30)
    receiver.prepare_receive("y", [1])
    sender.close()  # the prefill side goes away cleanly: pending receives fail instead of hanging
    r = receiver.wait("y", 5)
    receiver.close()
    assert r.state is TransferState.FAILED and "closed" in r.reason


# ---- across processes ----------------------------------------------------------------------------------------
_SENDER_SCRIPT = '''
import json, sys
from workers.kv.config import TransferConfig
from workers.kv.routes import plan_routes
from workers.kv.sender import KVSender
from workers.kv.transport import PairChannel

host, port, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
src = _filled_cache(spec["num_pages"], seed=spec["seed"], dtype_name=spec["dtype"])
sender = KVSender(src, config=TransferConfig(timeout_s=30, max_chunk_bytes=spec["chunk"]))
sender.add_peer("d0", PairChannel.connect((host, port), timeout_s=60), plan_routes(2, 1, 1)[0])
for rid, ids in spec["requests"].items():
    sender.send(rid, ids)
out = {rid: sender.wait(rid, 60).state.value for rid in spec["requests"]}
print("REASONS", [sender.result(r).reason for r in spec["requests"]])
sender.close()
print("RESULT " + json.dumps(out))
'''


def _script(body: str) -> str:
    return textwrap.dedent(inspect.getsource(_filled_cache)) + "\n" + body


def test_two_plain_processes_move_pages_bitwise():
    spec = {"num_pages": 20, "seed": 11, "dtype": "bfloat16", "chunk": 30_000,
            "requests": {"p-0": [4, 19, 0], "p-1": [7], "p-2": [1, 2, 3, 5, 8, 13]}}
    src = _filled_cache(20, seed=11, dtype_name="bfloat16")
    dst = KVCache.allocate(_tiny(), 32, dtype=torch.bfloat16)
    receiver = KVReceiver(dst, config=TransferConfig(timeout_s=30, receive_timeout_s=90))
    listener = PairChannel.listen(timeout_s=60)
    receiver.add_peer("p0", listener, plan_routes(2, 1, 1)[0])
    dst_ids = {"p-0": [31, 0, 16], "p-1": [9], "p-2": [2, 30, 11, 5, 24, 18]}
    for rid, ids in dst_ids.items():
        receiver.prepare_receive(rid, ids)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _script(_SENDER_SCRIPT), *map(str, listener.address),
                           json.dumps(spec)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        assert json.loads(line[7:]) == {rid: "done" for rid in dst_ids}, proc.stdout[-2000:]
        for rid, ids in dst_ids.items():
            assert receiver.wait(rid, 30).state is TransferState.DONE
            _assert_pages_equal(dst, ids, src, spec["requests"][rid])
    finally:
        receiver.close()


_RAY_SCRIPT = '''
import json, sys
import ray, torch
from workers.kv.config import TransferConfig
from workers.kv.receiver import KVReceiver
from workers.kv.routes import plan_routes
from workers.kv.sender import KVSender
from workers.kv.transport import PairChannel

ray.init(address="local", num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
         log_to_driver=False, configure_logging=False)

@ray.remote(num_cpus=1)
class Decode:
    def __init__(self):
        from msa.config import M3Config
        from msa.kv_cache import KVCache
        from workers.configio import load_yaml, preset_path
        self.kv = KVCache.allocate(load_yaml(preset_path("models", "tiny"), M3Config), 16)
        self.rx = KVReceiver(self.kv, config=TransferConfig(timeout_s=30))
    def listen(self):
        ch = PairChannel.listen(timeout_s=60)
        self.rx.add_peer("p0", ch, plan_routes(2, 1, 1)[0])
        return ch.address
    def prepare(self, rid, ids):
        self.rx.prepare_receive(rid, ids)
    def collect(self, rid, ids):
        st = self.rx.wait(rid, 60).state.value
        return st, [t[ids] for t in self.kv.k + self.kv.v + [x for x in self.kv.index_k if x is not None]]

@ray.remote(num_cpus=1)
class Prefill:
    def __init__(self):
        self.kv = _filled_cache(12, seed=21)
        self.tx = KVSender(self.kv, config=TransferConfig(timeout_s=30))
    def connect(self, address):
        self.tx.add_peer("d0", PairChannel.connect(tuple(address), timeout_s=60), plan_routes(2, 1, 1)[0])
    def send(self, rid, ids):
        self.tx.send(rid, ids)
        return self.tx.wait(rid, 60).state.value
    def pages(self, ids):
        return [t[ids] for t in self.kv.k + self.kv.v + [x for x in self.kv.index_k if x is not None]]

d, p = Decode.remote(), Prefill.remote()
ray.get(p.connect.remote(ray.get(d.listen.remote())))
ok = True
for rid, s_ids, d_ids in [("r-0", [3, 11, 0], [15, 2, 7]), ("r-1", [5, 6], [0, 1])]:
    ray.get(d.prepare.remote(rid, d_ids))
    sent = ray.get(p.send.remote(rid, s_ids))
    got_state, got = ray.get(d.collect.remote(rid, d_ids))
    want = ray.get(p.pages.remote(s_ids))
    same = all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want) == 11
    print(rid, sent, got_state, same)
    ok &= sent == got_state == "done" and same
print("RESULT " + json.dumps(ok))
ray.shutdown()
'''


def test_two_ray_actors_move_pages_bitwise():
    ray_tmp = tempfile.mkdtemp(prefix="kvt", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_TMPDIR=ray_tmp)
    try:
        proc = subprocess.run([sys.executable, "-c", _script(_RAY_SCRIPT)], capture_output=True, text=True,
                              timeout=180, env=env, cwd=ROOT)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    assert json.loads(line[7:]) is True, proc.stdout[-2000:]


def test_device_error_mid_payload_fails_both_sides(monkeypatch):
    """An exception that is not a wire error (here: the gather) must still settle the op, never hang it."""
    import workers.kv.sender as sender_module

    def broken_gather(*a, **k):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(sender_module._SendWorker, "_gather", broken_gather)
    src, dst = _filled_cache(4, seed=10), KVCache.allocate(_tiny(), 4)
    cfg = TransferConfig(timeout_s=1.0)
    sender, receiver = KVSender(src, config=cfg), KVReceiver(dst, config=cfg)
    _wire(sender, receiver, plan_routes(2, 1, 1)[0])
    try:
        sender.wait_ready(30)
        receiver.prepare_receive("z", [0, 1])
        sender.send("z", [2, 3])
        s, r = sender.wait("z", 5), receiver.wait("z", 5)
        assert s.state is TransferState.FAILED and "internal: RuntimeError: simulated device fault" in s.reason
        assert r.state is TransferState.FAILED and r.settled
    finally:
        sender.close(), receiver.close()


def test_benchmark_cpu_smoke_reports_the_time_split(tmp_path):
    """benchmarks/bench_kv_transfer.py end to end on gloo (tiny shapes): transfers verified bitwise by the bench
    itself, and every row carries the phase split (post, header, payload, ack, wake) that the GPU run prints."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "benchmarks/bench_kv_transfer.py", "--device", "cpu", "--tiny",
                           "--tokens", "64", "--chunk-mib", "64", "--reps", "2", "--warmup", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    out = json.loads((tmp_path / "bench_kv_transfer.json").read_text())
    assert out["failures"] == [] and [r["mode"] for r in out["rows"]] == ["plain", "announced"]
    row, announced = out["rows"]
    assert row["bytes"] == announced["bytes"] == 4 * KVCache.bytes_per_page(_tiny()) and row["messages"] == 3
    split = row["split_s"]
    assert set(split) == {"post", "header", "payload", "ack", "wake"} and min(split.values()) >= 0, split
    # the phases after send() tile the sender's wall time (medians of each, so only roughly)
    assert 0 < split["header"] + split["payload"] + split["ack"] + split["wake"] < 3 * row["ours_s"] + 0.05
    # announced: the receiver held the header before send_many was called (during the stand-in forward)
    assert announced["split_s"]["header"] < 0 and announced["timeline_ms"]["r_header"] < 0
    assert "where ours goes" in proc.stdout and "8k" not in proc.stdout
