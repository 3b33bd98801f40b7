import pytest
import torch

from flowactors import (
    ALL_TO_ALL,
    DP,
    MESH,
    ONE_TO_ALL,
    RANK_ZERO,
    Batch,
    Layout,
    Protocol,
    ProtocolError,
    get_protocol,
    register_protocol,
)


def rows(n):
    return Batch({"x": torch.arange(n)})


def test_layout_rank_order_is_tp_fastest_then_dp_then_pp():
    lay = Layout(pp=2, dp=3, tp=2)
    assert lay.world_size == 12
    assert [lay.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert lay.coords(11) == (1, 2, 1)
    assert all(lay.rank(*lay.coords(r)) == r for r in range(12))
    with pytest.raises(ValueError, match="Layout.tp must be a positive integer"):
        Layout(tp=0)


def test_dp_splits_batches_and_replicates_other_args():
    per = DP.split((rows(6), 7), {"b": rows(6)}, Layout(dp=3))
    assert [p[0][0]["x"].tolist() for p in per] == [[0, 1], [2, 3], [4, 5]]
    assert all(p[0][1] == 7 for p in per) and per[2][1]["b"]["x"].tolist() == [4, 5]
    assert DP.collect([rows(2), rows(3)], Layout(dp=2))["x"].tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="data-parallel size 4"):
        DP.split((rows(6),), {}, Layout(dp=4))


def test_mesh_splits_by_dp_replicates_tp_pp_and_collects_last_stage_tp0():
    lay = Layout(pp=2, dp=2, tp=2)
    per = MESH.split((rows(4),), {}, lay)
    got = [p[0][0]["x"].tolist() for p in per]
    for r in range(8):
        assert got[r] == [[0, 1], [2, 3]][lay.coords(r)[1]]
    outs = [Batch({"r": torch.tensor([r])}) for r in range(8)]
    # last stage (pp=1), tp=0: ranks 4 (dp 0) and 6 (dp 1)
    assert MESH.collect(outs, lay)["r"].tolist() == [4, 6]


def test_one_to_all_all_to_all_rank_zero():
    lay = Layout(dp=3)
    assert [p[0] for p in ONE_TO_ALL.split((1, 2), {}, lay)] == [(1, 2)] * 3
    assert [p[0] for p in ALL_TO_ALL.split(([1, 2, 3],), {}, lay)] == [(1,), (2,), (3,)]
    with pytest.raises(ValueError, match="one item per rank"):
        ALL_TO_ALL.split(([1, 2],), {}, lay)
    assert RANK_ZERO.collect(["a", "b", "c"], lay) == "a"
    assert ONE_TO_ALL.collect(["a", "b", "c"], lay) == ["a", "b", "c"]


def test_custom_protocol_registration_and_checks():
    bad = Protocol("test_bad_count", lambda a, k, lay: [(a, k)], lambda o, lay: o)
    with pytest.raises(ProtocolError, match="returned 1 per-rank inputs for a group of 2 ranks"):
        bad.split((), {}, Layout(dp=2))
    p = register_protocol(
        Protocol("test_reverse", lambda a, k, lay: [(a[::-1], k)] * lay.world_size, lambda o, lay: o[::-1])
    )
    assert get_protocol("test_reverse") is p
    with pytest.raises(ValueError, match="already registered"):
        register_protocol(Protocol("test_reverse", p.distribute, p.collect))
    with pytest.raises(ValueError, match="unknown protocol 'nope'"):
        get_protocol("nope")


@pytest.mark.parametrize("protocol", [DP, MESH, RANK_ZERO])
@pytest.mark.parametrize(
    "layout", [Layout(dp=1), Layout(dp=4), Layout(dp=2, tp=2), Layout(pp=2, dp=2, tp=2), Layout(pp=3, tp=2)]
)
def test_declared_parts_and_destinations_match_collect_and_distribute(protocol, layout):
    """Protocol.parts / destinations are promises the runtime routes data by: check them against the functions."""
    w = layout.world_size
    outputs = [Batch({"r": torch.full((2,), r)}) for r in range(w)]
    parts = protocol.parts(layout)
    assert sorted(r for p in parts for r in p) == list(range(w))  # every rank in exactly one part
    want = Batch.concat([outputs[p[0]] for p in parts])
    got = protocol.collect(outputs, layout)
    assert got["r"].tolist() == want["r"].tolist()
    if protocol.destinations is None:
        return
    dest = protocol.destinations(layout)
    n = max(dest) + 1
    per = protocol.split((rows(4 * n), "other"), {"b": rows(4 * n)}, layout)
    for r in range(w):
        (a, other), kw = per[r]
        assert a["x"].tolist() == rows(4 * n).split(n)[dest[r]]["x"].tolist() == kw["b"]["x"].tolist()
        assert other == "other"


def test_builtin_protocols_travel_by_name_custom_ones_by_value():
    import cloudpickle

    assert cloudpickle.loads(cloudpickle.dumps(DP)) is DP
    custom = Protocol("test_unregistered", lambda a, k, lay: [(a, k)] * lay.world_size, lambda o, lay: o)
    back = cloudpickle.loads(cloudpickle.dumps(custom))
    assert back.name == "test_unregistered" and back.collect([1], Layout()) == [1]
