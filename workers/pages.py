"""The KV page manager: which pool pages each sequence owns, and which full pages can be reused (pure Python).

A *page* holds `page_size` consecutive tokens of one sequence (for every layer: K, V and, on sparse layers, the
index-K). A sequence's `page_table` lists its pages in logical order; token t lives in slot
`page_table[t // page_size] * page_size + t % page_size`.

Prefix caching: once a page is *full and computed* its content is identified by a hash chain
`h_i = H(h_{i-1}, tokens of page i)`, so equal hashes mean equal whole prefixes (a page's K/V depends on every
earlier token, not only its own). A new sequence whose prompt starts with cached pages takes them by reference
instead of recomputing them. Pages with no owner but a hash stay reusable until memory is needed; they are then
evicted least recently freed first. A sequence's pages are released tail first, so the tail of a chain is evicted
before its head (a head page is useful to more prompts than a tail page, which is useless without its head).

Sharing: only full pages are ever shared (prefix hits and `n > 1` samples). The partially filled last page of a
prompt is never shared: each sample owns a private tail page and computes the tail tokens into it itself. That
makes copy-on-write unnecessary (no page with two owners is ever written) at the cost of recomputing fewer than
`page_size` prompt tokens per extra sample, and needs no device-side page-copy kernel.

Accounting: a page is either *used* (reference count > 0), *free* (no owner, no hash) or *cached* (no owner,
hash kept, evictable). Free and cached pages are both available to allocation.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT_HASH = b"\x00" * 16


def hash_page(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full page given the hash of the page before it (the root for page 0): 16-byte BLAKE2b digest.

    A cryptographic digest, not Python's `hash`, because a collision would silently serve another prompt's K/V.
    """
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_pages(token_ids: Sequence[int], page_size: int, num_pages: int, start_hashes: Sequence[bytes] = ()) -> list[bytes]:
    """Hash chain of the first `num_pages` full pages of `token_ids`, continuing `start_hashes` (a prefix of it)."""
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else _ROOT_HASH
    for i in range(len(hashes), num_pages):
        parent = hash_page(parent, token_ids[i * page_size:(i + 1) * page_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixHit:
    """Cached full pages found for the start of a token sequence. `hashes[i]` is the hash of `page_ids[i]`."""

    page_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.page_ids) * self.page_size


class PageManager:
    """Owns the page ids of a pool of `num_pages` pages. Not thread-safe: the engine's step thread drives it."""

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.0) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # Admission keeps this many pages free so running sequences can still grow (fewer preemptions).
        self.watermark_pages = int(watermark * num_pages)
        self._ref_count = [0] * num_pages
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_pages))  # no owner, no hash: taken first, lowest ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no owner, hashed; first = evicted first
        self._tables: dict[int, list[int]] = {}  # seq id -> page ids in logical order
        self._hashes: dict[int, list[bytes]] = {}  # seq id -> hash chain of its computed full pages
        self.prefix_queries = 0  # cumulative tokens looked up in the prefix cache
        self.prefix_hits = 0  # cumulative tokens found

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages available to allocation: never-used/unhashed ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a reusable prefix."""
        return len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        """Fraction of the pool owned by sequences (0..1)."""
        return self.num_used_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's page ids in logical order (the live list: do not mutate). While the sequence holds its
        pages the list only grows at its end; pages freed and taken again come in a new list (the core's
        per-step deltas rely on both: workers/batch_delta.py)."""
        return self._tables[seq_id]

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def ref_count(self, page_id: int) -> int:
        return self._ref_count[page_id]

    def is_cached(self, page_id: int) -> bool:
        return self._page_hash[page_id] is not None

    def owners(self) -> dict[int, list[int]]:
        """Seq id -> page table copy, for invariant checks."""
        return {s: list(t) for s, t in self._tables.items()}

    # ---- prefix cache -----------------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest run of cached full pages at the start of `token_ids`.

        At least one token is always left uncomputed, because the step that computes the last token is the one
        that yields the logits for the next.
        """
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixHit((), (), self.page_size)
        max_pages = (len(token_ids) - 1) // self.page_size
        page_ids: list[int] = []
        hashes: list[bytes] = []
        parent = _ROOT_HASH
        for i in range(max_pages):
            parent = hash_page(parent, token_ids[i * self.page_size:(i + 1) * self.page_size])
            page = self._page_of_hash.get(parent)
            if page is None:
                break
            page_ids.append(page)
            hashes.append(parent)
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(page_ids) * self.page_size
        return PrefixHit(tuple(page_ids), tuple(hashes), self.page_size)

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish the sequence's newly full and computed pages in the prefix cache.

        Call after the step that computed `token_ids[:num_computed_tokens]`. If another page already holds the
        same content (two sequences computed one prefix in the same step), the first stays the cached one.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[seq_id]
        num_full = num_computed_tokens // self.page_size
        if num_full <= len(hashes):
            return
        start = len(hashes)
        hashes[:] = hash_pages(token_ids, self.page_size, num_full, hashes)
        table = self._tables[seq_id]
        for i in range(start, num_full):
            h, page = hashes[i], table[i]
            if h not in self._page_of_hash and self._page_hash[page] is None:
                self._page_of_hash[h] = page
                self._page_hash[page] = h

    # ---- ownership --------------------------------------------------------------------------------------
    def can_admit(self, num_tokens: int, hit: PrefixHit, *, ignore_watermark: bool = False) -> bool:
        """Whether a new sequence holding `num_tokens` tokens (the first `hit.num_tokens` from `hit`) fits,
        leaving the admission watermark free."""
        new_pages = max(self.pages_for(num_tokens) - len(hit.page_ids), 0)
        revived = sum(1 for p in hit.page_ids if self._ref_count[p] == 0)  # cached pages leaving the free set
        keep = 0 if ignore_watermark else self.watermark_pages
        return self.num_free_pages - revived - new_pages >= keep

    def admit(self, seq_id: int, hit: PrefixHit | None = None) -> None:
        """Start owning pages for `seq_id`: the prefix-hit pages by reference (none if `hit` is None)."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id} already owns pages")
        pages = list(hit.page_ids) if hit else []
        for p in pages:
            self._incref(p)
        self._tables[seq_id] = pages
        self._hashes[seq_id] = list(hit.hashes) if hit else []

    def share(self, dst_seq_id: int, src_seq_id: int, num_pages: int) -> None:
        """Start owning pages for `dst_seq_id`: the first `num_pages` (full) pages of `src_seq_id`, by reference."""
        if dst_seq_id in self._tables:
            raise ValueError(f"seq {dst_seq_id} already owns pages")
        pages = self._tables[src_seq_id][:num_pages]
        for p in pages:
            self._incref(p)
        self._tables[dst_seq_id] = pages
        self._hashes[dst_seq_id] = self._hashes[src_seq_id][:num_pages]

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the sequence's page table to hold `num_tokens` tokens. All or nothing: False if the pool is short."""
        table = self._tables[seq_id]
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        for _ in range(need):
            page = self._take_free_page()
            self._ref_count[page] = 1
            table.append(page)
        return True

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; pages nobody else holds become free (or cached if hashed).

        Tail first, so within one chain the tail pages are the first to be evicted.
        """
        table = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table is None:
            return
        for page in reversed(table):
            self._ref_count[page] -= 1
            if self._ref_count[page] == 0:
                if self._page_hash[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached page (e.g. after new weights). Returns how many were dropped."""
        n = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._drop_hash(page)
            self._free.append(page)
        return n

    # ---- internals --------------------------------------------------------------------------------------
    def _incref(self, page: int) -> None:
        if self._ref_count[page] == 0:
            del self._evictable[page]  # a cached page comes back into use: no longer evictable
        self._ref_count[page] += 1

    def _take_free_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)  # least recently freed cached page
        self._drop_hash(page)
        return page

    def _drop_hash(self, page: int) -> None:
        h = self._page_hash[page]
        self._page_hash[page] = None
        if h is not None and self._page_of_hash.get(h) == page:
            del self._page_of_hash[h]
