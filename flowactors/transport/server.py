"""The worker's end of the direct path: a listener that runs controllers' items in their issue order.

Each worker (present or joining later, `DirectPlugin`) listens on a port of its own; a connection that proves it
holds the worker's secret (`flowactors.transport.wire`) sends items, which a thread of the worker reads and hands
to its task thread (`_TaskThread`, one per worker) one at a time. Outputs stay in this process's store until
released, are fetched by peers (chained calls) and the controller, and their runs are reported to the dashboard
(`CALLS_TOPIC`).
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import structlog
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.metrics import time as now
from distributed.worker import _worker_cvar

from flowactors.transport.fanout import FANOUT, SCALARS, map_leaves, resolve, subtrees, trim
from flowactors.transport.payload import payload_bytes
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
    dial,
    frames,
    host_key,
    pack_reports,
    raw_frames,
    unwrap_reply,
)

__all__ = [
    "PLUGIN_NAME",
    "REFUSED",
    "DirectPlugin",
    "listen",
    "listen_port",
    "refused",
    "running_stack",
    "spans_between",
    "stored_keys",
    "tree_levels",
]

REPORT_S = 0.2
PLUGIN_NAME = "flowactors-direct"

_STORE: dict[str, Any] = {}
_WAITING: dict[str, list[asyncio.Future]] = {}
"""Item key -> the event loop's futures waiting for its output (`_stored`); only awaited keys wake the loop."""
_SPANS: deque[tuple[str, float, float]] = deque(maxlen=20000)
_REPORTS: deque[dict] = deque(maxlen=200000)
_FETCHED: dict[str, dict[str, int]] = {}
"""For the last items that fetched inputs from peers: item key -> {peer address: bytes} (`fetched_for`)."""
_FETCHED_KEEP = 4096
_RUNNING: dict[str, Any] = {}  # {"key": ..., "thread": ident} while the task thread runs an item
_PEERS: dict[str, tuple] = {}  # every worker's direct listener, as the controller told this one


class DirectPlugin(WorkerPlugin):
    """Listens for controllers on every worker (present and joining later) and serves peers' fetches."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        self._listeners = listen(worker)
        self._report = PeriodicCallback(lambda: _flush_reports(worker), REPORT_S * 1000)
        self._report.start()

    def teardown(self, worker: Any) -> None:
        _FETCHER.close()
        with _OWN_LOCK:  # a controller connecting later (a long-lived cluster) starts a new one
            tasks = worker.__dict__.pop("_flowactors_tasks", None)
        if tasks is not None:
            tasks.stop()
        report = getattr(self, "_report", None)
        if report is not None:
            report.stop()
        for listener in getattr(self, "_listeners", ()):
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
            except OSError:
                pass
            listener.close()


def listen(worker: Any) -> list[socket.socket]:
    """Start `worker`'s listeners, with a secret of its own: TCP on the interface of its address, and where the
    platform has them an abstract Unix socket for peers on the same host (`wire.dial`), each with a thread that
    accepts its connections. `worker` needs `address`, `loop.asyncio_loop` and `log_event`, as a Dask worker has
    (or a light stand-in, benchmarks/fanout.py). The TCP listener comes first."""
    from distributed.comm import get_address_host

    listeners = [socket.create_server((get_address_host(worker.address), 0), backlog=1024)]
    secret = secrets.token_bytes(32)
    local = None
    if host_key() is not None:
        name = b"\0flowactors-direct-" + secrets.token_hex(12).encode()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(name)
            unix.listen(1024)
            listeners.append(unix)
            local = (host_key(), name)
        except OSError:  # no abstract namespace here: TCP only
            unix.close()
    worker._flowactors_direct = (listeners[0].getsockname()[1], secret, local)
    for listener in listeners:
        threading.Thread(
            target=_accept, args=(worker, listener, secret), daemon=True, name="flowactors-direct accept"
        ).start()
    return listeners


def tree_levels(dask_worker: Any = None) -> dict[int, int]:
    """How many items of call trees this process ran at each level of their tree (1: sent by the controller)."""
    return dict(_LEVELS)


def listen_port(dask_worker: Any = None) -> tuple[int, bytes, tuple[str, bytes] | None]:
    """The port this worker's direct-path socket listens on, its secret, and its Unix socket (host key and name,
    or None): `wire.dial`'s arguments (run through `Client.run`: only a client the cluster lets in learns them)."""
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
            target=_serve,
            args=(worker, sock, peer or "a peer on this host", secret),
            daemon=True,
            name="flowactors-direct serve",
        ).start()


def refused(dask_worker: Any = None) -> list[str]:
    """`REFUSED` (run through `Client.run`)."""
    return list(REFUSED)


class _Sequencer:
    """Runs each controller's items on this worker in the order the controller issued them (its sequence numbers),
    whichever connection brought them: straight from the controller, or forwarded down a call's tree by a peer.
    A number the controller gave up on (its relay died) is skipped; an item that arrives after that is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, list] = {}  # controller id -> [next number, {number: start}, skipped, last key]

    def offer(self, cid: str, seq: int, key: str, start: Any) -> None:
        """`start(previous key)` queues the item on the task thread, once every earlier item of `cid` has been."""
        with self._lock:
            st = self._state.setdefault(cid, [0, {}, set(), None])
            if seq < st[0] or seq in st[2]:
                st[2].discard(seq)
                return
            st[1][seq] = (key, start)
            self._drain(st)

    def skip(self, cid: str, seqs: Sequence[int]) -> None:
        with self._lock:
            st = self._state.setdefault(cid, [0, {}, set(), None])
            st[2].update(s for s in seqs if s >= st[0])
            self._drain(st)

    @staticmethod
    def _drain(st: list) -> None:
        while True:
            if st[0] in st[2]:  # given up on by the controller: not run even if it arrived
                st[2].discard(st[0])
                st[1].pop(st[0], None)
            elif st[0] in st[1]:
                key, start = st[1].pop(st[0])
                st[0] += 1
                previous, st[3] = st[3], key
                start(previous)  # never raises (`_queue`)
                continue
            else:
                return
            st[0] += 1


class _TaskThread:
    """The thread that runs a worker's direct items, one at a time in the order the sequencer queues them. Not
    Dask's executor: its hand-off (a `concurrent.futures.Future`, a condition-guarded queue, the result set on the
    future) cost each item ~10-15 us more CPU on a busy host (docs/benchmarks.md); a `SimpleQueue` is one lock in C."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flowactors-direct task")
        self._thread.start()

    def submit(self, job: tuple) -> None:
        """Queue `_job(*job)`."""
        self._jobs.put(job)

    def stop(self) -> None:
        """End the thread after the items queued so far (the worker is closing)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                _job(*job)
            except BaseException:  # `_job` answers the item's own failures: this is the runtime's; the thread goes on
                structlog.get_logger("flowactors.worker").exception("direct item not answered", key=job[3])
            del job  # nothing of a finished item stays referenced while the next is awaited


def _own(worker: Any, attr: str, make: Any) -> Any:
    """`worker`'s object `attr`, made by `make()` the first time any thread asks."""
    got = getattr(worker, attr, None)
    if got is None:
        with _OWN_LOCK:
            got = getattr(worker, attr, None)
            if got is None:
                got = make()
                setattr(worker, attr, got)
    return got


def _sequencer(worker: Any) -> _Sequencer:
    return _own(worker, "_flowactors_sequencer", _Sequencer)


_OWN_LOCK = threading.Lock()


def _serve(worker: Any, sock: socket.socket, peer: Any, secret: bytes) -> None:
    """Authenticate the peer, then read its messages: items (queued on the task thread in their controller's issue
    order, their inputs fetched meanwhile), a call's tree (this worker's item, and the subtrees below it sent on to
    their first ranks), releases, skips, the peers' table, fetches."""
    if not authenticate(sock, secret):
        REFUSED.append(f"{peer}: did not authenticate within {HANDSHAKE_S:g} s")
        sock.close()
        return
    conn = Connection(sock)
    loop = worker.loop.asyncio_loop
    while True:
        try:
            msg = conn.receive()
            kind = msg[0]
            if kind == "release":
                _handle_release(msg[1])
                continue
            if kind == "peers":
                _PEERS.update(msg[1])
                continue
            if kind == "skip":
                _sequencer(worker).skip(msg[1], msg[2])
                continue
            if kind == "get":  # on a fetch connection: one get at a time, so waiting here holds up no one
                _serve_get(conn, loop, msg[1])
                continue
            data, buffers = conn.receive_frames()  # unpickled apart: a failure there is the item's failure
        except Exception as e:
            if isinstance(e, ProtocolError):
                REFUSED.append(f"{peer}: {e}")
            conn.close()
            return
        if kind == "tree":
            try:
                _tree(worker, conn, msg, data, buffers)
            except Exception as e:  # a malformed tree: its ranks below here are not reached; the loop goes on
                REFUSED.append(f"{peer}: a call's tree could not be handled: {type(e).__name__}: {e}")
            continue
        _, key, step, release, cid, seq = msg
        if release:
            _handle_release(release)
        _queue(worker, cid, seq, key, step, _decode(data, buffers), _Reply(conn).one, data)


def _decode(data: Any, buffers: list) -> tuple:
    """(fn, args, kwargs) of an item's frames; a failure to unpickle becomes the item's failure."""
    import pickle

    try:
        return pickle.loads(data, buffers=buffers)
    except BaseException as e:
        return _raise, (e,), {}


def _queue(worker: Any, cid: str, seq: int, key: str, step: Any, task: tuple, reply: Any, data: Any = None) -> None:
    """Queue `task` (fn, args, kwargs) on the task thread in `cid`'s issue order; `reply` takes its reply.
    `data`, the pickle it was decoded from, tells whether it can hold a reference to look for (`_may_refer`)."""
    fn, args, kwargs = task
    refs: dict[str, DirectRef] = {}
    if data is None or _may_refer(data):
        _collect_refs((args, kwargs), refs)

    def start(previous: str | None) -> None:
        try:
            _REPORTS.append(
                {"key": key, "deps": list(refs), "order": previous, "state": "waiting", "step": step, "at": time.time()}
            )
            inputs: Any = None
            if refs and all(r.address == worker.address for r in refs.values()):
                inputs = refs  # outputs of this process: the task thread takes them from the store (`_job`)
            elif refs:  # fetched on the event loop meanwhile
                inputs = _fetch_on_loop(worker, (args, kwargs), refs, key)
            _own(worker, "_flowactors_tasks", _TaskThread).submit(
                (worker, reply, previous, key, step, fn, args, kwargs, inputs, list(refs))
            )
        except Exception as e:  # the worker is closing: the item fails, the order goes on
            reply((key, "error", e, False))

    _sequencer(worker).offer(cid, seq, key, start)


class _Reply:
    """Sends replies up one connection (to the controller, or to the peer that forwarded a tree)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def one(self, reply: tuple) -> None:
        try:
            try:
                out = frames(reply)
            except Exception as e:
                out = frames(
                    (reply[0], "error", RuntimeError(f"{reply[0]}: its result cannot be sent back: {e}"), False)
                )
            self.conn.send(out)
        except OSError:  # the controller went away
            pass

    def many(self, tree: int, replies: list) -> None:
        try:
            try:
                out = frames(("replies", tree, replies))
            except Exception:
                out = frames(("replies", tree, [_sendable(r) for r in replies]))
            self.conn.send(out)
        except OSError:  # the one above went away: it is lost to the controller too
            pass


def _sendable(reply: tuple) -> tuple:
    try:
        frames(reply)
        return reply
    except Exception as e:
        return (reply[0], "error", RuntimeError(f"{reply[0]}: its result cannot be sent back: {e}"), False)


AGGREGATE_S = 0.05
"""A node of a call's tree sends up what its subtree has replied when all has, or after this long (so the
controller's view of a call some of whose ranks hang stays current)."""


class _Gather:
    """A tree node's replies for one call: its own and its subtrees', sent up together."""

    __slots__ = ("reply", "tree", "left", "held", "since", "lock")

    def __init__(self, reply: _Reply, tree: int, expected: int) -> None:
        self.reply, self.tree, self.left = reply, tree, expected
        self.held: list = []
        self.since = 0.0
        self.lock = threading.Lock()

    def add(self, replies: list) -> None:
        with self.lock:
            if not self.held:
                self.since = time.monotonic()
            self.held.extend(replies)
            self.left -= len(replies)
            done = self.left <= 0
            out = self.held if done else None
            if done:
                self.held = []
        if done:
            _PARTIAL.discard(self)
            self.reply.many(self.tree, out)
        else:
            _flush_later(self)

    def flush(self, older_than: float) -> bool:
        """Send up what is held when it has waited `older_than` seconds; whether anything is still expected."""
        with self.lock:
            out = None
            if self.held and time.monotonic() - self.since >= older_than:
                out, self.held = self.held, []
            left = self.left
        if out:
            self.reply.many(self.tree, out)
        return left > 0


_PARTIAL: set[_Gather] = set()
_PARTIAL_LOCK = threading.Lock()
_FLUSHER: list[threading.Thread] = []


def _flush_later(gather: _Gather) -> None:
    with _PARTIAL_LOCK:
        _PARTIAL.add(gather)
        if not _FLUSHER:
            t = threading.Thread(target=_flush_loop, daemon=True, name="flowactors-direct flush")
            _FLUSHER.append(t)
            t.start()


def _flush_loop() -> None:
    while True:
        time.sleep(AGGREGATE_S / 2)
        with _PARTIAL_LOCK:
            waiting = list(_PARTIAL)
        for g in waiting:
            if not g.flush(AGGREGATE_S):
                _PARTIAL.discard(g)


def _tree(worker: Any, conn: Connection, msg: tuple, data: Any, buffers: list) -> None:
    """A call's tree: `entries` are this subtree's ranks, this worker's first. Send each subtree below on to its
    first rank (with only the parts its ranks take), then queue this worker's item; replies go up together."""
    _, tree, cid, step, entries, first, marked, level = msg
    decoded: list = []

    def task() -> tuple:
        if not decoded:
            decoded.append(_decode(data, buffers))
        return decoded[0]

    rest, up = entries[1:], _Reply(conn)
    if rest:
        gather = _Gather(up, tree, len(entries))
        done = lambda r: gather.add([(first, r[1], r[2], r[3])])  # noqa: E731
    else:  # a leaf: its one reply goes up as it comes
        done = lambda r: up.many(tree, [(first, r[1], r[2], r[3])])  # noqa: E731
    for start, stop in subtrees(len(rest), FANOUT):
        child, child_first = rest[start:stop], first + 1 + start
        try:
            if marked:
                fn, args, kwargs = task()
                lo, hi = min(e[3] for e in child), max(e[3] for e in child)
                payload = frames((fn, trim(args, lo, hi), trim(kwargs, lo, hi)))
            else:
                payload = raw_frames(data, buffers)
            header = ("tree", tree, cid, step, child, child_first, marked, level + 1)
            _RELAYS.send(worker.address, child, child_first, [*frames(header), *payload], gather)
        except Exception as e:
            lost = (child[0][0], f"{type(e).__name__}: {e}")
            gather.add([(child_first + j, "lost", lost, False) for j in range(len(child))])
    address, key, seq, part, extra, kw, release = entries[0]
    _LEVELS[level] = _LEVELS.get(level, 0) + 1
    if release:  # (outputs to drop, numbers not to wait for) that rode along
        drops, skips = release
        if drops:
            _handle_release(drops)
        if skips:
            _sequencer(worker).skip(cid, skips)
    fn, args, kwargs = task()
    if part >= 0 and fn is not _raise:
        try:
            args, kwargs = resolve(args, part), resolve(kwargs, part)
        except BaseException as e:
            fn, args, kwargs = _raise, (e,), {}
    hint = data  # the shared inputs' pickle; the rank's own fields came in the header
    if fn is not _raise:
        if kw or not all(type(v) in SCALARS for v in extra):
            own: dict[str, DirectRef] = {}
            _collect_refs((extra, kw), own)
            hint = None if own else data
        args, kwargs = (*extra, *args), {**kwargs, **kw}
    _queue(worker, cid, seq, key, step, (fn, args, kwargs), done, hint)


_LEVELS: dict[int, int] = {}
"""How many tree items this process took at each level of their tree (1: sent by the controller)."""


class _Relays:
    """This process's connections to the peers it forwards subtrees to, each with a thread reading their replies
    up; a connection that breaks fails every rank of the subtrees still waiting on it (their first rank died)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, str], tuple[Connection, dict]] = {}

    def send(self, here: str, child: list, first: int, message: list, gather: _Gather) -> None:
        address = child[0][0]
        with self._lock:
            got = self._conns.get((here, address))
            if got is None:
                conn = dial(address, *_peer(address))
                conn.send(frames(("peers", dict(_PEERS))))
                got = self._conns[(here, address)] = (conn, {})
                threading.Thread(
                    target=self._read, args=(here, address, got), daemon=True, name=f"flowactors-direct relay {address}"
                ).start()
            got[1][gather.tree] = (gather, set(range(first, first + len(child))))
        try:
            got[0].send(message)
        except Exception as e:  # the reader may have reported these already (its connection broke): once only
            with self._lock:
                entry = got[1].pop(gather.tree, None)
            if entry is not None:
                lost = (address, f"{type(e).__name__}: {e}")
                gather.add([(i, "lost", lost, False) for i in sorted(entry[1])])

    def _read(self, here: str, address: str, got: tuple) -> None:
        conn, waiting = got
        while True:
            try:
                _, tree, replies = conn.receive()
            except Exception as e:
                with self._lock:
                    if self._conns.get((here, address)) is got:
                        del self._conns[(here, address)]
                    left = list(waiting.values())
                    waiting.clear()
                for gather, keys in left:
                    gather.add([(k, "lost", (address, f"lost the connection to {address}: {e}"), False) for k in keys])
                conn.close()
                return
            with self._lock:
                entry = waiting.get(tree)
                if entry is not None:
                    entry[1].difference_update(r[0] for r in replies)
                    if not entry[1]:
                        del waiting[tree]
            if entry is not None:
                entry[0].add(replies)


_RELAYS = _Relays()


def _serve_get(conn: Connection, loop: Any, key: str) -> None:
    """Reply to a fetch of `key` once its item is done (its output, what it raised, or that it was released)."""
    if key in _STORE:  # done: answered here, not on the event loop (a wake of it per fetch)
        reply = _fetched(key)
    else:
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
    reply_to: Any,
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
    there), keep its output, hand its reply to `reply_to` (up to the controller, directly or through the tree)."""
    failed: BaseException | None = None
    if inputs is not None:
        try:
            if isinstance(inputs, dict):  # every input an output of this process (a chained call's, usually)
                got = _stored_inputs((args, kwargs), inputs)
                if got is None:  # not all stored yet (several task threads): waited for on the event loop
                    got = _fetch_on_loop(worker, (args, kwargs), inputs, key).result()
                args, kwargs = got
            else:
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
    _STORE[key] = _Raised(failed) if failed is not None else value  # before its reply: a release comes after
    try:
        if failed is not None:
            reply_to((key, "error", failed, False))
        elif payload_bytes(value) <= INLINE_BYTES:
            reply_to((key, "ok", value, False))
        else:
            reply_to((key, "ok", None, True))
    finally:
        # After the reply (the call's latency): waking the event loop first would take the GIL from this thread
        # before it sends. Only an output something awaits wakes the loop (a wake per item cost each worker a
        # self-pipe write and a loop turn, as much CPU as the reply's own send).
        waiting = _WAITING.pop(key, None)
        if waiting:
            worker.loop.asyncio_loop.call_soon_threadsafe(_wake, waiting)
        _dropped_early(key)


def _stored_inputs(value: Any, refs: dict[str, DirectRef]) -> Any:
    """`value` with its DirectRefs replaced by the outputs they name, all in this process's store (None: one is
    not there yet), or `InputRaised` for one whose item raised. In issue order on one task thread the items a
    call's inputs come from have run before it: no hop through the event loop (two thread wakes an item)."""
    try:
        return _replace_refs(value, {k: _output(k) for k in refs})
    except LookupError:
        return None


def _wake(waiting: list[asyncio.Future]) -> None:
    for fut in waiting:
        if not fut.done():
            fut.set_result(None)


async def _stored(key: str) -> None:
    """(On the event loop.) Return once `key`'s item has finished, its output (or what it raised) in the store.
    The waiter registers before it looks, and the task thread stores before it looks for waiters: either the
    look finds the output or the task thread finds the waiter (each dict operation is atomic under the GIL)."""
    if key in _STORE:
        return
    fut = asyncio.get_running_loop().create_future()
    _WAITING.setdefault(key, []).append(fut)
    if key in _STORE:
        return
    await fut


class _Raised:
    """Stands in the store for an item that raised: items that take its output raise the same."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _lookup(key: str) -> dict:
    """On the worker's event loop: what a fetch of `key` gets, once its item is done."""
    await _stored(key)
    return _fetched(key)


def _fetched(key: str) -> dict:
    """What a fetch of `key` gets, its item done: its output, what it raised, or that it was released."""
    try:
        return {"status": "ok", "value": _output(key)}
    except InputRaised as e:
        return {"status": "raised", "exception": e.error}
    except LookupError as e:
        return {"status": "missing", "message": str(e)}


def _output(key: str) -> Any:
    """The output `key` names in this process's store: `InputRaised` if its item raised, LookupError if it is not
    there (released, or its item has not run: `_stored` waits for that). The one reader of the store's entries."""
    value = _STORE.get(key, _RELEASED)
    if value is _RELEASED:
        raise LookupError(f"{key} was released")
    if isinstance(value, _Raised):
        raise InputRaised(value.error)
    return value


def _fetch_on_loop(worker: Any, value: Any, refs: dict[str, DirectRef], item: str) -> Any:
    """`_fetch_inputs` run on the worker's event loop, from another thread: its concurrent future."""
    return asyncio.run_coroutine_threadsafe(_fetch_inputs(worker, value, refs, item), worker.loop.asyncio_loop)


_RELEASED = object()


def _peer(address: str) -> tuple[int, bytes, tuple[str, bytes] | None]:
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
    """Drop released outputs (on any thread: nothing on the event loop awaits an output its controller dropped).
    One whose item has not stored it yet (a future dropped before its call ended) is remembered, and its item
    drops it when it stores it (`_dropped_early`); else it would be kept until the worker ends."""
    for k in keys:
        if _STORE.pop(k, _RELEASED) is _RELEASED:
            with _EARLY_LOCK:
                _EARLY[k] = True
                while len(_EARLY) > _EARLY_KEEP:  # keys of items that never came here: the oldest are forgotten
                    del _EARLY[next(iter(_EARLY))]
            _STORE.pop(k, None)  # stored meanwhile, by an item that looked before the key was remembered


def _dropped_early(key: str) -> None:
    """(After its item stored `key`'s output.) Drop it if its controller released it before."""
    if _EARLY:
        with _EARLY_LOCK:
            early = _EARLY.pop(key, False)
        if early:
            _STORE.pop(key, None)


_EARLY: dict[str, bool] = {}
"""Keys released before their item stored its output, oldest first."""
_EARLY_KEEP = 65536
_EARLY_LOCK = threading.Lock()


def fetched_for(keys: Sequence[str], dask_worker: Any = None) -> dict[str, int]:
    """The bytes the items `keys` of this worker fetched from peers for their inputs, by peer address (items
    long gone are forgotten: the last 4,096 are kept)."""
    out: dict[str, int] = {}
    for k in keys:
        for address, n in _FETCHED.get(k, {}).items():
            out[address] = out.get(address, 0) + n
    return out


async def _fetch_inputs(worker: Any, value: Any, refs: dict[str, DirectRef], item: str = "") -> Any:
    """`value` with its DirectRefs (`refs`, by key) replaced by what they name (fetched from their worker where not
    held here); an input that cannot be had becomes a RankFailure, which the runtime reports as the rank's failure,
    and one whose item raised raises `InputRaised`."""

    async def one(ref: DirectRef) -> Any:
        try:
            if ref.address == worker.address:
                await _stored(ref.key)
                return _output(ref.key)
            loop = asyncio.get_running_loop()
            reply, size = await loop.run_in_executor(_fetch_pool(), _FETCHER.get_sized, ref.address, ref.key)
            if item:
                sizes = _FETCHED.setdefault(item, {})
                sizes[ref.address] = sizes.get(ref.address, 0) + size
                while len(_FETCHED) > _FETCHED_KEEP:
                    del _FETCHED[next(iter(_FETCHED))]
            return unwrap_reply(reply)
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


_REF_NAME = DirectRef.__name__.encode()


def _may_refer(data: Any) -> bool:
    """Whether a pickle can hold a DirectRef: one names its class in the bytes (pickled by reference). A scan of
    the bytes in C instead of a walk of the decoded inputs in Python (a fifth of a worker's Python per item)."""
    return _REF_NAME in data


def _collect_refs(value: Any, out: dict[str, DirectRef]) -> None:
    map_leaves(value, DirectRef, lambda ref: out.setdefault(ref.key, ref))


def _replace_refs(value: Any, got: dict[str, Any]) -> Any:
    return map_leaves(value, DirectRef, lambda ref: got[ref.key])


def _flush_reports(worker: Any) -> None:
    """Send the items' reports gathered since the last flush, as one blob (`pack_reports`); an item that ended
    meanwhile is not also reported running (its end says it ran). Its arrival is kept: the page counts an item
    first seen finished as `late`."""
    calls = []
    while _REPORTS:
        calls.append(_REPORTS.popleft())
    if not calls:
        return
    ended = {c["key"] for c in calls if "stop" in c}
    if ended:
        calls = [c for c in calls if c.get("state") != "processing" or c["key"] not in ended]
    try:
        worker.log_event(CALLS_TOPIC, {"worker": worker.address, "calls": pack_reports(calls)})
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
