"""Running on Slurm through dask-jobqueue (docs/design.md §8).

The first half needs no Slurm: the preload's choice of device and LOCAL_RANK from a worker's name and its job's
environment, the settings' validation, and the job script the settings produce. The second half brings up a real,
private single-node Slurm (munged, slurmctld, slurmd; `tests/deploy/slurm_local.py`) with two fake GPUs, opens
`open_slurm` on it, and checks what a user relies on: one worker process per GPU, each pinned to a different
device with LOCAL_RANK 0/1, a group collective across them, and an algorithm program run against the Slurm
workers. The fake GPUs are character devices, so torch sees no CUDA and the workers use gloo; the pinning is
checked through the environment. The tests never install anything: where slurm-wlm and munge are missing (`.ci/run`
installs them), without root, or when the daemons do not come up, these tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowactors._slurm_preload import JOB_DEVICES_ENV, WORKERS_PER_JOB_ENV, select_device
from flowactors.slurm import SlurmSettings

ROOT = Path(__file__).resolve().parents[2]


# -- device selection (no Slurm) -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, env, device, local_rank",
    [
        ("SLURMCluster-0-0", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "0", "0"),
        ("SLURMCluster-0-1", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "1", "1"),
        ("SLURMCluster-12-3", {WORKERS_PER_JOB_ENV: "4", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "7", "3"),
        # a single-process job whose name ends in a number is process 0, not process 7
        ("SLURMCluster-7", {WORKERS_PER_JOB_ENV: "1", "CUDA_VISIBLE_DEVICES": "3"}, "3", "0"),
        # device UUIDs (MIG slices, some sites) pass through
        ("j-1", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, "GPU-bb", "1"),
        # no CUDA_VISIBLE_DEVICES from Slurm (no gres configuration): process i takes the node's GPU i
        ("j-2", {WORKERS_PER_JOB_ENV: "8"}, "2", "2"),
        # more GPUs in the job than processes: the first ones, in order
        ("j-1", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "2,3,5"}, "3", "1"),
    ],
)
def test_select_device_takes_the_processs_own_gpu_from_the_jobs_list(name, env, device, local_rank):
    out = select_device(name, env)
    assert out["CUDA_VISIBLE_DEVICES"] == device
    assert out["LOCAL_RANK"] == local_rank
    assert out["LOCAL_WORLD_SIZE"] == env[WORKERS_PER_JOB_ENV]


def test_select_device_is_idempotent_so_nanny_and_worker_preloads_and_restarts_agree():
    env = {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "4,6"}
    first = select_device("SLURMCluster-3-1", env)
    again = select_device("SLURMCluster-3-1", {**env, **first})  # CUDA_VISIBLE_DEVICES is now "6" alone
    assert first == again and first["CUDA_VISIBLE_DEVICES"] == "6" and first[JOB_DEVICES_ENV] == "4,6"


def test_select_device_without_pinning_sets_only_local_rank():
    out = select_device(
        "cpu-0-2", {WORKERS_PER_JOB_ENV: "3", "FLOWACTORS_PIN_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}
    )
    assert out == {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}


@pytest.mark.parametrize(
    "name, env, match",
    [
        ("SLURMCluster-0-1", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "0"}, r"1 GPU\(s\).*--gres=gpu:2"),
        ("SLURMCluster-0-1", {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": ""}, r"0 GPU\(s\)"),
        ("worker", {WORKERS_PER_JOB_ENV: "2"}, r"does not end in -<index>.*--nworkers 2"),
        ("SLURMCluster-0-2", {WORKERS_PER_JOB_ENV: "2"}, r"index 2.*only 2 worker processes"),
        ("SLURMCluster-0-0", {WORKERS_PER_JOB_ENV: "two"}, r"FLOWACTORS_WORKERS_PER_JOB='two'"),
    ],
)
def test_select_device_errors_say_what_is_wrong(name, env, match):
    with pytest.raises(ValueError, match=match):
        select_device(name, env)


# -- settings (no Slurm) -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 0}, r"SlurmSettings\.nodes must be an integer >= 1"),
        ({"gpus_per_node": -1}, r"SlurmSettings\.gpus_per_node"),
        ({"gpus_per_node": 0, "cpu_workers_per_node": 0}, r"SlurmSettings\.cpu_workers_per_node"),
        ({"gpus_per_node": 4, "cores_per_job": 2}, r"SlurmSettings\.cores_per_job=2 is fewer than the 4 worker"),
        ({"walltime": "1h"}, r"SlurmSettings\.walltime='1h'.*HH:MM:SS"),
        ({"memory_per_job": "lots"}, r"SlurmSettings\.memory_per_job='lots'.*'64GB'"),
        ({"memory_per_job": "0GB"}, r"SlurmSettings\.memory_per_job"),
        ({"partition": "gpu large"}, r"SlurmSettings\.partition"),
        ({"account": ""}, r"SlurmSettings\.account"),
        ({"job_directives": ["#SBATCH --exclusive"]}, r"SlurmSettings\.job_directives.*without '#SBATCH'"),
        ({"job_directives": ["--gres=gpu:4"]}, r"SlurmSettings\.job_directives.*gpus_per_node already"),
        ({"job_directives": "--exclusive"}, r"SlurmSettings\.job_directives must be a list"),
        ({"setup_commands": [""]}, r"SlurmSettings\.setup_commands"),
        ({"startup_timeout_s": 0}, r"SlurmSettings\.startup_timeout_s must be > 0"),
    ],
)
def test_settings_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlurmSettings(**kwargs)


@pytest.mark.parametrize("walltime", ["30", "30:00", "04:00:00", "2-00:00:00", "1-12"])
def test_slurm_walltime_formats_are_accepted(walltime):
    assert SlurmSettings(walltime=walltime).walltime == walltime


def test_settings_defaults_and_derived_sizes():
    s = SlurmSettings(nodes=2, gpus_per_node=8, dashboard_address="none")
    assert (s.workers_per_node, s.total_workers, s.dashboard_address) == (8, 16, None)
    assert SlurmSettings(gpus_per_node=0, cpu_workers_per_node=3).workers_per_node == 3


def test_cluster_kwargs_give_one_single_threaded_pinned_worker_per_gpu():
    kw = SlurmSettings(
        gpus_per_node=4,
        cores_per_job=16,
        partition="gpu",
        account="proj",
        walltime="02:00:00",
        memory_per_job="200GB",
        job_directives=["--exclusive"],
        setup_commands=["module load cuda"],
    ).cluster_kwargs()
    assert (kw["processes"], kw["cores"], kw["job_cpu"]) == (4, 4, 16)  # 1 thread per process, 16 cores booked
    assert kw["job_extra_directives"] == ["--gres=gpu:4", "--exclusive"]
    assert kw["worker_extra_args"] == ["--resources", "GPU=1,slot=1", "--preload", "flowactors._slurm_preload"]
    assert kw["job_script_prologue"][:2] == [
        f"unset {JOB_DEVICES_ENV} LOCAL_RANK LOCAL_WORLD_SIZE",
        f"export {WORKERS_PER_JOB_ENV}=4",
    ]
    assert "export OMP_NUM_THREADS=4" in kw["job_script_prologue"]
    assert kw["job_script_prologue"][-1] == "module load cuda"
    cpu = SlurmSettings(gpus_per_node=0, cpu_workers_per_node=2).cluster_kwargs()
    assert cpu["job_extra_directives"] == [] and cpu["worker_extra_args"][1] == "slot=1"
    assert "export FLOWACTORS_PIN_DEVICES=0" in cpu["job_script_prologue"]


def test_dask_setup_pins_a_worker_process_and_refuses_after_cuda_started(monkeypatch):
    from types import SimpleNamespace

    import flowactors._slurm_preload as preload

    env = {WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setattr(os, "environ", dict(env))  # a private environment: nothing leaks into later jobs
    preload.dask_setup(SimpleNamespace(name="SLURMCluster-5-1"))
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"]) == ("3", "1")
    monkeypatch.setattr(os, "environ", dict(env))
    monkeypatch.setattr(preload, "_cuda_initialised", lambda: True)
    with pytest.raises(SystemExit, match=r"CUDA was initialised .* before .* device 3.*--preload-nanny"):
        preload.dask_setup(SimpleNamespace(name="SLURMCluster-5-1"))


def test_a_worker_process_the_preload_cannot_pin_does_not_start():
    """Dask logs an exception raised by a preload and starts the worker anyway, which would then run on the job's
    first device: the preload ends the process instead, with its reason, and the worker never joins."""
    from distributed import LocalCluster

    cluster = None
    with pytest.raises(Exception, match="failed to start"):
        cluster = LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            preload=["flowactors._slurm_preload"],
            # (the worker's own environment: two per job, but its name carries no index)
            env={WORKERS_PER_JOB_ENV: "2", "CUDA_VISIBLE_DEVICES": "0,1"},
        )
    if cluster is not None:  # (a failed test does not leave its worker running)
        cluster.close()


def test_job_script_as_dask_jobqueue_writes_it():
    pytest.importorskip("dask_jobqueue", reason='dask-jobqueue is not installed: pip install "flowactors[slurm]"')
    from dask_jobqueue.slurm import SLURMJob

    kw = SlurmSettings(
        gpus_per_node=2, partition="debug", memory_per_job="8GB", walltime="00:30:00", interface="lo"
    ).cluster_kwargs()
    kw.pop("scheduler_options")
    script = SLURMJob("tcp://127.0.0.1:8786", name="flowactors-0", **kw).job_script()
    for line in (
        "#SBATCH -p debug",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --mem=8G",
        "#SBATCH -t 00:30:00",
        "#SBATCH --gres=gpu:2",
        f"export {WORKERS_PER_JOB_ENV}=2",
    ):
        assert line in script.splitlines(), (line, script)
    for arg in (
        "--nworkers 2",
        "--nthreads 1",
        "--resources GPU=1,slot=1",
        "--preload flowactors._slurm_preload",
        "--interface lo",
        "--nanny",
    ):
        assert arg in script, (arg, script)


def test_open_slurm_without_dask_jobqueue_says_how_to_install(monkeypatch):
    from flowactors.slurm import open_slurm

    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)
    with pytest.raises(ImportError, match=r'pip install "flowactors\[slurm\]"'):
        open_slurm(SlurmSettings())


# -- a real Slurm ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory):
    """A private single-node Slurm with 2 fake GPUs for this session; skipped (with the reason) where impossible."""
    pytest.importorskip("dask_jobqueue", reason='dask-jobqueue is not installed: pip install "flowactors[slurm]"')
    from tests.deploy.slurm_local import LocalSlurm, SlurmUnavailable, require_installed

    try:
        require_installed()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    if os.geteuid() != 0:
        pytest.skip("a private Slurm needs root (slurmd runs jobs as their user)")
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"), gpus=2)
    try:
        slurm.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(slurm.env)  # sbatch, squeue and scancel (called by dask-jobqueue) find this Slurm
    yield slurm
    slurm.stop()
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved


def _settings(slurm, tmp_path: Path, **kw) -> SlurmSettings:
    return SlurmSettings(
        **{
            "nodes": 1,
            "gpus_per_node": 2,
            "partition": slurm.partition,
            "memory_per_job": "4GB",
            "walltime": "00:10:00",
            "interface": "lo",
            "dashboard_address": None,
            "log_directory": str(tmp_path / "jobs"),
            "startup_timeout_s": 60,
            "credentials_directory": str(tmp_path),
            **kw,
        }
    )


def _wait_no_jobs(slurm, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (jobs := slurm.job_ids()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return jobs


def _pinning() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SLURM_JOB_ID")}


def test_slurm_workers_are_pinned_one_gpu_each_and_form_a_group(local_slurm, tmp_path, monkeypatch):
    import flowactors as fa
    from flowactors.slurm import open_slurm
    from tests.runtime.workers import Reducer

    # sbatch exports this process's environment to the job; a pinning of the submitter must not carry over
    monkeypatch.setenv(JOB_DEVICES_ENV, "7,9")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with open_slurm(_settings(local_slurm, tmp_path), collective_timeout_s=60) as ctl:
        assert len(ctl.slots) == 2
        info = ctl.client.scheduler_info(n_workers=-1)["workers"]
        assert all(info[a]["nthreads"] == 1 and info[a]["resources"] == {"GPU": 1, "slot": 1} for a in ctl.slots)
        env = ctl.client.run(_pinning)
        pinned = [env[a] for a in ctl.slots]  # in slot (rank) order
        assert [p["LOCAL_RANK"] for p in pinned] == ["0", "1"]
        assert sorted(p["CUDA_VISIBLE_DEVICES"] for p in pinned) == ["0", "1"]  # one device each, different
        assert pinned[0]["SLURM_JOB_ID"] == pinned[1]["SLURM_JOB_ID"] in local_slurm.job_ids()

        group = fa.ActorGroup(ctl, Reducer, name="reducer", slots=ctl.slots, layout=fa.Layout(dp=2))
        assert group.all_reduce(1.0).result() == [3.0, 3.0]  # 1*1 + 1*2 summed over the two ranks
        group.close()
    assert _wait_no_jobs(local_slurm) == [], "closing the controller should scancel its Slurm jobs"


def test_cpu_only_slurm_jobs_give_cpu_slots(local_slurm, tmp_path):
    from flowactors.slurm import open_slurm

    settings = _settings(local_slurm, tmp_path, gpus_per_node=0, cpu_workers_per_node=2)
    with open_slurm(settings) as ctl:
        info = ctl.client.scheduler_info(n_workers=-1)["workers"]
        assert [info[a]["resources"] for a in ctl.slots] == [{"slot": 1}, {"slot": 1}]
        env = ctl.client.run(_pinning)
        assert [env[a]["LOCAL_RANK"] for a in ctl.slots] == ["0", "1"]
        assert all(env[a]["CUDA_VISIBLE_DEVICES"] is None for a in ctl.slots)  # no --gres, nothing pinned
    assert _wait_no_jobs(local_slurm) == []


def test_algorithm_program_runs_on_slurm_workers(local_slurm, tmp_path):
    from flowactors.slurm import open_slurm

    metrics = tmp_path / "m.jsonl"
    with open_slurm(_settings(local_slurm, tmp_path)) as ctl:
        address = ctl.client.scheduler.address
        assert address.startswith("tls://")  # the run's credentials: the program joins with Dask's TLS settings
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for name, pem in (
            ("CA_FILE", ctl.cluster.security.tls_ca_file),
            ("CLIENT__CERT", ctl.cluster.security.tls_client_cert),
            ("CLIENT__KEY", ctl.cluster.security.tls_client_key),
        ):
            path = tmp_path / name.lower()
            path.write_text(pem)
            path.chmod(0o600)
            env[f"DASK_DISTRIBUTED__COMM__TLS__{name}"] = str(path)
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "algorithms" / "grpo.py"),
                "--address",
                address,
                "--steps",
                "2",
                "sft_steps=2",
                "dashboard=none",
                "--metrics-file",
                str(metrics),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "data-parallel size 2" in out.stderr  # both Slurm workers became ranks of the groups
    assert _wait_no_jobs(local_slurm) == []


def test_pending_jobs_fail_with_squeues_view_and_are_cancelled(local_slurm, tmp_path):
    from flowactors.slurm import SlurmStartupError, open_slurm

    t0 = time.monotonic()
    with pytest.raises(SlurmStartupError, match=r"0 of 2 worker processes joined\. squeue: job \d+ PENDING BeginTime"):
        open_slurm(_settings(local_slurm, tmp_path, job_directives=["--begin=now+3600"], startup_timeout_s=3))
    assert time.monotonic() - t0 < 20
    assert _wait_no_jobs(local_slurm) == []


def test_a_job_slurm_cannot_run_is_refused_at_once_with_sbatchs_words(local_slurm, tmp_path):
    from flowactors.slurm import SlurmStartupError, open_slurm

    t0 = time.monotonic()
    with pytest.raises(SlurmStartupError, match=r"would not accept.*Requested node configuration is not available"):
        open_slurm(_settings(local_slurm, tmp_path, gpus_per_node=4))  # the node has 2
    assert time.monotonic() - t0 < 10
    assert local_slurm.job_ids() == []


def test_a_pool_job_slurm_cancels_serves_until_retired_and_ends_before_slurm_kills_it(
    local_slurm, tmp_path, monkeypatch
):
    """`scancel` of a pool worker's job, as a preemption or its time limit (SIGTERM to every process of the job:
    its shell, the nanny and the worker; SIGKILL KillWait = 30 s later): the worker is announced and still serves,
    its nanny does not close it, and once retired the job ends long before Slurm would kill it; nothing is lost."""
    import flowactors as fa
    import flowactors.controller as controller
    from flowactors.slurm import open_slurm
    from tests.runtime.workers import Reducer

    monkeypatch.setattr(controller, "LEAVE_GRACE_S", 60.0)
    settings = _settings(local_slurm, tmp_path, gpus_per_node=0, cpu_workers_per_node=1)
    with open_slurm(settings, collective_timeout_s=60) as ctl:
        ctl.resize_pool("rollout", 1)
        deadline = time.monotonic() + 90
        while not (pool := ctl.workers_with("rollout")) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert len(pool) == 1, local_slurm.logs_tail()
        replica = fa.ActorGroup(ctl, Reducer, name="replica", slots=pool, args=(3.0,), own_world=True)
        job = ctl.client.run(lambda: os.environ["SLURM_JOB_ID"], workers=pool)[pool[0]]
        local_slurm.run(["scancel", job])
        deadline = time.monotonic() + 15
        while ctl.leaving != pool and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.leaving == pool
        time.sleep(1.5)  # Dask's command line would have closed the job's nanny and its worker by now
        assert replica.all_reduce(2.0).result(timeout=30) == [6.0]
        t0 = time.monotonic()
        ctl.retire_worker(pool[0])
        while job in local_slurm.job_ids() and time.monotonic() - t0 < 25:
            time.sleep(0.3)
        assert job not in local_slurm.job_ids(), "the retired job should end before Slurm's KillWait (30 s)"
        assert ctl.lost_workers == [] and ctl.leaving == []
    assert _wait_no_jobs(local_slurm) == []


def test_the_rollout_fleet_grows_and_shrinks_with_slurm_jobs_of_its_own(local_slurm, tmp_path, monkeypatch):
    """--cluster slurm async_replicas=1:2: the trainer's jobs keep their two CPU workers while the fleet submits a
    job of its own for its first replica, one more to grow (a second job whose worker joins with a peer's
    weights), then retires that replica, which cancels its job; every step's batch full, every group trained once.
    The scale-ups and the retire are the autoscaler's own calls, made here at fixed steps."""
    from algorithms.grpo import main as grpo
    from algorithms.rollout.fleet import RESOURCE, Autoscale, FleetRollouts

    monkeypatch.setattr(Autoscale, "decide", lambda self, *a, **k: 0)  # the test decides when
    seen: dict = {}
    take = FleetRollouts.take

    def take_and_scale(self, i):
        out = take(self, i)
        if i == 2:
            seen["jobs_before"] = len(local_slurm.job_ids())
            self.ctl.resize_pool(RESOURCE, 2)
            deadline = time.monotonic() + 120
            while len(self.fleet) < 2 and time.monotonic() < deadline:
                with self._owning():  # (the fleet's state, as the pipeline's own calls hold it; a join takes it)
                    self._poll(0.2)
                    self._collect()
            seen["grown"] = len(self.fleet)
            seen["jobs_up"] = len(local_slurm.job_ids())
        if i == 5:
            with self._owning():
                self._retire(self.fleet[-1])
            deadline = time.monotonic() + 30
            while len(local_slurm.job_ids()) >= seen["jobs_up"] and time.monotonic() < deadline:
                time.sleep(0.3)
            seen["jobs_down"] = len(local_slurm.job_ids())
        return out

    monkeypatch.setattr(FleetRollouts, "take", take_and_scale)
    slurm = [
        f"slurm.partition={local_slurm.partition}",
        "slurm.gpus_per_node=0",
        "slurm.nodes=2",  # (one worker per job: the trainer's two jobs, one per replica)
        "slurm.cpu_workers_per_node=1",
        "slurm.memory_per_job=2GB",
        "slurm.interface=lo",
        f"slurm.log_directory={tmp_path / 'jobs'}",
        f"slurm.credentials_directory={tmp_path}",
    ]
    history = grpo(
        ["--cluster", "slurm", *slurm, "--steps", "8", "dashboard=none", "sft_steps=2", "prompts_per_step=8"]
        + ["async_staleness=1", "partial_rollout=true", "async_replicas=1:2"]
    )
    assert seen["jobs_before"] == 3  # the trainer's two and the first replica's
    assert seen["grown"] == 2 and seen["jobs_up"] == 4
    assert seen["jobs_down"] == 3
    assert [r["step"] for r in history] == list(range(8))
    assert all(r["async/trained_groups"] == 8 and r["async/duplicates"] == 0 for r in history)
    assert all(r["async/lost"] == 0 for r in history)
    assert history[-1]["fleet/joined"] == 1 and history[-1]["fleet/left"] == 1
    # the join's weights came from the first replica, not the trainer (on this TLS cluster's Dask transport)
    joined = next(r for r in history if "fleet/join_peer_bytes" in r)
    assert joined["fleet/join_trainer_bytes"] == 0 and joined["fleet/join_peer_bytes"] > 0
    assert _wait_no_jobs(local_slurm) == []
