"""Page manager: exact page ids for allocation, freeing, prefix reuse and eviction order."""
from __future__ import annotations

import pytest

from workers.pages import PageManager, hash_pages


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_allocate_grows_page_table_lowest_ids_first_and_all_or_nothing():
    pm = PageManager(num_pages=4, page_size=4)
    pm.admit(1)
    assert pm.allocate(1, 5)  # 5 tokens -> 2 pages
    assert pm.page_table(1) == [0, 1]
    assert pm.allocate(1, 8)  # still 2 pages
    assert pm.page_table(1) == [0, 1]
    pm.admit(2)
    assert not pm.allocate(2, 12)  # needs 3, only 2 free: nothing taken
    assert pm.page_table(2) == []
    assert pm.num_free_pages == 2
    assert pm.allocate(2, 8)
    assert pm.page_table(2) == [2, 3]
    assert pm.num_free_pages == 0 and pm.usage == 1.0


def test_free_returns_pages_and_freed_pages_are_reused_after_untouched_ones():
    pm = PageManager(num_pages=4, page_size=4, enable_prefix_caching=False)
    pm.admit(1)
    pm.allocate(1, 8)  # [0, 1]
    pm.free(1)
    assert pm.num_free_pages == 4 and pm.usage == 0.0
    pm.admit(2)
    pm.allocate(2, 16)
    # untouched pages 2, 3 first, then the freed ones (tail first: 1, 0)
    assert pm.page_table(2) == [2, 3, 1, 0]
    pm.free(2)
    pm.free(2)  # idempotent
    assert pm.num_free_pages == 4


def test_prefix_hit_reuses_full_pages_and_leaves_one_token_to_compute():
    pm = PageManager(num_pages=8, page_size=4)
    prompt = toks(10)
    pm.admit(1)
    pm.allocate(1, 10)  # [0, 1, 2]
    pm.commit(1, prompt, 10)  # pages 0, 1 full and computed; page 2 partial
    assert pm.is_cached(0) and pm.is_cached(1) and not pm.is_cached(2)

    hit = pm.find_cached_prefix(prompt + [99])
    assert hit.page_ids == (0, 1) and hit.num_tokens == 8
    # exactly 8 tokens: only one page may come from the cache (the last token must be computed)
    assert pm.find_cached_prefix(prompt[:8]).page_ids == (0,)
    # a different first page breaks the chain even if page 2's tokens match
    assert pm.find_cached_prefix([7] + prompt[1:]).page_ids == ()

    pm.admit(2, hit)
    assert pm.ref_count(0) == 2 and pm.ref_count(1) == 2
    pm.allocate(2, 11)
    assert pm.page_table(2) == [0, 1, 3]
    pm.free(1)
    assert pm.ref_count(0) == 1 and pm.page_table(2)[:2] == [0, 1]
    pm.free(2)
    assert pm.num_free_pages == 8 and pm.num_cached_pages == 2


def test_commit_continues_the_hash_chain_across_steps():
    pm = PageManager(num_pages=8, page_size=4)
    tokens = toks(12, base=50)
    pm.admit(1)
    pm.allocate(1, 6)
    pm.commit(1, tokens, 6)  # page 0 full
    pm.allocate(1, 12)
    pm.commit(1, tokens, 12)  # pages 1, 2 full
    assert pm._hashes[1] == hash_pages(tokens, 4, 3)
    assert pm.find_cached_prefix(tokens + [1]).page_ids == (0, 1, 2)


def test_cached_pages_are_evicted_least_recently_freed_first_tail_first():
    pm = PageManager(num_pages=6, page_size=2)
    a, b = toks(4, 100), toks(4, 200)
    for sid, t in ((1, a), (2, b)):
        pm.admit(sid)
        pm.allocate(sid, 4)
        pm.commit(sid, t, 4)
    assert pm.page_table(1) == [0, 1] and pm.page_table(2) == [2, 3]
    pm.free(2)  # b freed first: its pages are older in the LRU (tail page 3 before head page 2)
    pm.free(1)
    assert pm.num_cached_pages == 4 and pm.num_free_pages == 6
    pm.admit(3)
    assert pm.allocate(3, 6)  # 3 pages: 4, 5 never used, then evict the LRU cached page: 3 (b's tail)
    assert pm.page_table(3) == [4, 5, 3]
    # b's head page survives, its tail does not; a's chain is intact
    assert pm.find_cached_prefix(b + [0]).page_ids == (2,)
    assert pm.find_cached_prefix(a + [0]).page_ids == (0, 1)
    assert pm.allocate(3, 8)  # next victim: page 2
    assert pm.page_table(3) == [4, 5, 3, 2]
    assert pm.find_cached_prefix(b + [0]).page_ids == ()


def test_prefix_hit_revives_a_cached_page_so_it_cannot_be_evicted():
    pm = PageManager(num_pages=3, page_size=2)
    a = toks(4)
    pm.admit(1)
    pm.allocate(1, 4)
    pm.commit(1, a, 4)
    pm.free(1)
    hit = pm.find_cached_prefix(a + [9])
    assert hit.page_ids == (0, 1)
    assert pm.can_admit(5, hit)  # 2 revived + 1 new = 3 pages
    assert not pm.can_admit(7, hit)  # needs 4
    pm.admit(2, hit)
    assert pm.num_free_pages == 1 and pm.num_cached_pages == 0
    assert pm.allocate(2, 6) and pm.page_table(2) == [0, 1, 2]
    assert not pm.allocate(2, 7)


def test_admission_watermark_keeps_pages_free():
    pm = PageManager(num_pages=10, page_size=4, watermark=0.2)  # keep 2 pages
    hit = pm.find_cached_prefix([1])
    assert pm.can_admit(32, hit)  # 8 pages, 2 left
    assert not pm.can_admit(33, hit)  # 9 pages, 1 left
    assert pm.can_admit(33, hit, ignore_watermark=True)


def test_share_gives_full_pages_by_reference():
    pm = PageManager(num_pages=6, page_size=4, enable_prefix_caching=False)
    pm.admit(1)
    pm.allocate(1, 10)  # [0, 1, 2]
    pm.share(2, 1, 2)
    pm.allocate(2, 10)
    assert pm.page_table(2) == [0, 1, 3]
    assert [pm.ref_count(p) for p in range(4)] == [2, 2, 1, 1]
    pm.free(1)
    assert pm.num_free_pages == 3  # page 2 back; 0, 1 still held by seq 2
    pm.free(2)
    assert pm.num_free_pages == 6 and pm.num_cached_pages == 0


def test_duplicate_content_in_one_step_keeps_the_first_cached_page():
    pm = PageManager(num_pages=4, page_size=2)
    t = [5, 6, 7]
    for sid in (1, 2):
        pm.admit(sid)
        pm.allocate(sid, 3)
    pm.commit(1, t, 3)
    pm.commit(2, t, 3)
    assert pm.find_cached_prefix(t).page_ids == (0,)
    pm.free(1)
    pm.free(2)
    assert pm.num_cached_pages == 1 and pm.num_free_pages == 4  # seq 2's copy went back unhashed
    assert pm.reset_prefix_cache() == 1
    assert pm.find_cached_prefix(t).page_ids == ()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(num_pages=0, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        PageManager(num_pages=1, page_size=0)
