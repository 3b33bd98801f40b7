"""The worker's end of the direct path: a listener that runs controllers' items in their issue order.

Each worker (present or joining later, `DirectPlugin`) listens on a port of its own; a connection that proves it
holds the worker's secret (`flowactors.transport.wire`) sends items, which a thread of the worker reads and hands
to the task thread one at a time. Outputs stay in this process's store until released, are fetched by peers
(chained calls) and the controller, and their runs are reported to the dashboard (`CALLS_TOPIC`).
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from flowactors.transport.wire import (
    CALLS_TOPIC,
    HANDSHAKE_S,
    INLINE_BYTES,
    Connection,
    DirectRef,
    Fetcher,
    InputRaised,
    ProtocolError,
    authenticate,
    frames,
    unwrap_reply,
)

__all__ = [
    "PLUGIN_NAME",
    "REFUSED",
    "DirectPlugin",
    "listen_port",
    "refused",
    "running_stack",
    "spans_between",
    "stored_keys",
]

REPORT_S = 0.2
PLUGIN_NAME = "flowactors-direct"

_STORE: dict[str, Any] = {}
_READY: dict[str, asyncio.Event] = {}  # touched on the worker's event loop only
_SPANS: deque[tuple[str, float, float]] = deque(maxlen=20000)
_REPORTS: deque[dict] = deque()
_RUNNING: dict[str, Any] = {}  # {"key": ..., "thread": ident} while the task thread runs an item
_PEERS: dict[str, tuple[int, bytes]] = {}  # every worker's direct listener, as the controller told this one


class DirectPlugin(WorkerPlugin):
    """Listens for controllers on every worker (present and joining later) and serves peers' fetches."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        from distributed.comm import get_address_host
        from tornado.ioloop import PeriodicCallback

        self._listener = socket.create_server((get_address_host(worker.address), 0), backlog=128)
        secret = secrets.token_bytes(32)
        worker._flowactors_direct = (self._listener.getsockname()[1], secret)
        threading.Thread(
            target=_accept, args=(worker, self._listener, secret), daemon=True, name="flowactors-direct accept"
        ).start()
        self._report = PeriodicCallback(lambda: _flush_reports(worker), REPORT_S * 1000)
        self._report.start()

    def teardown(self, worker: Any) -> None:
        _FETCHER.close()
        report = getattr(self, "_report", None)
        if report is not None:
            report.stop()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
            except OSError:
                pass
            listener.close()


def listen_port(dask_worker: Any = None) -> tuple[int, bytes]:
    """The port this worker's direct-path socket listens on, and its secret (run through `Client.run`: only a
    client the cluster lets in learns it)."""
    return dask_worker._flowactors_direct


REFUSED: deque[str] = deque(maxlen=100)
"""Why this worker closed each of its last unauthenticated or oversized connections (tests and hang reports)."""


def _accept(worker: Any, listener: socket.socket, secret: bytes) -> None:
    while True:
        try:
            sock, peer = listener.accept()
        except OSError:  # closed with the plugin
            return
        threading.Thread(
            target=_serve, args=(worker, sock, peer, secret), daemon=True, name="flowactors-direct serve"
        ).start()


def refused(dask_worker: Any = None) -> list[str]:
    """`REFUSED` (run through `Client.run`)."""
    return list(REFUSED)


class _Order:
    """What one controller's connection ran last on this worker (the dashboard's order edge)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: str | None = None


def _serve(worker: Any, sock: socket.socket, peer: Any, secret: bytes) -> None:
    """Authenticate the peer, then read its items in order and queue each on the task thread; its inputs are
    fetched meanwhile."""
    import pickle

    if not authenticate(sock, secret):
        REFUSED.append(f"{peer}: did not authenticate within {HANDSHAKE_S:g} s")
        sock.close()
        return
    conn = Connection(sock)
    loop = worker.loop.asyncio_loop
    executor = worker.executors["default"]
    order = _Order()
    while True:
        try:
            msg = conn.receive()
            if msg[0] == "release":
                loop.call_soon_threadsafe(_handle_release, msg[1])
                continue
            if msg[0] == "peers":
                _PEERS.update(msg[1])
                continue
            if msg[0] == "get":  # on a fetch connection: one get at a time, so waiting here holds up no one
                _serve_get(conn, loop, msg[1])
                continue
            _, key, step, release = msg
            if release:
                loop.call_soon_threadsafe(_handle_release, release)
            data, buffers = conn.receive_frames()  # unpickled apart: a failure there is this item's failure
        except Exception as e:
            if isinstance(e, ProtocolError):
                REFUSED.append(f"{peer}: {e}")
            conn.close()
            return
        try:
            fn, args, kwargs = pickle.loads(data, buffers=buffers)
        except BaseException as e:
            fn, args, kwargs = _raise, (e,), {}
        refs: dict[str, DirectRef] = {}
        _collect_refs((args, kwargs), refs)
        previous, order.last = order.last, key  # items of one connection run in the order they arrive
        _REPORTS.append(
            {"key": key, "deps": list(refs), "order": previous, "state": "waiting", "step": step, "at": time.time()}
        )
        inputs = asyncio.run_coroutine_threadsafe(_fetch_inputs(worker, (args, kwargs), refs), loop) if refs else None
        executor.submit(_job, worker, conn, previous, key, step, fn, args, kwargs, inputs, list(refs))


def _serve_get(conn: Connection, loop: Any, key: str) -> None:
    """Reply to a fetch of `key` once its item is done (its output, what it raised, or that it was released)."""
    reply = asyncio.run_coroutine_threadsafe(_lookup(key), loop).result()
    try:
        out = frames(reply)
    except Exception as e:
        out = frames(
            {"status": "raised", "exception": RuntimeError(f"{key} raised, and its exception cannot be sent: {e}")}
        )
    conn.send(out)


def _raise(error: BaseException) -> None:
    raise error


def _job(
    worker: Any,
    conn: Connection,
    previous: str | None,
    key: str,
    step: int | None,
    fn: Any,
    args: tuple,
    kwargs: dict,
    inputs: Any,
    deps: list[str],
) -> None:
    """In the worker's task thread: wait for the inputs, run the item as a task would run (`get_worker()` answers
    there), keep its output, reply to the controller."""
    from distributed.metrics import time as now
    from distributed.worker import _worker_cvar

    from flowactors.transport.payload import payload_bytes

    failed: BaseException | None = None
    if inputs is not None:
        try:
            args, kwargs = inputs.result()
        except InputRaised as e:  # an input's item raised: this one raises the same, without running (as Dask)
            failed = e.error
        except BaseException as e:
            failed = e
    start = now()
    value = None
    if failed is None:
        _REPORTS.append({"key": key, "state": "processing", "start": start, "step": step})
        token = _worker_cvar.set(worker)
        _RUNNING.update(key=key, thread=threading.get_ident())
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:
            failed = e
        finally:
            _RUNNING.clear()
            _worker_cvar.reset(token)
    stop = now()
    _SPANS.append((key, start, stop))
    _REPORTS.append(
        {"key": key, "deps": deps, "order": previous, "start": start, "stop": stop, "ok": failed is None, "step": step}
    )
    _STORE[key] = _Raised(failed) if failed is not None else value
    worker.loop.asyncio_loop.call_soon_threadsafe(_mark_ready, key)
    if failed is not None:
        reply = (key, "error", failed, False)
    elif payload_bytes(value) <= INLINE_BYTES:
        reply = (key, "ok", value, False)
    else:
        reply = (key, "ok", None, True)
    try:
        try:
            out = frames(reply)
        except Exception as e:
            out = frames((key, "error", RuntimeError(f"{key}: its result cannot be sent back: {e}"), False))
        conn.send(out)
    except OSError:  # the controller went away
        pass


def _mark_ready(key: str) -> None:
    _ready(key).set()


def _ready(key: str) -> asyncio.Event:
    ev = _READY.get(key)
    if ev is None:
        ev = _READY[key] = asyncio.Event()
    return ev


class _Raised:
    """Stands in the store for an item that raised: items that take its output raise the same."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _lookup(key: str) -> dict:
    """On the worker's event loop: what a fetch of `key` gets, once its item is done."""
    await _ready(key).wait()
    if key not in _STORE:
        return {"status": "missing", "message": f"{key} was released"}
    value = _STORE[key]
    if isinstance(value, _Raised):
        return {"status": "raised", "exception": value.error}
    return {"status": "ok", "value": value}


def _peer(address: str) -> tuple[int, bytes]:
    try:
        return _PEERS[address]
    except KeyError:
        raise LookupError(f"no direct listener known for {address} (not a worker of this cluster)") from None


_FETCHER = Fetcher(_peer)
_FETCH_POOL: Any = None


def _fetch_pool() -> Any:
    global _FETCH_POOL
    if _FETCH_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _FETCH_POOL = ThreadPoolExecutor(16, thread_name_prefix="flowactors-fetch")
    return _FETCH_POOL


def _handle_release(keys: Sequence[str]) -> None:
    for k in keys:
        _STORE.pop(k, None)
        ev = _READY.get(k)
        if ev is not None and ev.is_set():
            del _READY[k]


async def _fetch_inputs(worker: Any, value: Any, refs: dict[str, DirectRef]) -> Any:
    """`value` with its DirectRefs (`refs`, by key) replaced by what they name (fetched from their worker where not
    held here); an input that cannot be had becomes a RankFailure, which the runtime reports as the rank's failure,
    and one whose item raised raises `InputRaised`."""

    async def one(ref: DirectRef) -> Any:
        try:
            if ref.address == worker.address:
                await _ready(ref.key).wait()
                if ref.key not in _STORE:
                    raise LookupError(f"{ref.key} was released")
                got = _STORE[ref.key]
                if isinstance(got, _Raised):
                    raise InputRaised(got.error)
                return got
            loop = asyncio.get_running_loop()
            return unwrap_reply(await loop.run_in_executor(_fetch_pool(), _FETCHER.get, ref.address, ref.key))
        except InputRaised:
            raise
        except Exception as e:
            from flowactors._runtime import RankFailure

            group, _, rest = ref.key.partition(".")
            return RankFailure(
                group,
                rest.rsplit("-", 2)[0],
                -1,
                "InputLost",
                f"input {ref.key} from {ref.address} could not be fetched: {type(e).__name__}: {e}",
                "",
            )

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
    calls = []
    while _REPORTS:
        calls.append(_REPORTS.popleft())
    if not calls:
        return
    try:
        worker.log_event(CALLS_TOPIC, {"worker": worker.address, "calls": calls})
    except Exception:
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


def stored_keys(dask_worker: Any = None) -> list[str]:
    """The keys of the outputs this worker's store holds (run through `Client.run`: what was not released yet)."""
    return sorted(_STORE)


def spans_between(start: float, stop: float, dask_worker: Any = None) -> list[tuple[str, float, float]]:
    return [(k, a, b) for k, a, b in list(_SPANS) if b > start and a < stop]
