"""The direct call path (flowactors.transport.channel) on a real 2-worker LocalCluster: calls never reach the scheduler, keep
issue order per process, chain worker to worker, store large outputs until nobody can ask for them, fail at the call
site on arguments that cannot travel, and show on the dashboard's records and in the controller's profile."""

from __future__ import annotations

import gc
import socket
import threading
import time

import pytest
import torch

import flowactors as fa
from flowactors import serialization as ser
from flowactors.dashboard import FlowactorsDashboard
from flowactors.transport import server, wire
from tests.runtime.workers import Reducer, nap


@pytest.fixture(scope="module")
def ctl():
    with fa.Controller.local(2, dashboard=None, call_timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def group(ctl):
    g = fa.ActorGroup(ctl, Reducer, name="direct")
    yield g
    g.close()


def _scheduler_knows(keys, dask_scheduler=None):
    return sorted(str(k) for k in keys if k in dask_scheduler.tasks)


def test_the_embedded_cluster_calls_directly_and_the_scheduler_sees_no_task(ctl, group):
    assert ctl.direct_calls and not ctl.pushes_results
    call = group.all_reduce(2.0)
    assert call.direct and call.result() == [6.0, 6.0]
    keys = [f.key for f in call.futures]
    assert ctl.client.run_on_scheduler(_scheduler_knows, keys) == []


def test_issue_order_holds_across_many_quick_calls_and_two_colocated_groups(ctl, group):
    other = fa.ActorGroup(ctl, Reducer, name="direct_other")
    try:
        calls = []
        for i in range(40):
            calls.append(group.record(i))
            calls.append(other.all_reduce(float(i)))  # collectives of two groups interleaved on both processes
            calls.append(group.all_reduce(float(i)))
        assert [c.result() for c in calls[1::3]] == [[3.0 * i] * 2 for i in range(40)]
        assert group.history().result()[0][-40:] == list(range(40))
    finally:
        other.close()


def test_chained_outputs_pass_worker_to_worker_and_are_released_with_their_futures(ctl, group):
    big = fa.Batch({"x": torch.arange(32768)})  # each rank's output: 16384 rows x 2 int64 columns = 256 KiB
    ser.RECEIVED.reset()
    first = group.add_rank(big)
    second = group.scale_x(first)
    ctl.wait([second])
    assert all(f.stored for f in first.futures + second.futures)  # too large for the reply: left on the workers
    assert ser.RECEIVED.bytes == 0  # the chain ran without any batch coming to the controller
    out = second.result()
    assert ser.RECEIVED.bytes == out.nbytes
    assert torch.equal(out["x"], (torch.arange(32768) + 1) * 2)
    assert torch.equal(out["rank"], torch.arange(2).repeat_interleave(16384))
    mine = {f.key for f in first.futures + second.futures}
    held = ctl.client.run(server.stored_keys)
    assert sorted(len(mine & set(keys)) for keys in held.values()) == [2, 2]  # each worker: its rank's two outputs
    del first, second
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(mine & set(v) for v in ctl.client.run(server.stored_keys).values()):
        time.sleep(0.1)
    assert not any(mine & set(v) for v in ctl.client.run(server.stored_keys).values())


def test_an_argument_that_cannot_travel_fails_at_the_call_and_takes_no_place_in_the_order(group):
    with pytest.raises(Exception, match="pickle|lock"):
        group.record(threading.Lock())
    assert group.record(7).result() == [7, 7]
    assert group.history().result()[0][-1] == 7


def test_a_rank_failure_is_a_remote_error_and_the_group_works_on(group):
    with pytest.raises(fa.RemoteError) as info:
        group.fail_on(1).result()
    assert info.value.rank == 1 and "deliberate failure on rank 1" in info.value.remote_message
    assert "Traceback" in info.value.remote_traceback
    assert group.all_reduce(1.0).result() == [3.0, 3.0]


def test_a_failed_input_reaches_the_consumer_as_the_producers_failure(group):
    with pytest.raises(fa.RemoteError) as info:
        group.scale_x(group.fail_rows(fa.Batch({"x": torch.arange(8)}), 0)).result()
    assert info.value.rank == 0 and "direct.fail_rows failed on rank 0" in info.value.remote_message


def test_hang_report_shows_the_running_item_and_the_queued_one(ctl, group):
    busy = group.sleep(3.0)
    queued = group.all_reduce(1.0)
    with pytest.raises(fa.HangError) as info:
        queued.result(timeout=1.0)
    report = info.value.report
    assert "- direct rank 0 on" in report and f"its worker is running: {busy.futures[0].key}" in report
    assert "time.sleep(seconds)" in report  # the stack of what runs instead
    assert queued.result(timeout=30) == [3.0, 3.0]


def test_pinned_items_and_apply_run_in_order_on_their_worker(ctl, group):
    a = ctl.slots[0]
    futs = ctl.submit_pinned_all([(a, nap, (0.3,), {}, "direct.nap-0"), (a, nap, (0.0,), {}, "direct.nap-1")])
    assert ctl.gather(futs) == [0.3, 0.0]
    assert futs[1].result() == 0.0
    joined = ctl.apply(lambda x, y: [u + v for u, v in zip(x, y)], group.all_reduce(1.0), group.all_reduce(2.0))
    assert joined.result() == [9.0, 9.0]
    assert joined.futures[0].address == group.addresses[0]  # where its first input was produced


def test_direct_items_become_dashboard_records_and_profile_spans(ctl, group):
    plugin = FlowactorsDashboard()
    plugin.scheduler = None
    ctl.step = 5
    try:
        call = group.sleep(0.3)
        call.result()
    finally:
        ctl.step = None
    deadline = time.monotonic() + 10
    reports = []
    while time.monotonic() < deadline:
        events = ctl.client.get_events(wire.CALLS_TOPIC)
        mine = {f.key for f in call.futures}
        reports = [m for _, m in events if any(c["key"] in mine for c in wire.reports_of(m))]
        states = [c.get("state", "end") for m in reports for c in wire.reports_of(m) if c["key"] in mine]
        if states.count("end") == 2:
            break
        time.sleep(0.2)
    # each rank's item: received (waiting), started (processing), ended
    assert sorted(states) == ["end", "end", "processing", "processing", "waiting", "waiting"]
    for m in reports:
        plugin.log_event(wire.CALLS_TOPIC, m)
    recs = plugin._steps[5]
    for f in call.futures:
        rec = recs[f.key]
        assert rec.state == "memory" and rec.done and len(rec.order_deps) == 1
    spans = [iv for iv in plugin._intervals if iv.node == "direct.sleep"]
    assert len(spans) == 2 and all(0.3 <= iv.stop - iv.start < 2.0 for iv in spans)
    with ctl.profile() as p:
        group.sleep(0.5).result()
    assert p.busy_s >= 0.45 and p.controller_share < 0.5


def test_on_a_cluster_it_joined_the_controller_leaves_no_listener_behind():
    """direct_calls=True on a cluster the controller did not start: after close() the workers listen no more."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        resources={"slot": 1},
    )
    try:
        client = Client(cluster, set_as_default=False)
        ctl = fa.Controller(client, None, direct_calls=True)
        g = fa.ActorGroup(ctl, Reducer, name="joined")
        assert g.all_reduce(1.0).result() == [3.0, 3.0] and ctl.direct_calls
        ports = client.run(server.listen_port)
        ctl.close()
        for port, _, local in ports.values():
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0
            if local is not None:  # nor on their Unix sockets
                with socket.socket(socket.AF_UNIX) as s:
                    assert s.connect_ex(local[1]) != 0
    finally:
        cluster.close()


@pytest.mark.skipif(wire.host_key() is None, reason="abstract Unix sockets are Linux's")
def test_the_controller_reaches_the_workers_of_its_host_by_unix_sockets(ctl, group):
    """Same host, same network namespace: no TCP stack between controller and workers (wire.dial)."""
    assert group.all_reduce(1.0).result() == [3.0, 3.0]
    conns = ctl.transport.channel._connections
    assert set(conns) == set(ctl.slots)
    assert {c.sock.family for c in conns.values()} == {socket.AF_UNIX}


def test_the_task_thread_logs_a_failure_of_the_runtime_around_an_item_and_runs_the_next(monkeypatch):
    """An item's own failure is answered by `_job`; one around it (here a stand-in `_job` that raises for one item,
    as a broken reply connection would) is logged with the item's key, and the thread serves the items after it."""
    from structlog.testing import capture_logs

    ran = []

    def job(worker, reply_to, previous, key, *rest):  # stand-in for the item runner
        if key == "bad-0":
            raise ConnectionError("the reply could not be sent")
        ran.append(key)

    monkeypatch.setattr(server, "_job", job)
    with capture_logs() as logs:
        thread = server._TaskThread()
        for key in ("good-0", "bad-0", "good-1"):
            thread.submit((None, None, None, key))
        thread.stop()
        thread._thread.join(10)
    assert not thread._thread.is_alive() and ran == ["good-0", "good-1"]
    [entry] = [e for e in logs if e["event"] == "direct item not answered"]
    assert entry["key"] == "bad-0" and entry["log_level"] == "error"
