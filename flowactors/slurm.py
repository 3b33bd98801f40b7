"""Open a controller on a Slurm allocation through dask-jobqueue (docs/design.md §3 Cluster, §8 Where it runs).

`open_slurm(SlurmSettings(nodes=2, gpus_per_node=8, partition="gpu"))` starts the Dask scheduler in this process
(the controller's), submits `nodes` batch jobs, each asking for `gpus_per_node` GPUs (`--gres=gpu:N`) and running
one `dask worker --nworkers N --nthreads 1` with resources `GPU=1,slot=1`, waits until every worker process has
joined, and returns a `Controller` over them. Closing the controller closes the `SLURMCluster`, which scancels the
jobs.

Design decisions, and why:

- **One single-threaded process per GPU.** The controller needs one thread per worker process (calls to a process
  run one at a time, docs/design.md §3 Ordering). dask-jobqueue gives each process cores / processes threads, so `cores`
  is set to the number of processes; what Slurm books (`--cpus-per-task`) is `cores_per_job`, separately.
- **Pinning in a preload.** Every process of a job sees all of the job's GPUs; `flowactors._slurm_preload` narrows
  CUDA_VISIBLE_DEVICES to one device and sets LOCAL_RANK from the process's index in its job before any task (and
  so before torch touches CUDA). The job script exports the processes per job for it (FLOWACTORS_WORKERS_PER_JOB).
- **One job per node's worth of GPUs**, not one multi-node job: that is dask-jobqueue's model, and it lets jobs
  start as nodes free up. Jobs of fewer GPUs than a node may share a node; add `--exclusive` to
  `job_directives` to get whole nodes.
- **Fail early, then a bounded wait.** The job script first goes through `sbatch --test-only`, so a wrong
  partition or more GPUs than any node has fail at once with sbatch's words (dask-jobqueue would only log them in
  the background). Pending jobs (a busy cluster, a wrong account or QOS) are the other usual failure: past
  `startup_timeout_s`, or as soon as a job ends before its workers joined, the error quotes squeue's view of each
  job and where its log is. Either way the cluster is closed (its jobs cancelled) before raising.
- **dask-jobqueue is optional** (`pip install "flowactors[slurm]"`) and imported only by `open_slurm`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from flowactors._slurm_preload import JOB_DEVICES_ENV, PIN_DEVICES_ENV, WORKERS_PER_JOB_ENV
from flowactors.controller import Controller
from flowactors.errors import FlowactorsError

__all__ = ["SlurmSettings", "SlurmStartupError", "open_slurm"]

PRELOAD = "flowactors._slurm_preload"
_WALLTIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "COMPLETING",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class SlurmStartupError(FlowactorsError, TimeoutError):
    """The Slurm jobs did not bring up all their workers; the message quotes squeue and says where the logs are."""


@dataclass
class SlurmSettings:
    """What the Slurm jobs ask for and how their Dask workers start. Sizes are per job; one job per node."""

    nodes: int = 1
    """Slurm jobs to submit, each one node's worth of GPUs (with `--exclusive` in job_directives: a whole node)."""
    gpus_per_node: int = 8
    """GPUs each job requests (`--gres=gpu:N`); one single-threaded worker process per GPU. 0: CPU-only nodes."""
    cpu_workers_per_node: int = 1
    """Worker processes (CPU slots) per job when gpus_per_node is 0; unused otherwise."""
    partition: str | None = None
    """`#SBATCH -p`; None: the cluster's default partition."""
    account: str | None = None
    """`#SBATCH -A`; None: the user's default account."""
    walltime: str = "01:00:00"
    """`#SBATCH -t`, in Slurm's format (MM, HH:MM:SS, D-HH:MM:SS). Workers die with their job; save checkpoints."""
    memory_per_job: str = "64GB"
    """Host memory each job requests (`--mem`); Dask's memory limit of each worker process is this / processes."""
    cores_per_job: int | None = None
    """CPU cores each job requests (`--cpus-per-task`); None: one per worker process. Each process still runs one
    task thread; OMP_NUM_THREADS is set to cores_per_job / processes."""
    job_directives: list[str] = field(default_factory=list)
    """More `#SBATCH` options, e.g. ["--exclusive", "--constraint=h100", "--qos=high"] (without `#SBATCH`)."""
    setup_commands: list[str] = field(default_factory=list)
    """Shell lines run in the job before the workers start, e.g. ["module load cuda/12.4", "source .venv/bin/activate"].
    """
    interface: str | None = None
    """Network interface of the workers and scheduler (e.g. "ib0", "eth0"); None: Dask's choice of host address."""
    scheduler_host: str | None = None
    """Address the scheduler (in this process) listens on, when this machine's interface differs from the nodes'."""
    python: str | None = None
    """Python executable on the compute nodes; None: this process's (sys.executable), which must exist there."""
    local_directory: str | None = None
    """Node-local scratch for worker files (e.g. "$TMPDIR"; expanded by the job's shell); None: the job's cwd."""
    log_directory: str | None = None
    """Where each job's stdout/stderr go; None: Slurm's default (slurm-JOBID.out in the submission directory)."""
    dashboard_address: str | None = ":8787"
    """The scheduler's dashboard (task stream, graph); None or "none" turns it off."""
    secure: bool = True
    """TLS between scheduler, workers and controller with credentials made for this run. Without it any user who
    can reach a node's ports can run code inside the job."""
    credentials_directory: str = "~"
    """Where the workers' copy of the run's credentials is written (files readable by you alone, removed when the
    run ends): a directory every node sees; expanded by the job's shell."""
    startup_timeout_s: float = 600.0
    """How long to wait for every worker to join (queueing included) before failing with squeue's view."""
    death_timeout_s: float = 60.0
    """Workers give up (and their job ends) this long after losing the scheduler, e.g. when the controller died."""

    def __post_init__(self) -> None:
        for name, low in (("nodes", 1), ("gpus_per_node", 0), ("cpu_workers_per_node", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"SlurmSettings.{name} must be an integer >= {low}, got {value!r}")
        procs = self.workers_per_node
        if self.cores_per_job is not None and (not isinstance(self.cores_per_job, int) or self.cores_per_job < procs):
            raise ValueError(
                f"SlurmSettings.cores_per_job={self.cores_per_job!r} is fewer than the {procs} worker "
                f"processes of a job (one per GPU, or per CPU slot); use at least {procs}, or None"
            )
        for name in (
            "partition",
            "account",
            "interface",
            "scheduler_host",
            "python",
            "local_directory",
            "log_directory",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str)
                or not value.strip()
                or value != value.strip()
                or (name in ("partition", "account", "interface") and " " in value)
            ):
                raise ValueError(f"SlurmSettings.{name} must be a non-empty name without spaces or None, got {value!r}")
        if not isinstance(self.walltime, str) or not _WALLTIME.match(self.walltime):
            raise ValueError(
                f"SlurmSettings.walltime={self.walltime!r} is not a Slurm time limit; use MM, HH:MM:SS "
                f"or D-HH:MM:SS, e.g. '04:00:00'"
            )
        self._memory_bytes()
        for name in ("job_directives", "setup_commands"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ValueError(f"SlurmSettings.{name} must be a list of non-empty strings, got {value!r}")
        for d in self.job_directives:
            if not d.startswith("-"):
                raise ValueError(
                    f"SlurmSettings.job_directives: {d!r} is not an sbatch option; write options "
                    f"without '#SBATCH', e.g. '--exclusive'"
                )
            if self.gpus_per_node and re.match(r"^(--gres|--gpus|--gpus-per-node|-G)\b", d):
                raise ValueError(
                    f"SlurmSettings.job_directives: {d!r} requests GPUs, which gpus_per_node already "
                    f"does (--gres=gpu:{self.gpus_per_node}); remove it or set gpus_per_node"
                )
        for name in ("startup_timeout_s", "death_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SlurmSettings.{name} must be > 0, got {getattr(self, name)!r}")
        if self.dashboard_address in ("none", "None", ""):
            self.dashboard_address = None

    @property
    def workers_per_node(self) -> int:
        """Worker processes (device slots) of each job."""
        return self.gpus_per_node or self.cpu_workers_per_node

    @property
    def total_workers(self) -> int:
        return self.nodes * self.workers_per_node

    def _memory_bytes(self) -> int:
        from dask.utils import parse_bytes

        try:
            n = parse_bytes(self.memory_per_job)
        except (ValueError, TypeError, AttributeError):
            n = 0
        if n <= 0:
            raise ValueError(
                f"SlurmSettings.memory_per_job={self.memory_per_job!r} is not a memory size; "
                f"write e.g. '64GB' or '500GiB'"
            )
        return n

    def cluster_kwargs(self) -> dict[str, Any]:
        """The arguments of `dask_jobqueue.SLURMCluster` that implement these settings."""
        procs = self.workers_per_node
        cores = self.cores_per_job or procs
        resources = "GPU=1,slot=1" if self.gpus_per_node else "slot=1"
        # sbatch exports the submitter's environment: drop a pinning that process may carry itself
        prologue = [
            f"unset {JOB_DEVICES_ENV} LOCAL_RANK LOCAL_WORLD_SIZE",
            f"export {WORKERS_PER_JOB_ENV}={procs}",
            f"export OMP_NUM_THREADS={cores // procs}",
            f"export MKL_NUM_THREADS={cores // procs}",
            "export TOKENIZERS_PARALLELISM=false",
        ]
        if not self.gpus_per_node:
            prologue.append(f"export {PIN_DEVICES_ENV}=0")
        # With the dashboard off the scheduler still serves health checks over HTTP: on any free port, not 8787.
        scheduler: dict[str, Any] = (
            {"dashboard_address": self.dashboard_address}
            if self.dashboard_address
            else {"dashboard": False, "dashboard_address": ":0"}
        )
        if self.scheduler_host is not None:
            scheduler["host"] = self.scheduler_host
        return {
            "job_name": "flowactors",
            "queue": self.partition,
            "account": self.account,
            "walltime": self.walltime,
            "cores": procs,  # dask-jobqueue: threads per process = cores / processes, which must be 1
            "processes": procs,
            "job_cpu": cores,
            "memory": self.memory_per_job,
            "job_extra_directives": ([f"--gres=gpu:{self.gpus_per_node}"] if self.gpus_per_node else [])
            + list(self.job_directives),
            "job_script_prologue": prologue + list(self.setup_commands),
            "worker_extra_args": ["--resources", resources, "--preload", PRELOAD],
            "interface": self.interface,
            "python": self.python or sys.executable,
            "local_directory": self.local_directory,
            "log_directory": self.log_directory,
            "death_timeout": self.death_timeout_s,
            "scheduler_options": scheduler,
        }


def _import_slurm_cluster() -> type:
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as e:
        raise ImportError(
            'running on Slurm needs dask-jobqueue: pip install "flowactors[slurm]" (or pip install dask-jobqueue)'
        ) from e
    return SLURMCluster


def open_slurm(settings: SlurmSettings, **controller_kwargs: Any) -> Controller:
    """Submit the jobs, wait for every worker, and return a Controller that owns the cluster (closing it
    scancels the jobs). `controller_kwargs` go to `Controller` (`call_timeout_s`, `collective_timeout_s`)."""
    from distributed import Client

    # security=True: dask-jobqueue makes Security.temporary() for the run and hands the workers their copy
    cluster = _import_slurm_cluster()(
        **settings.cluster_kwargs(),
        security=True if settings.secure else None,
        shared_temp_directory=settings.credentials_directory,
    )
    client = None
    try:
        _test_submission(cluster.job_script(), settings)
        cluster.scale(jobs=settings.nodes)
        client = Client(cluster, set_as_default=False)
        _wait_for_workers(client, cluster, settings)
        return Controller(client, cluster, **controller_kwargs)
    except BaseException:
        if client is not None:
            client.close()
        cluster.close()
        raise


def _test_submission(script: str, settings: SlurmSettings) -> None:
    """`sbatch --test-only` the job script: a wrong partition or account, or more GPUs than any node has, fails
    here with sbatch's own words instead of as a silent background error and a timeout."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="flowactors-job-") as f:
        f.write(script)
        f.flush()
        try:
            out = subprocess.run(["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise SlurmStartupError(
                "sbatch not found: run the controller on a Slurm login node (or a node that "
                "can submit jobs), with Slurm's commands on PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise SlurmStartupError(
                "`sbatch --test-only` did not answer within 60 s; is slurmctld reachable (`sinfo`)?"
            ) from None
    if out.returncode != 0:
        said = " ".join(out.stderr.split()) or f"exit code {out.returncode}"
        raise SlurmStartupError(
            f"Slurm would not accept the worker job: {said}. Check partition="
            f"{settings.partition!r}, account={settings.account!r}, gpus_per_node="
            f"{settings.gpus_per_node} and job_directives={settings.job_directives} against "
            f"`sinfo -o '%P %G %D %t'`; the job script is SLURMCluster(...).job_script()"
        )


def _wait_for_workers(
    client: Any, cluster: Any, settings: SlurmSettings, poll_s: float = 1.0, squeue_every_s: float = 5.0
) -> None:
    want = settings.total_workers
    deadline = time.monotonic() + settings.startup_timeout_s
    next_squeue = time.monotonic() + squeue_every_s
    while True:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        if have >= want:
            return
        now = time.monotonic()
        if now >= next_squeue or now > deadline:
            next_squeue = now + squeue_every_s
            jobs = _job_ids(cluster)
            states = _squeue(jobs)
            ended = [j for j in jobs if j not in states or states[j][0] in _ENDED]
            if ended or now > deadline:
                what = (
                    f"Slurm job(s) {', '.join(ended)} ended before their workers joined"
                    if ended
                    else f"the Slurm jobs did not start all workers within {settings.startup_timeout_s:.0f} s "
                    f"(startup_timeout_s)"
                )
                raise SlurmStartupError(
                    f"{what}: {have} of {want} worker processes joined. squeue: "
                    f"{_describe(jobs, states)}. {_hint(settings)}"
                )
        time.sleep(poll_s)


def _job_ids(cluster: Any) -> list[str]:
    return [str(j.job_id) for j in cluster.workers.values() if getattr(j, "job_id", None)]


def _squeue(jobs: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} of `jobs` as squeue sees them; jobs it no longer lists are absent. (Listing the
    user's jobs, not `-j`, because squeue rejects the whole query when one id has been forgotten.)"""
    import getpass

    if not jobs:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-u", getpass.getuser(), "-o", "%i %T %r"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {j: ("UNKNOWN", f"squeue failed: {e}") for j in jobs}
    if out.returncode != 0:
        return {j: ("UNKNOWN", f"squeue failed: {out.stderr.strip()}") for j in jobs}
    states = {}
    for line in out.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] in jobs:
            states[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return states


def _describe(jobs: list[str], states: dict[str, tuple[str, str]]) -> str:
    if not jobs:
        return "no job was submitted yet (is sbatch reachable from here?)"
    return "; ".join(
        f"job {j} "
        + (" ".join(x for x in states[j] if x and x != "None") if j in states else "no longer listed (it ended)")
        for j in jobs
    )


def _hint(settings: SlurmSettings) -> str:
    logs = settings.log_directory or "the slurm-JOBID.out files in the submission directory"
    return (
        f"Pending jobs: check partition={settings.partition!r}, account={settings.account!r} and "
        f"gpus_per_node={settings.gpus_per_node} against `sinfo -o '%P %G %D %t'`, or raise startup_timeout_s. "
        f"Ended jobs: read their logs in {logs}."
    )
