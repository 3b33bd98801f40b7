"""Pin each Dask worker process of a Slurm job to its own GPU (a Dask preload module; docs/design.md §3, Cluster).

dask-jobqueue runs one `dask worker --nworkers N` per job. Its N processes inherit the job's environment, so each
of them sees every GPU Slurm gave the job (CUDA_VISIBLE_DEVICES=0,1,...): without pinning, all of them would put
their models on the job's first device. This module is loaded with `--preload flowactors._slurm_preload` (or
`--preload-nanny`, which pins the worker process before it even starts) and, before any task runs and so before
torch initialises CUDA, narrows CUDA_VISIBLE_DEVICES to the one device of this process and sets LOCAL_RANK.

The process's index within its job comes from its worker name: `dask worker --nworkers N --name JOB` names its
processes `JOB-0` ... `JOB-{N-1}`. A name alone cannot tell `JOB-3` (process 3 of a job) from a single-process job
whose own name ends in a number, so the job script exports N as FLOWACTORS_WORKERS_PER_JOB (`flowactors.slurm`
does). The job's own device list is kept in FLOWACTORS_JOB_CUDA_VISIBLE_DEVICES, so pinning twice (nanny and
worker preload, or a worker restarted by its nanny) gives the same device. Where Slurm set no CUDA_VISIBLE_DEVICES
(no gres configuration), process i takes the node's GPU i. With FLOWACTORS_PIN_DEVICES=0 (CPU-only nodes) only
LOCAL_RANK and LOCAL_WORLD_SIZE are set.

`select_device` is a pure function of the worker name and the environment, so it is tested without Slurm.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["select_device", "dask_setup", "WORKERS_PER_JOB_ENV", "JOB_DEVICES_ENV", "PIN_DEVICES_ENV"]

WORKERS_PER_JOB_ENV = "FLOWACTORS_WORKERS_PER_JOB"
"""Worker processes of one Slurm job (the N of `dask worker --nworkers N`), exported by the job script."""
JOB_DEVICES_ENV = "FLOWACTORS_JOB_CUDA_VISIBLE_DEVICES"
"""The job's whole device list, remembered when a process is narrowed to one device."""
PIN_DEVICES_ENV = "FLOWACTORS_PIN_DEVICES"
"""0: set only LOCAL_RANK (CPU-only nodes). Default 1."""

_INDEX = re.compile(r"-(\d+)$")


def select_device(worker_name: str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that pin the worker process `worker_name` of a job to its device.

    Process `SLURMCluster-0-1` of a 2-process job given CUDA_VISIBLE_DEVICES=4,5 gets CUDA_VISIBLE_DEVICES=5 and
    LOCAL_RANK=1 (and LOCAL_WORLD_SIZE=2, FLOWACTORS_JOB_CUDA_VISIBLE_DEVICES=4,5).
    """
    raw = env.get(WORKERS_PER_JOB_ENV, "1")
    try:
        per_job = int(raw)
    except ValueError:
        per_job = 0
    if per_job < 1:
        raise ValueError(f"{WORKERS_PER_JOB_ENV}={raw!r} must be a positive integer (worker processes per job)")
    index = 0
    if per_job > 1:
        m = _INDEX.search(worker_name)
        if m is None:
            raise ValueError(
                f"worker name {worker_name!r} does not end in -<index>, so its position among the "
                f"{per_job} worker processes of its job is unknown; start the job's workers with "
                f"`dask worker --nworkers {per_job} --name NAME` (dask-jobqueue does)"
            )
        index = int(m.group(1))
        if index >= per_job:
            raise ValueError(
                f"worker {worker_name!r} has index {index}, but its job runs only {per_job} worker "
                f"processes ({WORKERS_PER_JOB_ENV}={per_job})"
            )
    out = {"LOCAL_RANK": str(index), "LOCAL_WORLD_SIZE": str(per_job)}
    if env.get(PIN_DEVICES_ENV, "1") == "0":
        return out
    job_devices = env.get(JOB_DEVICES_ENV, env.get("CUDA_VISIBLE_DEVICES"))
    if job_devices is None:
        out["CUDA_VISIBLE_DEVICES"] = str(index)
        return out
    devices = [d.strip() for d in job_devices.split(",") if d.strip()]
    if len(devices) < per_job:
        raise ValueError(
            f"the job has {len(devices)} GPU(s) (CUDA_VISIBLE_DEVICES={job_devices!r}) for {per_job} "
            f"worker processes; request one GPU per process (#SBATCH --gres=gpu:{per_job}, which "
            f"flowactors.slurm adds from gpus_per_node)"
        )
    out["CUDA_VISIBLE_DEVICES"] = devices[index]
    out[JOB_DEVICES_ENV] = ",".join(devices)
    return out


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def dask_setup(server: Any) -> None:
    """Dask's preload hook. A Nanny passes the variables to the worker process it spawns; a Worker sets them on
    itself, which works because nothing in a fresh worker process has touched CUDA before its preloads run. A
    process that cannot be pinned ends (`SystemExit`, with the reason): Dask only logs a preload's exception and
    starts the worker anyway, which would then run on the job's first device."""
    try:
        _pin(server)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"flowactors._slurm_preload: {e}") from e


def _pin(server: Any) -> None:
    from distributed import Nanny

    updates = select_device(str(server.name), os.environ)
    if isinstance(server, Nanny):
        server.env.update(updates)
        return
    if _cuda_initialised() and os.environ.get("CUDA_VISIBLE_DEVICES") != updates.get("CUDA_VISIBLE_DEVICES"):
        raise RuntimeError(
            f"CUDA was initialised in worker {server.name} before flowactors._slurm_preload could "
            f"pin it to device {updates.get('CUDA_VISIBLE_DEVICES')}; load the preload first "
            f"(`--preload flowactors._slurm_preload` before other preloads) or use --preload-nanny"
        )
    os.environ.update(updates)
