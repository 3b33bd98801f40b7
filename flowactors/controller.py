"""The single controller: a Dask client plus the rules that make pinned tasks behave like actor calls.

docs/design.md §3. What this module owns, and why each piece exists:

- **Cluster.** `Controller.local()` starts an embedded `LocalCluster` of worker *processes* with one thread and
  one device slot each (resource `slot=1`, plus `GPU=1` where CUDA exists); `Controller.connect(address)` joins
  an existing scheduler whose workers were started the same way. Slots are ordered by host, then worker name.
- **Two call paths.** With the embedded cluster (and `direct_calls=True`) pinned work goes straight to the
  workers over one socket each, not through the scheduler (`flowactors._direct`: ~0.6 ms for a no-op call over
  2 ranks on the 2-core CI machine against ~5 ms as Dask tasks); `ctl.apply` then runs on the worker of its first
  input. Otherwise every call is one Dask task per rank, as below, which the task stream shows.
- **Ordering.** Dask runs tasks submitted close together in any order and prefers tasks whose inputs are local.
  Colocated groups then issue collectives in different orders on different ranks, and gloo silently returns
  wrong sums. So every task pinned to a worker process depends on the previous one pinned there and carries a
  decreasing priority (`submit_pinned_all`). All ranks' tasks of one call go to the scheduler in one graph
  update (`flowactors._submit`), not one `client.submit` per rank. On the direct path the order is that of the
  socket, written under the controller's lock.
- **Failures.** Dask never fails a task pinned to a worker that died; it waits for a worker of that address
  forever. The controller subscribes to the scheduler's `remove-worker` events and cancels every future that
  needs the dead process, and `CallFuture.result()` turns that into a `WorkerLostError` naming role and rank.
- **World.** One torch.distributed world spans the controller's slots (NCCL on GPU, gloo on CPU, with a
  timeout); groups are subgroups of it, so colocated groups share processes without sharing a process group.
  Its rendezvous store and gloo listen only on the address the workers use (see `_runtime.init_world`), and
  `close()` destroys it on every rank, so a long-lived cluster keeps no listener of a finished run.
- **Watchdog.** `call_timeout_s` bounds every wait for workers: calls, and equally the steps that form the world
  and build a group (`_await_setup`), since a rank stuck in a collective inside `__init__` hangs just like one
  in a method. Past it a `HangError` says where every unfinished rank is, with its Python stack.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future, LocalCluster
from distributed.client import FutureCancelledError, FuturesCancelledError

from flowactors import _runtime
from flowactors._direct import DirectChannel, DirectFuture
from flowactors._submit import PinnedTask, submit_pinned_tasks
from flowactors.errors import HangError, PlacementError, SchedulerUnreachableError, WorkerLostError
from flowactors.profiling import ComputeProfile, controller_share
from flowactors.protocols import ONE_TO_ALL, Layout, Protocol

__all__ = ["Controller", "CallFuture"]

_SLOT_RESOURCES = ("slot", "GPU")


class CallFuture:
    """The future of one group call: one Dask future per rank plus the protocol that joins their outputs.

    There is no separate collect task (it would add a scheduling hop to every call): `.result()` gathers the
    rank outputs and joins them on the controller, and a later call or `Controller.apply` that takes this future
    receives the rank outputs on its worker and joins them there, so the bytes never pass through the controller.
    A later call whose ranks take the same parts (`parts`, see `flowactors.group`) receives on each rank only the
    output of the rank that produced its part.
    """

    __slots__ = ("_controller", "futures", "protocol", "layout", "group", "method", "addresses", "pushed",
                 "__weakref__")

    def __init__(self, controller: "Controller", futures: Sequence[Future], protocol: Protocol, layout: Layout,
                 group: str, method: str, addresses: Sequence[str], pushed: bool = False) -> None:
        """`pushed`: the ranks also push their outputs to the controller's inbox (flowactors._push)."""
        self._controller, self.futures, self.pushed = controller, list(futures), pushed
        self.protocol, self.layout, self.group, self.method = protocol, layout, group, method
        self.addresses = tuple(addresses)

    @property
    def label(self) -> str:
        return f"{self.group}.{self.method}"

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> Any:
        """The joined output. Past `timeout` (default: the controller's watchdog, `call_timeout_s`) a
        `HangError` reports the stack of every rank of this call."""
        ctl = self._controller
        timeout = ctl.call_timeout_s if timeout is None else timeout
        if self.direct:
            outputs = ctl._direct_outputs([self], timeout)[0]
            return _runtime.collect(self.group, self.method, self.protocol, self.layout, *outputs)
        left = timeout
        if self.pushed and ctl._inbox is not None:
            start = time.monotonic()
            pushed = ctl._inbox.wait(self.futures, timeout)
            if pushed is not None:
                return _runtime.collect(self.group, self.method, self.protocol, self.layout, *pushed)
            if timeout is not None:  # the Dask path gets what is left of the watchdog
                left = max(0.0, timeout - (time.monotonic() - start))
        try:
            if timeout is not None:
                try:
                    ctl.wait([self], left)
                except HangError as e:
                    if e.timeout_s == timeout:
                        raise
                    raise HangError(e.call, timeout, e.report) from e.__cause__  # reported as a whole
            outputs = ctl.client.gather(self.futures)
        except (FutureCancelledError, FuturesCancelledError) as e:
            lost = self._controller._lost_error(self.addresses, self.label)
            if lost is not None:
                raise lost from e
            raise
        return _runtime.collect(self.group, self.method, self.protocol, self.layout, *outputs)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    @property
    def direct(self) -> bool:
        """Whether this call went on the direct path (flowactors._direct), not through the scheduler."""
        return bool(self.futures) and isinstance(self.futures[0], DirectFuture)

    @property
    def parts(self) -> list[list[int]] | None:
        """The ranks of each part of the output (Protocol.parts), or None when the protocol does not say."""
        return self.protocol.parts(self.layout) if self.protocol.parts is not None else None

    def _ref(self) -> tuple:
        """What travels in a task's arguments: Dask resolves the futures, the worker joins the outputs."""
        return (_runtime.CALL_REF, self.group, self.method, self.protocol, self.layout, list(self.futures))

    def _part_ref(self, part: int) -> tuple:
        """Part `part` of the output alone: its rank's output, and the outcome of the part's other ranks."""
        ranks = self.parts[part]  # type: ignore[index]
        return (_runtime.PART_REF, self.group, self.method, ranks, [self.futures[r] for r in ranks])

    def __repr__(self) -> str:
        return f"<CallFuture {self.label} {[f.status for f in self.futures]}>"


class Controller:
    """A Dask client, its device slots, and the torch.distributed world over them. Use as a context manager."""

    def __init__(self, client: Client, cluster: LocalCluster | None = None, *,
                 collective_timeout_s: float = 600.0, call_timeout_s: float | None = None,
                 stream_interval_ms: float | None = 1.0, push_results: bool | None = None,
                 direct_calls: bool | None = None) -> None:
        """`stream_interval_ms`: the batching interval of the Dask streams between client, scheduler and workers
        (flowactors._streams; None keeps Dask's 2-10 ms, which most call hops then pay). `push_results`: ranks
        send small outputs straight to the controller (flowactors._push); None: only with the embedded cluster.
        `direct_calls`: calls go from the controller straight to the workers, not through the scheduler
        (flowactors._direct); None: only with the embedded cluster."""
        self.client = client
        self.cluster = cluster
        self.collective_timeout_s = collective_timeout_s
        self.call_timeout_s = call_timeout_s  # watchdog of result()/wait(): past it, a HangError with stacks
        self.step: int | None = None
        self.groups: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._last: dict[str, Future] = {}
        self._calls: dict[str, weakref.WeakSet[CallFuture]] = {}
        self._hosted: dict[str, list[tuple[str, int]]] = {}
        self._lost: dict[str, list[tuple[str, int]]] = {}
        self._world: list[str] | None = None
        self._backend: str | None = None
        self.slots: list[str] = self._discover_slots()
        client.subscribe_topic("all", self._on_event)
        if _check_interval(stream_interval_ms) is not None:
            _shorten_streams(client, stream_interval_ms / 1000)
        self._direct: DirectChannel | None = None
        if direct_calls or (direct_calls is None and isinstance(cluster, LocalCluster)):
            self._direct = DirectChannel(client)
        self._inbox = None
        if self._direct is None and (push_results or (push_results is None and isinstance(cluster, LocalCluster))):
            from flowactors._push import ResultInbox

            self._inbox = ResultInbox(client, _client_host(client))

    # -- opening and closing --------------------------------------------------------------------------------
    @classmethod
    def local(cls, n_slots: int = 2, *, dashboard: str | None = "127.0.0.1:8787", **kwargs: Any) -> "Controller":
        """An embedded LocalCluster of `n_slots` single-threaded worker processes on 127.0.0.1.

        `dashboard=None` turns the dashboard off (tests); exposing it beyond 127.0.0.1 is an explicit choice.
        """
        import torch

        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        _check_interval(kwargs.get("stream_interval_ms"))  # before any process starts
        resources = {"slot": 1} | ({"GPU": 1} if torch.cuda.is_available() else {})
        cluster = LocalCluster(
            n_workers=n_slots, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=dashboard, resources=resources, silence_logs=logging.WARNING,
            # without a dashboard the scheduler still serves /health on an HTTP port: a free one, not 8787
            scheduler_kwargs=None if dashboard else {"dashboard_address": "127.0.0.1:0"},
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        return cls(Client(cluster, set_as_default=False), cluster, **kwargs)

    @classmethod
    def connect(cls, address: str, *, connect_timeout_s: float = 4.0, **kwargs: Any) -> "Controller":
        """Join an existing scheduler (`dask worker --nthreads 1 --resources slot=1` or `GPU=1` per device).

        The address is probed first: Dask's client retries a refused connection for its whole timeout and waits
        forever on a port that accepts TCP but is not a scheduler (an HTTP server, say), so a wrong address would
        otherwise hang or take half a minute to fail."""
        _check_interval(kwargs.get("stream_interval_ms"))
        _probe_scheduler(address, connect_timeout_s)
        return cls(Client(address, set_as_default=False), None, **kwargs)

    def close(self) -> None:
        """Close groups (without waiting on busy workers), the client, and the embedded cluster if any."""
        for group in list(self.groups.values()):
            group.close(wait=False)
        self._teardown_world()
        if self._direct is not None:
            self._direct.close()
        if self._inbox is not None:
            self._inbox.close()
        try:
            self.client.unsubscribe_topic("all")
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.client.close()
        if isinstance(self.cluster, LocalCluster):
            self._stop_workers()
        if self.cluster is not None:
            self.cluster.close()

    def _stop_workers(self, timeout_s: float = 30.0) -> None:
        """Stop the embedded cluster's worker processes, giving each `timeout_s` to exit. LocalCluster's own close
        allows 4 s, after which the nanny kills the process and warns; a worker that holds torch and its models
        can need longer to exit on a loaded machine, and a killed process is not a clean end of a run."""
        import asyncio

        nannies = list(self.cluster.workers.values())

        async def stop() -> None:
            await asyncio.gather(*(n.close(timeout=timeout_s) for n in nannies), return_exceptions=True)

        try:
            self.cluster.sync(stop)
        except Exception:  # noqa: BLE001 - the cluster's own close below still ends them
            pass

    def _teardown_world(self, timeout_s: float = 10.0) -> None:
        """Destroy the torch.distributed world on every live rank (after the calls issued before): its threads
        and rank 0's rendezvous store would otherwise outlive the run, keeping an external cluster's workers
        listening, and an embedded cluster's worker processes alive until the nanny kills them."""
        if self._world is None:
            return
        from distributed.client import _wait

        token = _token()
        futs = self.submit_pinned_all([(a, _runtime.teardown_world, (), {}, f"world.teardown-{r}-{token}")
                                       for r, a in enumerate(self._world) if a not in self._lost])
        try:  # this client's own wait: `distributed.wait` looks for a default client, and this one is not
            if self._direct is not None:
                self._direct.wait(futs, timeout_s)
            else:
                self.client.sync(_wait, futs, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - closing anyway; a hung rank is killed with its process
            pass
        self._world = None

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
        except Exception:  # noqa: BLE001 - no dashboard running
            return None

    def _discover_slots(self) -> list[str]:
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        slots, bad = [], []
        for addr, w in workers.items():
            if not any(w.get("resources", {}).get(r) for r in _SLOT_RESOURCES):
                continue
            if w.get("nthreads") != 1:
                bad.append(f"{addr} has {w.get('nthreads')} threads")
            slots.append((w.get("host", ""), str(w.get("name", "")), addr))
        if bad:
            raise PlacementError("every device slot needs a worker process with exactly one thread "
                                 f"(calls to one process must run one at a time): {bad}; start workers with "
                                 f"`dask worker --nthreads 1 --resources slot=1`")
        return [a for *_, a in sorted(slots, key=lambda s: (s[0], _natural(s[1])))]

    def wait(self, calls: Sequence[CallFuture], timeout: float | None = None) -> None:
        """Block until `calls` finished (successfully or not) without fetching their values.

        Past `timeout` (default: the watchdog `call_timeout_s`; None waits forever) raise a `HangError` that
        reports, for every rank of every unfinished call, what its worker is executing and where."""
        from distributed.client import _wait
        from distributed.utils import TimeoutError as DaskTimeoutError

        timeout = self.call_timeout_s if timeout is None else timeout
        direct = [c for c in calls if c.direct]
        if direct:
            self._direct_outputs(direct, timeout, values=False)
            calls = [c for c in calls if not c.direct]
        try:
            self.client.sync(_wait, [f for c in calls for f in c.futures], timeout=timeout)
        except (DaskTimeoutError, TimeoutError) as e:
            pending = [c for c in calls if not c.done()]
            label = ", ".join(sorted({c.label for c in pending})) or "calls"
            raise HangError(label, float(timeout or 0), self.hang_report(pending)) from e
        except (FutureCancelledError, FuturesCancelledError) as e:
            for c in calls:
                lost = self._lost_error(c.addresses, c.label)
                if lost is not None:
                    raise lost from e
            raise

    def _direct_outputs(self, calls: Sequence[CallFuture], timeout: float | None, values: bool = True) -> list:
        """Wait for direct calls (flowactors._direct) under the watchdog, as `wait` does for Dask futures: a
        `HangError` with every unfinished rank's stack past `timeout`, a `WorkerLostError` for a dead worker, the
        exception of a runtime function that raised; then each call's rank outputs (when `values`)."""
        assert self._direct is not None
        futures = [f for c in calls for f in c.futures]
        if not self._direct.wait(futures, timeout):
            pending = [c for c in calls if not c.done()]
            label = ", ".join(sorted({c.label for c in pending})) or "calls"
            raise HangError(label, float(timeout or 0), self.hang_report(pending))
        for c in calls:
            lost = next((f for f in c.futures if f.status == "lost"), None)
            if lost is not None:  # its connection broke: the worker is gone, whether or not the scheduler said so
                with self._lock:
                    self._lost.setdefault(lost.address, self._hosted.get(lost.address, []))
                self._direct.fail_address(lost.address, ConnectionError(f"worker {lost.address} died"))
                raise self._lost_error([lost.address], c.label) from lost.error
        if not values:
            return []
        for c in calls:
            failed = next((f for f in c.futures if f.status == "error"), None)
            if failed is not None:
                raise failed.error if isinstance(failed.error, BaseException) else RuntimeError(failed.error)
        return [self._direct.values(c.futures) for c in calls]

    def gather(self, futures: Sequence[Any], timeout: float | None = None) -> list:
        """The values of per-rank futures as `submit_pinned_all` returns them (direct or Dask)."""
        if futures and isinstance(futures[0], DirectFuture):
            call = CallFuture(self, futures, ONE_TO_ALL, Layout(dp=len(futures)), "runtime", "gather",
                              [f.address for f in futures])
            return self._direct_outputs([call], timeout)[0]
        return self.client.gather(list(futures))

    def call_records(self, start: float, stop: float) -> list[dict]:
        """What the workers ran on the direct call path between `start` and `stop` (`distributed.metrics.time`),
        shaped like Dask's task-stream records (those calls are not tasks, so the task stream misses them); [] when
        calls go through the scheduler."""
        return self._direct.records(start, stop) if self._direct is not None else []

    def profile(self) -> contextlib.AbstractContextManager[ComputeProfile]:
        """`with ctl.profile() as p: ...` measures the block: `p.controller_share` is the fraction of its wall
        time in which no worker computed anything (see `flowactors.profiling`)."""
        return controller_share(self.client, extra=self._direct.spans if self._direct is not None else None)

    def report_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Publish a step's metrics to the scheduler (topic "flowactors.metrics"), where dashboards read them."""
        self.client.log_event("flowactors.metrics", {"step": step, **metrics})

    def scatter_to(self, items: Sequence[tuple[str, Any]]) -> list[Future]:
        """Send each value straight to its worker (not through the scheduler), all at once; one future each."""
        import asyncio

        async def send() -> list[Future]:
            return list(await asyncio.gather(*(
                self.client.scatter(v, workers=[a], direct=True, hash=False, asynchronous=True) for a, v in items)))

        return self.client.sync(send) if items else []

    def apply(self, fn: Any, *args: Any, name: str | None = None, **kwargs: Any) -> CallFuture:
        """Run a pure function on call results where the data is (any worker), e.g. joining batches or
        computing advantages; futures in the arguments are resolved there, never on the controller."""
        label = name or getattr(fn, "__name__", "apply")
        args = tuple(_unwrap_one(a) for a in args)
        kwargs = {k: _unwrap_one(v) for k, v in kwargs.items()}
        if self._direct is not None:  # on the worker that produced the first input (else the least busy one)
            where = next((f.address for v in (*args, *kwargs.values()) for f in _direct_futures(v)), None) \
                or self._direct.least_busy([a for a in self.slots if a not in self._lost] or self.slots)
            fut = self.submit_pinned(where, _runtime.apply, fn, args, kwargs, key=f"{label}-{_token()}")
            return self._track(CallFuture(self, [fut], _runtime.SINGLE, Layout(), label, "apply", (where,)))
        with self._lock:
            seq = next(self._seq)
        fut = self.client.submit(_runtime.apply, fn, args, kwargs, key=f"{label}-{_token()}", pure=False,
                                 priority=-seq)
        return CallFuture(self, [fut], _runtime.SINGLE, Layout(), label, "apply", ())

    def hang_report(self, calls: Sequence[CallFuture]) -> str:
        """What every rank of `calls` is doing: its task's stack if running, else what its worker runs instead.

        A task that is not pinned (`Controller.apply`) is reported by its key with what the scheduler says of it:
        the worker it runs on (and its stack), or the inputs it still waits for, or that it waits for a worker."""
        stacks = self.client.call_stack()  # {worker: {key: [frames]}} of every executing task
        if self._direct is not None:
            for addr, running in self._direct.stacks().items():
                stacks.setdefault(addr, {}).update(running)
        running_on = {key: addr for addr, tasks in stacks.items() for key in tasks}
        free = [f.key for c in calls if not c.addresses for f in c.futures if not f.done() and f.key not in running_on]
        states = _scheduler_states(self.client, free) if free else {}
        lines = []
        for c in calls:
            for rank, f in enumerate(c.futures):
                if f.done():
                    continue
                if c.addresses and c.method != "apply":
                    addr = c.addresses[rank]
                    head = f"{c.group} rank {rank} on {addr}"
                elif c.addresses:  # a direct-path apply, pinned where its first input is
                    addr = c.addresses[0]
                    head = f"{c.label} task {f.key} on {addr}"
                else:
                    addr = running_on.get(f.key) or states.get(f.key, {}).get("worker")
                    head = f"{c.label} task {f.key} on {addr or 'no worker yet'}"
                running = stacks.get(addr, {}) if addr else {}
                if f.key in running:
                    where = f"running {c.label}"
                    frames = running[f.key]
                elif c.addresses:
                    others = ", ".join(str(k) for k in running) or "nothing"
                    where = f"waiting; its worker is running: {others}"
                    frames = next(iter(running.values()), [])
                else:
                    where = _describe_waiting(states.get(f.key), running)
                    frames = next(iter(running.values()), [])
                tail = "".join(frames[-6:]).rstrip() if frames else "    (no Python stack)"
                lines.append(f"- {head}: {where}\n{tail}")
        return "\n".join(lines) or "(no rank is still running)"

    # -- pinned, ordered submission -------------------------------------------------------------------------
    def submit_pinned(self, address: str, fn: Any, *args: Any, key: str, **kwargs: Any) -> Future:
        """Run `fn` on `address` after every task pinned there before it (docs/design.md §3, Ordering)."""
        return self.submit_pinned_all([(address, fn, args, kwargs, key)])[0]

    def submit_pinned_all(self, tasks: Sequence[tuple[str, Any, tuple, dict, str]]) -> list[Future]:
        """Several (address, fn, args, kwargs, key) tasks, e.g. every rank of one call, each run on its address
        after every task pinned there before it, sent to the scheduler in one graph update (`flowactors._submit`):
        one scheduler round of work per call instead of one per rank. They share one place in the issue order (a
        priority below every earlier call's); a task depends on the previous one issued to its worker."""
        with self._lock:
            for address, *_, key in tasks:
                if address in self._lost:
                    raise WorkerLostError(address, self._lost[address], call=key.rsplit("-", 1)[0])
            if self._direct is not None:
                futs = self._direct.submit(tasks, step=self.step)
                for f in futs:  # its stored output is dropped once nobody can ask for it
                    weakref.finalize(f, self._direct.release_one, f.key, f.address)
                return futs
            out: list[Future] = []
            batch: list[PinnedTask] = []
            seq = next(self._seq)
            for address, fn, args, kwargs, key in tasks:
                if any(t.address == address for t in batch):  # a second task for one worker orders after the first
                    out += self._send(batch)
                    batch, seq = [], next(self._seq)
                prev = self._last.get(address)
                if prev is not None and prev.status in ("error", "cancelled"):
                    prev = None
                batch.append(PinnedTask(address, fn, key, tuple(args), {**kwargs, "_after": prev}, priority=-seq))
            out += self._send(batch)
        return out

    def _send(self, batch: list[PinnedTask]) -> list[Future]:
        futures = submit_pinned_tasks(self.client, batch)
        for t, f in zip(batch, futures):
            self._last[t.address] = f
        return futures

    def _track(self, call: CallFuture) -> CallFuture:
        for a in call.addresses:
            self._calls.setdefault(a, weakref.WeakSet()).add(call)
        if call.pushed and self._inbox is not None:
            weakref.finalize(call, self._inbox.forget, [f.key for f in call.futures])
        return call

    @property
    def direct_calls(self) -> bool:
        """Whether pinned work goes straight to the workers (flowactors._direct) instead of through the scheduler."""
        return self._direct is not None

    @property
    def pushes_results(self) -> bool:
        """Whether group calls' ranks push their outputs to this controller's inbox (flowactors._push)."""
        return self._inbox is not None

    def push_target(self, key: str) -> dict[str, Any]:
        """The task keyword that has a rank push its output for `key` to this controller (none without an
        inbox)."""
        return {"push": (self._inbox.address, key)} if self.pushes_results else {}

    # -- failures -------------------------------------------------------------------------------------------
    async def _on_event(self, event: tuple[float, dict]) -> None:
        msg = event[1] if isinstance(event, tuple) else event
        if not isinstance(msg, dict) or msg.get("action") != "remove-worker":
            return
        address = msg.get("worker")
        if address not in self.slots:
            return
        with self._lock:
            self._lost[address] = self._hosted.get(address, [])
            futures = [f for c in self._calls.pop(address, ()) for f in c.futures]
            last = self._last.pop(address, None)
        if last is not None:
            futures.append(last)
        if self._direct is not None:
            self._direct.fail_address(address, ConnectionError(f"worker {address} died"))
        futures = [f for f in futures if not isinstance(f, DirectFuture)]
        if futures:
            await self.client.cancel(futures, asynchronous=True, reason="worker-lost",
                                     msg=f"worker {address} died")

    def _lost_error(self, addresses: Sequence[str], label: str) -> WorkerLostError | None:
        lost = [a for a in addresses if a in self._lost] or list(self._lost)
        if not lost:
            return None
        return WorkerLostError(lost[0], [h for a in lost for h in self._lost[a]], call=label)

    @property
    def lost_workers(self) -> list[str]:
        return list(self._lost)

    def recover(self, wait_s: float = 60.0, min_slots: int = 1) -> list[str]:
        """Forget every group and the torch.distributed world after a worker died, and take the live slots.

        Waits up to `wait_s` for as many slots as before (a nanny restarts a killed worker under a new address),
        then continues with the live ones if at least `min_slots` are there. Callers rebuild their groups (the
        world is re-formed on the first one) and restore state from a checkpoint.
        """
        import time

        want = len(self.slots)
        deadline = time.monotonic() + wait_s
        while True:
            live = [a for a in self._discover_slots() if a not in self._lost]
            if len(live) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if len(live) < min_slots:
            raise PlacementError(f"only {len(live)} live slots after waiting {wait_s:.0f} s for lost workers to "
                                 f"come back; need at least {min_slots}")
        with self._lock:
            stale = [f for calls in self._calls.values() for c in calls for f in c.futures] + list(self._last.values())
            self._calls.clear()
            self._last.clear()
            self._hosted.clear()
            self._lost.clear()
            self.groups.clear()
            self._world = None
            self.slots = live
        if self._direct is not None:
            for a in {f.address for f in stale if isinstance(f, DirectFuture)}:
                self._direct.fail_address(a, FutureCancelledError(a, "recovery", "the controller rebuilt its groups "
                                                                             "after a lost worker"), lost=False)
            self._direct.reset()
        stale = [f for f in stale if not isinstance(f, DirectFuture)]
        if stale:
            self.client.cancel(stale, reason="recovery", msg="the controller rebuilt its groups after a lost worker")
        return live

    # -- world ----------------------------------------------------------------------------------------------
    def _ensure_world(self, backend: str | None) -> None:
        if self._world is not None:
            want = backend or self._backend
            if want != self._backend:
                raise PlacementError(f"the process-group backend of this controller is {self._backend!r}; a group "
                                     f"cannot use {want!r} on the same worker processes. Use one backend for all "
                                     f"groups, or a separate cluster")
            return
        if self._lost:
            raise WorkerLostError(next(iter(self._lost)), [], call="init_world")
        world = list(self.slots)
        # CUDA is asked of a worker: the controller may run on a machine without GPUs (a Slurm login node)
        reserve = self.submit_pinned(world[0], _runtime.free_port, key=f"world.free_port-{_token()}")
        host, port, cuda = self._await_setup("world", "free_port", [reserve], world[:1])[0]
        want = backend or ("nccl" if cuda else "gloo")
        token = _token()
        futs = self.submit_pinned_all([(a, _runtime.init_world, (r, len(world), host, port, want,
                                                                  self.collective_timeout_s, r), {},
                                        f"world.init_world-{r}-{token}") for r, a in enumerate(world)])
        self._await_setup("world", "init_world", futs, world)
        self._world, self._backend = world, want

    def new_group_ranks(self, name: str, addresses: Sequence[str], layout: Layout, backend: str | None,
                        subgroups: Sequence[tuple[int, ...]] = ()) -> None:
        """Create the group's process group, and its `subgroups` (group ranks), on every world rank (all must take
        part, in the same order)."""
        self._ensure_world(backend)
        assert self._world is not None
        missing = [a for a in addresses if a not in self._world]
        if missing:
            raise PlacementError(f"slots {missing} joined after the torch.distributed world was formed; "
                                 f"recreate the controller to include them")
        ranks = [self._world.index(a) for a in addresses]
        token = _token()
        futs = self.submit_pinned_all([(a, _runtime.new_group, (name, ranks, layout, list(subgroups)), {},
                                        f"{name}.new_group-{r}-{token}") for r, a in enumerate(self._world)])
        self._await_setup(name, "new_group", futs, self._world)
        for rank, a in enumerate(addresses):
            self._hosted.setdefault(a, []).append((name, rank))

    def _await_setup(self, group: str, step: str, futures: Sequence[Future], addresses: Sequence[str]) -> list:
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


def _probe_scheduler(address: str, timeout_s: float) -> None:
    """Raise SchedulerUnreachableError unless a Dask scheduler answers an identity request at `address` in time."""
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
        raise SchedulerUnreachableError(f"{address!r} is not a Dask scheduler address ({e}); use tcp://HOST:PORT, "
                                        f"e.g. tcp://127.0.0.1:8786") from None
    if scheme in ("tcp", "tls"):  # a refused port fails here at once; Dask would retry it until its timeout
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as e:
            raise SchedulerUnreachableError(f"cannot reach a Dask scheduler at {address}: {e.strerror or e}; "
                                            f"{start}") from None

    async def identity() -> dict:
        comm = await connect(address, timeout=timeout_s)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        with ThreadPoolExecutor(1) as pool:  # its own event loop, also when the caller runs one (notebooks)
            info = pool.submit(asyncio.run, asyncio.wait_for(identity(), timeout_s)).result()
    except (OSError, asyncio.TimeoutError, TimeoutError) as e:
        raise SchedulerUnreachableError(f"{address} accepts connections but did not answer as a Dask scheduler "
                                        f"within {timeout_s:g} s ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
                                        f"; check the port (the scheduler's, 8786 by default, not its dashboard's) "
                                        f"or {start}") from None
    if not isinstance(info, dict) or info.get("type") != "Scheduler":
        kind = info.get("type") if isinstance(info, dict) else type(info).__name__
        raise SchedulerUnreachableError(f"{address} is a Dask {kind}, not a scheduler; give the scheduler's address")


def _task_states(keys: Sequence[str], dask_scheduler: Any = None) -> dict[str, dict]:
    """Run on the scheduler: the state of each task, the worker it is assigned to, and the inputs it waits for."""
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            out[key] = {"state": "forgotten", "worker": None, "waiting_on": []}
            continue
        worker = ts.processing_on.address if ts.processing_on is not None else None
        out[key] = {"state": ts.state, "worker": worker, "waiting_on": sorted(str(d.key) for d in ts.waiting_on or ())}
    return out


def _scheduler_states(client: Client, keys: Sequence[str]) -> dict[str, dict]:
    try:
        return client.run_on_scheduler(_task_states, list(keys))
    except Exception:  # noqa: BLE001 - a report without the scheduler's view is still a report
        return {}


def _describe_waiting(state: dict | None, running: dict) -> str:
    """Why an unpinned task is not running, from the scheduler's state of it (see `_task_states`)."""
    if state is None:
        return "not running on any worker (the scheduler could not be asked why)"
    if state["waiting_on"]:
        return f"waiting for its inputs: {', '.join(state['waiting_on'])}"
    if state["state"] == "processing":
        others = ", ".join(str(k) for k in running) or "nothing"
        return f"assigned to {state['worker']}, queued there; that worker is running: {others}"
    if state["state"] in ("queued", "no-worker"):
        return f"{state['state']}: waiting for a worker to run it"
    return f"not running (scheduler state: {state['state']})"


def _unwrap_one(v: Any) -> Any:
    """CallFutures (also inside a list or tuple) become their Dask futures, which Dask then resolves."""
    if isinstance(v, CallFuture):
        return v._ref()
    if isinstance(v, (list, tuple)) and any(isinstance(x, CallFuture) for x in v):
        return type(v)(_unwrap_one(x) for x in v)
    return v


def _direct_futures(v: Any) -> list[DirectFuture]:
    """The direct futures a (possibly nested) argument refers to."""
    if isinstance(v, DirectFuture):
        return [v]
    if isinstance(v, (list, tuple)):
        return [f for x in v for f in _direct_futures(x)]
    if isinstance(v, dict):
        return [f for x in v.values() for f in _direct_futures(x)]
    return []


def _token() -> str:
    return uuid.uuid4().hex[:16]


def _natural(name: str) -> tuple:
    return (0, int(name)) if name.isdigit() else (1, name)


def _check_interval(ms: float | None) -> float | None:
    if ms is not None and not (isinstance(ms, (int, float)) and ms >= 0):
        raise ValueError(f"stream_interval_ms must be a number >= 0 (milliseconds), or None for Dask's own "
                         f"intervals; got {ms!r}")
    return ms


def _shorten_streams(client: Client, interval_s: float) -> None:
    """Shorter stream batching (flowactors._streams); a scheduler that cannot take the plugins (flowactors not
    importable there) keeps Dask's intervals, with a warning: calls are slower, not wrong."""
    from flowactors._streams import shorten

    try:
        shorten(client, interval_s)
    except Exception as e:  # noqa: BLE001 - an optimisation; the runtime works without it
        import structlog

        structlog.get_logger("flowactors.controller").warning(
            "stream_interval_not_set", error=f"{type(e).__name__}: {e}",
            hint="install flowactors on the scheduler and workers, or pass stream_interval_ms=None")


def _client_host(client: Client) -> str:
    """The interface this client reaches its scheduler from (where workers can reach it back)."""
    from distributed.comm import get_address_host

    comm = getattr(client.scheduler_comm, "comm", None)
    local = getattr(comm, "local_address", None)
    return get_address_host(local) if local else "127.0.0.1"
