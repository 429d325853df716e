"""Per-step page-table deltas: a step's batch carries what changed in its sequences' page tables since the last
batch the shards saw, not every scheduled sequence's whole table (a 128k-token decode row is 1,024 page ids at
page size 128, and the batch went to every shard every step).

Two pure halves and the message between them:
  `PageTableEncoder` (scheduler side, one per engine core): per sequence, the table it last sent and how many
      of its pages; `encode` -> a `PageTableDelta`.
  `PageTableDelta` (`StepBatch.page_tables`): the batch's sequence ids (one per chunk) and, for each sequence
      whose table changed, either its whole table or the pages appended since the last send.
  `PageTableMirror` (shard side, one per `ModelRunner`): the tables as the shard knows them; `apply` a delta,
      then `resolve` the batch's chunks (sent without tables) into `ChunkSpec`s with their full page tables.

Why a tail is enough: `PageManager` only ever appends to a live table; pages freed and taken again (preemption,
a re-admission with a prefix-cache hit, a fork) come in a new list object. So the encoder keeps a reference to
the list it sent: the same object is the same table grown at its end (send the tail); another object is a new
table (send it whole).

Staying in step: the mirror applies deltas in the order the encoder made them (one runner; async scheduling
launches the step ahead after the step before it). A failed step may or may not have reached the shards, so the
core `reset()`s the encoder on every step failure: the generation goes up and the encoder forgets what it sent;
a mirror that sees a new generation drops all it holds first, and that batch carries every table it needs whole.
Within a generation the deltas are numbered, so a shard that missed one (a batch lost while the next was already
on its way) raises `PageTableMismatch` instead of running on stale tables, as does an append whose base does not
match the mirror: its step fails, which resets both ends. Never silently wrong pages. Released sequence ids (`StepBatch.released_seq_ids`: requests that
ended) drop their entries on both ends.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from msa.metadata import ChunkSpec

# the page table a chunk travels with when its sequence's table is in `StepBatch.page_tables`; metadata built
# from an unresolved chunk fails (no page covers its positions) rather than read wrong pages
NO_TABLE: tuple[int, ...] = ()


class PageTableMismatch(RuntimeError):
    """A delta appends to a table the mirror does not hold at the length the encoder assumed."""


@dataclass(frozen=True, slots=True)
class PageTableDelta:
    """The page-table part of one batch (see the module docstring).

    generation: the encoder's generation; a mirror that holds another one drops its tables before applying.
    step: the delta's number within its generation (0, 1, ...): a mirror applies each one, in order.
    seq_ids: the sequence of each chunk of the batch, in chunk order.
    updates: (seq id, base, pages): the shard's table of that sequence has `base` pages, append `pages`;
             base 0 = `pages` is the whole table (it replaces whatever the mirror held).
    """

    generation: int
    step: int
    seq_ids: list[int]
    updates: list[tuple[int, int, list[int]]]

    @property
    def num_page_ids(self) -> int:
        """Page ids carried (what the delta saves is the rest of the tables)."""
        return sum(len(pages) for _sid, _base, pages in self.updates)


class PageTableEncoder:
    """Scheduler side: what each sequence's shards hold of its page table. Pure; one per engine core."""

    def __init__(self) -> None:
        self.generation = 0
        self._step = 0  # the number of the next delta within this generation
        # seq id -> (the live table last sent, by reference; how many of its pages were sent)
        self._sent: dict[int, tuple[list[int], int]] = {}

    def encode(self, tables: Iterable[tuple[int, list[int]]], released: Iterable[int] = ()) -> PageTableDelta:
        """The delta of one batch: `tables` = (seq id, its live page table) per chunk, in chunk order;
        `released` = the sequence ids the batch releases (forgotten here, dropped by the mirror)."""
        for sid in released:
            self._sent.pop(sid, None)
        seq_ids: list[int] = []
        updates: list[tuple[int, int, list[int]]] = []
        for sid, table in tables:
            seq_ids.append(sid)
            n = len(table)
            sent = self._sent.get(sid)
            if sent is not None and sent[0] is table and sent[1] <= n:
                if sent[1] == n:
                    continue  # unchanged: the usual decode row (a page lasts page_size steps)
                updates.append((sid, sent[1], table[sent[1]:]))
            else:
                updates.append((sid, 0, list(table)))  # a copy: the live list grows after this batch is sent
            self._sent[sid] = (table, n)
        delta = PageTableDelta(self.generation, self._step, seq_ids, updates)
        self._step += 1
        return delta

    def reset(self) -> None:
        """A step failed: whether its delta reached the shards is unknown. The next batch starts a new
        generation and sends every table it names whole."""
        self.generation += 1
        self._step = 0
        self._sent.clear()

    def tracked(self) -> set[int]:
        """The sequences whose sent table is remembered (tests: released ones are forgotten)."""
        return set(self._sent)


class PageTableMirror:
    """Shard side: the page tables of the sequences the shard's batches named. One per runner."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self._last_step = -1  # the number of the last delta applied in this generation
        self._tables: dict[int, list[int]] = {}

    def apply(self, delta: PageTableDelta, released: Iterable[int] = ()) -> None:
        """Bring the tables up to the batch's: a new generation drops every table first, then `released`
        sequences are dropped and the updates applied. Raises `PageTableMismatch` for a delta out of order or an
        append the mirror cannot take (the step fails and the encoder resets)."""
        if delta.generation != self.generation:
            self._tables.clear()
            self.generation, self._last_step = delta.generation, -1
        if delta.step != self._last_step + 1:
            raise PageTableMismatch(f"page_tables: delta {delta.step} of generation {delta.generation} follows "
                                    f"delta {self._last_step}: one never reached this shard")
        self._last_step = delta.step
        for sid in released:
            self._tables.pop(sid, None)
        for sid, base, pages in delta.updates:
            if base == 0:
                self._tables[sid] = list(pages)  # owned here: an in-process batch shares its lists with nobody else
                continue
            table = self._tables.get(sid)
            if table is None or len(table) != base:
                have = "no table" if table is None else f"{len(table)} pages"
                raise PageTableMismatch(f"page_tables: seq {sid} appends at page {base}, the shard holds {have} "
                                        f"(generation {delta.generation})")
            table.extend(pages)

    def resolve(self, chunks: Sequence[ChunkSpec], seq_ids: Sequence[int]) -> list[ChunkSpec]:
        """The batch's chunks with their sequences' full page tables (the live mirror lists: the runner reads them
        while building the step's inputs, before the next `apply`)."""
        if len(seq_ids) != len(chunks):
            raise PageTableMismatch(f"page_tables: {len(seq_ids)} sequence ids for {len(chunks)} chunks")
        tables = self._tables
        try:
            return [ChunkSpec(tables[sid], c.start, c.num_tokens, c.is_decode, c.all_logits)
                    for c, sid in zip(chunks, seq_ids)]
        except KeyError as e:
            raise PageTableMismatch(f"page_tables: seq {e.args[0]} has no table on the shard") from None

    def table(self, seq_id: int) -> list[int] | None:
        return self._tables.get(seq_id)

    def seq_ids(self) -> set[int]:
        return set(self._tables)
