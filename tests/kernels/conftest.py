"""Kernel-test fixtures: random paged caches with shuffled page tables, contexts of any length, query rows.

(A fixture rather than a helper module: tests run with --import-mode=importlib, so test folders are not on sys.path.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# The interpreter tests need TRITON_INTERPRET=1 before triton is first imported (jit decorators read it when they
# run); this conftest loads before any test module of this folder. Without CUDA, Triton can only interpret anyway.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True, kw_only=True)
class PagedCase:
    page_tables: torch.Tensor  # [R, max_pages] int32, shuffled physical pages
    k_cache: torch.Tensor  # [P, ps, Hkv, D]
    v_cache: torch.Tensor
    index_k_cache: torch.Tensor  # [P, ps, Di]
    row_seq: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int64


def make_case(*, context_lens: list[int], rows: list[tuple[int, int]], page_size: int, kv_heads: int,
              head_dim: int, index_dim: int, dtype=torch.float32, device="cpu", seed: int = 0,
              spare_pages: int = 3, extra_table_cols: int = 1) -> PagedCase:
    """context_lens[r] tokens per request r; rows = (request, position) per query row (position < its length)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in context_lens]
    num_pages = sum(pages_per) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    width = max(pages_per) + extra_table_cols
    # unused table entries point at a real page so a kernel that reads past the row's blocks reads garbage, not OOB
    table = torch.full((len(context_lens), width), int(perm[-1]), dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_per):
        table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    for r, p in rows:
        assert p < context_lens[r], (r, p)
    return PagedCase(
        page_tables=table.to(device),
        k_cache=rnd(num_pages, page_size, kv_heads, head_dim).to(device),
        v_cache=rnd(num_pages, page_size, kv_heads, head_dim).to(device),
        index_k_cache=rnd(num_pages, page_size, index_dim).to(device),
        row_seq=torch.tensor([r for r, _ in rows], dtype=torch.int32, device=device),
        positions=torch.tensor([p for _, p in rows], dtype=torch.int64, device=device),
    )


@pytest.fixture
def paged_case():
    """`paged_case(context_lens=..., rows=..., page_size=..., ...) -> PagedCase` (see make_case)."""
    return make_case
