"""msa/metadata.py: the host lists of a step, and their staging into one buffer (pack / Stager)."""
from __future__ import annotations

import random

import pytest
import torch

from msa.metadata import ChunkSpec, Stager, build_metadata, host_metadata, pack


def _chunks(rng: random.Random, page_size: int) -> list[ChunkSpec]:
    chunks, pool = [], list(range(200))
    rng.shuffle(pool)
    for is_decode, (start, n) in [(False, (0, 37)), (False, (2 * page_size + 3, 50)), (True, (70, 1)),
                                   (True, (page_size - 1, 1))]:
        pages = -(-(start + n) // page_size)
        table, pool = pool[:pages + rng.randrange(3)], pool[pages + 3:]
        chunks.append(ChunkSpec(table, start, n, is_decode, all_logits=(n == 50)))
    return chunks


def test_pack_lays_every_list_at_an_aligned_offset_and_round_trips():
    rng = random.Random(0)
    lists = [([rng.randrange(-2**40, 2**40) for _ in range(n)], torch.int64) for n in (0, 3, 7)] + \
            [([rng.randrange(-2**30, 2**30) for _ in range(n)], torch.int32) for n in (5, 0, 1)] + \
            [([-1, 2**62], torch.int64)]
    blob, spans = pack(lists)
    assert len(blob) % 16 == 0 and len(spans) == len(lists)
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    for (values, dtype), (offset, nbytes, got_dtype) in zip(lists, spans):
        assert offset % 16 == 0 and got_dtype == dtype  # Triton specialises pointers on 16 and nbytes == len(values) * dtype.itemsize
        assert buf[offset:offset + nbytes].view(dtype).tolist() == values
    ends = [o + n for o, n, _ in spans]
    assert all(o >= e for o, e in zip([o for o, _, _ in spans][1:], ends))  # no two lists overlap


def test_host_metadata_lists_match_the_device_metadata():
    ps = 16
    chunks = _chunks(random.Random(1), ps)
    host = host_metadata(chunks, ps)
    meta, (extra,) = host.to_device(Stager("cpu"), extra=[([5, 6, 7], torch.int64)])
    ref = build_metadata(chunks, ps)
    for name in ("positions", "slot_mapping", "row_seq", "query_start_loc", "context_lens", "logits_indices"):
        assert getattr(meta, name).tolist() == getattr(ref, name).tolist() == getattr(host, name).tolist(), name
    assert meta.page_tables.tolist() == ref.page_tables.tolist()
    assert meta.page_tables.shape == (len(chunks), max(len(c.page_table) for c in chunks))
    assert extra.tolist() == [5, 6, 7]
    assert (meta.num_prefill_tokens, meta.num_prefill_requests, meta.max_prefill_len) == (87, 2, 50)
    # the slot of token t of a chunk is its page id * page size + offset
    c = chunks[1]
    first_row = host.query_start_loc[1]
    for i in range(c.num_tokens):
        p = c.start + i
        assert host.slot_mapping[first_row + i] == c.page_table[p // ps] * ps + p % ps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stager_on_cuda_equals_the_host_lists_across_steps_and_growth():
    rng = random.Random(2)
    stager = Stager("cuda")
    staged = []
    for n in [10, 5000, 20000, 3, 40000, 7]:  # sizes grow past the first buffer (64 KiB) and shrink again
        torch.cuda._sleep(10_000_000)  # keep the stream busy: the copy is still queued when the next step stages
        lists = [([rng.randrange(-2**40, 2**40) for _ in range(n)], torch.int64),
                 ([rng.randrange(-2**30, 2**30) for _ in range(n // 2 + 1)], torch.int32), ([], torch.int64)]
        staged.append((lists, stager.stage(lists)))
    for lists, got in staged:  # read only now: a later step's staging must not have overwritten an earlier copy
        for (values, dtype), t in zip(lists, got):
            assert t.device.type == "cuda" and t.dtype == dtype and t.tolist() == values
