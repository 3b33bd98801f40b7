"""A pool worker started as dask-jobqueue's jobs start it (`dask worker --nanny`: a nanny process and the worker
process it runs) told to stop. Slurm signals every process of a job (a preemption, its time limit, `scancel`), so
the nanny gets SIGTERM too, and Dask's command line closes its workers at once: the graceful leave the controller
offers (`Controller.leaving`, then `retire_worker`) would be a loss. The controller's nanny plugin keeps the
nanny up until its worker ends, and passes a nanny's SIGTERM on to the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flowactors as fa
from tests.runtime.workers import Reducer

ROOT = Path(__file__).resolve().parents[2]


def _dask_worker(scheduler: str, log: Path) -> subprocess.Popen:
    """One pool worker as a dask-jobqueue job runs it: the `dask worker` command, with its nanny."""
    args = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--nthreads", "1", "--nanny"]
    args += ["--resources", "rollout=1", "--no-dashboard", "--host", "127.0.0.1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def _pool_worker(ctl: fa.Controller, job: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 90
    while not (pool := ctl.workers_with("rollout")):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return pool[0]


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def joined(tmp_path, monkeypatch, request):
    """A controller (its grace: the test's parameter) and one `dask worker --nanny` job joined to its cluster,
    hosting a group."""
    import flowactors.controller as controller

    monkeypatch.setattr(controller, "LEAVE_GRACE_S", request.param)
    log = tmp_path / "job.log"
    with fa.Controller.local(1, dashboard=None, secure=False, collective_timeout_s=60) as ctl:
        job = _dask_worker(ctl.cluster.scheduler_address, log)
        try:
            address = _pool_worker(ctl, job, log)
            group = fa.ActorGroup(ctl, Reducer, name="replica", slots=[address], args=(3.0,), own_world=True)
            worker_pid = group.pid().result()[0]
            assert worker_pid != job.pid  # the nanny runs the worker in a process of its own
            yield ctl, job, address, group, worker_pid, log
        finally:
            job.kill()
            job.wait(10)


@pytest.mark.parametrize("joined", [60.0], indirect=True)
def test_a_job_told_to_stop_serves_until_retired_then_its_nanny_ends_with_it(joined):
    """Both processes signalled, as Slurm does: the worker is announced, still serves after the nanny would have
    closed it, and once retired the whole job ends (the nanny does not start a new worker); nothing is lost."""
    ctl, job, address, group, worker_pid, log = joined
    os.kill(job.pid, signal.SIGTERM)
    os.kill(worker_pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while ctl.leaving != [address] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctl.leaving == [address]
    time.sleep(1.5)  # Dask's command line would have closed its nanny's worker by now
    assert group.all_reduce(2.0).result(timeout=30) == [6.0]
    assert group.pid().result(timeout=30) == [worker_pid] and job.poll() is None
    ctl.retire_worker(address)
    assert job.wait(timeout=20) is not None, log.read_text()[-3000:]  # retired: long before its grace ends
    assert _gone(worker_pid, 10)
    assert ctl.lost_workers == [] and ctl.leaving == []
    assert "Restarting worker" not in log.read_text()


@pytest.mark.parametrize("joined", [4.0], indirect=True)
def test_a_nanny_told_to_stop_passes_it_on_and_ends_with_its_worker_after_the_grace(joined):
    """Only the nanny signalled (`kill` of the job's process): its worker is told and announced; nobody retires
    it, so the worker ends after its grace, as a lost worker, and the nanny ends with it instead of restarting it."""
    ctl, job, address, group, worker_pid, log = joined
    os.kill(job.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while ctl.leaving != [address] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctl.leaving == [address]
    assert group.all_reduce(1.0).result(timeout=30) == [3.0]
    with pytest.raises(fa.WorkerLostError) as lost:
        group.sleep(60.0).result(timeout=60)
    assert lost.value.address == address
    assert job.wait(timeout=30) is not None, log.read_text()[-3000:]
    assert _gone(worker_pid, 10)
    assert "Restarting worker" not in log.read_text()
