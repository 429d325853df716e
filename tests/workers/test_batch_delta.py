"""Per-sequence deltas alone (workers/batch_delta.py): the encoder over a real `PageManager`, the mirror on the
other side of a pickle, and random runs of add / grow / preempt / fork / release / step / failed-step that must give
the shard the same page tables and penalty token ids as sending them whole. Pure Python: no model."""
from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings, strategies as st

from msa.metadata import ChunkSpec
from workers.batch import penalty_token_ids, resolve_batch
from workers.batch_delta import NO_TABLE, SeqDelta, SeqDeltaEncoder, SeqMirror, SeqDeltaMismatch
from workers.pages import PageManager


def wire(delta: SeqDelta) -> SeqDelta:
    return pickle.loads(pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL))


def send(enc: SeqDeltaEncoder, mirror: SeqMirror, pm: PageManager, sids, released=()) -> list[list[int]]:
    """One batch over the wire: the tables the shard resolves for `sids`."""
    delta = wire(enc.encode([(s, pm.page_table(s)) for s in sids], released=released))
    mirror.apply(delta, released)
    return [c.page_table for c in mirror.resolve([ChunkSpec(NO_TABLE, 0, 1, True)] * len(sids), delta.seq_ids)]


class ShardTables:
    """A shard's mirror for engine-core tests with a fake executor: `check(core, batch)` right after the core
    scheduled `batch` resolves it over the wire as a runner would and asserts that its chunks got the core's live
    page tables and its rows the token ids a batch without deltas would carry."""

    def __init__(self) -> None:
        self.mirror = SeqMirror()

    def check(self, core, batch) -> list[ChunkSpec]:
        assert all(c.page_table == NO_TABLE for c in batch.chunks)
        resolved = resolve_batch(pickle.loads(pickle.dumps(batch)), self.mirror)
        page_size = core.pages.page_size
        for c, sid in zip(resolved.chunks, batch.seq_delta.seq_ids, strict=True):
            assert c.page_table == core.pages.page_table(sid)
            assert len(c.page_table) * page_size >= c.start + c.num_tokens
        seqs = {q.seq_id: q for r in core.scheduler.requests.values() for q in r.seqs}
        for row in resolved.rows:
            seq = seqs[row.seq_id]
            needs_prompt, needs_output = penalty_token_ids(row.params)
            assert row.prompt_token_ids == (seq.token_ids[:seq.num_prompt_tokens] if needs_prompt else [])
            assert row.output_token_ids == (seq.output_token_ids if needs_output else [])
        return resolved.chunks


def test_a_decode_row_sends_its_table_once_then_only_new_pages():
    pm, enc, mirror = PageManager(64, 4), SeqDeltaEncoder(), SeqMirror()
    pm.admit(0)
    pm.allocate(0, 10)  # 3 pages
    assert send(enc, mirror, pm, [0]) == [[0, 1, 2]]
    delta = enc.encode([(0, pm.page_table(0))])
    assert delta.tables == [] and delta.seq_ids == [0]  # the same table: nothing travels
    mirror.apply(delta)
    pm.allocate(0, 13)  # a fourth page
    delta = enc.encode([(0, pm.page_table(0))])
    assert delta.tables == [(0, 3, [3])]
    mirror.apply(delta)
    assert mirror.table(0) == [0, 1, 2, 3]


def test_a_preempted_sequence_is_sent_whole_again():
    pm, enc, mirror = PageManager(64, 4), SeqDeltaEncoder(), SeqMirror()
    for s in (0, 1):
        pm.admit(s)
        pm.allocate(s, 8)
    assert send(enc, mirror, pm, [0, 1]) == [[0, 1], [2, 3]]
    pm.free(0)  # preempted: its pages go back, then it is admitted again into other pages, same length
    pm.allocate(1, 12)
    pm.admit(0)
    pm.allocate(0, 8)
    delta = enc.encode([(0, pm.page_table(0)), (1, pm.page_table(1))])
    assert delta.tables == [(0, 0, pm.page_table(0)), (1, 2, [pm.page_table(1)[2]])]
    mirror.apply(wire(delta))
    assert [mirror.table(0), mirror.table(1)] == [pm.page_table(0), pm.page_table(1)]


def test_released_sequences_are_forgotten_on_both_ends():
    pm, enc, mirror = PageManager(64, 4), SeqDeltaEncoder(), SeqMirror()
    pm.admit(0)
    pm.allocate(0, 4)
    pm.admit(1)
    pm.allocate(1, 4)
    send(enc, mirror, pm, [0, 1])
    pm.free(0)
    send(enc, mirror, pm, [1], released=[0])
    assert enc.tracked() == mirror.seq_ids() == {1}


def test_a_failed_step_resets_and_the_next_batch_sends_whole_tables():
    pm, enc, mirror = PageManager(64, 4), SeqDeltaEncoder(), SeqMirror()
    for s in (1, 0):
        pm.admit(s)
        pm.allocate(s, 8)
    send(enc, mirror, pm, [1, 0])
    pm.allocate(0, 12)
    enc.encode([(0, pm.page_table(0))])  # this step's delta never reaches the shard
    enc.reset()
    delta = enc.encode([(0, pm.page_table(0))])
    assert delta.tables == [(0, 0, [2, 3, 4])] and delta.generation == 1 and delta.step == 0
    mirror.apply(wire(delta))
    assert mirror.table(0) == [2, 3, 4] and mirror.seq_ids() == {0}  # the old generation's tables are gone


def test_a_missed_delta_or_a_wrong_base_raises_rather_than_run_on_stale_tables():
    pm, enc, mirror = PageManager(64, 4), SeqDeltaEncoder(), SeqMirror()
    pm.admit(0)
    pm.allocate(0, 4)
    send(enc, mirror, pm, [0])
    pm.allocate(0, 8)
    enc.encode([(0, pm.page_table(0))])  # lost on the way
    later = enc.encode([(0, pm.page_table(0))])  # carries nothing for seq 0: the shard would keep 1 page
    with pytest.raises(SeqDeltaMismatch, match="delta 2 of generation 0 follows delta 0"):
        mirror.apply(wire(later))
    with pytest.raises(SeqDeltaMismatch, match="seq 0 appends to its page table at 3, the shard holds 1"):
        mirror.apply(SeqDelta(0, 1, [0], [(0, 3, [9])]))
    with pytest.raises(SeqDeltaMismatch, match="seq 7 has no page table"):
        mirror.resolve([ChunkSpec(NO_TABLE, 0, 1, True)], [7])


def test_a_decode_step_at_128k_tokens_carries_almost_nothing():
    pm, enc = PageManager(16 * 1025, 128), SeqDeltaEncoder()
    for s in range(16):
        pm.admit(s)
        pm.allocate(s, 128 * 1024)
    tables = [(s, pm.page_table(s)) for s in range(16)]
    first = len(pickle.dumps(enc.encode(tables)))
    steady = len(pickle.dumps(enc.encode(tables)))
    assert first > 16 * 1024 * 2 and steady < 200


# ---- random runs: the mirror always resolves what sending every table whole would ----------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12)),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 9)),
    st.tuples(st.just("preempt"), st.integers(0, 7), st.booleans()),  # bool: re-admitted at once (else later)
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    # which live sequences run (a bit mask over the first 8), and whether the step reaches the shard: "lost" =
    # its launch raised (the core fails it at once: no batch was made after it)
    st.tuples(st.just("step"), st.integers(0, 255), st.sampled_from(["ok", "ok", "ok", "lost"])),
    # a step that reached the shard failed afterwards (its result raised; with async scheduling the step launched
    # ahead of it reached the shard too)
    st.tuples(st.just("fail_landed")),
), max_size=60)


class Run:
    """The scheduler side (page manager, encoder, released ids kept until a batch carries them) and the shard."""

    def __init__(self, prefix_caching: bool) -> None:
        self.pm = PageManager(48, 4, enable_prefix_caching=prefix_caching)
        self.enc, self.mirror = SeqDeltaEncoder(), SeqMirror()
        self.live: list[int] = []  # sequences holding pages
        self.parked: list[int] = []  # preempted, not admitted again yet
        self.released: list[int] = []  # released, not yet carried by a batch that landed
        # each sequence's token ids (one list for its life, as `Sequence.token_ids`); odd seq ids have a penalty
        # row, whose token ids travel too
        self.tokens: dict[int, list[int]] = {}
        self.next_sid = 0

    def pick(self, i: int) -> int:
        return self.live[i % len(self.live)]

    def new_sid(self, tokens: list[int]) -> int:
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        self.tokens[sid] = tokens
        return sid

    def keep_or_release(self, sid: int, ok: bool) -> None:
        if ok:
            self.live.append(sid)
        else:  # no room: the sequence ends
            self.pm.free(sid)
            self.released.append(sid)

    def add(self, tokens: int) -> None:
        sid = self.new_sid([100 + self.next_sid] * tokens)
        self.pm.admit(sid)
        self.keep_or_release(sid, self.pm.allocate(sid, tokens))

    def fork(self, parent: int) -> None:
        sid = self.new_sid(list(self.tokens[parent]))
        self.pm.share(sid, parent, len(self.pm.page_table(parent)) // 2)
        self.keep_or_release(sid, self.pm.allocate(sid, len(self.pm.page_table(sid)) * 4 + 1))

    def grow(self, sid: int, tokens: int) -> None:
        self.pm.allocate(sid, len(self.pm.page_table(sid)) * 4 + tokens)
        self.tokens[sid].extend(range(tokens))

    def preempt(self, sid: int, readmit: bool) -> None:
        self.pm.free(sid)
        self.live.remove(sid)
        self.parked.append(sid)
        if readmit:
            self.readmit()

    def readmit(self) -> None:
        sid = self.parked.pop(0)
        self.pm.admit(sid)  # the same seq id, a new table (pages may repeat, a prefix-cache hit's would)
        if self.pm.allocate(sid, 5):
            self.live.append(sid)
        else:
            self.pm.free(sid)
            self.parked.append(sid)

    def release(self, sid: int) -> None:
        self.pm.free(sid)
        self.live.remove(sid)
        self.released.append(sid)

    def step(self, mask: int, fate: str) -> None:
        self.run_step([s for i, s in enumerate(self.live) if mask >> (i % 8) & 1], fate)

    def run_step(self, sids: list[int], fate: str) -> None:
        if not sids:
            return
        released, self.released = self.released, []
        delta = self.enc.encode([(s, self.pm.page_table(s)) for s in sids],
                                [(s, self.tokens[s]) for s in sids if s % 2], released)
        if fate == "lost":
            self.enc.reset()
            self.released[:0] = released  # the core sends them again
            return
        self.mirror.apply(wire(delta), released)
        chunks = [ChunkSpec(NO_TABLE, 0, 1, True)] * len(sids)
        # what sending every list whole would have given the shard
        assert [c.page_table for c in self.mirror.resolve(chunks, delta.seq_ids)] == \
            [self.pm.page_table(s) for s in sids]
        assert all(self.mirror.tokens(s) == self.tokens[s] for s in sids if s % 2)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, prefix_caching=st.booleans())
def test_random_runs_resolve_the_tables_sending_everything_would(ops, prefix_caching):
    run = Run(prefix_caching)
    for op in ops:
        kind, args = op[0], op[1:]
        if kind == "add":
            run.add(*args)
        elif kind == "step":
            run.step(*args)
        elif kind == "fail_landed":
            run.enc.reset()
        elif kind == "preempt" and run.parked and not run.live:
            run.readmit()
        elif run.live:
            sid = run.pick(args[0])
            if kind == "grow":
                run.grow(sid, args[1])
            elif kind == "preempt":
                run.preempt(sid, args[1])
            elif kind == "fork":
                run.fork(sid)
            elif kind == "release":
                run.release(sid)
    run.run_step(list(run.live), "ok")  # a last batch of every live sequence lands
    holding = set(run.live) | set(run.parked) | set(run.released)
    assert all(run.mirror.table(s) == run.pm.page_table(s) for s in run.live)
    assert run.enc.tracked() <= holding and run.mirror.seq_ids() <= holding  # ended sequences are forgotten


def test_an_in_process_engine_sends_the_live_tables(tiny_ckpt):
    """Deltas are for shards in other processes: the in-process executor's batches carry the live page tables
    (nothing is pickled, so encoding and resolving would be pure cost), and greedy tokens are the same."""
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.executor import LocalExecutor
    from workers.request import SamplingParams

    seen = []

    class Spy(LocalExecutor):
        def execute(self, batch):
            seen.append(batch.seq_delta)
            return super().execute(batch)

    cfg = EngineConfig(num_pages=32)
    eng = Engine(tiny_ckpt, engine_config=cfg, executor=Spy(tiny_ckpt, engine_config=cfg, device="cpu"))
    try:
        assert eng.core.seq_delta is None
        eng.add_request("r", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert seen and all(d is None for d in seen)
    finally:
        eng.shutdown()
