"""Per-step deltas of per-sequence state: a step's batch carries what changed since the last batch the shards saw,
not every scheduled sequence's whole page table (a 128k-token decode row is 1,024 page ids at page size 128, and
the batch went to every shard every step) nor, for a row with a repetition / presence / frequency penalty, its
whole prompt and output token ids.

Two pure halves and the message between them:
  `SeqDeltaEncoder` (scheduler side, one per engine core): per sequence, the lists it last sent (page table,
      token ids) and how much of each; `encode` -> a `SeqDelta`.
  `SeqDelta` (`StepBatch.seq_delta`): the batch's sequence ids (one per chunk) and, for each list that changed,
      either the whole list or what was appended since the last send.
  `SeqMirror` (shard side, one per `ModelRunner`): the lists as the shard knows them; `apply` a delta, then
      `resolve` the batch's chunks (sent without tables) into `ChunkSpec`s with their full page tables, and read
      a penalty row's token ids (`tokens`; workers/batch.py `resolve_batch` does both).

Why a tail is enough: both lists only grow while the encoder tracks them. `PageManager` only ever appends to a
live table; pages freed and taken again (preemption, a re-admission with a prefix-cache hit, a fork) come in a new
list object. A sequence's `token_ids` only grow while it needs its tokens on the host (a penalty row never runs
ahead, so async scheduling's placeholders never reach it: `workers.tracking.needs_host_tokens`). So the encoder
keeps a reference to the list it sent: the same object no shorter than sent is the same list grown at its end
(send the tail); anything else is sent whole.

Staying in step: the mirror applies deltas in the order the encoder made them (one runner; async scheduling
launches the step ahead after the step before it). A failed step may or may not have reached the shards, so the
core `reset()`s the encoder on every step failure: the generation goes up and the encoder forgets what it sent;
a mirror that sees a new generation drops all it holds first, and that batch carries every list it needs whole.
Within a generation the deltas are numbered, so a shard that missed one (a batch lost while the next was already
on its way) raises `SeqDeltaMismatch` instead of running on stale tables, as does an append whose base does not
match the mirror: its step fails, which resets both ends. Never silently wrong pages.
Released sequence ids (`StepBatch.released_seq_ids`: requests that ended) drop their entries on both ends.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from msa.metadata import ChunkSpec

# the page table a chunk travels with when its sequence's table is in `StepBatch.seq_delta`; metadata built from
# an unresolved chunk fails (no page covers its positions) rather than read wrong pages
NO_TABLE: tuple[int, ...] = ()

# (seq id, base, items): the shard's list of that sequence has `base` items, append `items`; base 0 = `items` is
# the whole list (it replaces whatever the mirror held)
Update = tuple[int, int, list[int]]


class SeqDeltaMismatch(RuntimeError):
    """A delta the mirror cannot take: one before it never arrived, or an append to a list the mirror does not
    hold at the length the encoder assumed."""


@dataclass(frozen=True, slots=True)
class SeqDelta:
    """The per-sequence part of one batch (see the module docstring).

    generation: the encoder's generation; a mirror that holds another one drops its lists before applying.
    step: the delta's number within its generation (0, 1, ...): a mirror applies each one, in order.
    seq_ids: the sequence of each chunk of the batch, in chunk order.
    tables: page-table updates. tokens: token-id updates of the rows whose penalties read their token ids.
    """

    generation: int
    step: int
    seq_ids: list[int]
    tables: list[Update]
    tokens: list[Update] = ()

    @property
    def num_ids(self) -> int:
        """Page and token ids carried (what the delta saves is the rest of the lists)."""
        return sum(len(items) for _sid, _base, items in (*self.tables, *self.tokens))


def _encode(sent: dict[int, tuple[list[int], int]], lists: Iterable[tuple[int, list[int]]]) -> list[Update]:
    updates: list[Update] = []
    for sid, items in lists:
        n = len(items)
        last = sent.get(sid)
        if last is not None and last[0] is items and last[1] <= n:
            if last[1] == n:
                continue  # unchanged: the usual decode row's table (a page lasts page_size steps)
            updates.append((sid, last[1], items[last[1]:]))
        else:
            updates.append((sid, 0, list(items)))  # a copy: the live list grows after this batch is sent
        sent[sid] = (items, n)
    return updates


class SeqDeltaEncoder:
    """Scheduler side: what each sequence's shards hold of its page table and token ids. Pure; one per core."""

    def __init__(self) -> None:
        self.generation = 0
        self._step = 0  # the number of the next delta within this generation
        # seq id -> (the live list last sent, by reference; how many of its items were sent)
        self._tables: dict[int, tuple[list[int], int]] = {}
        self._tokens: dict[int, tuple[list[int], int]] = {}

    def encode(self, tables: Sequence[tuple[int, list[int]]], tokens: Iterable[tuple[int, list[int]]] = (),
               released: Iterable[int] = ()) -> SeqDelta:
        """The delta of one batch: `tables` = (seq id, its live page table) per chunk, in chunk order; `tokens` =
        (seq id, its live token ids) per row whose penalties read them; `released` = the sequence ids the batch
        releases (forgotten here, dropped by the mirror)."""
        for sid in released:
            self._tables.pop(sid, None)
            self._tokens.pop(sid, None)
        delta = SeqDelta(self.generation, self._step, [sid for sid, _ in tables], _encode(self._tables, tables),
                         _encode(self._tokens, tokens))
        self._step += 1
        return delta

    def reset(self) -> None:
        """A step failed: whether its delta reached the shards is unknown. The next batch starts a new
        generation and sends every list it names whole."""
        self.generation += 1
        self._step = 0
        self._tables.clear()
        self._tokens.clear()

    def tracked(self) -> set[int]:
        """The sequences whose sent lists are remembered (tests: released ones are forgotten)."""
        return set(self._tables) | set(self._tokens)


def _apply(store: dict[int, list[int]], updates: Iterable[Update], what: str, generation: int) -> None:
    for sid, base, items in updates:
        if base == 0:
            store[sid] = list(items)  # owned here: an in-process batch shares its lists with nobody else
            continue
        have = store.get(sid)
        if have is None or len(have) != base:
            held = f"no {what}" if have is None else f"{len(have)}"
            raise SeqDeltaMismatch(f"seq_delta: seq {sid} appends to its {what} at {base}, the shard holds {held} "
                                   f"(generation {generation})")
        have.extend(items)


class SeqMirror:
    """Shard side: the page tables (and penalty rows' token ids) of the sequences the shard's batches named."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self._last_step = -1  # the number of the last delta applied in this generation
        self._tables: dict[int, list[int]] = {}
        self._tokens: dict[int, list[int]] = {}

    def apply(self, delta: SeqDelta, released: Iterable[int] = ()) -> None:
        """Bring the lists up to the batch's: a new generation drops everything first, then `released`
        sequences are dropped and the updates applied. Raises `SeqDeltaMismatch` for a delta out of order or an
        append the mirror cannot take (the step fails and the encoder resets)."""
        if delta.generation != self.generation:
            self._tables.clear()
            self._tokens.clear()
            self.generation, self._last_step = delta.generation, -1
        if delta.step != self._last_step + 1:
            raise SeqDeltaMismatch(f"seq_delta: delta {delta.step} of generation {delta.generation} follows "
                                   f"delta {self._last_step}: one never reached this shard")
        self._last_step = delta.step
        for sid in released:
            self._tables.pop(sid, None)
            self._tokens.pop(sid, None)
        _apply(self._tables, delta.tables, "page table", delta.generation)
        _apply(self._tokens, delta.tokens, "token ids", delta.generation)

    def resolve(self, chunks: Sequence[ChunkSpec], seq_ids: Sequence[int]) -> list[ChunkSpec]:
        """The batch's chunks with their sequences' full page tables (the live mirror lists: the runner reads them
        while building the step's inputs, before the next `apply`)."""
        if len(seq_ids) != len(chunks):
            raise SeqDeltaMismatch(f"seq_delta: {len(seq_ids)} sequence ids for {len(chunks)} chunks")
        tables = self._tables
        try:
            return [ChunkSpec(tables[sid], c.start, c.num_tokens, c.is_decode, c.all_logits)
                    for c, sid in zip(chunks, seq_ids)]
        except KeyError as e:
            raise SeqDeltaMismatch(f"seq_delta: seq {e.args[0]} has no page table on the shard") from None

    def tokens(self, seq_id: int) -> list[int]:
        """A penalty row's token ids (prompt then output), as its batch left them."""
        try:
            return self._tokens[seq_id]
        except KeyError:
            raise SeqDeltaMismatch(f"seq_delta: seq {seq_id} has no token ids on the shard") from None

    def table(self, seq_id: int) -> list[int] | None:
        return self._tables.get(seq_id)

    def seq_ids(self) -> set[int]:
        return set(self._tables) | set(self._tokens)
