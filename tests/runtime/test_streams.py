"""Stream batching intervals (flowactors._streams) on a real LocalCluster: every stream between client, scheduler
and worker processes gets the controller's interval, a worker that joins later too; None keeps Dask's own."""

from __future__ import annotations

import pytest

import flowactors as fa


def _intervals(ctl: fa.Controller) -> dict[str, object]:
    def on_scheduler(dask_scheduler):
        return {
            "to_workers": sorted({b.interval for b in dask_scheduler.stream_comms.values()}),
            "to_clients": sorted({b.interval for b in dask_scheduler.client_comms.values()}),
        }

    return {
        "client": ctl.client.scheduler_comm.interval,
        **ctl.client.run_on_scheduler(on_scheduler),
        "workers": sorted(set(ctl.client.run(lambda dask_worker: dask_worker.batched_stream.interval).values())),
    }


def test_every_stream_gets_the_interval_also_on_a_worker_that_joins_later():
    with fa.Controller.local(2, dashboard=None, stream_interval_ms=0.5) as ctl:
        assert _intervals(ctl) == {
            "client": 0.0005,
            "to_workers": [0.0005],
            "to_clients": [0.0005],
            "workers": [0.0005],
        }
        ctl.cluster.scale(3)
        ctl.client.wait_for_workers(3, timeout=60)
        after = _intervals(ctl)
        assert len(ctl.client.scheduler_info()["workers"]) == 3
        assert after["to_workers"] == [0.0005] and after["workers"] == [0.0005]


def test_none_keeps_dasks_intervals_and_a_bad_value_fails_before_any_process_starts():
    with fa.Controller.local(1, dashboard=None, stream_interval_ms=None) as ctl:
        got = _intervals(ctl)
        assert got["client"] == 0.01 and got["to_workers"] == [0.005] and got["workers"] == [0.002]
    with pytest.raises(ValueError, match="stream_interval_ms must be a number >= 0"):
        fa.Controller.local(1, dashboard=None, stream_interval_ms=-1)


def test_a_second_controller_on_the_same_scheduler_sets_its_interval_once():
    with fa.Controller.local(1, dashboard=None, stream_interval_ms=0.5) as ctl:
        second = fa.Controller.connect(
            ctl.cluster.scheduler_address, stream_interval_ms=2.0, security=ctl.cluster.security
        )
        try:
            got = _intervals(second)
            assert got["client"] == 0.002 and got["to_workers"] == [0.002] and got["workers"] == [0.002]
            names = ctl.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
            assert names.count("flowactors-streams") == 1
        finally:
            second.close()
