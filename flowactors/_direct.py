"""The direct call path: the controller sends pinned work straight to the workers, without the scheduler.

Why: a group call through Dask is a chain of messages (client → scheduler → worker → scheduler → client, then the
value), each with the scheduler's bookkeeping on the way; on the 2-core CI machine a no-op call over 2 ranks costs
~5 ms that way, ~10 times a Ray actor call. Sent as one request per rank over Dask's own comms (the connection pool
the client already has) it costs ~0.9 ms, and running the scheduler's bookkeeping for the same call next to it
(a Dask task per rank kept only for the record) brings it back to ~3 ms on 2 cores: so direct work is not a Dask
task at all. Measured in benchmarks/dispatch.py.

What calls keep promising, and how:

- **Issue order per process.** The controller numbers what it sends to each worker (`seq`, per controller
  session); the worker runs item n only after item n - 1, whatever order the requests arrive in, one at a time,
  in its single task thread (the executor Dask runs tasks in: torch state, the CUDA device, and anything else bound
  to that thread is shared with Dask-path work). An item fetches its inputs before its turn, so a transfer overlaps
  the previous item's compute.
- **Chaining.** An item's output stays in its worker's store under the item's key until the controller drops the
  future that names it (a `CallFuture` and every call that takes it as input). In a later item's arguments a
  `DirectFuture` travels as a `DirectRef` (key and worker); the worker replaces it by the value, from its own store
  or fetched from the producing worker (one request, worker to worker; never through the controller).
- **Values.** The reply to the request carries the output when it is small (`INLINE_BYTES`), else only that it is
  stored; `result()` then fetches it from the worker.
- **Failures.** A rank's failure is its returned `RankFailure`, as on the Dask path; an exception raised by a
  runtime function (forming the world, say) is sent back and raised by `result()`. A request to a dead worker
  fails; the controller also fails every pending item of a worker the scheduler removed (`fail_address`).
  `result()` waits under the controller's watchdog; the hang report asks each worker what its task thread runs
  (`stacks`).
- **Visibility.** Every worker reports the items it ran (key, inputs, previous item, compute span) to the
  scheduler's event log every `REPORT_S` on topic `flowactors.calls`; the `/flowactors` dashboard page draws them
  like tasks, and `Controller.profile` counts their spans. Dask's task stream does not show them: they are not
  tasks.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["CALLS_TOPIC", "DirectChannel", "DirectFuture", "DirectRef", "INLINE_BYTES"]

INLINE_BYTES = 64 * 1024
"""Outputs up to this size (flowactors._push.payload_bytes) come back in the reply; larger ones stay on the worker
until `result()` asks."""
CALLS_TOPIC = "flowactors.calls"
REPORT_S = 0.2
RELEASE_S = 0.5
PLUGIN_NAME = "flowactors-direct"


class DirectRef:
    """An output held by a worker's direct store, as it travels in arguments (a `DirectFuture` pickles to this)."""

    __slots__ = ("key", "address")

    def __init__(self, key: str, address: str) -> None:
        self.key, self.address = key, address

    def __reduce__(self) -> tuple:
        return (DirectRef, (self.key, self.address))

    def __repr__(self) -> str:
        return f"<DirectRef {self.key} on {self.address}>"


class DirectFuture:
    """One item sent on the direct path; the part of `distributed.Future`'s surface that `CallFuture` uses."""

    __slots__ = ("key", "address", "status", "value", "stored", "error", "_channel", "__weakref__")

    def __init__(self, channel: "DirectChannel", key: str, address: str) -> None:
        self._channel, self.key, self.address = channel, key, address
        self.status = "pending"  # then "finished", "error" (the function raised) or "lost" (its worker died)
        self.value: Any = None
        self.stored = False  # finished, the value left on the worker (too large for the reply)
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.status != "pending"

    def result(self, timeout: float | None = None) -> Any:
        """The item's output (raising what it raised, or a `ConnectionError` when its worker died); a
        `TimeoutError` past `timeout` seconds."""
        if not self._channel.wait([self], timeout):
            raise TimeoutError(f"{self.key} did not finish within {timeout} s")
        if self.status == "lost":
            raise ConnectionError(f"the worker {self.address} running {self.key} died") from self.error
        if self.status == "error":
            raise self.error if isinstance(self.error, BaseException) else RuntimeError(self.error)
        return self._channel.values([self])[0]

    def __reduce__(self) -> tuple:
        return (DirectRef, (self.key, self.address))

    def __repr__(self) -> str:
        return f"<DirectFuture {self.key} {self.status}>"


class DirectChannel:
    """The controller's end: sends items, keeps their futures, releases stored outputs nobody can ask for."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.session = uuid.uuid4().hex[:12]
        self._seq: dict[str, itertools.count] = {}
        self._cond = threading.Condition()
        self._pending: dict[str, weakref.WeakSet[DirectFuture]] = {}
        self._dropped: dict[str, list[str]] = {}
        self._flush_pending = False
        client.register_plugin(DirectPlugin(), name=PLUGIN_NAME)

    # -- sending ---------------------------------------------------------------------------------------------
    def submit(self, items: Sequence[tuple[str, Any, tuple, dict, str]], step: int | None = None
               ) -> list[DirectFuture]:
        """Send each (address, fn, args, kwargs, key) item to run on its address after everything sent there
        before. All are serialized first, so an argument that cannot travel raises at the call site and no item
        is sent (no rank enters a collective alone); arguments are held until their item is done, so the outputs
        they name stay stored until it has read them."""
        from distributed.protocol.serialize import Serialized, serialize

        payloads = [Serialized(*serialize((fn, args, kwargs), serializers=("dask", "pickle"), on_error="raise"))
                    for _, fn, args, kwargs, _ in items]
        out = []
        for (address, _, args, kwargs, key), payload in zip(items, payloads):
            fut = DirectFuture(self, key, address)
            with self._cond:
                seq = next(self._seq.setdefault(address, itertools.count()))
                self._pending.setdefault(address, weakref.WeakSet()).add(fut)
                release = self._dropped.pop(address, [])  # outputs to drop there: they ride along
            self._client.loop.add_callback(self._send, fut, seq, payload, step, release, (args, kwargs))
            out.append(fut)
        return out

    async def _send(self, fut: DirectFuture, seq: int, payload: Any, step: int | None, release: list[str],
                    keep: tuple) -> None:
        from distributed.comm.core import CommClosedError

        try:
            reply = await self._client.rpc(fut.address).flowactors_call(
                session=self.session, seq=seq, key=fut.key, task=payload, step=step, release=release)
        except (OSError, CommClosedError, asyncio.CancelledError) as e:
            self._finish(fut, "lost", error=e)
            return
        except Exception as e:  # noqa: BLE001 - e.g. the worker could not deserialize the item
            self._finish(fut, "error", error=e)
            return
        if reply.get("status") == "error":
            self._finish(fut, "error", error=reply.get("exception"))
        else:
            self._finish(fut, "finished", value=reply.get("value"), stored=bool(reply.get("stored")))

    def _finish(self, fut: DirectFuture, status: str, value: Any = None, stored: bool = False,
                error: BaseException | None = None) -> None:
        with self._cond:
            if fut.status != "pending":
                return
            fut.value, fut.stored, fut.error, fut.status = value, stored, error, status
            pending = self._pending.get(fut.address)
            if pending is not None:
                pending.discard(fut)
            self._cond.notify_all()

    # -- waiting and values ------------------------------------------------------------------------------------
    def wait(self, futures: Sequence[DirectFuture], timeout: float | None) -> bool:
        """Wait until every future is done, or one is lost (its worker died: the others may never finish);
        False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(f.done() for f in futures) and not any(f.status == "lost" for f in futures):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def values(self, futures: Sequence[DirectFuture]) -> list[Any]:
        """The outputs of finished futures, fetching stored ones from their workers (all at once)."""
        fetch = [f for f in futures if f.stored]
        if fetch:
            async def get() -> list[Any]:
                return list(await asyncio.gather(*(self._client.rpc(f.address).flowactors_get(key=f.key)
                                                   for f in fetch)))

            got = dict(zip((f.key for f in fetch), self._client.sync(get)))
            return [_unwrap_reply(got[f.key]) if f.stored else f.value for f in futures]
        return [f.value for f in futures]

    def least_busy(self, addresses: Sequence[str]) -> str:
        """The address with the fewest items sent and not yet done (the first among equals)."""
        with self._cond:
            return min(addresses, key=lambda a: len(self._pending.get(a, ())))

    def fail_address(self, address: str, error: BaseException) -> list[DirectFuture]:
        """Fail every pending item sent to `address` (its worker died); returns them."""
        with self._cond:
            futs = list(self._pending.pop(address, ()))
        for f in futs:
            self._finish(f, "lost", error=error)
        return futs

    def release_one(self, key: str, address: str) -> None:
        """Drop the stored output of `key` on `address` (its future is gone: nobody can refer to it any more).
        Called from finalizers in any thread; the drops of one moment go in one request per worker."""
        with self._cond:
            self._dropped.setdefault(address, []).append(key)
            if self._flush_pending:
                return
            self._flush_pending = True
        try:  # the next item sent to the worker takes them; a quiet worker gets them on their own shortly
            self._client.loop.add_callback(self._client.loop.call_later, RELEASE_S, self._release)
        except Exception:  # noqa: BLE001 - the loop is gone (interpreter exit): the workers went with it
            pass

    def _release(self) -> None:
        asyncio.ensure_future(self._release_now())

    async def _release_now(self) -> None:
        with self._cond:
            by_address, self._dropped, self._flush_pending = self._dropped, {}, False

        async def one(address: str, keys: list[str]) -> None:
            try:
                await self._client.rpc(address).flowactors_release(keys=keys)
            except Exception:  # noqa: BLE001 - a dead worker holds nothing any more
                pass

        await asyncio.gather(*(one(a, k) for a, k in by_address.items()))

    def reset(self) -> None:
        """A new session (after recovery): numbering starts again; items of the old one are not waited for."""
        with self._cond:
            self.session = uuid.uuid4().hex[:12]
            self._seq.clear()

    # -- reports ---------------------------------------------------------------------------------------------
    def stacks(self) -> dict[str, dict[str, list[str]]]:
        """{worker: {key: stack frames}} of the item each worker's task thread runs now (as `Client.call_stack`)."""
        try:
            return self._client.run(running_stack)
        except Exception:  # noqa: BLE001 - a report without them is still a report
            return {}

    def records(self, start: float, stop: float) -> list[dict]:
        """The items every worker ran that overlap [start, stop] (workers' clocks), shaped like Dask's task-stream
        records: {"key", "worker", "startstops": [{"action": "compute", "start", "stop"}]}."""
        try:
            found = self._client.run(spans_between, start, stop)
        except Exception:  # noqa: BLE001 - a profile without them undercounts; calls are unaffected
            return []
        return [{"key": k, "worker": w, "startstops": [{"action": "compute", "start": a, "stop": b}]}
                for w, spans in found.items() for k, a, b in spans]

    def spans(self, start: float, stop: float) -> list[tuple[float, float]]:
        """Compute spans of direct items on every worker that overlap [start, stop] (workers' clocks)."""
        return [(s["start"], s["stop"]) for r in self.records(start, stop) for s in r["startstops"]]


def _unwrap_reply(reply: Any) -> Any:
    """The value of a `flowactors_get` reply; raises `_InputRaised` for an item that raised, LookupError for
    one that was released."""
    if isinstance(reply, dict) and reply.get("status") == "raised":
        raise _InputRaised(reply.get("exception"))
    if isinstance(reply, dict) and reply.get("status") == "missing":
        raise LookupError(reply.get("message"))
    return reply.get("value") if isinstance(reply, dict) else reply


# ---- the worker's end ----------------------------------------------------------------------------------------------

_STORE: dict[str, Any] = {}
_READY: dict[str, asyncio.Event] = {}
_LANES: dict[str, "_Lane"] = {}
_SPANS: deque[tuple[str, float, float]] = deque(maxlen=20000)
_REPORTS: list[dict] = []
_RUNNING: dict[str, Any] = {}  # {"key": ..., "thread": ident} while the task thread runs an item


class _Lane:
    """One controller session's order on this worker."""

    def __init__(self) -> None:
        self.next = 0
        self.last: str | None = None
        self.turn = asyncio.Condition()


class DirectPlugin(WorkerPlugin):
    """Installs the direct path's handlers on every worker (present and joining later)."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        worker.handlers.update({
            "flowactors_call": lambda comm=None, **kw: _handle_call(worker, **kw),
            "flowactors_get": lambda comm=None, **kw: _handle_get(worker, **kw),
            "flowactors_release": lambda comm=None, **kw: _handle_release(**kw),
        })
        self._report = PeriodicCallback(lambda: _flush_reports(worker), REPORT_S * 1000)
        self._report.start()

    def teardown(self, worker: Any) -> None:
        report = getattr(self, "_report", None)
        if report is not None:
            report.stop()


def _ready(key: str) -> asyncio.Event:
    ev = _READY.get(key)
    if ev is None:
        ev = _READY[key] = asyncio.Event()
    return ev


async def _handle_call(worker: Any, session: str, seq: int, key: str, task: Any, step: int | None = None,
                       release: Sequence[str] = ()) -> dict:
    from distributed.metrics import time as now
    from distributed.protocol import to_serialize

    from flowactors._push import payload_bytes

    _handle_release(release)
    fn, args, kwargs = task
    deps: list[str] = []
    failed: BaseException | None = None
    try:
        args, kwargs = await _fetch_inputs(worker, (args, kwargs), deps)
    except _InputRaised as e:  # an input's item raised: this one raises the same, without running (as Dask does)
        failed = e.error
    lane = _LANES.setdefault(session, _Lane())
    async with lane.turn:
        await lane.turn.wait_for(lambda: lane.next >= seq)
    previous = lane.last
    start = now()
    value = None
    if failed is None:
        try:
            value = await asyncio.get_running_loop().run_in_executor(worker.executors["default"], _run, worker, key,
                                                                     fn, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - sent to the controller, raised by result()
            failed = e
    stop = now()
    async with lane.turn:
        lane.next, lane.last = max(lane.next, seq + 1), key
        lane.turn.notify_all()
    _SPANS.append((key, start, stop))
    _REPORTS.append({"key": key, "deps": deps, "order": previous, "start": start, "stop": stop,
                     "ok": failed is None, "step": step})
    if failed is not None:
        _STORE[key] = _Raised(failed)
        _ready(key).set()
        return {"status": "error", "exception": to_serialize(failed)}
    _STORE[key] = value
    _ready(key).set()
    if payload_bytes(value) <= INLINE_BYTES:
        return {"status": "ok", "value": to_serialize(value)}
    return {"status": "ok", "stored": True}


def _run(worker: Any, key: str, fn: Any, args: tuple, kwargs: dict) -> Any:
    """In the worker's task thread, as a task would run: `get_worker()` answers there."""
    from distributed.worker import _worker_cvar

    token = _worker_cvar.set(worker)
    _RUNNING.update(key=key, thread=threading.get_ident())
    try:
        return fn(*args, **kwargs)
    finally:
        _RUNNING.clear()
        _worker_cvar.reset(token)


class _Raised:
    """Stands in the store for an item that raised: items that take its output raise the same."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _InputRaised(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def _handle_get(worker: Any, key: str) -> dict:
    from distributed.protocol import to_serialize

    await _ready(key).wait()
    if key not in _STORE:
        return {"status": "missing", "message": f"{key} was released on {worker.address}"}
    value = _STORE[key]
    if isinstance(value, _Raised):
        return {"status": "raised", "exception": to_serialize(value.error)}
    return {"status": "ok", "value": to_serialize(value)}


def _handle_release(keys: Sequence[str]) -> None:
    for k in keys:
        _STORE.pop(k, None)
        ev = _READY.get(k)
        if ev is not None and ev.is_set():
            del _READY[k]


async def _fetch_inputs(worker: Any, value: Any, deps: list[str]) -> Any:
    """`value` with every DirectRef replaced by what it names (fetched from its worker where not held here); an
    input that cannot be had becomes a RankFailure, which the runtime reports as the rank's failure, and one whose
    item raised raises `_InputRaised`."""
    refs: dict[str, DirectRef] = {}
    _collect_refs(value, refs)
    if not refs:
        return value
    deps.extend(refs)

    async def one(ref: DirectRef) -> Any:
        try:
            if ref.address == worker.address:
                await _ready(ref.key).wait()
                if ref.key not in _STORE:
                    raise LookupError(f"{ref.key} was released")
                got = _STORE[ref.key]
                if isinstance(got, _Raised):
                    raise _InputRaised(got.error)
                return got
            return _unwrap_reply(await worker.rpc(ref.address).flowactors_get(key=ref.key))
        except _InputRaised:
            raise
        except Exception as e:  # noqa: BLE001
            from flowactors._runtime import RankFailure

            group, _, rest = ref.key.partition(".")
            return RankFailure(group, rest.rsplit("-", 2)[0], -1, "InputLost",
                               f"input {ref.key} from {ref.address} could not be fetched: {type(e).__name__}: {e}",
                               "")

    results = await asyncio.gather(*(one(r) for r in refs.values()), return_exceptions=True)
    raised = next((r for r in results if isinstance(r, BaseException)), None)
    if raised is not None:
        raise raised
    got = dict(zip(refs, results))
    return _replace_refs(value, got)


def _collect_refs(value: Any, out: dict[str, DirectRef]) -> None:
    if isinstance(value, DirectRef):
        out[value.key] = value
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_refs(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_refs(v, out)


def _replace_refs(value: Any, got: dict[str, Any]) -> Any:
    if isinstance(value, DirectRef):
        return got[value.key]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_replace_refs(v, got) for v in value)
    if isinstance(value, list):
        return [_replace_refs(v, got) for v in value]
    if isinstance(value, dict):
        return {k: _replace_refs(v, got) for k, v in value.items()}
    return value


def _flush_reports(worker: Any) -> None:
    if not _REPORTS:
        return
    calls = list(_REPORTS)
    _REPORTS.clear()
    try:
        worker.log_event(CALLS_TOPIC, {"worker": worker.address, "calls": calls})
    except Exception:  # noqa: BLE001 - the dashboard misses a few items; calls are unaffected
        pass


def running_stack(dask_worker: Any = None) -> dict[str, list[str]]:
    """{key: frames} of the item this worker's task thread runs now ({} when idle); run through `Client.run`."""
    import sys
    import traceback

    key, ident = _RUNNING.get("key"), _RUNNING.get("thread")
    frame = sys._current_frames().get(ident) if ident is not None else None
    if key is None or frame is None:
        return {}
    return {key: traceback.format_stack(frame)}


def spans_between(start: float, stop: float, dask_worker: Any = None) -> list[tuple[str, float, float]]:
    return [(k, a, b) for k, a, b in list(_SPANS) if b > start and a < stop]
