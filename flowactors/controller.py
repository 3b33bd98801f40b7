"""The single controller: a Dask client, its device slots, and the rules that make pinned work behave like actor calls.

docs/design.md §3. What this module owns, and where the rest lives:

- **Calls.** `CallFuture` is a group call's future; the controller issues every call through one `Transport`
  (`flowactors.transport`), chosen when it opens: direct calls straight to the workers with the embedded cluster
  (`direct_calls`, `flowactors.transport.channel`), else one pinned Dask task per rank (`flowactors.transport.tasks`), with small
  results pushed back (`push_results`, `flowactors.transport.pushed`). Whichever it is, calls to one worker process run in
  the order the controller issued them (docs/design.md §3 Ordering): submission holds the controller's lock.
- **Cluster.** `Controller.local()` (an embedded LocalCluster) and `Controller.connect(address)` (a running
  scheduler) start or join the cluster through `flowactors.cluster`; Slurm through `flowactors.slurm`.
- **Failures.** Dask never fails a task pinned to a worker that died; it waits for a worker of that address
  forever. The controller subscribes to the scheduler's `remove-worker` events, has its transport fail every
  future that needs the dead process, and `CallFuture.result()` turns that into a `WorkerLostError` naming role
  and rank; `recover()` then forgets the groups and takes the live slots.
- **Watchdog.** `call_timeout_s` bounds every wait for workers (calls, forming the world, building a group); past
  it a `HangError` reports where every unfinished rank is, with its Python stack (`flowactors.watchdog`).
- **World.** One torch.distributed world spans the controller's slots (NCCL on GPU, gloo on CPU, with a
  timeout); groups are subgroups of it, so colocated groups share processes without sharing a process group.
  Its rendezvous store and gloo listen only on the address the workers use (see `_runtime.init_world`), and
  `close()` destroys it on every rank, so a long-lived cluster keeps no listener of a finished run.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future, LocalCluster
from distributed.client import FutureCancelledError, FuturesCancelledError

from flowactors import _leaving, _runtime, watchdog
from flowactors import cluster as _cluster
from flowactors.errors import PlacementError, RemoteError, WorkerLostError
from flowactors.futures import CallFuture, new_token, unwrap
from flowactors.profiling import ComputeProfile, controller_share
from flowactors.protocols import ONE_TO_ALL, Layout
from flowactors.transport import CallTimeout, ResultRecomputed, Transport, WorkerGone
from flowactors.transport.fanout import Fanout

__all__ = ["Controller", "CallFuture", "LEAVE_GRACE_S", "open_transport"]

LEAVE_GRACE_S = 30.0
"""How long a pool worker told to stop (SIGTERM) waits to be retired before it ends (Slurm's default KillWait, the
time between a job's SIGTERM and its SIGKILL, is 30 s)."""


class Controller:
    """A Dask client, its device slots, and the torch.distributed world over them. Use as a context manager."""

    def __init__(
        self,
        client: Client,
        cluster: LocalCluster | None = None,
        *,
        collective_timeout_s: float = 600.0,
        call_timeout_s: float | None = None,
        stream_interval_ms: float | None = 1.0,
        push_results: bool | None = None,
        direct_calls: bool | None = None,
    ) -> None:
        """`stream_interval_ms`: the batching interval of the Dask streams between client, scheduler and workers
        (flowactors._streams; None keeps Dask's 2-10 ms, which most call hops then pay). `push_results`: ranks
        send small outputs straight to the controller (flowactors.transport.pushed); None: only with the embedded cluster.
        `direct_calls`: calls go from the controller straight to the workers, not through the scheduler
        (flowactors.transport.channel); None: only with the embedded cluster."""
        self.client = client
        self.cluster = cluster
        self.collective_timeout_s = collective_timeout_s
        self.call_timeout_s = call_timeout_s  # watchdog of result()/wait(): past it, a HangError with stacks
        self.step: int | None = None
        self.groups: dict[str, Any] = {}
        self._lock = threading.Lock()  # the issue order, and the failure bookkeeping below
        self._calls: weakref.WeakSet[CallFuture] = weakref.WeakSet()  # issued and alive (failures, recovery)
        self._hosted: dict[str, list[tuple[str, int]]] = {}
        self._lost: dict[str, list[tuple[str, int]]] = {}
        self._forgotten: dict[str, list[tuple[str, int]]] = {}  # lost pool workers written off (`forget_lost`)
        self._retired: set[str] = set()  # pool workers `retire_worker` closed (once removed: written off too)
        self._world: list[str] | None = None
        self._backend: str | None = None
        self.slots: list[str] = _cluster.discover_slots(client)
        client.subscribe_topic("all", self._on_event)
        self._leaving: set[str] = set()  # pool workers that announced a SIGTERM
        client.subscribe_topic(_leaving.TOPIC, self._on_leaving)
        # a pool worker announces a SIGTERM and waits to be retired, from its registration on (every pool worker)
        client.register_plugin(_leaving.LeaveHandler(LEAVE_GRACE_S, _cluster.SLOT_RESOURCES))
        # and its nanny, if it has one, does not close it at that SIGTERM (Slurm signals every process of a job)
        client.register_plugin(_leaving.NannyLeaveHandler(_cluster.SLOT_RESOURCES))
        if _cluster.check_interval(stream_interval_ms) is not None:
            _cluster.shorten_streams(client, stream_interval_ms / 1000)
        self.transport: Transport = open_transport(
            client, isinstance(cluster, LocalCluster), direct_calls, push_results
        )

    # -- opening and closing --------------------------------------------------------------------------------
    @classmethod
    def local(
        cls,
        n_slots: int = 2,
        *,
        dashboard: str | None = "127.0.0.1:8787",
        secure: bool = True,
        preload: Sequence[str] = (),
        **kwargs: Any,
    ) -> "Controller":
        """An embedded LocalCluster of `n_slots` single-threaded worker processes on 127.0.0.1.

        `dashboard=None` turns the dashboard off (tests); exposing it beyond 127.0.0.1 is an explicit choice.
        `secure`: its listeners serve only this run (TLS with credentials made for it; flowactors.cluster).
        `preload`: modules every worker has imported when it starts (the model code's: imported once, in the
        process the workers fork from; `flowactors.cluster.fork_from_server`).
        """
        cluster = _cluster.start_local(
            n_slots, dashboard, kwargs.get("stream_interval_ms"), secure=secure, preload=preload
        )
        return cls(Client(cluster, set_as_default=False), cluster, **kwargs)

    @classmethod
    def connect(
        cls, address: str, *, connect_timeout_s: float = 4.0, security: Any = None, **kwargs: Any
    ) -> "Controller":
        """Join an existing scheduler (`dask worker --nthreads 1 --resources slot=1` or `GPU=1` per device).

        `security`: the cluster's `distributed.security.Security` (None: Dask's configuration, `distributed.comm.tls`,
        as `dask scheduler --tls-*` clusters are joined). The address is probed first: Dask's client retries a
        refused connection for its whole timeout and waits forever on a port that accepts TCP but is not a
        scheduler (an HTTP server, say), so a wrong address would otherwise hang or take half a minute to fail."""
        from distributed.security import Security

        security = security if security is not None else Security()
        _cluster.check_interval(kwargs.get("stream_interval_ms"))
        _cluster.probe_scheduler(address, connect_timeout_s, security)
        return cls(Client(address, set_as_default=False, security=security), None, **kwargs)

    def close(self) -> None:
        """Close groups (without waiting on busy workers), the client, and the embedded cluster if any."""
        try:
            busy = self._busy(self._world or ())  # (before the groups' own closing calls)
        except Exception:  # (closing whatever state it is in)
            busy = set()
        for group in list(self.groups.values()):
            group.close(wait=False)
        self._teardown_world(busy)
        self.transport.close()
        if self.cluster is None:  # a cluster it joined outlives it: its pool workers die of SIGTERM again
            for name, nanny in ((_leaving.LeaveHandler.name, False), (_leaving.NannyLeaveHandler.name, True)):
                try:
                    self.client.unregister_worker_plugin(name, nanny=nanny)
                except Exception:
                    pass
        for topic in ("all", _leaving.TOPIC):
            try:
                self.client.unsubscribe_topic(topic)
            except Exception:
                pass
        self.client.close()
        if isinstance(self.cluster, LocalCluster):
            _cluster.stop_workers(self.cluster)
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def dashboard_link(self) -> str | None:
        """Address of the Dask dashboard (task stream, graph), or None when it is off."""
        try:
            if "dashboard" not in self.client.scheduler_info(n_workers=0).get("services", {}):
                return None
            return self.client.dashboard_link
        except Exception:
            return None

    # -- the call path --------------------------------------------------------------------------------------
    @property
    def direct_calls(self) -> bool:
        """Whether pinned work goes straight to the workers (flowactors.transport.channel) instead of through the scheduler."""
        return self.transport.direct

    @property
    def pushes_results(self) -> bool:
        """Whether group calls' ranks push their outputs to this controller (flowactors.transport.pushed)."""
        return self.transport.pushes_results

    @property
    def _inbox(self) -> Any:
        """The inbox of pushed results (flowactors.transport.pushed.ResultInbox), None on the other transports."""
        return getattr(self.transport, "inbox", None)

    def push_target(self, key: str) -> dict[str, Any]:
        """The task keywords that have a rank push its output for `key` to this controller (none without an
        inbox)."""
        return self.transport.task_kwargs(key)

    def submit_pinned(self, address: str, fn: Any, *args: Any, key: str, **kwargs: Any) -> Any:
        """Run `fn` on `address` after every task pinned there before it (docs/design.md §3, Ordering)."""
        return self.submit_pinned_all([(address, fn, args, kwargs, key)])[0]

    def submit_pinned_all(self, tasks: Sequence[tuple[str, Any, tuple, dict, str]]) -> list[Any]:
        """Several (address, fn, args, kwargs, key) tasks, e.g. every rank of one call, each run on its address
        after every task issued there before it; they share one place in the issue order, and the Dask transports
        send them to the scheduler in one graph update (`flowactors.transport.tasks`). One future per task (a Dask future,
        or a direct one)."""
        with self._lock:
            for address, *_, key in tasks:
                if address in self._lost:
                    raise WorkerLostError(address, self._lost[address], call=key.rsplit("-", 1)[0])
            return self.transport.submit(tasks, self.step)

    def submit_fanout(self, call: Fanout) -> list[Any]:
        """Every rank of `call` (`flowactors.transport.fanout`), each run on its worker after every task issued
        there before it, as `submit_pinned_all` does for per-rank items; the transport decides how it travels (the
        direct path: down a tree, serialized once). One future per rank."""
        with self._lock:
            for r in call.ranks:
                if r.address in self._lost:
                    raise WorkerLostError(r.address, self._lost[r.address], call=r.key.rsplit("-", 1)[0])
            return self.transport.submit_fanout(call, self.step)

    def _track(self, call: CallFuture) -> CallFuture:
        self._calls.add(call)  # one entry per call: a failure (rare) finds a worker's calls by their addresses
        self.transport.track(call)
        return call

    def apply(self, fn: Any, *args: Any, name: str | None = None, **kwargs: Any) -> CallFuture:
        """Run a pure function on call results where the data is (any worker), e.g. joining batches or
        computing advantages; futures in the arguments are resolved there, never on the controller."""
        label = name or getattr(fn, "__name__", "apply")
        args = tuple(unwrap(a) for a in args)
        kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        site = self.transport.apply_site(args, kwargs, [a for a in self.slots if a not in self._lost] or self.slots)
        fut = self.submit_pinned_all([(site, _runtime.apply, (fn, args, kwargs), {}, f"{label}-{new_token()}")])[0]
        return self._track(
            CallFuture(self, [fut], _runtime.SINGLE, Layout(), label, "apply", (site,) if isinstance(site, str) else ())
        )

    def scatter_to(self, items: Sequence[tuple[str, Any]]) -> list[Future]:
        """Send each value straight to its worker (not through the scheduler), all at once; one future each."""
        from flowactors.transport.tasks import scatter_to

        return scatter_to(self.client, items)

    # -- waiting --------------------------------------------------------------------------------------------
    def wait(self, calls: Sequence[CallFuture], timeout: float | None = None) -> None:
        """Block until `calls` finished (successfully or not) without fetching their values.

        Past `timeout` (default: the watchdog `call_timeout_s`; None waits forever) raise a `HangError` that
        reports, for every rank of every unfinished call, what its worker is executing and where."""
        self.resolve(calls, self.call_timeout_s if timeout is None else timeout, values=False)

    def gather(self, futures: Sequence[Any], timeout: float | None = None) -> list:
        """The values of per-rank futures as `submit_pinned_all` returns them."""
        where = [getattr(f, "address", None) for f in futures]  # direct futures know their worker, Dask's do not
        call = CallFuture(
            self, futures, ONE_TO_ALL, Layout(dp=len(futures)), "runtime", "gather", where if all(where) else ()
        )
        return self.resolve([call], timeout)[0]

    def resolve(self, calls: Sequence[CallFuture], timeout: float | None, values: bool = True) -> list[list]:
        """Each call's per-rank outputs (when `values`) once all finished, as the transport gives them, with its
        failures in the controller's terms: past `timeout` a `HangError` with every unfinished rank's stack, a
        dead worker a `WorkerLostError` naming what it hosted."""
        try:
            return self.transport.resolve(calls, timeout, values)
        except CallTimeout as e:
            raise watchdog.hang_error(calls, timeout, self.hang_report) from e.__cause__
        except WorkerGone as e:
            with self._lock:
                if e.address in self.slots or e.address in self._hosted:  # not one written off (`forget_lost`)
                    self._lost.setdefault(e.address, self._hosted.get(e.address, []))
            hosted = self._lost.get(e.address) or self._forgotten.get(e.address, [])
            raise self._lost_at(e.address, hosted, e.label) from e.__cause__
        except (FutureCancelledError, FuturesCancelledError) as e:
            for c in calls:
                lost = self._lost_error(c.addresses, c.label)
                if lost is not None:
                    raise lost from e
            raise
        except RemoteError as e:  # a runtime function's, e.g. one that read an output of the dead worker
            lost = self.lost_input_error(e, calls[0].label if calls else "call")
            if lost is not None:
                raise lost from e
            raise
        except ResultRecomputed as e:  # (the Dask path) a result of a dead worker, recomputed: lost at that worker
            lost = self._recomputed_error(calls)
            if lost is not None:
                raise lost from e
            raise

    def hang_report(self, calls: Sequence[CallFuture]) -> str:
        """What every rank of `calls` is doing: its task's stack if running, else what its worker runs instead
        (see `flowactors.watchdog`)."""
        return watchdog.hang_report(self.client, self.transport, calls)

    # -- observing ------------------------------------------------------------------------------------------
    def call_records(self, start: float, stop: float) -> list[dict]:
        """What the workers ran on the direct call path between `start` and `stop` (`distributed.metrics.time`),
        shaped like Dask's task-stream records (those calls are not tasks, so the task stream misses them); [] when
        calls go through the scheduler."""
        return self.transport.records(start, stop)

    def profile(self) -> contextlib.AbstractContextManager[ComputeProfile]:
        """`with ctl.profile() as p: ...` measures the block: `p.controller_share` is the fraction of its wall
        time in which no worker computed anything (see `flowactors.profiling`)."""
        return controller_share(self.client, extra=self.transport.spans)

    def report_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Publish a step's metrics to the scheduler (topic "flowactors.metrics"), where dashboards read them."""
        self.client.log_event("flowactors.metrics", {"step": step, **metrics})

    # -- failures -------------------------------------------------------------------------------------------
    async def _on_event(self, event: tuple[float, dict]) -> None:
        msg = event[1] if isinstance(event, tuple) else event
        if not isinstance(msg, dict) or msg.get("action") != "remove-worker":
            return
        address = msg.get("worker")
        if address not in self.slots and address not in self._hosted:  # a slot, or a pool worker with a group
            return
        with self._lock:
            self._leaving.discard(address)
            if address in self._retired:  # its owner took back what it held: written off, not lost
                self._write_off(address)
            else:
                self._lost[address] = self._hosted.get(address, [])
            futures = [f for c in list(self._calls) if address in c.addresses for f in c.futures]
        await self.transport.worker_lost(address, futures)

    def _on_leaving(self, event: tuple[float, dict]) -> None:
        msg = event[1] if isinstance(event, tuple) else event
        address = msg.get("worker") if isinstance(msg, dict) else None
        if address is not None:
            with self._lock:  # (the client's event thread; `leaving` reads it on the caller's)
                if address not in self._lost and address not in self._retired:  # (a retired one is told to stop)
                    self._leaving.add(address)

    @property
    def leaving(self) -> list[str]:
        """Pool workers hosting groups that were told to stop (SIGTERM) and wait, for a grace period
        (`LEAVE_GRACE_S`), to be retired: their owner takes back what they hold, then `retire_worker`."""
        with self._lock:
            return [a for a in self._leaving if a not in self._lost and a not in self._retired]

    def lost_input_error(self, error: RemoteError, label: str, grace_s: float = 10.0) -> WorkerLostError | None:
        """A call that failed because an input could not be fetched from a worker that died (the direct path's
        `InputLost`, possibly a few calls down the chain) failed for that death: its WorkerLostError, once the
        scheduler has reported it (within `grace_s`), so the program recovers as from any lost worker."""
        import re

        found = re.findall(r"InputLost: input \S+ from (\S+) could not be fetched", str(error))
        if not found:
            return None
        gone = [a for a in found if a in self._forgotten]
        if gone:  # a worker already written off: lost at it, at once (it is not reported again)
            return self._lost_at(gone[0], self._forgotten[gone[0]], label)
        deadline = time.monotonic() + grace_s
        while not any(a in self._lost for a in found):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return self._lost_error(found, label)

    def _recomputed_error(self, calls: Sequence[CallFuture], grace_s: float = 10.0) -> WorkerLostError | None:
        """The WorkerLostError of calls that met a recomputed result: at a call's own worker if it died, else at the
        worker whose death lost the result (the scheduler's report may come after the error: waited for within
        `grace_s`; else one written off already, the latest)."""
        addresses = [a for c in calls for a in c.addresses]
        deadline = time.monotonic() + grace_s
        while True:
            with self._lock:
                gone = {**self._forgotten, **self._lost}
                culprit = next((a for a in addresses if a in gone), None) or next(iter(self._lost), None)
                if culprit is None and time.monotonic() > deadline:
                    culprit = next(reversed(self._forgotten), None)
                if culprit is not None:
                    return self._lost_at(culprit, gone[culprit], calls[0].label if calls else "call")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _lost_error(self, addresses: Sequence[str], label: str) -> WorkerLostError | None:
        gone = {**self._forgotten, **self._lost}  # (a call naming a worker written off or retired: lost at it)
        lost = [a for a in addresses if a in gone] or list(self._lost)
        if not lost:
            return None
        return self._lost_at(lost[0], [h for a in lost for h in gone[a]], label)

    def _lost_at(self, address: str, hosted: list[tuple[str, int]], label: str) -> WorkerLostError:
        """The error of a call lost at `address`: a worker that died, or one its owner retired."""
        return WorkerLostError(address, hosted, call=label, retired=address in self._retired)

    @property
    def lost_workers(self) -> list[str]:
        return list(self._lost)

    def forget_lost(self, address: str) -> None:
        """A lost pool worker (not a slot) whose groups their owner has written off (an elastic fleet's replica):
        the controller stops counting it as lost, so the calls that need no slot of it go on without `recover`; a
        call whose input was on it still fails as lost at it, at once."""
        if address in self.slots:
            raise PlacementError(f"{address} is a slot of the controller's world: a lost slot needs recover()")
        with self._lock:
            self._write_off(address)

    def _write_off(self, address: str) -> None:
        """(Holding `_lock`.) `address` no longer counts as lost or hosting; what it hosted is kept for the errors of
        calls that still name it."""
        self._forgotten[address] = self._lost.pop(address, self._hosted.get(address, []))
        self._hosted.pop(address, None)

    def resize_pool(self, resource: str, n: int, preload: Sequence[str] = ()) -> None:
        """Ask the cluster this controller started or was given (a SpecCluster: the embedded one, dask-jobqueue's)
        for `n` workers carrying `resource` (loading the `preload` modules before they register); they arrive (or
        go) while the run goes on (`workers_with`)."""
        if self.cluster is None or not hasattr(self.cluster, "worker_spec"):
            raise PlacementError(
                "this controller joined a cluster it cannot scale (--address): start pool workers there, e.g. "
                f"`dask worker --nthreads 1 --resources {resource}=1 ADDRESS`"
            )
        _cluster.resize_pool(self.cluster, resource, n, preload)

    def retire_worker(self, address: str) -> None:
        """Close a pool worker gracefully (after its owner took back what it held): a cluster this controller
        scales forgets its spec, so it is not restarted; on a joined cluster the scheduler retires it. Once it is
        gone it is written off as `forget_lost` does, not counted as lost: its unfinished calls are cancelled and
        its finished results not kept (gathering one raises `WorkerLostError`)."""
        if address in self.slots:
            raise PlacementError(f"{address} is a slot of the controller's world; only pool workers are retired")
        with self._lock:
            self._retired.add(address)
        if self.cluster is not None and hasattr(self.cluster, "worker_spec"):
            name = self.client.scheduler_info(n_workers=-1)["workers"].get(address, {}).get("name")
            if name is not None and name in self.cluster.worker_spec:  # (not a worker that joined it by itself)
                # Dask's graceful retire first: no task goes there any more, and what only it holds is copied to
                # other workers, so nothing Dask tracks is lost with it (a lost result a future still names, Dask
                # recomputes, and with it the actor calls it came from: the Slurm fleet test's flake). The cluster's
                # scale-down alone would not: it hands the scheduler the worker's name where Dask wants an address.
                self.client.retire_workers([address], close_workers=False, remove=False)
                self.cluster.sync(self.cluster.scale_down, [name])
                return
        self.client.retire_workers([address], close_workers=True)

    def fetched_bytes(self, call: CallFuture) -> dict[str, int]:
        """The bytes `call`'s ranks fetched from other workers for their inputs, by the worker they came from
        (whether a call's data came from where it should: an elastic fleet's join, from a peer replica and not from
        the trainer)."""
        return self.transport.fetched_bytes(call)

    def workers_with(self, resource: str) -> list[str]:
        """Live workers that carry `resource` and are not slots: the members of an elastic pool, which Dask adds
        and removes while a run goes on (`dask worker --resources rollout=1`, `cluster.scale`, a jobqueue's
        `adapt`), in order of name."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        found = [
            (str(w.get("name", "")), a)
            for a, w in workers.items()
            if w.get("resources", {}).get(resource) and a not in self.slots and a not in self._lost
        ]
        return [a for _, a in sorted(found, key=lambda f: _cluster.natural(f[0]))]

    def recover(self, wait_s: float = 60.0, min_slots: int = 1) -> list[str]:
        """Forget every group and the torch.distributed world after a worker died, and take the live slots.

        Waits up to `wait_s` for as many slots as before (a nanny restarts a killed worker under a new address),
        then continues with the live ones if at least `min_slots` are there. Callers rebuild their groups (the
        world is re-formed on the first one) and restore state from a checkpoint.
        """
        want = len(self.slots)
        deadline = time.monotonic() + wait_s
        while True:
            live = [a for a in _cluster.discover_slots(self.client) if a not in self._lost]
            if len(live) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if len(live) < min_slots:
            raise PlacementError(
                f"only {len(live)} live slots after waiting {wait_s:.0f} s for lost workers to "
                f"come back; need at least {min_slots}"
            )
        with self._lock:
            stale = [f for c in list(self._calls) for f in c.futures]
            self._calls.clear()
            self._hosted.clear()
            self._lost.clear()
            self.groups.clear()
            self._world = None
            self.slots = live
        self.transport.reset(stale)
        return live

    # -- world ----------------------------------------------------------------------------------------------
    def _ensure_world(self, backend: str | None) -> None:
        if self._world is not None:
            want = backend or self._backend
            if want != self._backend:
                raise PlacementError(
                    f"the process-group backend of this controller is {self._backend!r}; a group "
                    f"cannot use {want!r} on the same worker processes. Use one backend for all "
                    f"groups, or a separate cluster"
                )
            return
        if self._lost:
            raise WorkerLostError(next(iter(self._lost)), [], call="init_world")
        world = list(self.slots)
        # CUDA is asked of a worker: the controller may run on a machine without GPUs (a Slurm login node)
        reserve = self.submit_pinned(world[0], _runtime.free_port, key=f"world.free_port-{new_token()}")
        host, port, cuda = self.await_setup("world", "free_port", [reserve], world[:1])[0]
        want = backend or ("nccl" if cuda else "gloo")
        token = new_token()
        futs = self.submit_pinned_all(
            [
                (
                    a,
                    _runtime.init_world,
                    (r, len(world), host, port, want, self.collective_timeout_s, r),
                    {},
                    f"world.init_world-{r}-{token}",
                )
                for r, a in enumerate(world)
            ]
        )
        self.await_setup("world", "init_world", futs, world)
        self._world, self._backend = world, want

    def link(self, name: str, groups: Sequence[Any], subgroups: Sequence[tuple[int, ...]] = ()) -> str:
        """Form a process group over the ranks of several groups (ActorGroups on distinct slots), once, for their
        methods to exchange tensors directly with collectives: the groups' ranks in order are the link's ranks,
        and `subgroups` (tuples of link ranks) are created with it. A member finds it with `flowactors.link(name)`
        inside a call. Returns `name`."""
        addresses = [a for g in groups for a in g.addresses]
        if len(set(addresses)) != len(addresses):
            raise PlacementError(f"link {name!r}: the linked groups share slots; link groups on distinct slots")
        if self._world is None:
            raise PlacementError(f"link {name!r}: create the groups before linking them")
        ranks = [self._world.index(a) for a in addresses]
        if ranks != sorted(ranks):  # torch.distributed numbers a group's members in the world's order
            raise PlacementError(
                f"link {name!r}: the linked groups' ranks must come in the order of the cluster's slots (a process "
                f"group numbers its members so), but {', '.join(g.name for g in groups)} are on world ranks "
                f"{ranks}; place the groups so that the first is on the earlier slots"
            )
        members, at = {}, 0
        for g in groups:
            members[g.name] = list(range(at, at + g.world_size))
            at += g.world_size
        token = new_token()
        futs = self.submit_pinned_all(
            [
                (
                    a,
                    _runtime.new_link,
                    (name, ranks, members, [tuple(s) for s in subgroups]),
                    {},
                    f"{name}.link-{r}-{token}",
                )
                for r, a in enumerate(self._world)
            ]
        )
        self.await_setup(name, "link", futs, self._world)
        return name

    def new_group_ranks(
        self,
        name: str,
        addresses: Sequence[str],
        layout: Layout,
        backend: str | None,
        subgroups: Sequence[tuple[int, ...]] = (),
    ) -> None:
        """Create the group's process group, and its `subgroups` (group ranks), on every world rank (all must take
        part, in the same order)."""
        self._ensure_world(backend)
        assert self._world is not None
        missing = [a for a in addresses if a not in self._world]
        if missing:
            raise PlacementError(
                f"slots {missing} joined after the torch.distributed world was formed; "
                f"recreate the controller to include them"
            )
        ranks = [self._world.index(a) for a in addresses]
        token = new_token()
        futs = self.submit_pinned_all(
            [
                (a, _runtime.new_group, (name, ranks, layout, list(subgroups)), {}, f"{name}.new_group-{r}-{token}")
                for r, a in enumerate(self._world)
            ]
        )
        self.await_setup(name, "new_group", futs, self._world)
        for rank, a in enumerate(addresses):
            self._hosted.setdefault(a, []).append((name, rank))

    def new_own_world(
        self, name: str, addresses: Sequence[str], layout: Layout, backend: str | None, subgroups: Sequence = ()
    ) -> None:
        """Form a torch.distributed world of the group's own over `addresses` (workers outside the controller's
        world, which is formed once and cannot take in a worker that joins later) and the group's process group
        and subgroups in it: the group's ranks are that world's ranks."""
        clash = [a for a in addresses if a in self.slots]
        if clash:
            raise PlacementError(
                f"group {name!r}: {clash} are slots of the controller's world, which a worker process cannot leave "
                f"for a world of a group's own; give such a group pool workers (Controller.workers_with)"
            )
        self.transport.connect(addresses)  # joined workers are dialled here, not under the issue lock
        if len(addresses) == 1:  # nothing to rendezvous with: one call (an elastic fleet's replicas)
            key = f"{name}.solo_world-{new_token()}"
            args = (name, layout, backend, self.collective_timeout_s, list(subgroups))
            self.await_setup(
                name,
                "solo_world",
                [self.submit_pinned(addresses[0], _runtime.solo_world, *args, key=key)],
                list(addresses),
            )
            self._hosted.setdefault(addresses[0], []).append((name, 0))
            return
        reserve = self.submit_pinned(addresses[0], _runtime.free_port, key=f"{name}.free_port-{new_token()}")
        host, port, cuda = self.await_setup(name, "free_port", [reserve], list(addresses[:1]))[0]
        want = backend or ("nccl" if cuda else "gloo")
        token, n = new_token(), len(addresses)
        args = (host, port, want, self.collective_timeout_s)
        futs = self.submit_pinned_all(
            [
                (a, _runtime.init_world, (r, n, *args, r), {}, f"{name}.init_world-{r}-{token}")
                for r, a in enumerate(addresses)
            ]
        )
        self.await_setup(name, "init_world", futs, addresses)
        futs = self.submit_pinned_all(
            [
                (
                    a,
                    _runtime.new_group,
                    (name, list(range(n)), layout, list(subgroups)),
                    {},
                    f"{name}.new_group-{r}-{token}",
                )
                for r, a in enumerate(addresses)
            ]
        )
        self.await_setup(name, "new_group", futs, addresses)
        for rank, a in enumerate(addresses):
            self._hosted.setdefault(a, []).append((name, rank))

    def await_setup(self, group: str, step: str, futures: Sequence[Any], addresses: Sequence[str]) -> list:
        """The per-rank results of the tasks that form the world or build a group (one per address), waited for
        like a call: under the watchdog (`call_timeout_s`; past it a `HangError` with every unfinished rank's
        stack, named `group.step`), a dead worker a `WorkerLostError`, and a rank that returned a failure a
        `RemoteError`. A rank stuck in a collective inside `__init__` would otherwise block the controller until
        the process group's own timeout, or forever on a rendezvous that never completes."""
        call = CallFuture(self, futures, ONE_TO_ALL, Layout(dp=len(futures)), group, step, addresses)
        return self._track(call).result()

    def forget_group(self, name: str) -> None:
        self.groups.pop(name, None)
        for hosted in self._hosted.values():
            hosted[:] = [h for h in hosted if h[0] != name]

    def _busy(self, addresses: Sequence[str]) -> set[str]:
        """Those of `addresses` running or holding a call not finished: the controller's live calls, and what the
        transport tracks (a direct controller knows every item, even of calls whose futures were dropped)."""
        with self._lock:
            calls = list(self._calls)
        busy = self.transport.busy(addresses)
        for call in calls:
            if not call.done():
                busy.update(a for a in call.addresses if a in addresses)
        return busy

    def _teardown_world(self, busy: set[str] = frozenset(), timeout_s: float = 10.0, busy_s: float = 1.0) -> None:
        """Destroy the torch.distributed world on every live rank (after the calls issued before): its threads
        and rank 0's rendezvous store would otherwise outlive the run, keeping an external cluster's workers
        listening, and an embedded cluster's worker processes alive until the nanny kills them. A rank in `busy`
        (a call of a run stopped mid-step, a hung collective) is waited for `busy_s` only: its teardown runs when
        its call ends, and an embedded cluster's worker is stopped without waiting for that call anyway."""
        if self._world is None:
            return
        token = new_token()
        ranks = [(r, a) for r, a in enumerate(self._world) if a not in self._lost]
        futs = self.submit_pinned_all(
            [(a, _runtime.teardown_world, (), {}, f"world.teardown-{r}-{token}") for r, a in ranks]
        )
        for held, timeout in ((False, timeout_s), (True, busy_s)):
            these = [f for f, (_, a) in zip(futs, ranks) if (a in busy) == held]
            with contextlib.suppress(Exception):  # (closing: a timeout, or a rank lost meanwhile)
                if these:
                    self.transport.settle(these, timeout)
            if held and these:
                with contextlib.suppress(Exception):
                    self.transport.detach([f for f in these if not f.done()])
        self._world = None


def open_transport(client: Any, embedded: bool, direct_calls: bool | None, push_results: bool | None) -> Transport:
    """The transport a controller uses: direct calls when asked, or by default with the embedded cluster
    (`embedded`) and with a joined cluster whose comms are plain TCP; else Dask tasks, with pushed results when
    asked or by default with the embedded cluster. The direct path authenticates each connection with a secret
    learned over the cluster's comms but does not encrypt: on a TLS cluster that would be a weaker door than the
    cluster's own, so a TLS cluster keeps the Dask path unless asked; on the embedded cluster (127.0.0.1) there is
    nothing to encrypt against."""
    plain = str(getattr(client.scheduler, "address", "")).startswith("tcp://")
    if direct_calls or (direct_calls is None and (embedded or plain)):
        from flowactors.transport.channel import DirectTransport

        return DirectTransport(client)
    if push_results or (push_results is None and embedded):
        from flowactors.transport.pushed import PushTransport

        return PushTransport(client)
    from flowactors.transport.tasks import DaskTransport

    return DaskTransport(client)
