"""Rank and group arithmetic of the 3D-HybridEngine, without processes."""

from __future__ import annotations

import itertools

import pytest

from engines.hybrid import HybridLayout


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


LAYOUTS = [
    HybridLayout(p, t, d, pg, tg)
    for p, t, d in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 3))
    for pg in _divisors(p)
    for tg in _divisors(t)
]


def test_paper_figure_8_example():
    """(p, t, d) = (1, 4, 2) -> t_g = 2: micro-DP groups are consecutive pairs, generation TP groups stride 2."""
    layout = HybridLayout(1, 4, 2, gen_pp=1, gen_tp=2)
    assert layout.micro_dp == 2 and layout.gen_dp == 4
    assert layout.micro_dp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.gen_tp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [layout.gen_coord(r).tp for r in range(4)] == [0, 0, 1, 1]
    assert [layout.gen_coord(r).dp for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_training_rank_order_is_tp_then_dp_then_pp():
    layout = HybridLayout(2, 2, 2)
    assert [tuple(layout.train_coord(r)) for r in range(8)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert all(layout.rank_of(*layout.train_coord(r)) == r for r in range(8))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_groups_partition_the_world_with_the_paper_strides(layout):
    world = set(range(layout.world_size))
    r, s = layout.tp_ratio, layout.pp_ratio
    for groups, size in (
        (layout.micro_dp_groups(), layout.micro_dp),
        (layout.gen_tp_groups(), layout.gen_tp),
        (layout.gen_pp_groups(), layout.gen_pp),
    ):
        assert all(len(g) == size for g in groups)
        assert sorted(x for g in groups for x in g) == sorted(world)
    for group in layout.gen_tp_groups():  # training TP ranks at stride t / t_g
        coords = [layout.train_coord(x) for x in group]
        assert len({(c.pp, c.dp) for c in coords}) == 1
        assert [c.tp - coords[0].tp for c in coords] == [j * r for j in range(layout.gen_tp)]
        assert [layout.gen_coord(x).tp for x in group] == list(range(layout.gen_tp))
    for group in layout.gen_pp_groups():  # training stages at stride p / p_g
        coords = [layout.train_coord(x) for x in group]
        assert [c.pp - coords[0].pp for c in coords] == [k * s for k in range(layout.gen_pp)]
        assert [layout.gen_coord(x).pp for x in group] == list(range(layout.gen_pp))
    for group in layout.micro_dp_groups():
        gens = [layout.gen_coord(x) for x in group]
        assert len({(g.pp, g.tp, g.dp // layout.micro_dp) for g in gens}) == 1  # one generation shard
        assert [g.micro for g in gens] == list(range(layout.micro_dp))
        if s == 1:
            assert list(group) == list(range(group[0], group[0] + len(group)))  # consecutive ranks


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_training_shards_of_a_micro_dp_group_tile_its_generation_shard(layout):
    r, s = layout.tp_ratio, layout.pp_ratio
    for rank in range(layout.world_size):
        g = layout.gen_coord(rank)
        members = {tuple(layout.train_coord(x))[::2] for x in layout.micro_dp_group(rank)}  # (pp, tp)
        assert members == {(pp, tp) for pp in range(g.pp * s, (g.pp + 1) * s) for tp in range(g.tp * r, (g.tp + 1) * r)}
        peers = layout.stage_peers(rank)
        assert rank in peers and set(peers) <= set(layout.micro_dp_group(rank))
        assert sorted(layout.train_coord(x).pp for x in peers) == list(range(g.pp * s, (g.pp + 1) * s))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_generation_mesh_is_a_bijection(layout):
    coords = {(g.pp, g.tp, g.dp) for g in map(layout.gen_coord, range(layout.world_size))}
    assert coords == set(itertools.product(range(layout.gen_pp), range(layout.gen_tp), range(layout.gen_dp)))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((1, 2, 1, 1, 4), "gen_tp=4 must divide train_tp=2"),
        ((1, 4, 1, 1, 3), "choose gen_tp among [1, 2, 4]"),
        ((2, 1, 1, 4, 1), "gen_pp=4 must divide train_pp=2"),
        ((3, 1, 1, 2, 1), "gen_pp=2 must divide train_pp=3"),
        ((1, 0, 1, 1, 1), "train_tp must be a positive integer"),
    ],
)
def test_bad_layouts_are_rejected_with_the_fix(sizes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        HybridLayout(*sizes)


def test_rank_outside_the_layout():
    with pytest.raises(ValueError, match="outside a layout of 4 ranks"):
        HybridLayout(1, 2, 2).gen_coord(4)
