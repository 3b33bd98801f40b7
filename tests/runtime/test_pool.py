"""Elastic pools: workers that join a running job carry a resource (not a slot), host groups with a torch.distributed
world of their own, and can be lost or retired without the controller's world noticing (Controller.workers_with,
resize_pool, retire_worker, forget_lost; ActorGroup(own_world=True))."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

import flowactors as fa
from tests.runtime.workers import Reducer, nap


def _wait_for(fn, n: int, timeout_s: float = 90.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if len(got) == n:
            return got
        time.sleep(0.2)
    raise AssertionError(f"expected {n} pool workers, have {fn()}")


def test_pool_workers_join_host_own_world_groups_and_leave_without_touching_the_slots():
    with fa.Controller.local(2, dashboard=None, collective_timeout_s=60) as ctl:
        trainer = fa.ActorGroup(ctl, Reducer, name="trainer", args=(1.0,))
        assert trainer.all_reduce(1.0).result() == [3.0, 3.0]  # the world of the slots is formed
        ctl.resize_pool("rollout", 2)
        pool = _wait_for(lambda: ctl.workers_with("rollout"), 2)
        assert not set(pool) & set(ctl.slots)
        assert ctl.slots == fa.cluster.discover_slots(ctl.client)  # pool workers are no slots
        # one group of two ranks over both pool workers: a world of its own, whose collectives work
        both = fa.ActorGroup(ctl, Reducer, name="both", slots=pool, args=(2.0,), own_world=True)
        assert both.all_reduce(1.0).result() == [6.0, 6.0]
        both.close()
        # then one world per worker (the worker left the two-rank world when that group closed)
        a = fa.ActorGroup(ctl, Reducer, name="a", slots=pool[:1], args=(1.0,), own_world=True)
        b = fa.ActorGroup(ctl, Reducer, name="b", slots=pool[1:], args=(5.0,), own_world=True)
        assert a.all_reduce(2.0).result() == [2.0]
        assert b.all_reduce(2.0).result() == [10.0]
        # losing b's worker fails b's calls naming it, and nothing else
        held = b.pid()  # a result held on b's worker
        pid = held.result()[0]
        pending = b.sleep(30.0)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(fa.WorkerLostError) as lost:
            pending.result(timeout=60)
        assert lost.value.address == pool[1] and "b" in str(lost.value)
        ctl.forget_lost(pool[1])
        assert ctl.lost_workers == []
        # a call whose input was on the worker written off fails as lost at it, at once (not after a grace)
        t0 = time.monotonic()
        with pytest.raises(fa.WorkerLostError) as lost:
            a.record(1, held).result(timeout=30)
        assert lost.value.address == pool[1] and time.monotonic() - t0 < 5
        assert trainer.all_reduce(1.0).result() == [3.0, 3.0]
        assert a.all_reduce(3.0).result() == [3.0]
        # the nanny restarts the killed worker under a new address: it arrives as a pool worker again
        back = _wait_for(lambda: ctl.workers_with("rollout"), 2)
        assert pool[0] in back and pool[1] not in back
        # a graceful retire takes one away for good; resizing to zero the rest
        ctl.retire_worker(pool[0])
        _wait_for(lambda: ctl.workers_with("rollout"), 1)
        time.sleep(1.0)
        assert len(ctl.workers_with("rollout")) == 1  # not restarted
        ctl.resize_pool("rollout", 0)
        _wait_for(lambda: ctl.workers_with("rollout"), 0)
        assert trainer.all_reduce(1.0).result() == [3.0, 3.0]
        with pytest.raises(fa.PlacementError, match="slots of the controller's world"):
            fa.ActorGroup(ctl, Reducer, name="c", slots=ctl.slots[:1], own_world=True)
        with pytest.raises(fa.PlacementError, match="only pool workers"):
            ctl.retire_worker(ctl.slots[0])


def _where(_dep=None) -> str:
    from distributed import get_worker

    return get_worker().address


@pytest.mark.parametrize("direct", [False, True], ids=["dask", "direct"])
def test_an_apply_runs_on_the_worlds_workers_never_on_a_pool_worker(direct):
    """An apply runs where its inputs are among the world's workers only: not on a pool worker, even one idle beside
    a busy slot or holding the input (before, on the Dask path the scheduler put them there, and a step's batch
    computed on a fleet's replica would go with the replica)."""
    with fa.Controller.local(
        1, dashboard=None, collective_timeout_s=60, direct_calls=direct, push_results=False
    ) as ctl:
        trainer = fa.ActorGroup(ctl, Reducer, name="trainer", args=(1.0,))
        assert trainer.all_reduce(1.0).result() == [1.0]
        ctl.resize_pool("rollout", 1)
        [w] = _wait_for(lambda: ctl.workers_with("rollout"), 1)
        a = fa.ActorGroup(ctl, Reducer, name="a", slots=[w], args=(1.0,), own_world=True)
        held = a.pid()  # an output on the pool worker
        busy = ctl.apply(nap, 1.0)  # the one slot's one thread, taken for a second
        where = [ctl.apply(_where, held if i % 2 else busy) for i in range(6)]
        assert [c.result() for c in where] == ctl.slots * 6  # (w, idle and holding `held`, took none)


def test_on_the_dask_path_a_retired_pool_workers_finished_calls_are_lost_and_nothing_is_recomputed():
    """The Dask call path: a finished call of a worker that left raises WorkerLostError naming it (Dask would
    recompute a lost result, and an actor's call is not a pure function); a worker retired by the controller is
    written off once gone, not counted as lost (before, every later cancelled future was reported as lost at the
    retired replica, and `lost_workers` grew with every retire of an elastic fleet); the retire leaves the client's
    connection whole: before, cancelling the worker's finished tasks broke it, the client reconnected and Dask ran
    the setup tasks it still held again, tearing down the replica's world (the Slurm fleet test, one rank a world)."""
    from flowactors import _runtime

    # (the Dask path as on a TLS cluster: without pushed results, which would hold a finished call's value here)
    with fa.Controller.local(1, dashboard=None, collective_timeout_s=60, direct_calls=False, push_results=False) as ctl:
        trainer = fa.ActorGroup(ctl, Reducer, name="trainer", args=(1.0,))
        assert trainer.all_reduce(2.0).result() == [2.0]
        ctl.resize_pool("rollout", 1)
        [w] = _wait_for(lambda: ctl.workers_with("rollout"), 1)
        a = fa.ActorGroup(ctl, Reducer, name="a", slots=[w], args=(1.0,), own_world=True)
        # forming its one-rank world again (what a recomputed setup task does) keeps the group and its state
        again = ctl.submit_pinned(w, _runtime.solo_world, "a", a.layout, None, 60.0, key="a.solo_world-again")
        assert ctl.gather([again]) == ["gloo"]
        assert a.all_reduce(2.0).result() == [2.0]
        done = a.all_reduce(3.0)
        assert done.result() == [3.0]
        for _ in range(3):  # later tasks ordered after it, their futures released
            assert a.all_reduce(1.0).result() == [1.0]
        scheduler_comm = ctl.client.scheduler_comm
        pending = a.sleep(60.0)  # a call its owner did not take back
        key = done.futures[0].key
        assert ctl.client.who_has(done.futures)[key] == (w,)
        ctl.retire_worker(w)
        # a graceful retire: Dask copied what only w held to the world, so it recomputes nothing once w is gone
        assert ctl.client.who_has(done.futures)[key] == tuple(ctl.slots)
        deadline = time.monotonic() + 60
        while w not in ctl._forgotten and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(fa.WorkerLostError) as lost:
            done.result(timeout=30)
        assert lost.value.address == w and lost.value.hosted == [("a", 0)]
        assert lost.value.retired and f"worker {w} was retired" in str(lost.value)
        with pytest.raises(fa.WorkerLostError) as unfinished:  # cancelled, and lost at its worker
            pending.result(timeout=30)
        assert unfinished.value.address == w and unfinished.value.hosted == [("a", 0)]
        assert ctl.lost_workers == [] and ctl.leaving == []
        ctl.forget_lost(w)  # (what an owner does for a worker that died: harmless for one retired)
        with pytest.raises(fa.WorkerLostError):  # written off: still lost, and not counted as lost
            done.result(timeout=30)
        assert ctl.lost_workers == []
        assert trainer.all_reduce(5.0).result() == [5.0]
        assert ctl.client.scheduler_comm is scheduler_comm and ctl.client.status == "running"
        written_off = ctl.transport._gone
        assert key in written_off
        del done, lost, pending, unfinished
        gc.collect()
        assert key not in written_off  # nobody can ask for it any more: not kept for the run's life


def test_on_the_dask_path_a_replica_that_dies_makes_no_live_worker_run_its_calls_again():
    """The Dask call path (a TLS cluster, Slurm): a pool worker dies unannounced while a future still names its
    result, which came from the trainer's call. Dask recomputes a lost result and every released task it came from:
    the trainer's calls, chained by their ordering links back to its group's creation. Before, the trainer ran them
    again (its history [1, 2, 3, 1, 2] or its group's creation failing), and the next trainer call hung behind the
    failed chain; each task now runs at most once on its worker (`tasks.once`)."""
    with fa.Controller.local(1, dashboard=None, collective_timeout_s=60, direct_calls=False, push_results=False) as ctl:
        trainer = fa.ActorGroup(ctl, Reducer, name="trainer")
        ctl.resize_pool("rollout", 1)
        [w] = _wait_for(lambda: ctl.workers_with("rollout"), 1)
        replica = fa.ActorGroup(ctl, Reducer, name="replica", slots=[w], own_world=True)
        assert trainer.record(1).result() == [1]
        weights = trainer.record(2)
        held = replica.record(7, weights)  # held, as a fleet holds its weight loads; its input came from the trainer
        assert held.result() == [7]
        del weights  # released: the trainer's result is freed once the replica has it
        gc.collect()
        assert trainer.record(3).result() == [3]
        [pid] = replica.pid().result()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while w not in ctl.lost_workers and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # (Dask's recomputation, where it happens, is under way by now)
        assert trainer.history().result(timeout=30) == [[1, 2, 3]]
        assert trainer.record(4).result(timeout=30) == [4]
        with pytest.raises(fa.WorkerLostError) as lost:
            held.result(timeout=30)
        assert lost.value.address == w and not lost.value.retired and f"worker {w} died" in str(lost.value)


def test_recovery_on_the_dask_path_keeps_the_clients_connection_and_the_live_workers_results():
    """After a slot dies, `recover` forgets every call: on the Dask path it cancels what has not run, and only that
    (cancelling a finished task cancels its dependents too, and one the client already released, a later call's
    ordering link, fails the scheduler's `who_wants` assertion: the client's stream breaks, it reconnects and
    Dask recomputes every key it holds). A call that finished on the live worker keeps its value."""
    with fa.Controller.local(2, dashboard=None, collective_timeout_s=60, direct_calls=False, push_results=False) as ctl:
        g = fa.ActorGroup(ctl, Reducer, name="g")
        pids = g.pid().result()
        done = g.all_reduce(1.0)
        assert done.result() == [3.0, 3.0]
        for _ in range(3):  # later tasks ordered after it on each worker, their futures released
            assert g.all_reduce(1.0).result() == [3.0, 3.0]
        held = g.all_reduce(2.0)
        assert held.result() == [6.0, 6.0]
        scheduler_comm = ctl.client.scheduler_comm
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not ctl.lost_workers and time.monotonic() < deadline:
            time.sleep(0.1)
        ctl.recover(wait_s=60, min_slots=2)
        assert ctl.client.scheduler_comm is scheduler_comm and ctl.client.status == "running"
        g = fa.ActorGroup(ctl, Reducer, name="g")
        assert g.all_reduce(1.0).result(timeout=60) == [3.0, 3.0]
        assert held.futures[0].result(timeout=30) == 6.0  # rank 0's worker lives: its finished value stays
        with pytest.raises(fa.WorkerLostError):  # rank 1's worker died: its result is written off, not recomputed
            held.result(timeout=30)


def test_a_pool_worker_told_to_stop_announces_it_serves_until_retired_and_ends_by_itself_after_its_grace(
    monkeypatch,
):
    """SIGTERM (a scale-down, a preemption notice, a Slurm job at its limit) on a pool worker hosting a group: the
    controller lists it in `leaving` and its group still answers (its owner takes back what it holds, then
    retires it); a worker nobody retires ends by itself after LEAVE_GRACE_S, as a lost worker."""
    import flowactors.controller as controller

    monkeypatch.setattr(controller, "LEAVE_GRACE_S", 3.0)
    with fa.Controller.local(1, dashboard=None, collective_timeout_s=60) as ctl:
        ctl.resize_pool("rollout", 2)
        pool = _wait_for(lambda: ctl.workers_with("rollout"), 2)
        a = fa.ActorGroup(ctl, Reducer, name="a", slots=pool[:1], args=(1.0,), own_world=True)
        b = fa.ActorGroup(ctl, Reducer, name="b", slots=pool[1:], args=(2.0,), own_world=True)
        pid_a, pid_b = a.pid().result()[0], b.pid().result()[0]
        assert ctl.leaving == []
        os.kill(pid_a, signal.SIGTERM)
        os.kill(pid_b, signal.SIGTERM)
        deadline = time.monotonic() + 2.5
        while len(ctl.leaving) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(ctl.leaving) == sorted(pool)
        assert a.all_reduce(2.0).result() == [2.0]  # still serving within its grace
        ctl.retire_worker(pool[0])  # retired in time: a graceful close
        # b is not retired: it ends by itself once its grace is over, as a lost worker
        with pytest.raises(fa.WorkerLostError) as lost:
            b.sleep(30.0).result(timeout=30)
        assert lost.value.address == pool[1]
        for pid in (pid_a, pid_b):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"worker process {pid} is still running after SIGTERM")
        assert ctl.leaving == []
