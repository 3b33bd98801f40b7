"""Rank-to-rank data: a chained call's rank receives only its part, and failures stay consistent across ranks."""

import time

import pytest
import torch

import flowactors as fa
from flowactors import Batch, Layout
from tests.runtime.workers import Reducer


def _received(ctl) -> dict[str, int]:
    """Batch tensor bytes each worker process deserialized since the last reset."""
    from flowactors import serialization as ser

    return ctl.client.run(lambda: ser.RECEIVED.bytes)


def _reset_received() -> None:
    from flowactors import serialization as ser

    ser.RECEIVED.reset()


def _reset(ctl) -> None:
    ctl.client.run(_reset_received)  # a function run there: a bound method would reset a pickled copy


@pytest.fixture(scope="module")
def pair(controller4):
    """Two DP groups of 2 ranks on different workers (rows must move), one colocated with the first."""
    s = controller4.slots
    p = fa.ActorGroup(controller4, Reducer, name="route_p", slots=s[:2])
    q = fa.ActorGroup(controller4, Reducer, name="route_q", slots=s[2:])
    same = fa.ActorGroup(controller4, Reducer, name="route_same", slots=s[:2])
    yield p, q, same
    for g in (p, q, same):
        g.close()


def _batch(n=1024):
    return Batch({"x": torch.arange(n * 64).reshape(n, 64)}, {"id": list(range(n))})


def test_equal_layouts_send_each_rank_only_its_part(controller4, pair):
    p, q, same = pair
    f1 = p.add_rank(_batch())
    controller4.wait([f1])
    produced = f1.result()
    _reset(controller4)
    f2 = q.scale_x(f1)
    controller4.wait([f2])
    got = _received(controller4)
    part = produced.nbytes // 2
    # each of q's workers received its half, never the whole batch; p's workers received nothing
    assert [got[a] for a in q.addresses] == [part, part]
    assert [got[a] for a in p.addresses] == [0, 0]
    out = f2.result()
    assert torch.equal(out["x"], (_batch()["x"] + 1) * 2) and out["id"] == list(range(1024))
    assert out["rank"].tolist() == [0] * 512 + [1] * 512  # part r came from p's rank r

    # colocated: each part is already on its rank's worker. (A fresh producer call: Dask's memory manager may
    # since have dropped f1's copies on p's workers, now that q's workers hold them too.)
    f1 = p.add_rank(_batch())
    controller4.wait([f1])
    _reset(controller4)
    f3 = same.scale_x(f1)
    controller4.wait([f3])
    assert set(_received(controller4).values()) == {0}
    assert f3.result().equals(out)


def test_differing_layouts_still_concatenate_and_split(controller4, pair):
    p, q, _ = pair
    four = fa.ActorGroup(controller4, Reducer, name="route_four")
    try:
        f = four.scale_x(q.add_rank(_batch(16)))  # 2 parts into 4
        out = f.result()
        assert out["x"].tolist() == ((_batch(16)["x"] + 1) * 2).tolist()
        assert out["rank"].tolist() == [0] * 8 + [1] * 8  # still q's ranks: scale_x passes "rank" on
        back = p.add_rank(four.add_rank(_batch(16))).result()  # 4 parts into 2
        assert back["x"].tolist() == (_batch(16)["x"] + 2).tolist()
        assert back["rank"].tolist() == [0] * 8 + [1] * 8
    finally:
        four.close()


def test_controller_values_and_futures_mix_in_one_call(controller4, pair):
    """A future part and a batch the controller holds (split on the controller) in one call."""
    p, q, _ = pair
    f = p.add_rank(_batch(8))
    local = Batch({"x": torch.arange(8)[:, None] * 1000})
    out = q.join_x(f, local, scale=2).result()
    assert out["x"].tolist() == ((_batch(8)["x"] + 1 + torch.arange(8)[:, None] * 1000) * 2).tolist()
    assert out["rank"].tolist() == [0] * 4 + [1] * 4


def test_rows_stay_on_the_rank_that_produced_them(controller4, pair):
    """Unequal outputs are not rebalanced: rank 1's part stays one row short; the collected order is kept."""
    p, q, _ = pair
    f = p.drop_last_on(_batch(8), 1)
    out = q.total_rows(f).result()
    assert out["x"][:, 0].tolist() == [0, 64, 128, 192, 256, 320, 384]
    assert out["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out["total"].tolist() == [7] * 7


def test_a_failed_part_fails_every_rank_at_once(controller4, pair):
    """Rank 1's input failed; rank 0's is fine but it must not enter the collective alone."""
    p, q, _ = pair
    t0 = time.monotonic()
    with pytest.raises(fa.RemoteError) as info:
        q.total_rows(p.fail_rows(_batch(8), 1)).result(timeout=30)
    assert time.monotonic() - t0 < 10
    e = info.value
    assert (e.group, e.method, e.rank, e.failed_ranks) == ("route_q", "total_rows", 1, [1])
    assert "route_p.fail_rows failed on rank 1" in e.remote_message and "deliberate failure" in e.remote_message
    assert q.total_rows(p.add_rank(_batch(8))).result()["total"].tolist() == [8] * 8  # both groups work on


def test_mesh_parts_carry_their_tensor_peers_outcome(controller4, pair):
    """MESH (dp=2, tp=2): the value is tp rank 0's outputs; a failure on tp rank 1 still reaches the consumer."""
    _, q, _ = pair
    mesh = fa.ActorGroup(controller4, Reducer, name="route_mesh", layout=Layout(dp=2, tp=2))
    try:
        ok = mesh.mesh_fail(_batch(8), -1)
        assert ok.result()["rank"].tolist() == [0] * 4 + [2] * 4
        assert controller4.gather([ok.futures[1]]) == [None]  # not part of the value: dropped on its worker
        out = q.total_rows(ok).result()
        assert out["rank"].tolist() == [0] * 4 + [1] * 4 and out["x"].tolist() == _batch(8)["x"].tolist()
        with pytest.raises(fa.RemoteError) as info:
            q.total_rows(mesh.mesh_fail(_batch(8), 1)).result(timeout=30)
        assert info.value.rank == 0 and "route_mesh.mesh_fail failed on rank 1" in info.value.remote_message
    finally:
        mesh.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_fetched_bytes_names_the_worker_a_calls_input_came_from(direct):
    """`Controller.fetched_bytes`: a call on one worker whose input another worker produced fetched the input's bytes
    from that worker, on either transport (the elastic fleet's join metrics rely on it); a call whose input was
    made where it runs fetched nothing."""
    with fa.Controller.local(2, dashboard=None, direct_calls=direct) as ctl:
        a, b = ctl.slots
        maker = fa.ActorGroup(ctl, Reducer, name="maker", slots=[a])
        taker = fa.ActorGroup(ctl, Reducer, name="taker", slots=[b])
        made = maker.add_rank(Batch({"x": torch.arange(1024 * 64).reshape(1024, 64)}))  # tensors only: bytes
        took = taker.scale_x(made)  # as Dask's transfer log sizes them (a row's Python objects, by an estimate)
        size = made.result().nbytes
        assert took.result()["x"].shape == (1024, 64)
        fetched = ctl.fetched_bytes(took)
        assert set(fetched) == {a}
        assert fetched[a] == pytest.approx(size, rel=0.05)
        here = taker.scale_x(taker.add_rank(_batch()))
        here.result()
        assert ctl.fetched_bytes(here) == {}
