"""Groups on a real LocalCluster of worker processes: collectives, colocation, chaining, ordering, errors."""

import pytest
import torch

import flowactors as fa
from flowactors import Batch, Layout
from flowactors import serialization as ser
from tests.runtime.workers import BrokenInit, PairReducer, Reducer, nap


@pytest.fixture(scope="module")
def groups(controller4):
    a = fa.ActorGroup(controller4, Reducer, name="rt_a", args=(1.0,))
    b = fa.ActorGroup(controller4, Reducer, name="rt_b", args=(10.0,))  # colocated with a, same 4 processes
    c = fa.ActorGroup(controller4, Reducer, name="rt_c", slots=controller4.slots[:2], args=(100.0,))
    yield a, b, c
    for g in (a, b, c):
        g.close()


def test_all_reduce_across_2_and_4_ranks(groups):
    a, _, c = groups
    assert a.all_reduce(1.0).result() == [10.0] * 4  # 1+2+3+4
    assert c.all_reduce(1.0).result() == [300.0] * 2  # 100*(1+2)


def test_colocated_groups_interleaved_collectives_sum_correctly(groups):
    a, b, c = groups
    futs = []
    for i in range(40):  # issued without waiting: ordering is what keeps collectives from crossing
        futs.append((a.all_reduce(float(i)), 10.0 * i))
        futs.append((b.all_reduce(float(i)), 100.0 * i))
        futs.append((c.all_reduce(float(i)), 300.0 * i))
    for f, want in futs:
        assert f.result() == [want] * len(f.result())


def test_a_worker_reaches_the_colocated_instance_of_another_group(groups):
    a, b, c = groups
    assert a.scale_of("rt_b").result() == [(10.0, r) for r in range(4)]  # same slots, same processes, same ranks
    assert c.scale_of("rt_a").result() == [(1.0, 0), (1.0, 1)]
    with pytest.raises(fa.RemoteError, match=r"group 'rt_nowhere' has no rank in this worker process .* place both"):
        a.scale_of("rt_nowhere").result()


def test_chain_moves_no_batch_bytes_through_the_controller(controller4, groups):
    a, b, c = groups
    batch = Batch({"x": torch.arange(1024 * 64).reshape(1024, 64)}, {"id": list(range(1024))})
    ser.RECEIVED.reset()
    f1 = a.add_rank(batch)
    f2 = b.scale_x(f1)
    f3 = c.scale_x(f2)
    controller4.wait([f3])  # completed on the workers, nothing fetched yet
    assert ser.RECEIVED.bytes == 0
    out = f3.result()
    assert ser.RECEIVED.bytes == out.nbytes > 0
    assert torch.equal(out["x"], (batch["x"] + 1) * 4)
    assert out["rank"].tolist() == [r for r in range(4) for _ in range(256)]
    assert out["id"] == list(range(1024))


def test_calls_run_in_issue_order_under_load(controller4, groups):
    a, _, c = groups
    a.history().result()
    start = len(a.history().result()[0])
    # Interleave calls whose input is remote (a future computed on other workers) with local ones.
    dep = c.all_reduce(1.0)
    issued = []
    for i in range(60):
        issued.append(i)
        a.record(i, dep if i % 3 == 0 else None)
        if i % 7 == 0:
            dep = c.all_reduce(float(i))
    hist = a.history().result()
    assert all(h[start:] == issued for h in hist)


def test_rank_error_names_group_method_rank_and_traceback(groups):
    a, _, _ = groups
    with pytest.raises(fa.RemoteError) as info:
        a.fail_on(2).result()
    e = info.value
    assert (e.group, e.method, e.rank, e.failed_ranks) == ("rt_a", "fail_on", 2, [2])
    assert "deliberate failure on rank 2" in str(e) and "Traceback" in e.remote_traceback
    # the failure does not poison later calls on the same processes
    assert a.all_reduce(1.0).result() == [10.0] * 4


def test_bad_calls_and_placements(controller4, groups):
    a, _, _ = groups
    with pytest.raises(fa.EndpointError, match="not_remote is not a remote endpoint; decorate it with @endpoint"):
        a.not_remote()
    with pytest.raises(fa.EndpointError, match="no endpoint 'nope'"):
        a.nope()
    with pytest.raises(ValueError, match="30 rows cannot be split into 4"):
        a.add_rank(Batch({"x": torch.zeros(30)}))
    with pytest.raises(fa.PlacementError, match="needs 8 slots but the cluster has 4"):
        fa.ActorGroup(controller4, Reducer, name="too_big", layout=Layout(dp=8))
    with pytest.raises(fa.PlacementError, match="same slot twice"):
        fa.ActorGroup(controller4, Reducer, name="dup", slots=controller4.slots[:1] * 2)
    with pytest.raises(fa.PlacementError, match="already exists"):
        fa.ActorGroup(controller4, Reducer, name="rt_a")
    with pytest.raises(fa.PlacementError, match="backend of this controller is 'gloo'"):
        fa.ActorGroup(controller4, Reducer, name="rt_nccl", backend="nccl")
    with pytest.raises(fa.RemoteError, match=r"BrokenInit|cannot load weights on rank 1") as info:
        fa.ActorGroup(controller4, BrokenInit, name="rt_broken", slots=controller4.slots[:2])
    assert info.value.rank == 1 and info.value.method == "__init__"
    assert "rt_broken" not in controller4.groups


def test_killed_worker_fails_pending_calls_promptly_naming_role_and_rank(fresh_controller):
    import os
    import signal
    import time

    ctl = fresh_controller
    g = fa.ActorGroup(ctl, Reducer, name="victim")
    pids = g.pid().result()
    pending = g.sleep(30.0)  # running on both ranks
    queued = g.all_reduce(1.0)  # waiting behind it
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    for f in (pending, queued):
        with pytest.raises(fa.WorkerLostError, match=r"hosted victim rank 1"):
            f.result(timeout=20)
    assert time.monotonic() - t0 < 10
    with pytest.raises(fa.WorkerLostError, match="victim rank 1"):
        g.all_reduce(1.0)


def test_close_does_not_wait_for_a_call_still_running_and_ends_the_worker_processes():
    """Dask's close waits for a worker's running task (then 30 s of grace and a kill): a hung rank, or a run
    stopped mid-step, would hold the controller's close that long."""
    import logging
    import os
    import time

    ctl = fa.Controller.local(2, dashboard=None)
    warned: list[logging.LogRecord] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = warned.append
    try:
        g = fa.ActorGroup(ctl, Reducer, name="busy")
        pids = g.pid().result()
        g.sleep(600.0)
        time.sleep(0.5)  # running on both ranks
    finally:
        logging.getLogger("distributed").addHandler(catch)
        t0 = time.monotonic()
        try:
            ctl.close()
        finally:
            logging.getLogger("distributed").removeHandler(catch)
    assert time.monotonic() - t0 < 8  # (it waited 10 s for the busy ranks' world teardown; now 1 s)
    assert not [r.getMessage() for r in warned]  # no worker restarted, no connection cut mid-handshake
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_closing_on_a_joined_cluster_tears_the_world_down_behind_a_busy_ranks_call(direct):
    """A controller closing while one rank still runs a call (its future dropped): the idle rank's world is torn
    down before the close returns, the busy rank's is not waited for but follows its call there, so the
    cluster's workers are left as they were found."""
    import time

    from distributed import Client, LocalCluster

    def world_up() -> bool:
        import torch.distributed as dist

        return dist.is_initialized()

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, resources={"slot": 1}, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        ctl = fa.Controller.connect(cluster.scheduler_address, direct_calls=direct)
        try:
            g = fa.ActorGroup(ctl, Reducer, name="g")
            assert g.all_reduce(1.0).result() == [3.0, 3.0]
            busy = ctl.slots[1]
            ctl.submit_pinned_all([(busy, nap, (6.0,), {}, "nap-0")])  # its future dropped at once
            time.sleep(0.5)
        finally:
            t0 = time.monotonic()
            ctl.close()
        assert time.monotonic() - t0 < 4  # not the call's 6 s, nor the 10 s the close waited for it before
        up = client.run(world_up)
        assert up == {ctl.slots[0]: False, busy: True}
        deadline = time.monotonic() + 30
        while client.run(world_up)[busy] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.run(world_up) == {ctl.slots[0]: False, busy: False}


def test_watchdog_reports_where_each_rank_is_stuck(fresh_controller):
    import time

    g = fa.ActorGroup(fresh_controller, Reducer, name="hang")
    t0 = time.monotonic()
    with pytest.raises(fa.HangError) as info:
        g.straggle(6.0).result(timeout=1.5)
    assert time.monotonic() - t0 < 5
    report = info.value.report
    rank0, rank1 = report.split("- hang rank 1")
    assert "hang rank 0" in rank0 and "all_reduce" in rank0  # blocked in the collective
    assert "sleep" in rank1 or "straggle" in rank1  # the straggler, in its own code
    assert g.straggle(0.0).result() == [2.0, 2.0]  # the group works again afterwards


@pytest.mark.parametrize(
    "stride, pairs", [(1, [(0, 1), (0, 1), (2, 3), (2, 3)]), (2, [(0, 2), (1, 3), (0, 2), (1, 3)])]
)
def test_declared_subgroups_are_created_with_the_group(controller4, groups, stride, pairs):
    """Worker.process_groups: extra groups among a group's ranks, created on every world rank with the group (while
    other groups live on the same processes), each rank holding its own."""
    g = fa.ActorGroup(controller4, PairReducer, name=f"rt_pairs{stride}", args=(stride,))
    try:
        out = g.pair_sum().result()
    finally:
        g.close()
    assert [pair for pair, _ in out] == pairs
    assert [total for _, total in out] == [float(sum(pair)) for pair in pairs]
    a, _, _ = groups
    assert a.all_reduce(1.0).result() == [10.0] * 4  # the older groups still work


def test_impossible_subgroups_fail_on_the_controller(controller4):
    with pytest.raises(ValueError, match="cannot form pairs at stride 3"):
        fa.ActorGroup(controller4, PairReducer, name="rt_pairs_bad", args=(3,))
    assert "rt_pairs_bad" not in controller4.groups
