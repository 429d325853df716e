"""Helpers shared by the torch references: gather one request's context from the paged cache."""
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
