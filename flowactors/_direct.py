"""The direct-call transport: the controller sends pinned work straight to the workers, without the scheduler.

Why: a group call through Dask is a chain of messages (client → scheduler → worker → scheduler → client, then the
value), each with the scheduler's bookkeeping on the way, and costs several times the work of a no-op call. A plain
socket per worker, written by the controller's thread and read by a thread of the worker that hands each item to
the task thread, costs a fraction of that. So direct work is not a Dask task: requests, replies and stored outputs
(worker to worker, and to the controller) travel on such sockets, which keep the calls' promises (issue order per
process, chaining, failures, hang reports, visibility on the `/flowactors` page) and serve only a peer that proves it
holds the worker's secret.

How it works and what it promises: docs/design.md §3 (Direct calls); the measurements that chose it:
docs/benchmarks.md (Group calls); the handshake and bounded reads: docs/security.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from contextlib import suppress as _suppress
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from flowactors.transport import CallTimeout, Transport, Work, WorkerGone

__all__ = [
    "CALLS_TOPIC",
    "ISSUED_TOPIC",
    "DirectChannel",
    "DirectFuture",
    "DirectRef",
    "DirectTransport",
    "INLINE_BYTES",
    "MAX_MESSAGE_BYTES",
    "ProtocolError",
]

INLINE_BYTES = 64 * 1024
"""Outputs up to this size (flowactors._push.payload_bytes) come back in the reply; larger ones stay on the worker
until `result()` asks."""
CALLS_TOPIC = "flowactors.calls"
ISSUED_TOPIC = "flowactors.issued"
"""The controller's reports of the items it sends, as it sends them (the dashboard's waiting calls)."""
REPORT_S = 0.2
ISSUE_REPORT_S = 0.2
"""The controller gathers issue reports this long into one message to the scheduler, off the caller's thread."""
RELEASE_S = 0.5
_FRAME = struct.Struct("!QI")  # pickle bytes, number of out-of-band buffers; then each buffer's length (!Q), data
MAX_MESSAGE_BYTES = 1 << 33
"""The most one direct-path message (a call's pickled arguments, or a reply) may hold: 8 GiB. Larger values travel
as Dask futures (`Client.scatter`) or as another call's output, worker to worker."""
MAX_BUFFERS = 1 << 16
HANDSHAKE_S = 10.0
"""How long a new connection has to answer the worker's nonce before it is closed."""
_HELLO = b"flowactors-direct/1"
_NONCE_BYTES = 32
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


class ProtocolError(ConnectionError):
    """A peer that did not authenticate, or sent a frame past the limits: its connection is closed."""


class _Connection:
    """One socket between a controller and a worker, written whole-message at a time under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, frames: list) -> None:
        with self.lock:
            self.sock.sendall(frames[0])
            for f in frames[1:]:
                self.sock.sendall(f)

    def receive(self) -> Any:
        """The next message (ConnectionError once the other end closed)."""
        import pickle

        data, buffers = self.receive_frames()
        return pickle.loads(data, buffers=buffers)

    def receive_frames(self) -> tuple[bytearray, list[bytearray]]:
        """The next message's pickle bytes and out-of-band buffers, not yet unpickled."""
        n, count = _FRAME.unpack(_read_exactly(self.sock, _FRAME.size))
        if count > MAX_BUFFERS:
            raise ProtocolError(f"a message announced {count} buffers, more than the {MAX_BUFFERS} allowed")
        sizes = struct.unpack(f"!{count}Q", _read_exactly(self.sock, 8 * count)) if count else ()
        if n + sum(sizes) > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"a message announced {n + sum(sizes)} bytes, more than MAX_MESSAGE_BYTES = "
                f"{MAX_MESSAGE_BYTES}; send values that large as Dask futures (Client.scatter)"
            )
        data = _read_exactly(self.sock, n)
        return data, [_read_exactly(self.sock, k) for k in sizes]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _frames(obj: Any) -> list:
    """`obj` as the frames of one message: pickle protocol 5, tensors out of band (cloudpickle where needed)."""
    from distributed.protocol.pickle import dumps

    buffers: list = []
    data = dumps(obj, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    return [
        _FRAME.pack(len(data), len(views)) + struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views)) + data,
        *views,
    ]


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _HELLO + nonce, hashlib.sha256).digest()


def _authenticate(sock: socket.socket, secret: bytes) -> bool:
    """The worker's side of the handshake: send a nonce, check the peer's HMAC of it within `HANDSHAKE_S`."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    try:
        sock.settimeout(HANDSHAKE_S)
        sock.sendall(_HELLO + nonce)
        ok = hmac.compare_digest(bytes(_read_exactly(sock, hashlib.sha256().digest_size)), _proof(secret, nonce))
        sock.settimeout(None)
        return ok
    except (OSError, ConnectionError):  # timed out, or gone
        return False


def _answer(sock: socket.socket, secret: bytes) -> None:
    """The controller's side: prove it holds the worker's secret."""
    hello = bytes(_read_exactly(sock, len(_HELLO) + _NONCE_BYTES))
    if not hello.startswith(_HELLO):
        raise ProtocolError(f"{sock.getpeername()} is not a flowactors direct-path listener")
    sock.sendall(_proof(secret, hello[len(_HELLO) :]))


def _dial(address: str, port: int, secret: bytes) -> _Connection:
    """An authenticated connection to the direct listener of the worker at `address`."""
    from distributed.comm import get_address_host

    sock = socket.create_connection((get_address_host(address), port), timeout=30)
    try:
        _answer(sock, secret)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return _Connection(sock)


class _Fetcher:
    """Fetches stored outputs from workers' direct listeners (a `get` per connection at a time, connections
    pooled per worker): the controller's `values()` and a worker's inputs held by a peer. The bytes of a large
    output travel here, authenticated but not encrypted, rather than on Dask's comms, which with TLS would encrypt
    them on a machine where no one else can read the loopback traffic anyway."""

    def __init__(self, listener: Any) -> None:
        self._listener = listener  # address -> (port, secret)
        self._idle: dict[str, list[_Connection]] = {}
        self._lock = threading.Lock()

    def get(self, address: str, key: str) -> dict:
        """The worker's reply for `key`: {"status": "ok", "value"}, "raised" (with "exception") or "missing"."""
        with self._lock:
            idle = self._idle.get(address)
            conn = idle.pop() if idle else None
        if conn is None:
            conn = _dial(address, *self._listener(address))
        try:
            conn.send(_frames(("get", key)))
            reply = conn.receive()
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(conn)
        return reply

    def forget(self, address: str) -> None:
        with self._lock:
            for conn in self._idle.pop(address, []):
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the connection was closed")
        got += k
    return buf


def _later(seconds: float, fn: Any) -> None:
    """Run `fn` on a daemon timer thread; at interpreter shutdown (a finalizer releasing a future) there is nothing
    left to do it for, and Python refuses new threads."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        pass


class DirectChannel:
    """The controller's end: sends items, keeps their futures, releases stored outputs nobody can ask for."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._pending: dict[str, weakref.WeakSet[DirectFuture]] = {}
        self._inflight: dict[str, tuple[DirectFuture, Any]] = {}  # key -> (future, its arguments, held)
        self._connections: dict[str, _Connection] = {}
        self._listeners: dict[str, tuple[int, bytes]] = {}  # each worker's direct port and secret
        self._fetcher = _Fetcher(self._listener)
        self._fetch_pool: Any = None
        self._dropped: dict[str, list[str]] = {}
        self._flush_pending = False
        self._issued: list[dict] = []  # issue reports not yet sent to the scheduler (the dashboard's)
        self._last_sent: dict[str, str] = {}  # address -> the key sent there last (the order edge)
        self._closed = False
        client.register_plugin(DirectPlugin(), name=PLUGIN_NAME)

    # -- connections -----------------------------------------------------------------------------------------
    def _listener(self, address: str) -> tuple[int, bytes]:
        """The port and secret of `address`'s direct listener. Asked of all workers at once, and never of one
        that died (it would not answer); each connected worker is told the new table, to fetch from its peers."""
        if address not in self._listeners:
            got = self._client.run(listen_port, on_error="return")
            self._listeners.update({a: v for a, v in got.items() if isinstance(v, tuple)})
            for conn in list(self._connections.values()):
                with _suppress(OSError):
                    conn.send(_frames(("peers", dict(self._listeners))))
        return self._listeners[address]  # KeyError: a worker the cluster does not know (any more)

    def _connection(self, address: str) -> _Connection:
        conn = self._connections.get(address)
        if conn is None:
            conn = _dial(address, *self._listener(address))
            conn.send(_frames(("peers", dict(self._listeners))))
            self._connections[address] = conn
            threading.Thread(
                target=self._read_replies, args=(address, conn), daemon=True, name=f"flowactors-direct {address}"
            ).start()
        return conn

    def _read_replies(self, address: str, conn: _Connection) -> None:
        while True:
            try:
                key, status, value, stored = conn.receive()
            except Exception as e:
                if self._connections.get(address) is conn:
                    del self._connections[address]
                if not self._closed:
                    self.fail_address(address, ConnectionError(f"lost the connection to worker {address}: {e}"))
                return
            self._on_reply(key, status, value, stored)
            del value  # nothing of a finished item may stay referenced here while the next reply is awaited

    def _on_reply(self, key: str, status: str, value: Any, stored: bool) -> None:
        with self._cond:
            entry = self._inflight.pop(key, None)  # the future, and the arguments held for it until now
        if entry is not None:
            if status == "error":
                self._finish(entry[0], "error", error=value)
            else:
                self._finish(entry[0], "finished", value=value, stored=stored)

    def close(self) -> None:
        """Close the connections, and the workers' listeners with the plugin (a long-lived cluster keeps none)."""
        self._closed = True
        for conn in list(self._connections.values()):
            conn.close()
        self._connections.clear()
        self._fetcher.close()
        if self._fetch_pool is not None:
            self._fetch_pool.shutdown(wait=False)
        try:
            self._client.unregister_worker_plugin(PLUGIN_NAME)
        except Exception:
            pass

    # -- sending ---------------------------------------------------------------------------------------------
    def submit(self, items: Sequence[tuple[str, Any, tuple, dict, str]], step: int | None = None) -> list[DirectFuture]:
        """Send each (address, fn, args, kwargs, key) item to run on its address after everything sent there
        before (the caller holds the controller's lock: one issue order). All are serialized first, so an argument
        that cannot travel raises at the call site and no item is sent (no rank enters a collective alone);
        arguments are held until their item is done, so the outputs they name stay stored until it has read them."""
        frames = [_frames((fn, args, kwargs)) for _, fn, args, kwargs, _ in items]
        self._report_issued(items, step)
        out = []
        for (address, _, args, kwargs, key), task in zip(items, frames):
            fut = DirectFuture(self, key, address)
            out.append(fut)
            with self._cond:
                self._pending.setdefault(address, weakref.WeakSet()).add(fut)
                self._inflight[key] = (fut, (args, kwargs))
                release = self._dropped.pop(address, [])  # outputs to drop there: they ride along
            try:
                conn = self._connection(address)
                conn.send([*_frames(("call", key, step, release)), *task])  # the task: a message of its own
            except Exception as e:
                with self._cond:
                    self._inflight.pop(key, None)
                self._finish(fut, "lost", error=e)
        return out

    def _report_issued(self, items: Sequence[tuple[str, Any, tuple, dict, str]], step: int | None) -> None:
        """Tell the scheduler (its dashboard) what is being sent, gathered over ISSUE_REPORT_S and sent from a
        timer thread: the caller does not wait on the scheduler."""
        from distributed.metrics import time as clock

        reports, now = [], clock()
        for address, _, args, kwargs, key in items:
            deps = list(dict.fromkeys(f.key for f in _direct_futures((args, kwargs))))  # they travel as DirectRefs
            reports.append(
                {
                    "key": key,
                    "worker": address,
                    "deps": deps,
                    "step": step,
                    "order": self._last_sent.get(address),
                    "at": now,
                }
            )
            self._last_sent[address] = key
        with self._cond:
            self._issued.extend(reports)
            if len(self._issued) > len(reports):
                return  # a send is already scheduled and will take these too
        _later(ISSUE_REPORT_S, self._send_issued)

    def _send_issued(self) -> None:
        with self._cond:
            calls, self._issued = self._issued, []
        if calls and not self._closed:
            try:
                self._client.log_event(ISSUED_TOPIC, {"calls": calls})
            except Exception:
                pass

    def _finish(
        self,
        fut: DirectFuture,
        status: str,
        value: Any = None,
        stored: bool = False,
        error: BaseException | None = None,
    ) -> None:
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
        if not fetch:
            return [f.value for f in futures]
        if len(fetch) == 1:
            got = {fetch[0].key: self._fetcher.get(fetch[0].address, fetch[0].key)}
        else:
            if self._fetch_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._fetch_pool = ThreadPoolExecutor(8, thread_name_prefix="flowactors-fetch")
            replies = self._fetch_pool.map(lambda f: self._fetcher.get(f.address, f.key), fetch)
            got = dict(zip((f.key for f in fetch), replies))
        return [_unwrap_reply(got[f.key]) if f.stored else f.value for f in futures]

    def least_busy(self, addresses: Sequence[str]) -> str:
        """The address with the fewest items sent and not yet done (the first among equals)."""
        with self._cond:
            return min(addresses, key=lambda a: len(self._pending.get(a, ())))

    def fail_address(self, address: str, error: BaseException, lost: bool = True) -> list[DirectFuture]:
        """Fail every pending item sent to `address`: `lost` (its worker died: the connection is closed too), or
        cancelled with `error` (the worker lives on; what it still replies for them is ignored). Returns them."""
        with self._cond:
            futs = list(self._pending.pop(address, ()))
            for f in futs:
                self._inflight.pop(f.key, None)
        for f in futs:
            self._finish(f, "lost" if lost else "error", error=error)
        conn = self._connections.pop(address, None) if lost else None
        if conn is not None:
            conn.close()
        if lost:
            self._fetcher.forget(address)
        return futs

    def release_one(self, key: str, address: str) -> None:
        """Drop the stored output of `key` on `address` (its future is gone: nobody can refer to it any more).
        Called from finalizers in any thread: the next item sent to that worker takes the drops along, and a quiet
        worker gets them on their own after `RELEASE_S`."""
        with self._cond:
            self._dropped.setdefault(address, []).append(key)
            if self._flush_pending:
                return
            self._flush_pending = True
        _later(RELEASE_S, self._release)

    def _release(self) -> None:
        with self._cond:
            by_address, self._dropped, self._flush_pending = self._dropped, {}, False
        for address, keys in by_address.items():
            conn = self._connections.get(address)
            if conn is None:
                continue  # never connected, or gone with its worker
            try:
                conn.send(_frames(("release", keys)))
            except OSError:  # a dead worker holds nothing any more
                pass

    def reset(self) -> None:
        """After recovery: connections to workers that are gone are dropped (the live ones keep their order)."""
        live = set(self._client.scheduler_info(n_workers=-1)["workers"])
        for address in [a for a in self._connections if a not in live]:
            self.fail_address(address, ConnectionError(f"worker {address} is gone"))

    # -- reports ---------------------------------------------------------------------------------------------
    def stacks(self) -> dict[str, dict[str, list[str]]]:
        """{worker: {key: stack frames}} of the item each worker's task thread runs now (as `Client.call_stack`)."""
        try:
            return self._client.run(running_stack)
        except Exception:
            return {}

    def records(self, start: float, stop: float) -> list[dict]:
        """The items every worker ran that overlap [start, stop] (workers' clocks), shaped like Dask's task-stream
        records: {"key", "worker", "startstops": [{"action": "compute", "start", "stop"}]}."""
        try:
            found = self._client.run(spans_between, start, stop)
        except Exception:
            return []
        return [
            {"key": k, "worker": w, "startstops": [{"action": "compute", "start": a, "stop": b}]}
            for w, spans in found.items()
            for k, a, b in spans
        ]


class DirectTransport(Transport):
    """Calls on the direct path (`DirectChannel`): the controller's `Transport` over it."""

    direct = True

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.channel = DirectChannel(client)

    def submit(self, tasks: Sequence[Work], step: int | None) -> list[DirectFuture]:
        futs = self.channel.submit(tasks, step=step)
        for f in futs:  # its stored output is dropped once nobody can ask for it
            weakref.finalize(f, self.channel.release_one, f.key, f.address)
        return futs

    def apply_site(self, args: tuple, kwargs: dict, slots: Sequence[str]) -> str:
        """The worker that produced the first input (its output is there), else the least busy one."""
        return next(
            (f.address for v in (*args, *kwargs.values()) for f in _direct_futures(v)), None
        ) or self.channel.least_busy(slots)

    def resolve(self, calls: Sequence[Any], timeout: float | None, values: bool = True) -> list[list]:
        """A future whose connection broke means its worker is gone, whether or not the scheduler said so: every
        item pending there fails, and `WorkerGone` names it. A runtime function's exception is raised here."""
        if not self.channel.wait([f for c in calls for f in c.futures], timeout):
            raise CallTimeout()
        for c in calls:
            lost = next((f for f in c.futures if f.status == "lost"), None)
            if lost is not None:
                self.channel.fail_address(lost.address, ConnectionError(f"worker {lost.address} died"))
                raise WorkerGone(lost.address, c.label) from lost.error
        if not values:
            return []
        for c in calls:
            failed = next((f for f in c.futures if f.status == "error"), None)
            if failed is not None:
                raise failed.error if isinstance(failed.error, BaseException) else RuntimeError(failed.error)
        return [self.channel.values(c.futures) for c in calls]

    def settle(self, futures: Sequence[DirectFuture], timeout: float) -> None:
        self.channel.wait(futures, timeout)

    async def worker_lost(self, address: str, futures: Sequence[DirectFuture]) -> None:
        """Every item pending on `address` fails (`futures` are among them: all of a direct controller's)."""
        self.channel.fail_address(address, ConnectionError(f"worker {address} died"))

    def reset(self, stale: Sequence[DirectFuture]) -> None:
        """Stale items are cancelled (their workers live on; what they still reply is ignored), connections to
        workers that are gone dropped."""
        from distributed.client import FutureCancelledError

        for a in {f.address for f in stale}:
            self.channel.fail_address(
                a,
                FutureCancelledError(a, "recovery", "the controller rebuilt its groups after a lost worker"),
                lost=False,
            )
        self.channel.reset()

    def stacks(self) -> dict[str, dict[str, list[str]]]:
        return self.channel.stacks()

    def records(self, start: float, stop: float) -> list[dict]:
        return self.channel.records(start, stop)

    def close(self) -> None:
        self.channel.close()


def _direct_futures(v: Any) -> list[DirectFuture]:
    """The direct futures a (possibly nested) argument refers to."""
    if isinstance(v, DirectFuture):
        return [v]
    if isinstance(v, (list, tuple)):
        return [f for x in v for f in _direct_futures(x)]
    if isinstance(v, dict):
        return [f for x in v.values() for f in _direct_futures(x)]
    return []


def _unwrap_reply(reply: Any) -> Any:
    """The value of a fetch's reply (`_lookup`); raises `_InputRaised` for an item that raised, LookupError for
    one that was released."""
    if isinstance(reply, dict) and reply.get("status") == "raised":
        raise _InputRaised(reply.get("exception"))
    if isinstance(reply, dict) and reply.get("status") == "missing":
        raise LookupError(reply.get("message"))
    return reply.get("value") if isinstance(reply, dict) else reply


# ---- the worker's end ----------------------------------------------------------------------------------------------

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

    if not _authenticate(sock, secret):
        REFUSED.append(f"{peer}: did not authenticate within {HANDSHAKE_S:g} s")
        sock.close()
        return
    conn = _Connection(sock)
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


def _serve_get(conn: _Connection, loop: Any, key: str) -> None:
    """Reply to a fetch of `key` once its item is done (its output, what it raised, or that it was released)."""
    reply = asyncio.run_coroutine_threadsafe(_lookup(key), loop).result()
    try:
        frames = _frames(reply)
    except Exception as e:
        frames = _frames(
            {"status": "raised", "exception": RuntimeError(f"{key} raised, and its exception cannot be sent: {e}")}
        )
    conn.send(frames)


def _raise(error: BaseException) -> None:
    raise error


def _job(
    worker: Any,
    conn: _Connection,
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

    from flowactors._push import payload_bytes

    failed: BaseException | None = None
    if inputs is not None:
        try:
            args, kwargs = inputs.result()
        except _InputRaised as e:  # an input's item raised: this one raises the same, without running (as Dask)
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
            frames = _frames(reply)
        except Exception as e:
            frames = _frames((key, "error", RuntimeError(f"{key}: its result cannot be sent back: {e}"), False))
        conn.send(frames)
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


class _InputRaised(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
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


_FETCHER = _Fetcher(_peer)
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
    and one whose item raised raises `_InputRaised`."""

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
            loop = asyncio.get_running_loop()
            return _unwrap_reply(await loop.run_in_executor(_fetch_pool(), _FETCHER.get, ref.address, ref.key))
        except _InputRaised:
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


def spans_between(start: float, stop: float, dask_worker: Any = None) -> list[tuple[str, float, float]]:
    return [(k, a, b) for k, a, b in list(_SPANS) if b > start and a < stop]
