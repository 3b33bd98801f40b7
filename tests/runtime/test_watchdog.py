"""The watchdog (`call_timeout_s`) bounds every wait of the controller: forming the torch.distributed world,
creating a group's process groups, running `__init__` on its ranks, and the report for unpinned tasks."""

import time

import pytest

import flowactors as fa
from tests.runtime.workers import HangInit, Reducer, nap


def _controller(collective_timeout_s: float, call_timeout_s: float) -> fa.Controller:
    ctl = fa.Controller.local(
        2, dashboard=None, collective_timeout_s=collective_timeout_s, call_timeout_s=call_timeout_s
    )
    # import torch before the clock starts: on a loaded machine the first import alone can outlast the timeouts
    ctl.client.run(__import__, "torch.distributed")
    return ctl


def test_a_rank_stuck_in_a_collective_in_init_is_a_hang_error_with_its_stack():
    ctl = _controller(collective_timeout_s=12, call_timeout_s=4)
    try:
        fa.ActorGroup(ctl, Reducer, name="warm")  # the world is formed; what follows times group creation only
        t0 = time.monotonic()
        with pytest.raises(fa.HangError) as info:
            fa.ActorGroup(ctl, HangInit, name="stuck")  # rank 0 all-reduces in __init__, rank 1 does not
        assert time.monotonic() - t0 < 4 + 8
        e = info.value
        assert e.call == "stuck.__init__" and e.timeout_s == 4
        assert "- stuck rank 0 on" in e.report and "running stuck.__init__" in e.report
        assert "inst.__init__" in e.report and "dist.all_reduce" in e.report  # its stack: in the collective
        assert "stuck rank 1" not in e.report  # its __init__ returned
        assert "stuck" not in ctl.groups  # forgotten: the name can be used again
        # Rank 0's collective ends at the process group's timeout (the world's, collective_timeout_s); the
        # processes then work as before.
        ctl.call_timeout_s = 60
        g = fa.ActorGroup(ctl, Reducer, name="after")
        assert g.all_reduce(1.0).result() == [3.0, 3.0]
    finally:
        t0 = time.monotonic()
        ctl.close()
    assert time.monotonic() - t0 < 15


def test_world_formation_is_under_the_watchdog():
    ctl = _controller(collective_timeout_s=30, call_timeout_s=3)
    try:
        # rank 1's process is busy, so it cannot join the world rank 0 starts to form
        blocker = ctl.submit_pinned(ctl.slots[1], nap, 7.0, key="blocker-1")
        t0 = time.monotonic()
        with pytest.raises(fa.HangError) as info:
            fa.ActorGroup(ctl, Reducer, name="late")
        assert time.monotonic() - t0 < 3 + 8
        report = info.value.report
        assert info.value.call == "world.init_world"
        rank0, rank1 = report.split("- world rank 1")
        assert "world rank 0" in rank0 and "running world.init_world" in rank0 and "TCPStore" in rank0
        assert "waiting; its worker is running: blocker-1" in rank1 and "time.sleep" in rank1
        assert "late" not in ctl.groups
        blocker.result()
        ctl.call_timeout_s = 60
        g = fa.ActorGroup(ctl, Reducer, name="late")  # the world forms again, now with both ranks
        assert g.all_reduce(1.0).result() == [3.0, 3.0]
    finally:
        ctl.close()


@pytest.fixture(params=["direct", "dask"])
def any_path(request, controller4):
    """controller4 (calls on the direct path), or a 4-slot controller whose calls go through the scheduler."""
    if request.param == "direct":
        yield controller4
    else:
        ctl = fa.Controller.local(4, dashboard=None, direct_calls=False)
        yield ctl
        ctl.close()


def test_hang_report_of_an_apply_task_says_where_it_is(any_path):
    ctl = any_path
    g = fa.ActorGroup(ctl, Reducer, name="wd_apply", slots=ctl.slots[:2])
    try:
        busy = g.sleep(4.0)
        waiting = ctl.apply(nap, 0.0, busy, name="join")  # needs busy's outputs first
        running = ctl.apply(nap, 4.0, name="slow")
        time.sleep(0.5)
        with pytest.raises(fa.HangError) as info:
            ctl.wait([waiting, running], timeout=1.0)
        report = info.value.report
        assert "None" not in report and "rank 0" not in report
        join, slow = report.split("- slow.apply")
        key = waiting.futures[0].key
        if ctl.direct_calls:  # pinned behind the call that produced its first input, on that call's rank 0
            assert (
                f"- join.apply task {key} on {g.addresses[0]}: waiting; its worker is running: "
                f"{busy.futures[0].key}" in join
            )
            assert running.futures[0].address in ctl.slots[2:]  # the least busy slot: no wait
        else:
            wanted = ", ".join(sorted(f.key for f in busy.futures))
            assert f"- join.apply task {key} on no worker yet: waiting for its inputs: {wanted}" in join
        assert f" task {running.futures[0].key} on tls://127.0.0.1:" in slow and "running slow.apply" in slow
        assert "time.sleep(seconds)" in slow  # its stack, in nap
        assert waiting.result(timeout=30) == 0.0 and running.result(timeout=30) == 4.0
    finally:
        g.close()
