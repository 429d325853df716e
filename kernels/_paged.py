"""Helpers shared by the launchers and the torch references: a step's prompt-row layout, gathering one request's
context from the paged cache."""
from __future__ import annotations

import torch


def request_rows(row_seq: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(request index, row indices)] for the requests present in `row_seq` [N]."""
    out = []
    for r in torch.unique(row_seq).tolist():
        out.append((int(r), (row_seq == r).nonzero(as_tuple=True)[0]))
    return out


def gather_context(cache: torch.Tensor, page_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens of one request from a paged cache [P, ps, ...] -> [num_tokens, ...]."""
    ps = cache.shape[1]
    n_pages = -(-num_tokens // ps)
    pages = page_table_row[:n_pages].to(torch.long)
    return cache.index_select(0, pages).reshape(n_pages * ps, *cache.shape[2:])[:num_tokens]


def gather_row_contexts(cache: torch.Tensor, page_tables: torch.Tensor, row_seq: torch.Tensor,
                        num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens of every row's request at once -> [N, num_tokens, ...] (rows whose request is
    shorter get whatever its table holds past its end, entries clamped into the cache: callers mask them)."""
    ps = cache.shape[1]
    n_pages = -(-num_tokens // ps)
    pages = page_tables.index_select(0, row_seq.to(torch.long))[:, :n_pages].to(torch.long)
    pages = pages.clamp(0, cache.shape[0] - 1)
    rows = cache.index_select(0, pages.flatten())
    return rows.reshape(row_seq.shape[0], n_pages * ps, *cache.shape[2:])[:, :num_tokens]


def prefill_layout(row_seq: torch.Tensor, num_prefill_rows: int) -> tuple[torch.Tensor, int, int]:
    """(query_start_loc [R + 1] int32 on row_seq's device, R, longest request's rows) of the prompt rows
    [0, num_prefill_rows), derived on the host (one sync: for direct callers and tests; the model passes its
    metadata's). The rows must be grouped by request, requests 0 .. R - 1 in order (the metadata's contract)."""
    seq = row_seq[:num_prefill_rows].tolist()
    starts = [0] + [i for i in range(1, len(seq)) if seq[i] != seq[i - 1]]
    if [seq[i] for i in starts] != list(range(len(starts))):
        raise ValueError("prefill rows must be grouped by request, requests 0 .. R-1 in order")
    qsl = starts + [len(seq)]
    max_len = max(b - a for a, b in zip(qsl, qsl[1:]))
    return torch.tensor(qsl, dtype=torch.int32, device=row_seq.device), len(starts), max_len
