"""The user's path to a real cluster: `dask scheduler` and `dask worker` started as separate processes, then
`python algorithms/grpo.py --address ...` run as a program against them."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(args, log):
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_workers(scheduler_file: Path, n: int, timeout: float = 60) -> str:
    from distributed import Client

    deadline = time.monotonic() + timeout
    while not scheduler_file.exists():
        assert time.monotonic() < deadline, "scheduler did not start"
        time.sleep(0.2)
    address = json.loads(scheduler_file.read_text())["address"]
    with Client(address, timeout=30) as c:
        c.wait_for_workers(n, timeout=timeout)
    return address


@pytest.fixture
def dask_cluster(tmp_path):
    procs = []

    def start(nthreads: int = 1, resources: str = "slot=1"):
        sched_file = tmp_path / "scheduler.json"
        log = open(tmp_path / "cluster.log", "ab")
        procs.append(
            _start(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--no-dashboard",
                    "--scheduler-file",
                    str(sched_file),
                ],
                log,
            )
        )
        deadline = time.monotonic() + 60
        while not sched_file.exists():  # a scheduler that cannot start fails the test, not hangs it
            assert procs[-1].poll() is None and time.monotonic() < deadline, (tmp_path / "cluster.log").read_text()[
                -2000:
            ]
            time.sleep(0.2)
        procs.append(
            _start(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    "--scheduler-file",
                    str(sched_file),
                    "--nworkers",
                    "2",
                    "--nthreads",
                    str(nthreads),
                    "--resources",
                    resources,
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                ],
                log,
            )
        )
        return _wait_workers(sched_file, 2)

    yield start
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_algorithm_runs_against_separately_started_scheduler_and_workers(tmp_path, dask_cluster):
    address = dask_cluster()
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "algorithms" / "grpo.py"),
            "--address",
            address,
            "--steps",
            "3",
            "sft_steps=5",
            "--metrics-file",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "data-parallel size 2" in out.stderr  # both external workers became ranks of the groups


def test_workers_with_several_threads_are_rejected_with_the_fix(dask_cluster):
    import flowactors as fa

    address = dask_cluster(nthreads=2)
    with pytest.raises(fa.PlacementError, match=r"exactly one thread.*--nthreads 1"):
        fa.Controller.connect(address)
