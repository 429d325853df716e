"""Scheduler output -> the step batch a shard runs: token ids, `ChunkSpec`s and the rows to sample.

`StepBatch` is plain data (lists, frozen dataclasses) so it pickles cheaply to a shard actor; the shard turns it
into `AttentionMetadata` on its own device (`msa.metadata.host_metadata` + one staged copy). Sampling state
that must persist across steps (a seeded request's RNG) lives on the shard, keyed by sequence id.

Structured outputs: the grammar state of each constrained row lives with the engine core (it advances with the
tokens the core receives); the batch carries only this step's allowed-token bitmask of those rows, filled here on
the host, and the shard's sampler applies it (see docs/sampling.md).

Page tables and penalty rows' token ids travel as deltas (workers/batch_delta.py): a batch built with the core's
`SeqDeltaEncoder` sends its chunks without tables (`NO_TABLE`) and its penalty rows without token ids, and
`seq_delta` says what changed since the last batch; the shard's `SeqMirror` gives them back (`resolve_batch`). A
batch with `seq_delta` None carries everything itself (tests, benchmarks and a worker group's idle batch).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from msa.metadata import ChunkSpec
from workers.batch_delta import NO_TABLE, SeqDelta, SeqDeltaEncoder, SeqMirror
from workers.pages import PageManager
from workers.request import SamplingParams
from workers.sampler import suppressed_token_ids
from workers.scheduler import SchedulerOutput, Sequence as Seq
from workers.structured import GrammarState, fill_token_bitmask

if TYPE_CHECKING:
    from workers.kv.commands import KVCommands


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleRow:
    """One sequence to sample this step. Token lists are filled only when a penalty needs them."""

    seq_id: int
    sample_index: int  # which of the request's n samples (its seed is params.seed + sample_index)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    suppressed_ids: list[int]  # EOS / stop ids while fewer than min_tokens exist
    num_output_tokens: int = 0  # tokens the sequence already holds (a seeded generator made now skips their draws)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptLogprobChunk:
    """A prefill chunk whose every position's logits are wanted: position start + j predicts prompt token
    `target_ids[j]` (only positions whose next token is still in the prompt have a target)."""

    chunk_index: int
    seq_id: int
    start: int
    target_ids: list[int]
    num_top: int


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One step for a shard. `input_ids[T]` in chunk order (prefill chunks first, decode rows last);
    `sample_chunks[i]` is the chunk whose last token's logits give `rows[i]` its next token."""

    input_ids: list[int]
    chunks: list[ChunkSpec]
    sample_chunks: list[int]
    rows: list[SampleRow]
    released_seq_ids: list[int]  # sequences gone since the last step: the shard drops their RNG state
    prompt_logprob_chunks: list[PromptLogprobChunk] = ()
    # structured outputs: `token_bitmask[j]` ([C, ceil(V / 32)] int32, bit set = allowed) is the mask of
    # `rows[bitmask_rows[j]]`; only constrained rows travel (a step of one JSON request among 256 carries one row)
    bitmask_rows: list[int] = ()
    token_bitmask: np.ndarray | None = None
    # async scheduling: `input_ids[deferred_positions[j]]` is not known on the host (a placeholder): the shard
    # takes it on the device from row `deferred_rows[j]` of the sampled ids of the step it ran just before
    deferred_positions: list[int] = ()
    deferred_rows: list[int] = ()
    # the chunks' page tables and the penalty rows' token ids as a delta against what the shard already holds
    # (None: in the chunks and rows themselves)
    seq_delta: SeqDelta | None = None
    # KV transfer: this step's commands for every shard of the engine (or dp rank), None without transfers; a
    # batch with no chunks and commands is a KV-only step (docs/disaggregation.md)
    kv: KVCommands | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def penalty_token_ids(p: SamplingParams) -> tuple[bool, bool]:
    """(whether the row's sampler reads its prompt token ids, its output token ids): a repetition penalty reads
    both, a presence or frequency penalty the output."""
    needs_prompt = p.repetition_penalty != 1.0
    return needs_prompt, needs_prompt or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _row(seq, eos_token_ids: Iterable[int], constrained: bool, with_tokens: bool) -> SampleRow:
    """`constrained`: the row follows a grammar, which alone decides where it may end: suppressing EOS for
    `min_tokens` could leave a complete grammar no allowed token. `with_tokens`: the row carries the token ids
    its penalties read (else they travel in the batch's `seq_delta`)."""
    p = seq.request.params
    needs_prompt, needs_output = penalty_token_ids(p) if with_tokens else (False, False)
    n_out = seq.num_output_tokens
    return SampleRow(
        seq_id=seq.seq_id,
        sample_index=seq.index,
        params=p,
        prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens] if needs_prompt else [],
        output_token_ids=seq.output_token_ids if needs_output else [],
        suppressed_ids=(suppressed_token_ids(p, n_out, eos_token_ids) if n_out < p.min_tokens and not constrained
                        else []),
        num_output_tokens=n_out,
    )


def _prompt_logprob_chunk(i: int, c, next_target: int | None) -> PromptLogprobChunk | None:
    """Where `next_target` (the first prompt position whose logprob is still missing) falls inside the chunk's
    targets, ask for every logit of the chunk."""
    seq = c.seq
    if next_target is None or c.is_decode:
        return None
    end = min(c.start + c.num_tokens, seq.num_prompt_tokens - 1)  # positions p with a target p + 1 in the prompt
    if max(next_target, c.start + 1) > end:
        return None  # every target of this chunk is collected already (a recompute after preemption)
    return PromptLogprobChunk(chunk_index=i, seq_id=seq.seq_id, start=c.start,
                              target_ids=seq.token_ids[c.start + 1:end + 1], num_top=seq.request.params.prompt_logprobs)


def build_step_batch(out: SchedulerOutput, pages: PageManager, *, eos_token_ids: Sequence[int] = (),
                     released_seq_ids: Sequence[int] = (),
                     prompt_logprob_progress: dict[int, int] | None = None,
                     grammar_of: Callable[[Seq], GrammarState | None] | None = None,
                     pending_rows: dict[int, int] | None = None,
                     seq_delta: SeqDeltaEncoder | None = None) -> StepBatch:
    """Flatten one scheduler output for the executor; valid until the scheduler runs again.

    `prompt_logprob_progress`: seq id -> the next prompt position whose logprob is wanted, for sequences
    collecting prompt logprobs. `grammar_of(seq)`: the sequence's grammar state (None: unconstrained); the
    sampled rows that have one get their bitmask filled now. `pending_rows` (async scheduling): seq id -> its
    row in the sampled ids of the step still running, for sequences whose last token that step samples.
    `seq_delta`: the core's encoder; the chunks then go without tables, the penalty rows without token ids, and
    the batch carries the delta (the encoder also forgets `released_seq_ids`). None: every chunk carries its
    sequence's live table and every row its token ids."""
    input_ids: list[int] = []
    chunks: list[ChunkSpec] = []
    sample_chunks: list[int] = []
    rows: list[SampleRow] = []
    plp: list[PromptLogprobChunk] = []
    grammars: list[GrammarState] = []
    bitmask_rows: list[int] = []
    deferred_positions: list[int] = []
    deferred_rows: list[int] = []
    tables: list[tuple[int, list[int]]] = []
    tokens: list[tuple[int, list[int]]] = []
    progress = prompt_logprob_progress or {}
    for i, c in enumerate(out.chunks):
        seq = c.seq
        input_ids.extend(seq.token_ids[c.start:c.start + c.num_tokens])
        if seq.pending:  # its chunk is the one decode token, the placeholder (workers.scheduler.advance)
            deferred_positions.append(len(input_ids) - 1)
            deferred_rows.append(pending_rows[seq.seq_id])
        want = _prompt_logprob_chunk(i, c, progress.get(seq.seq_id)) if progress else None
        if want is not None:
            plp.append(want)
        # The live page table, not a copy: the executor consumes the batch (builds metadata, or pickles it for
        # an actor) before the scheduler next grows it; the encoder copies what it sends.
        table = pages.page_table(seq.seq_id)
        if seq_delta is not None:
            tables.append((seq.seq_id, table))
            table = NO_TABLE
        chunks.append(ChunkSpec(table, c.start, c.num_tokens, c.is_decode, all_logits=want is not None))
        if c.sample:
            state = grammar_of(seq) if grammar_of is not None else None
            if state is not None:
                bitmask_rows.append(len(rows))
                grammars.append(state)
            sample_chunks.append(i)
            rows.append(_row(seq, eos_token_ids, state is not None, with_tokens=seq_delta is None))
            if seq_delta is not None and penalty_token_ids(seq.request.params)[1]:
                tokens.append((seq.seq_id, seq.token_ids))
    bitmask = fill_token_bitmask(grammars, grammars[0].vocab_size) if grammars else None
    return StepBatch(input_ids=input_ids, chunks=chunks, sample_chunks=sample_chunks, rows=rows,
                     released_seq_ids=list(released_seq_ids), prompt_logprob_chunks=plp, bitmask_rows=bitmask_rows,
                     token_bitmask=None if bitmask is None else bitmask.numpy(),
                     deferred_positions=deferred_positions, deferred_rows=deferred_rows,
                     seq_delta=None if seq_delta is None else seq_delta.encode(tables, tokens, released_seq_ids))


def resolve_batch(batch: StepBatch, mirror: SeqMirror) -> StepBatch:
    """Shard side: the batch with its chunks' full page tables and its penalty rows' token ids, from `mirror`
    brought up to the batch's delta (the batch itself where it carries them)."""
    delta = batch.seq_delta
    if delta is None:
        return batch
    mirror.apply(delta, batch.released_seq_ids)
    rows = batch.rows
    if delta.tokens:
        rows = [_with_token_ids(r, mirror.tokens(r.seq_id)) if penalty_token_ids(r.params)[1] else r for r in rows]
    return dataclasses.replace(batch, chunks=mirror.resolve(batch.chunks, delta.seq_ids), rows=rows, seq_delta=None)


def _with_token_ids(row: SampleRow, token_ids: list[int]) -> SampleRow:
    """A penalty row with its token ids: the output is the last `num_output_tokens` of them."""
    num_prompt = len(token_ids) - row.num_output_tokens
    needs_prompt, _ = penalty_token_ids(row.params)
    return dataclasses.replace(row, prompt_token_ids=token_ids[:num_prompt] if needs_prompt else [],
                               output_token_ids=token_ids[num_prompt:])


def rows_token_bitmask(batch: StepBatch) -> np.ndarray | None:
    """The [len(rows), W] int32 bitmask the sampler takes: the constrained rows' masks, every other row all
    ones (all allowed); None when no row is constrained (the sampler then skips masking)."""
    if batch.token_bitmask is None:
        return None
    full = np.full((len(batch.rows), batch.token_bitmask.shape[1]), -1, dtype=np.int32)
    full[np.asarray(batch.bitmask_rows, dtype=np.int64)] = batch.token_bitmask
    return full


def logits_row_of_chunk(chunks: Sequence[ChunkSpec]) -> tuple[list[int], list[int]]:
    """(first, last) index into `meta.logits_indices` of each chunk: one row per chunk, every token's row for
    chunks with all_logits (build_metadata's order)."""
    first, last, n = [], [], 0
    for c in chunks:
        k = c.num_tokens if c.all_logits else 1
        first.append(n)
        last.append(n + k - 1)
        n += k
    return first, last
