"""The controller's end of the direct path: it sends pinned work straight to the workers, without the scheduler.

Why: a group call through Dask is a chain of messages (client → scheduler → worker → scheduler → client, then the
value), each with the scheduler's bookkeeping on the way, and costs several times the work of a no-op call. A plain
socket per worker, written by the controller's thread and read by a thread of the worker that hands each item to
the task thread (`flowactors.transport.server`), costs a fraction of that. So direct work is not a Dask task:
requests, replies and stored outputs (worker to worker, and to the controller) travel on such sockets
(`flowactors.transport.wire`), which keep the calls' promises (issue order per process, chaining, failures, hang
reports, visibility on the `/flowactors` page).

How it works and what it promises: docs/design.md §3 (Direct calls); the measurements that chose it:
docs/benchmarks.md (Group calls); the handshake and bounded reads: docs/security.md.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress as _suppress
from typing import Any

from flowactors.transport import CallTimeout, Transport, Work, WorkerGone
from flowactors.transport.server import PLUGIN_NAME, DirectPlugin, listen_port, running_stack, spans_between
from flowactors.transport.wire import ISSUED_TOPIC, Connection, DirectRef, Fetcher, dial, frames, unwrap_reply

__all__ = ["DirectChannel", "DirectFuture", "DirectTransport"]

ISSUE_REPORT_S = 0.2
"""The controller gathers issue reports this long into one message to the scheduler, off the caller's thread."""
RELEASE_S = 0.5


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
        self._connections: dict[str, Connection] = {}
        self._listeners: dict[str, tuple[int, bytes]] = {}  # each worker's direct port and secret
        self._fetcher = Fetcher(self._listener)
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
                    conn.send(frames(("peers", dict(self._listeners))))
        return self._listeners[address]  # KeyError: a worker the cluster does not know (any more)

    def _connection(self, address: str) -> Connection:
        conn = self._connections.get(address)
        if conn is None:
            conn = dial(address, *self._listener(address))
            conn.send(frames(("peers", dict(self._listeners))))
            self._connections[address] = conn
            threading.Thread(
                target=self._read_replies, args=(address, conn), daemon=True, name=f"flowactors-direct {address}"
            ).start()
        return conn

    def _read_replies(self, address: str, conn: Connection) -> None:
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
        encoded = [frames((fn, args, kwargs)) for _, fn, args, kwargs, _ in items]
        self._report_issued(items, step)
        out = []
        for (address, _, args, kwargs, key), task in zip(items, encoded):
            fut = DirectFuture(self, key, address)
            out.append(fut)
            with self._cond:
                self._pending.setdefault(address, weakref.WeakSet()).add(fut)
                self._inflight[key] = (fut, (args, kwargs))
                release = self._dropped.pop(address, [])  # outputs to drop there: they ride along
            try:
                conn = self._connection(address)
                conn.send([*frames(("call", key, step, release)), *task])  # the task: a message of its own
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
        return [unwrap_reply(got[f.key]) if f.stored else f.value for f in futures]

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
                conn.send(frames(("release", keys)))
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
