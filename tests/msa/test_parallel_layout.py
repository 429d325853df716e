"""Rank layout and context rules (no process groups needed): which world ranks form each group, how tokens are
de-duplicated over tp before expert dispatch, and the errors for layouts that cannot work."""
from __future__ import annotations

import pytest

from msa.parallel import ParallelContext, RankLayout, init_parallel


def test_groups_of_tp2_dp2_ep4():
    lay = RankLayout(tp=2, ep=4, dp=2)
    assert lay.world_size == 4
    assert lay.tp_groups() == [[0, 1], [2, 3]]
    assert lay.dp_groups() == [[0, 2], [1, 3]]
    assert lay.ep_groups() == [[0, 1, 2, 3]]
    assert [lay.ranks(r) for r in range(4)] == [{"tp": 0, "dp": 0, "ep": 0}, {"tp": 1, "dp": 0, "ep": 1},
                                                {"tp": 0, "dp": 1, "ep": 2}, {"tp": 1, "dp": 1, "ep": 3}]


def test_every_rank_is_in_exactly_one_group_per_axis():
    for tp, ep, dp in [(4, 2, 1), (1, 2, 4), (2, 2, 2), (8, 8, 1), (2, 8, 4)]:
        lay = RankLayout(tp=tp, ep=ep, dp=dp)
        for groups, size in ((lay.tp_groups(), tp), (lay.dp_groups(), dp), (lay.ep_groups(), ep)):
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(lay.world_size)) and all(len(g) == size for g in groups)
        for r in range(lay.world_size):
            ranks = lay.ranks(r)
            assert lay.tp_groups()[ranks["dp"]][ranks["tp"]] == r
            assert lay.dp_groups()[ranks["tp"]][ranks["dp"]] == r
            assert next(g for g in lay.ep_groups() if r in g).index(r) == ranks["ep"]


def test_bad_layouts_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="ep: 3 must divide tp \\* dp = 4"):
        RankLayout(tp=2, ep=3, dp=2)
    with pytest.raises(ValueError, match="tp: must be >= 1"):
        RankLayout(tp=0, ep=1, dp=1)
    with pytest.raises(ValueError, match="world_size: 3 != tp \\* dp"):
        init_parallel(0, 3, tp=2, dp=1)
    with pytest.raises(ValueError, match="rank: 4 is not a rank"):
        init_parallel(4, 4, tp=4)
    with pytest.raises(ValueError, match="init_method/store"):
        init_parallel(0, 2, tp=2)
    with pytest.raises(ValueError, match="moe_dispatch"):
        ParallelContext(moe_dispatch="ring")
    with pytest.raises(ValueError, match="ep_group: a process group is required"):
        ParallelContext(ep_size=2, ep_rank=1)


def test_world_of_one_needs_no_process_group():
    ctx = init_parallel(0, 1)
    assert ctx == ParallelContext.single()


def _ctx(tp=1, tp_rank=0, ep=1, dp=1):
    g = object()  # no collective runs here
    return ParallelContext(tp_size=tp, tp_rank=tp_rank, tp_group=g if tp > 1 else None, ep_size=ep,
                           ep_group=g if ep > 1 else None, dp_size=dp, dp_group=g if dp > 1 else None)


def test_moe_token_slices_cover_the_batch_once():
    for tp in (2, 4, 8):
        for t in (0, 1, 3, 7, 64, 129):
            slices = [_ctx(tp, r, ep=2).moe_token_slice(t) for r in range(tp)]
            assert sum(n for _, n in slices) == t
            assert all(s[0] + s[1] == nxt[0] for s, nxt in zip(slices, slices[1:]))
            assert max(n for _, n in slices) - min(n for _, n in slices) <= 1
    # ep = 1: experts are tp-sharded, every rank needs every token
    assert _ctx(4, 3).moe_token_slice(10) == (0, 10)


def test_lockstep_only_when_an_ep_group_spans_dp_ranks():
    assert not _ctx(tp=2, ep=2, dp=2).dp_ranks_in_lockstep  # ep groups are the tp groups
    assert _ctx(tp=2, ep=4, dp=2).dp_ranks_in_lockstep
    assert _ctx(tp=1, ep=2, dp=2).dp_ranks_in_lockstep
    assert not _ctx(tp=1, ep=1, dp=2).dp_ranks_in_lockstep  # experts replicated per dp rank: nothing shared
