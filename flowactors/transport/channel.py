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

import atexit
import os
import secrets
import select
import sys
import threading
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import suppress as _suppress
from typing import Any

from distributed.metrics import time as clock

from flowactors.transport import CallTimeout, Transport, Work, WorkerGone
from flowactors.transport.fanout import ROOTS, Fanout, has_parts, part_refs, subtree_of, subtrees, trim
from flowactors.transport.server import (
    PLUGIN_NAME,
    DirectPlugin,
    fetched_for,
    listen_port,
    running_stack,
    spans_between,
)
from flowactors.transport.wire import (
    ISSUED_TOPIC,
    Connection,
    DirectRef,
    Fetcher,
    dial,
    frames,
    pack_reports,
    unwrap_reply,
)

__all__ = ["DirectChannel", "DirectFuture", "DirectTransport"]

ISSUE_REPORT_S = 0.2
"""The controller gathers issue reports this long into one message to the scheduler, off the caller's thread."""
RELEASE_S = 0.5


_EXITING = False


def _exiting() -> None:
    global _EXITING
    _EXITING = True


atexit.register(_exiting)


class DirectFuture:
    """One item sent on the direct path; the part of `distributed.Future`'s surface that `CallFuture` uses."""

    __slots__ = (
        "key",
        "address",
        "status",
        "value",
        "stored",
        "error",
        "seq",
        "tree",
        "lost_at",
        "replied",
        "_channel",
        "__weakref__",
    )

    def __init__(self, channel: "DirectChannel", key: str, address: str, seq: int = -1, tree: Any = None) -> None:
        self._channel, self.key, self.address, self.seq, self.tree = channel, key, address, seq, tree
        self.status = "pending"  # then "finished", "error" (the function raised) or "lost" (its worker died)
        self.value: Any = None
        self.stored = False  # finished, the value left on the worker (too large for the reply)
        self.error: BaseException | None = None
        self.lost_at: str | None = None  # "lost": the worker that died (this one's, or a relay's on its way)
        self.replied = False  # its worker (or the relay above it) has answered for it: nothing more will come

    def __del__(self) -> None:
        """Its output is dropped on its worker once nobody can ask for it (not at exit: no thread may start then,
        and the workers' stores go with the cluster)."""
        if _EXITING or sys.is_finalizing():
            return
        try:
            self._channel.release_one(self.key, self.address)
        except Exception:
            pass

    def done(self) -> bool:
        return self.status != "pending"

    def result(self, timeout: float | None = None) -> Any:
        """The item's output (raising what it raised, or a `ConnectionError` when its worker died); a
        `TimeoutError` past `timeout` seconds."""
        if not self._channel.wait([self], timeout):
            raise TimeoutError(f"{self.key} did not finish within {timeout} s")
        if self.status == "lost":
            raise ConnectionError(f"the worker {self.lost_at or self.address} running {self.key} died") from self.error
        if self.status == "error":
            raise self.error if isinstance(self.error, BaseException) else RuntimeError(self.error)
        return self._channel.values([self])[0]

    def __reduce__(self) -> tuple:
        return (DirectRef, (self.key, self.address))

    def __repr__(self) -> str:
        return f"<DirectFuture {self.key} {self.status}>"


class _Tree:
    """A call sent down a tree: its ranks' futures and addresses in rank order, the inputs held until it is done."""

    __slots__ = ("futures", "addresses", "inputs", "left", "_index")

    def __init__(self, futures: list[DirectFuture], addresses: list[str], inputs: Any) -> None:
        self.futures, self.addresses, self.inputs, self.left = futures, addresses, inputs, len(futures)
        self._index: dict[str, int] | None = None

    def position(self, address: str) -> int | None:
        """The rank index of `address` in this tree (None: not one of its ranks)."""
        if self._index is None:
            self._index = {a: i for i, a in enumerate(self.addresses)}
        return self._index.get(address)


def _unfinished(futures: Sequence[DirectFuture]) -> bool:
    """Whether some of `futures` may still finish: one is pending and none is lost (its worker died: the others
    may never finish)."""
    pending = False
    for f in futures:
        status = f.status
        if status == "lost":
            return False
        if status == "pending":
            pending = True
    return pending


class _Waiter:
    """A thread waiting for some futures: woken once, when all are done or one is lost, not at every reply (a
    wake that finds the call unfinished costs the waiting thread a context switch, tens of us on a busy host)."""

    __slots__ = ("futures", "next", "lock")

    def __init__(self, futures: Sequence[DirectFuture]) -> None:
        self.futures, self.next = futures, 0  # every future before `next` is done
        self.lock = threading.Lock()
        self.lock.acquire()  # released to wake the waiter

    def ready(self, lost: bool) -> bool:
        """(Holding the channel's lock.) Whether to wake: every future done, or (`lost`: one was lost since the
        last look) one of them lost. Futures finish in any order but never return to pending, so each look goes
        on from the first one the last look found pending."""
        if lost and not _unfinished(self.futures):
            return True
        fs, i = self.futures, self.next
        while i < len(fs) and fs[i].status != "pending":
            i += 1
        self.next = i
        return i == len(fs)


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

    def __init__(self, client: Any, listeners: dict[str, tuple] | None = None) -> None:
        """`listeners`: every worker's `wire.dial` arguments (port, secret, and its Unix socket or none), given
        instead of asked of a Dask `client`."""
        self._client = client
        self._lock = threading.RLock()  # guards the state below (no thread waits on it: `_Waiter`s)
        self._waiters: list[_Waiter] = []
        self._lost_since_wake = False  # a future was lost: waiters check for it, not only for all done
        self._pending: dict[str, dict[str, DirectFuture]] = {}  # address -> {key: future} of what is not done
        self._inflight: dict[str, tuple[DirectFuture, Any]] = {}  # key -> (future, its arguments, held)
        self._connections: dict[str, Connection] = {}
        self._listeners: dict[str, tuple] = {}  # each worker's direct port, secret (and Unix socket)
        self._fetcher = Fetcher(self._listener)
        self._fetch_pool: Any = None
        self._dropped: dict[str, list[str]] = {}
        self._drops: deque[tuple[str, str]] = deque()  # (address, key) released by finalizers, not yet sorted
        self._skips: dict[str, list[int]] = {}  # address -> numbers it must not wait for, sent with its next item
        self._dialing = threading.Lock()
        self._flush_pending = False
        self._issued: list[tuple] = []  # what was sent and not yet reported to the scheduler (the dashboard's)
        self._issue_pending = False
        self._last_sent: dict[str, str] = {}  # address -> the key sent there last (the order edge)
        self._closed = False
        self.id = secrets.token_hex(8)  # the workers order this controller's items by it and their numbers
        self._seq: dict[str, int] = {}  # address -> the number of the next item sent there
        self._trees: dict[str, _Tree] = {}  # calls sent down a tree, by id, until every rank answered
        self._tree_count = 0
        self._replies = _Replies(self) if hasattr(select, "epoll") and hasattr(os, "eventfd") else None
        if listeners is not None:  # light stand-in workers (benchmarks/fanout.py): no Dask client
            self._listeners.update(listeners)
        else:
            client.register_plugin(DirectPlugin(), name=PLUGIN_NAME)

    # -- connections -----------------------------------------------------------------------------------------
    def _listener(self, address: str) -> tuple:
        """The port and secret (and Unix socket) of `address`'s direct listener. Asked of all workers at once, and
        never of one that died (it would not answer); each connected worker is told the new table, to fetch from
        its peers. Once the table is known, a worker that joins later is asked alone (the others may be busy: an
        elastic pool's worker joins while the run trains)."""
        if address not in self._listeners:
            only = {"workers": [address]} if self._listeners else {}
            got = self._client.run(listen_port, on_error="return", **only)
            self._listeners.update({a: v for a, v in got.items() if isinstance(v, tuple)})
            for conn in list(self._connections.values()):
                with _suppress(OSError):
                    conn.send(frames(("peers", dict(self._listeners))))
        return self._listeners[address]  # KeyError: a worker the cluster does not know (any more)

    def _connection(self, address: str) -> Connection:
        conn = self._connections.get(address)
        if conn is None:
            with self._dialing:  # one connection per worker, whichever thread asks first
                conn = self._connections.get(address)
                if conn is None:
                    conn = dial(address, *self._listener(address))
                    conn.send(frames(("peers", dict(self._listeners))))
                    self._connections[address] = conn
                    if self._replies is not None:
                        self._replies.add(address, conn)
                    else:
                        threading.Thread(
                            target=self._read_replies,
                            args=(address, conn),
                            daemon=True,
                            name=f"flowactors-direct {address}",
                        ).start()
        return conn

    def _read_replies(self, address: str, conn: Connection) -> None:
        """(Without epoll: a thread per connection.) Read `conn`'s replies until it breaks."""
        while self._read_one(address, conn):
            pass

    def _read_one(self, address: str, conn: Connection) -> bool:
        """Read and apply `conn`'s next message; False once the connection broke (its worker's items fail)."""
        try:
            msg = conn.receive()
        except Exception as e:
            if self._connections.get(address) is conn:
                del self._connections[address]
            if not self._closed:
                self.fail_address(address, ConnectionError(f"lost the connection to worker {address}: {e}"))
            return False
        if msg[0] == "replies":
            self._on_tree_replies(msg[1], msg[2])
        else:
            self._on_replies([msg])
        del msg  # nothing of a finished item may stay referenced here while the next reply is awaited
        return True

    def _on_replies(self, replies: list) -> None:
        """Finish the futures of single items' `replies` ((key, status, value, stored) each)."""
        with self._lock:
            for key, status, value, stored in replies:
                entry = self._inflight.pop(key, None)  # the future, and the arguments held for it until now
                if entry is not None:
                    self._answer(entry[0], status, value, stored, None)
            self._wake()

    def _on_tree_replies(self, tree_id: str, replies: list) -> None:
        """Finish the futures of a tree's `replies` ((rank index, status, value, stored) each) under one lock. A
        rank reported "lost" by the relay above it (whose connection to the subtree broke) is lost at that
        subtree's first rank; its own worker, if alive, skips its number (the item may never arrive)."""
        skips: dict[str, list[int]] = {}
        with self._lock:
            tree = self._trees.get(tree_id)
            if tree is None:
                return
            futures = tree.futures
            for i, status, value, stored in replies:
                fut = futures[i]
                if not fut.replied:
                    fut.replied = True
                    tree.left -= 1
                    self._answer(fut, status, value, stored, skips)
            if tree.left <= 0:
                del self._trees[tree_id]
            self._wake()
        for address, seqs in skips.items():
            self._skip(address, seqs)

    def _answer(self, fut: DirectFuture, status: str, value: Any, stored: bool, skips: dict | None) -> None:
        """(Holding `_lock`.) `fut`'s reply; nothing for a future already cancelled but its number skipped where
        its item may never have arrived (the worker may live: a relay's connection to it can break for other
        reasons, and a skip to a dead worker costs nothing)."""
        if status == "lost" and skips is not None:
            skips.setdefault(fut.address, []).append(fut.seq)
        if fut.status != "pending":
            return
        if status == "error":
            fut.error, fut.status = value, "error"
        elif status == "lost":
            fut.lost_at, fut.error, fut.status = value[0], ConnectionError(value[1]), "lost"
            self._lost_since_wake = True
        else:
            fut.value, fut.stored, fut.status = value, stored, "finished"
        if fut.tree is None:
            waiting = self._pending.get(fut.address)
            if waiting is not None:
                waiting.pop(fut.key, None)

    def _skip(self, address: str, seqs: list[int]) -> None:
        """Tell `address` never to wait for items `seqs` (they may never arrive): now on its connection if there is
        one, else with the next item sent to it (never a dial from a reader thread or the event loop)."""
        conn = self._connections.get(address)
        if conn is not None:
            try:
                conn.send(frames(("skip", self.id, seqs)))
                return
            except OSError:  # gone: the next connection takes them
                pass
        with self._lock:
            self._skips.setdefault(address, []).extend(seqs)

    def close(self) -> None:
        """Close the connections, and the workers' listeners with the plugin (a long-lived cluster keeps none)."""
        self._closed = True
        for conn in list(self._connections.values()):
            conn.close()
        self._connections.clear()
        if self._replies is not None:
            self._replies.close()
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
            seq = self._next_seq(address)
            fut = DirectFuture(self, key, address, seq)
            out.append(fut)
            with self._lock:
                self._pending.setdefault(address, {})[key] = fut
                self._inflight[key] = (fut, (args, kwargs))
                self._drain_drops()
                release = self._dropped.pop(address, [])  # outputs to drop there: they ride along
                skips = self._skips.pop(address, [])
            try:
                conn = self._connection(address)
                head = frames(("skip", self.id, skips)) if skips else []
                conn.send([*head, *frames(("call", key, step, release, self.id, seq)), *task])  # the task apart
            except Exception as e:
                with self._lock:
                    self._inflight.pop(key, None)
                    self._skips.setdefault(address, []).extend([*skips, seq])  # if it lives, it must not wait
                self._finish(fut, "lost", error=e)
        return out

    def _next_seq(self, address: str) -> int:
        seq = self._seq.get(address, 0)
        self._seq[address] = seq + 1
        return seq

    def submit_fanout(self, call: Fanout, step: int | None = None) -> list[DirectFuture]:
        """Send `call` down a tree (`flowactors.transport.fanout`): the controller serializes the inputs once (once
        per root where ranks take parts: each root's subtree gets only its parts) and sends to at most `FANOUT`
        roots; each node sends its subtrees on and the replies come back up the same way. The ranks' items keep
        their place in each worker's issue order (their numbers), so trees and single items mix freely."""
        ranks = call.ranks
        addresses = [r.address for r in ranks]
        if any(a not in self._listeners for a in addresses):
            self._listener(next(a for a in addresses if a not in self._listeners))  # every worker's, at once
        marked = has_parts((call.args, call.kwargs)) if call.marked is None else call.marked
        roots = subtrees(len(ranks), ROOTS)
        if marked:  # each root's parts; all serialized before anything is sent (an error leaves no rank alone)
            payloads = []
            for start, stop in roots:
                lo, hi = min(r.part for r in ranks[start:stop]), max(r.part for r in ranks[start:stop])
                payloads.append(frames((call.fn, trim(call.args, lo, hi), trim(call.kwargs, lo, hi))))
        else:
            payloads = [frames((call.fn, call.args, call.kwargs))] * len(roots)
        self._tree_count += 1
        tree_id = f"{self.id}:{self._tree_count}"
        entries, futs = [], []
        at = clock()
        with self._lock:
            dropped = self._dropped
            self._drain_drops()
            seqs = self._seq
            for r in ranks:
                address = r.address
                seq = seqs.get(address, 0)
                seqs[address] = seq + 1
                futs.append(DirectFuture(self, r.key, address, seq, tree_id))
                release = (
                    (dropped.pop(address, None), self._skips.pop(address, None)) if dropped or self._skips else None
                )
                entries.append((address, r.key, seq, r.part, r.extra, r.kwargs, release))
            self._trees[tree_id] = _Tree(futs, addresses, (call.args, call.kwargs))
            self._issued.append((call, futs, step, at))  # reported after the sends (off the call's latency)
        for (start, stop), payload in zip(roots, payloads):
            try:
                conn = self._connection(addresses[start])
                header = ("tree", tree_id, self.id, step, entries[start:stop], start, marked, 1)
                conn.send([*frames(header), *payload])
            except Exception as e:
                lost = [(i, "lost", (addresses[start], f"{type(e).__name__}: {e}"), False) for i in range(start, stop)]
                self._on_tree_replies(tree_id, lost)
        self._schedule_issued()
        return futs

    def _report_issued(self, items: Sequence[tuple[str, Any, tuple, dict, str]], step: int | None) -> None:
        """Tell the scheduler (its dashboard) what is being sent, gathered over ISSUE_REPORT_S and sent from a
        timer thread: the caller does not wait on the scheduler, nor pay for the reports."""
        with self._lock:
            self._issued.append((items, None, step, clock()))
        self._schedule_issued()

    def _schedule_issued(self) -> None:
        with self._lock:
            if self._issue_pending:
                return  # a send is already scheduled and will take these too
            self._issue_pending = True
        _later(ISSUE_REPORT_S, self._send_issued)

    def _reports(self, items: Any, futs: list[DirectFuture] | None, step: int | None, at: float) -> list[dict]:
        """The issue reports of single `items` (Work), one dict each, or of a fan-out (`items` a Fanout, `futs`
        its ranks'), one dict for the whole call with a list per field (`fanout`: the scheduler's plugin expands
        it; a dict per rank cost the controller ~3 us a rank to build and send)."""
        if futs is None:
            reports = []
            for address, _, args, kwargs, key in items:
                deps = list(dict.fromkeys(f.key for f in _direct_futures((args, kwargs))))  # they travel as DirectRefs
                order = self._last_sent.get(address)
                self._last_sent[address] = key
                reports.append({"key": key, "worker": address, "deps": deps, "step": step, "order": order, "at": at})
            return reports
        ranks = items.ranks
        keys, workers = [r.key for r in ranks], [r.address for r in ranks]
        orders, last = [], self._last_sent
        for w, k in zip(workers, keys):  # (a worker twice in one call: its second item comes after its first)
            orders.append(last.get(w))
            last[w] = k
        shared, parts = part_refs((items.args, items.kwargs))
        base = list(dict.fromkeys(f.key for f in _direct_futures(shared)))
        report = {"fanout": True, "keys": keys, "workers": workers, "orders": orders, "deps": base}
        report.update(step=step, at=at)
        if any(_direct_futures(p.values) for p in parts):  # some ranks refer to outputs of their own part
            deps_of: dict[int, list[str]] = {}
            for r in ranks:
                if r.part not in deps_of:
                    own = (
                        [f.key for p in parts for f in _direct_futures(p.values[r.part - p.first])]
                        if r.part >= 0
                        else []
                    )
                    deps_of[r.part] = list(dict.fromkeys(base + own))
            report["deps_each"] = [deps_of[r.part] for r in ranks]
        return [report]

    def _send_issued(self) -> None:
        with self._lock:
            issued, self._issued = self._issued, []
            self._issue_pending = False
        if self._closed or self._client is None:
            return
        calls = [r for items, futs, step, at in issued for r in self._reports(items, futs, step, at)]
        if calls:
            try:
                self._client.log_event(ISSUED_TOPIC, {"calls": pack_reports(calls)})
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
        """Finish `fut` here (its send failed, its worker died, or it was cancelled)."""
        with self._lock:
            if fut.status == "pending":
                fut.value, fut.stored, fut.error, fut.status = value, stored, error, status
                self._lost_since_wake |= status == "lost"
                if fut.tree is None:
                    waiting = self._pending.get(fut.address)
                    if waiting is not None:
                        waiting.pop(fut.key, None)
            self._wake()

    # -- waiting and values ------------------------------------------------------------------------------------
    def wait(self, futures: Sequence[DirectFuture], timeout: float | None) -> bool:
        """Wait until every future is done, or one is lost (its worker died: the others may never finish);
        False when `timeout` ran out first."""
        with self._lock:
            if not _unfinished(futures):
                return True
            waiter = _Waiter(futures)
            self._waiters.append(waiter)
            polls = self._replies is not None and self._replies.lead(waiter)
        if polls:  # this thread reads the replies itself (`_Replies`): no reader thread's wake, then ours
            if self._replies.wait(waiter, timeout):
                return True
        elif waiter.lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return True
        with self._lock:  # timed out: unless woken meanwhile, no longer waiting
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            return not _unfinished(futures)

    def _wake(self) -> None:
        """(Holding `_lock`, after futures finished.) Wake the waiters whose futures are all done or one lost."""
        if self._waiters:
            lost, keep = self._lost_since_wake, []
            for w in self._waiters:
                if w.ready(lost):
                    w.lock.release()
                    if self._replies is not None:
                        self._replies.woke(w)
                else:
                    keep.append(w)
            self._waiters = keep
        self._lost_since_wake = False

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
        busy = self.unfinished(addresses)
        return min(addresses, key=busy.__getitem__)

    def unfinished(self, addresses: Sequence[str]) -> dict[str, int]:
        """{address: the number of items sent there and not yet done}."""
        with self._lock:
            busy = {a: len(self._pending.get(a, ())) for a in addresses}
            for tree in self._trees.values():
                for a in addresses:
                    i = tree.position(a)
                    if i is not None and tree.futures[i].status == "pending":
                        busy[a] += 1
            return busy

    def fail_address(self, address: str, error: BaseException, lost: bool = True) -> list[DirectFuture]:
        """Fail every pending item sent to `address`: `lost` (its worker died: the connection is closed too, and
        the ranks of the trees it relayed that have not answered are lost with it), or cancelled with `error` (the
        worker lives on; what it still replies for them is ignored). Returns them."""
        with self._lock:
            futs = list(self._pending.pop(address, {}).values())
            for f in futs:
                self._inflight.pop(f.key, None)
            for tree in self._trees.values():
                i = tree.position(address)
                if i is not None and tree.futures[i].status == "pending":
                    futs.append(tree.futures[i])
        for f in futs:
            self._finish(f, "lost" if lost else "error", error=error)
        if lost:
            self._lose_relayed(address)
            with self._lock:
                self._dropped.pop(address, None)
        conn = self._connections.pop(address, None) if lost else None
        if conn is not None:
            if self._replies is not None:
                self._replies.forget(conn)
            conn.close()
        if lost:
            self._fetcher.forget(address)
        return futs

    def _lose_relayed(self, address: str) -> None:
        """`address` died: in every tree it was a node of, it and the ranks below it that have not answered may
        never answer. They are lost at `address`, and the workers of the others skip their numbers."""
        skips: dict[str, list[int]] = {}
        with self._lock:
            for tree_id, tree in list(self._trees.items()):
                at = tree.position(address)
                if at is None:
                    continue
                start, stop = subtree_of(len(tree.futures), at)
                for f in tree.futures[start:stop]:
                    if f.replied:
                        continue
                    f.replied = True
                    tree.left -= 1
                    if f.status == "pending":
                        f.lost_at, f.error, f.status = address, ConnectionError(f"worker {address} died"), "lost"
                        self._lost_since_wake = True
                    skips.setdefault(f.address, []).append(f.seq)
                if tree.left <= 0:
                    del self._trees[tree_id]
            self._wake()
        for a, seqs in skips.items():
            self._skip(a, seqs)

    def release_one(self, key: str, address: str) -> None:
        """Drop the stored output of `key` on `address` (its future is gone: nobody can refer to it any more).
        Called from finalizers in any thread (an append, no lock): the next item sent to that worker takes the
        drops along, and a quiet worker this controller is connected to gets them on their own after `RELEASE_S`."""
        self._drops.append((address, key))
        if not self._flush_pending:
            self._flush_pending = True
            _later(RELEASE_S, self._release)

    def _drain_drops(self) -> None:
        """(Holding `_lock`.) Move the finalizers' drops into the per-worker lists."""
        drops, dropped = self._drops, self._dropped
        while drops:
            address, key = drops.popleft()
            dropped.setdefault(address, []).append(key)

    def _release(self) -> None:
        """Send the drops to the workers this controller is connected to; a worker it reaches only through trees
        gets its drops with its next item (connecting to every rank of a large tree would undo the tree)."""
        with self._lock:
            self._flush_pending = False
            self._drain_drops()
            by_address, self._dropped = self._dropped, {}
            for address in [a for a in by_address if a not in self._connections]:
                self._dropped[address] = by_address.pop(address)
        for address, keys in by_address.items():
            conn = self._connections.get(address)
            try:
                if conn is not None:
                    conn.send(frames(("release", keys)))
            except OSError:  # gone with its worker: a dead worker holds nothing any more
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


class _Replies:
    """The replies of every connection read by whichever thread waits (Linux: one epoll set, each connection armed
    for one event at a time). A caller waiting for its futures polls the set itself and reads the replies that
    come, its own or others', so the reply that completes its call wakes it directly: a reader thread per
    connection cost a wake of that thread and then one of the caller, each tens of us of CPU on a busy host. One
    caller polls at a time (the others wait on their `_Waiter`s as before); a background thread polls when no
    caller does, for replies nobody waits for and broken connections. While a caller polls the background
    thread does not (it looks again every `PARK_S`: a wake per call to hand the set back would cost what this
    saves), but it may be inside a poll begun before: epoll wakes its most recent waiter first, the caller, and a
    reply the background thread read for the caller wakes it through an eventfd that only the caller drains."""

    CAP_S = 0.05
    """A polling caller looks at its waiter at least this often (a wake through the eventfd by another thread
    while the background thread polls can reach the background thread)."""
    PARK_S = 0.005

    def __init__(self, channel: "DirectChannel") -> None:
        self._channel = channel
        self._epoll = select.epoll()
        self._kick = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._kick, select.EPOLLIN)
        self._conns: dict[int, tuple[str, Connection]] = {}
        self._polling: _Waiter | None = None  # the caller polling now (guarded by the channel's lock)
        self._poller = 0  # its thread
        self._thread: threading.Thread | None = None
        self._resume = threading.Event()  # a caller stopped polling while others wait

    def add(self, address: str, conn: Connection) -> None:
        fd = conn.sock.fileno()
        self._conns[fd] = (address, conn)
        self._epoll.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
        if self._thread is None:
            self._thread = threading.Thread(target=self._background, daemon=True, name="flowactors-direct replies")
            self._thread.start()

    def lead(self, waiter: _Waiter) -> bool:
        """(Holding the channel's lock.) Whether `waiter`'s thread polls: none polls yet."""
        if self._polling is not None:
            return False
        self._polling, self._poller = waiter, threading.get_ident()
        return True

    def woke(self, waiter: _Waiter) -> None:
        """(Holding the channel's lock.) `waiter` was released; if it polls in another thread, end its poll."""
        if waiter is self._polling and threading.get_ident() != self._poller:
            with _suppress(OSError):
                os.eventfd_write(self._kick, 1)

    def wait(self, waiter: _Waiter, timeout: float | None) -> bool:
        """Poll until `waiter` is released (True) or `timeout` runs out (False)."""
        deadline = None if timeout is None else clock() + max(0.0, timeout)
        try:
            while not waiter.lock.acquire(False):
                left = self.CAP_S if deadline is None else min(self.CAP_S, deadline - clock())
                if left <= 0 or self._channel._closed:
                    return waiter.lock.acquire(False)
                self._poll(left)
            return True
        finally:
            with self._channel._lock:
                self._polling = None
                if self._channel._waiters:  # others wait (on their locks): the background thread reads for them now
                    self._resume.set()

    def _background(self) -> None:
        while not self._channel._closed:
            if self._polling is not None:  # a caller reads meanwhile
                self._resume.wait(self.PARK_S)
                self._resume.clear()
            elif not self._poll(None, caller=False):
                return

    def _poll(self, timeout: float | None, caller: bool = True) -> bool:
        """Read what one poll finds; False once the set is closed."""
        try:
            events = self._epoll.poll(-1 if timeout is None else timeout, 8)
        except (OSError, ValueError):  # closed
            return False
        for fd, _ in events:
            if fd == self._kick:
                if caller or self._polling is None:  # (a caller's wake is its own to take)
                    with _suppress(OSError):
                        os.eventfd_read(self._kick)
                continue
            entry = self._conns.get(fd)
            if entry is not None:
                self._read(fd, *entry)
        return True

    def _read(self, fd: int, address: str, conn: Connection) -> None:
        """Read `conn`'s message and any the buffer holds whole or in part, then arm it for the next."""
        channel = self._channel
        while True:
            if not channel._read_one(address, conn):
                self._conns.pop(fd, None)
                with _suppress(OSError, ValueError):
                    self._epoll.unregister(fd)
                return
            if not conn.buffered():
                break
        try:
            self._epoll.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
        except (OSError, ValueError):  # closed meanwhile (its worker was failed)
            self._conns.pop(fd, None)

    def forget(self, conn: Connection) -> None:
        """Stop polling `conn` (before it is closed: its descriptor's number may be reused)."""
        with _suppress(OSError, ValueError):
            fd = conn.sock.fileno()
            if self._conns.get(fd, (None, None))[1] is conn:
                del self._conns[fd]
                self._epoll.unregister(fd)

    def close(self) -> None:
        with _suppress(OSError):
            os.eventfd_write(self._kick, 1)
        if self._thread is not None:
            self._thread.join(1)
        self._epoll.close()
        with _suppress(OSError):
            os.close(self._kick)


class DirectTransport(Transport):
    """Calls on the direct path (`DirectChannel`): the controller's `Transport` over it."""

    direct = True
    fans_out = True

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.channel = DirectChannel(client)

    def submit(self, tasks: Sequence[Work], step: int | None) -> list[DirectFuture]:
        return self.channel.submit(tasks, step=step)

    def connect(self, addresses: Sequence[str]) -> None:
        for a in addresses:
            self.channel._connection(a)

    def submit_fanout(self, call: Fanout, step: int | None) -> list[DirectFuture]:
        return self.channel.submit_fanout(call, step=step)

    def apply_site(self, args: tuple, kwargs: dict, slots: Sequence[str]) -> str:
        """The worker that produced the first input produced by one of `slots` (its output is there), else the
        least busy slot."""
        return next(
            (f.address for v in (*args, *kwargs.values()) for f in _direct_futures(v) if f.address in slots), None
        ) or self.channel.least_busy(slots)

    def resolve(self, calls: Sequence[Any], timeout: float | None, values: bool = True) -> list[list]:
        """A future whose connection broke means its worker is gone, whether or not the scheduler said so: every
        item pending there fails, and `WorkerGone` names it. A runtime function's exception is raised here."""
        if not self.channel.wait([f for c in calls for f in c.futures], timeout):
            raise CallTimeout()
        for c in calls:
            lost = next((f for f in c.futures if f.status == "lost"), None)
            if lost is not None:  # its worker died, or the worker of a relay on its way
                dead = lost.lost_at or lost.address
                self.channel.fail_address(dead, ConnectionError(f"worker {dead} died"))
                raise WorkerGone(dead, c.label) from lost.error
        if not values:
            return []
        for c in calls:
            failed = next((f for f in c.futures if f.status == "error"), None)
            if failed is not None:
                raise failed.error if isinstance(failed.error, BaseException) else RuntimeError(failed.error)
        return [self.channel.values(c.futures) for c in calls]

    def settle(self, futures: Sequence[DirectFuture], timeout: float) -> None:
        self.channel.wait(futures, timeout)

    def busy(self, addresses: Sequence[str]) -> set[str]:
        return {a for a, n in self.channel.unfinished(addresses).items() if n}

    def fetched_bytes(self, call: Any) -> dict[str, int]:
        """As each rank's worker counted its items' fetches (`server.fetched_for`)."""
        total: Counter[str] = Counter()
        for sizes in self.client.run(
            fetched_for, [f.key for f in call.futures], workers=list(set(call.addresses))
        ).values():
            total.update(sizes)
        return dict(total)

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
