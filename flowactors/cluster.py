"""Cluster start-up: the embedded LocalCluster, joining a running scheduler, and the device slots of either.

docs/design.md §3 Cluster. `Controller.local()` starts an embedded `LocalCluster` of worker *processes* with one
thread and one device slot each (resource `slot=1`, plus `GPU=1` where CUDA exists), on 127.0.0.1 only;
`Controller.connect(address)` joins an existing scheduler whose workers were started the same way, after probing
the address (Dask's client would otherwise retry a wrong one for half a minute, or wait forever on a port that is
not a scheduler). The embedded cluster's listeners accept only peers holding the run's credentials (TLS, made
in memory per run; `secure=False` turns that off); a joined cluster keeps its own Dask security. `discover_slots`
lists the workers that are device slots, ordered by host, then worker name, and refuses a slot with more than one
thread (calls to one process must run one at a time). `shorten_streams` sets the Dask streams' batching interval
(`flowactors._streams`). Slurm allocations start in `flowactors.slurm`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from distributed import Client, LocalCluster

from flowactors.errors import ClusterStartError, PlacementError, SchedulerUnreachableError

__all__ = [
    "SLOT_RESOURCES",
    "check_interval",
    "discover_slots",
    "fork_from_server",
    "natural",
    "pool_workers",
    "probe_scheduler",
    "resize_pool",
    "shorten_streams",
    "start_local",
    "stop_workers",
]

SLOT_RESOURCES = ("slot", "GPU")


def start_local(
    n_slots: int,
    dashboard: str | None,
    stream_interval_ms: float | None = None,
    secure: bool = True,
    preload: Sequence[str] = (),
) -> LocalCluster:
    """An embedded LocalCluster of `n_slots` single-threaded worker processes on 127.0.0.1 (`dashboard=None`: no
    dashboard; `stream_interval_ms` is checked before any process starts).

    The worker processes fork from one server process that imported torch, the runtime and `preload` (modules, as
    Dask's worker `preload`) once, instead of each spawning a Python that imports them again: a 2-worker cluster
    starts in ~0.3 s rather than ~2.7 s, and a model worker does not pay seconds of imports in its first call
    (`fork_from_server`).

    `secure`: every Dask listener (scheduler, nannies, workers) speaks TLS and requires a certificate signed by the
    run's own authority, made in memory for this run (`Security.temporary`) and handed to the worker processes as
    they start (through the pipe each reads its start-up state from), never written anywhere. Without it any local
    user could connect a Dask client, or send a pickle to a worker, and run code as the trainer. The direct-call
    sockets are guarded by secrets learned over these comms (flowactors.transport.channel)."""
    import torch

    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    check_interval(stream_interval_ms)
    resources = {"slot": 1} | ({"GPU": 1} if torch.cuda.is_available() else {})
    nanny_log, told = logging.getLogger("distributed.nanny"), _ToldInTheError()
    nanny_log.addFilter(told)
    try:
        fork_from_server(preload)
        return _local_cluster(n_slots, dashboard, secure, resources, preload)
    except Exception as e:
        said, cause = [], e
        while cause is not None:
            said.append(f"{type(cause).__name__}: {cause}".rstrip(". "))
            cause = cause.__cause__ or cause.__context__
        part = (
            "a worker process ended or failed while starting"
            if "Nanny" in " ".join(said)
            else "its scheduler or workers could not be set up"
        )
        raise ClusterStartError(
            f"the embedded cluster of {n_slots} worker process(es) did not start: {part} "
            f"({'; '.join(said)}); the processes' own output above says why (an import that "
            f"fails in them, memory, a signal)"
        ) from e
    finally:
        nanny_log.removeFilter(told)


class _ToldInTheError(logging.Filter):
    """Drops the nanny's traceback of a worker process that could not be started (the fork server gone, say):
    `start_local`'s ClusterStartError says it in one line, with the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Failed to start process"


_SERVER_PRELOAD = ["distributed", "torch", "flowactors", "flowactors._local_preload"]
"""What the fork server imports: the runtime's, and every module an embedded cluster of this process asked for."""


def fork_from_server(preload: Sequence[str] = ()) -> None:
    """Have this process's Dask nannies fork their worker processes from a server that imported `preload` and the
    runtime (Python's "forkserver" method, as Dask's own test suite runs), where Dask's default spawns each one.

    A fork is safe there, where it is not from the controller: the server is a single thread that only imported
    (no CUDA context, no OpenMP pool), and each worker it forks starts with Dask's pre-spawn environment
    (`OMP_NUM_THREADS=1`: the server is started by the first worker's start, after Dask set it). The server starts
    once per process with what was asked by then; a module asked later is imported by each worker as it starts
    (Dask's worker `preload`), so the result is the same, only slower. A method chosen in Dask's configuration
    (`distributed.worker.multiprocessing-method` in a YAML file, `DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD`,
    or set by the program to other than Dask's default) is kept: "spawn" there spawns each worker as Dask does."""
    import dask
    from distributed.utils import get_mp_context

    key = "distributed.worker.multiprocessing-method"
    chosen = dask.config.get(key, config=dask.config.collect(), default=None)  # files and DASK_*, not defaults
    if chosen is None and dask.config.get(key) == "spawn":
        dask.config.set({key: "forkserver"})
    if dask.config.get(key) != "forkserver":
        return
    context = get_mp_context()  # sets Dask's own list once; ours replaces it (it holds "distributed")
    _SERVER_PRELOAD.extend(m for m in preload if m not in _SERVER_PRELOAD)
    context.set_forkserver_preload(list(_SERVER_PRELOAD))


def _local_cluster(
    n_slots: int, dashboard: str | None, secure: bool, resources: dict, preload: Sequence[str]
) -> LocalCluster:
    from distributed.security import Security

    return LocalCluster(
        n_workers=n_slots,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=dashboard,
        resources=resources,
        silence_logs=logging.WARNING,
        security=Security.temporary() if secure else None,
        # Ctrl-C is the controller's to handle: workers ignore SIGINT
        preload=["flowactors._local_preload", *(m for m in preload if m != "flowactors._local_preload")],
        # without a dashboard the scheduler still serves /health on an HTTP port: a free one, not 8787
        scheduler_kwargs=None if dashboard else {"dashboard_address": "127.0.0.1:0"},
        env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )


def resize_pool(cluster: Any, resource: str, n: int, preload: Sequence[str] = ()) -> None:
    """Start or stop workers of `cluster` (a SpecCluster: LocalCluster, a dask-jobqueue cluster) that carry
    `resource` and no slot, until about `n` of them are asked for: an elastic pool beside the slots (a jobqueue job
    brings its `processes` workers at once, so jobs are rounded up). The cluster's template for new workers
    becomes a pool worker's, so its own `scale` and `adapt` grow and shrink the pool (they stop the newest workers
    first, which are the pool's). `preload`: modules the pool's workers load before they register (Dask's
    `--preload`: what a joining worker would otherwise import in its first call)."""
    import copy
    import secrets

    if n < 0:
        raise ValueError(f"a pool has >= 0 workers, got {n}")
    spec = copy.deepcopy(cluster.new_spec)
    options = spec.setdefault("options", {})
    args = options.get("worker_extra_args")
    if args and "--resources" in args:  # a dask-jobqueue job: its workers' command line says what they carry
        args[args.index("--resources") + 1] = f"{resource}=1"
        for module in preload:
            if module not in args:
                args += ["--preload", module]
    else:
        options["resources"] = {resource: 1}
        options["preload"] = [*options.get("preload", []), *(m for m in preload if m not in options.get("preload", []))]
    cluster.new_spec = spec
    per_spec = int(options.get("processes") or 1)
    want = -(-n // per_spec)
    pool = pool_workers(cluster, resource)
    for name in pool[want:][::-1]:  # the newest first
        del cluster.worker_spec[name]
    for _ in range(want - len(pool)):  # a name never used: one that was retired may still be closing
        cluster.worker_spec[f"{resource}-{secrets.token_hex(4)}"] = copy.deepcopy(spec)
    if hasattr(cluster, "job_cls"):  # dask-jobqueue counts workers unless told jobs
        cluster.scale(jobs=len(cluster.worker_spec))
    else:
        cluster.scale(len(cluster.worker_spec))  # starts and stops workers to match the specs


def pool_workers(cluster: Any, resource: str) -> list[str]:
    """The names of `cluster`'s worker specs that carry `resource` (see `resize_pool`)."""

    def carries(options: dict) -> bool:
        args = options.get("worker_extra_args") or []
        if "--resources" in args:
            return any(r.split("=")[0] == resource for r in args[args.index("--resources") + 1].split(","))
        return resource in (options.get("resources") or {})

    return [name for name, spec in cluster.worker_spec.items() if carries(spec.get("options", {}))]


def stop_workers(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Stop the embedded cluster's worker processes, giving each `timeout_s` to exit. LocalCluster's own close
    allows 4 s, after which the nanny kills the process and warns; a worker that holds torch and its models
    can need longer to exit on a loaded machine, and a killed process is not a clean end of a run. A call still
    running (a hung rank, a run stopped mid-step) is not waited for: the controller that issued it is closing."""
    import asyncio

    nannies = list(cluster.workers.values())

    async def stop_one(nanny: Any) -> None:
        process = getattr(nanny, "process", None)
        if process is not None:  # Dask's close waits for the task thread; the stop message can say not to
            nanny.close_gracefully(reason="flowactors-close")  # (the process's end is no crash to recover from)
            try:
                await process.kill(timeout=timeout_s, executor_wait=False, reason="flowactors-close")
            except Exception:
                pass
        await nanny.close(timeout=timeout_s)

    async def stop() -> None:
        await asyncio.gather(*(stop_one(n) for n in nannies), return_exceptions=True)

    try:
        cluster.sync(stop)
    except Exception:
        pass


def discover_slots(client: Client) -> list[str]:
    """The addresses of the workers that are device slots (resource `slot` or `GPU`), by host, then name."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    slots, bad = [], []
    for addr, w in workers.items():
        if not any(w.get("resources", {}).get(r) for r in SLOT_RESOURCES):
            continue
        if w.get("nthreads") != 1:
            bad.append(f"{addr} has {w.get('nthreads')} threads")
        slots.append((w.get("host", ""), str(w.get("name", "")), addr))
    if bad:
        raise PlacementError(
            "every device slot needs a worker process with exactly one thread "
            f"(calls to one process must run one at a time): {bad}; start workers with "
            f"`dask worker --nthreads 1 --resources slot=1`"
        )
    return [a for *_, a in sorted(slots, key=lambda s: (s[0], natural(s[1])))]


def probe_scheduler(address: str, timeout_s: float, security: Any = None) -> None:
    """Raise SchedulerUnreachableError unless a Dask scheduler answers an identity request at `address` in time
    (over TLS with `security`'s client credentials for a tls:// address)."""
    import asyncio
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from distributed.comm import connect
    from distributed.comm.addressing import get_address_host_port, parse_address

    start = "start one with `dask scheduler` and workers with `dask worker ADDRESS --nthreads 1 --resources slot=1`"
    try:
        scheme, _ = parse_address(address)
        host, port = get_address_host_port(address)
    except ValueError as e:
        raise SchedulerUnreachableError(
            f"{address!r} is not a Dask scheduler address ({e}); use tcp://HOST:PORT, e.g. tcp://127.0.0.1:8786"
        ) from None
    if scheme in ("tcp", "tls"):  # a refused port fails here at once; Dask would retry it until its timeout
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as e:
            raise SchedulerUnreachableError(
                f"cannot reach a Dask scheduler at {address}: {e.strerror or e}; {start}"
            ) from None

    async def identity() -> dict:
        args = security.get_connection_args("client") if security is not None and scheme == "tls" else {}
        comm = await connect(address, timeout=timeout_s, **args)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        with ThreadPoolExecutor(1) as pool:  # its own event loop, also when the caller runs one (notebooks)
            info = pool.submit(asyncio.run, asyncio.wait_for(identity(), timeout_s)).result()
    except (OSError, asyncio.TimeoutError, TimeoutError) as e:
        raise SchedulerUnreachableError(
            f"{address} accepts connections but did not answer as a Dask scheduler "
            f"within {timeout_s:g} s ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
            f"; check the port (the scheduler's, 8786 by default, not its dashboard's) "
            f"or {start}"
        ) from None
    if not isinstance(info, dict) or info.get("type") != "Scheduler":
        kind = info.get("type") if isinstance(info, dict) else type(info).__name__
        raise SchedulerUnreachableError(f"{address} is a Dask {kind}, not a scheduler; give the scheduler's address")


def check_interval(ms: float | None) -> float | None:
    if ms is not None and not (isinstance(ms, (int, float)) and ms >= 0):
        raise ValueError(
            f"stream_interval_ms must be a number >= 0 (milliseconds), or None for Dask's own intervals; got {ms!r}"
        )
    return ms


def shorten_streams(client: Client, interval_s: float) -> None:
    """Shorter stream batching (flowactors._streams); a scheduler that cannot take the plugins (flowactors not
    importable there) keeps Dask's intervals, with a warning: calls are slower, not wrong."""
    from flowactors._streams import shorten

    try:
        shorten(client, interval_s)
    except Exception as e:
        import structlog

        structlog.get_logger("flowactors.controller").warning(
            "stream_interval_not_set",
            error=f"{type(e).__name__}: {e}",
            hint="install flowactors on the scheduler and workers, or pass stream_interval_ms=None",
        )


def natural(name: str) -> tuple:
    return (0, int(name)) if name.isdigit() else (1, name)
