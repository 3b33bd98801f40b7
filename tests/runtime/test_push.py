"""Results pushed by the ranks to the controller (flowactors.transport.pushed) on a real 2-worker LocalCluster: small outputs
arrive by push, large ones through Dask, and order, chaining, failures and the watchdog behave as on the Dask
path."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import flowactors as fa
from flowactors.transport.payload import PUSH_BYTES, payload_bytes
from tests.runtime.workers import Reducer


@pytest.fixture(scope="module")
def ctl():
    with fa.Controller.local(2, dashboard=None, call_timeout_s=60, direct_calls=False) as c:
        yield c


@pytest.fixture(scope="module")
def group(ctl):
    g = fa.ActorGroup(ctl, Reducer, name="pushed")
    yield g
    g.close()


def _pushed(ctl, call: fa.CallFuture) -> list:
    return [ctl._inbox._values.get(f.key, "absent") for f in call.futures]


def test_small_outputs_arrive_by_push_large_ones_through_dask(ctl, group):
    call = group.all_reduce(2.0)
    assert call.pushed and call.result() == [6.0, 6.0]
    # every rank pushed its output (on a loaded machine Dask can tell of a finish before a push lands: result()
    # then takes the value from Dask, as the transport intends, and the push arrives just after)
    deadline = time.monotonic() + 10
    while "absent" in _pushed(ctl, call) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pushed(ctl, call) == [6.0, 6.0]
    big = fa.Batch({"x": torch.arange(16384)})  # each rank returns 8192 rows of two int64 columns: 128 KiB
    call = group.add_rank(big)
    out = call.result()
    assert torch.equal(out["x"], torch.arange(16384) + 1)
    assert torch.equal(out["rank"], torch.arange(2).repeat_interleave(8192))
    assert payload_bytes(fa.Batch({"x": out["x"][:8192], "rank": out["rank"][:8192]})) > PUSH_BYTES
    deadline = time.monotonic() + 10
    while "absent" in _pushed(ctl, call) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(isinstance(v, str) and "too large" in v for v in _pushed(ctl, call))  # only a marker came


def test_issue_order_and_chaining_hold(group):
    group.record(1)
    group.record(2)
    assert group.history().result()[0][-2:] == [1, 2]  # per-process issue order
    batch = fa.Batch({"x": torch.arange(8.0)})
    chained = group.scale_x(group.add_rank(batch))  # the first call's output stays on the workers
    assert torch.equal(chained.result()["x"], 2 * (torch.arange(8.0) + 1))


def test_a_failure_is_a_remote_error_with_rank_and_traceback(group):
    with pytest.raises(fa.RemoteError) as info:
        group.fail_on(1).result()
    assert info.value.rank == 1 and "deliberate failure on rank 1" in info.value.remote_traceback


def test_the_watchdog_reports_its_whole_timeout(ctl, group):
    with pytest.raises(fa.HangError) as info:
        group.sleep(3.0).result(timeout=0.5)
    assert info.value.timeout_s == 0.5 and "running pushed.sleep" in info.value.report
    assert group.all_reduce(1.0).result() == [3.0, 3.0]  # the group works once the sleep is over


def test_outputs_are_dropped_with_their_call(ctl, group):
    call = group.all_reduce(3.0)
    call.result()
    keys = [f.key for f in call.futures]
    del call
    gc.collect()
    assert not any(k in ctl._inbox._values for k in keys)


def test_without_an_inbox_calls_take_the_dask_path():
    with fa.Controller.local(1, dashboard=None, push_results=False, direct_calls=False) as ctl:
        g = fa.ActorGroup(ctl, Reducer, name="plain")
        call = g.all_reduce(2.0)
        assert not call.pushed and ctl._inbox is None and call.result() == [2.0]  # one rank: 2.0 x 1
