"""The controller's reply reading (`channel._Replies`): a waiting caller reads the replies itself, the background
thread reads when nobody waits, and a caller whose reply another thread read is woken at once."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from flowactors.transport import channel
from flowactors.transport.wire import Connection, frames

pytestmark = pytest.mark.skipif(not hasattr(select, "epoll"), reason="the polled replies need epoll (Linux)")


class _Channel:
    """What `_Replies` needs of a `DirectChannel` (its lock, `_closed`, `_waiters`, `_read_one`), its messages waking the
    waiter registered under their text; records which thread read each."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self.waiters: dict[str, channel._Waiter] = {}
        self._waiters: list = []  # (the channel's waiters on their locks: none here)
        self.read: list[tuple[str, str]] = []
        self.broken: list[str] = []
        self.replies = channel._Replies(self)

    def _read_one(self, address: str, conn: Connection) -> bool:
        try:
            msg = conn.receive()
        except Exception:
            self.broken.append(address)
            return False
        self.read.append((msg, threading.current_thread().name))
        with self._lock:
            w = self.waiters.pop(msg, None)
            if w is not None:
                w.lock.release()
                self.replies.woke(w)
        return True


@pytest.fixture
def link():
    ch = _Channel()
    here, there = socket.socketpair()
    ch.replies.add("w0", Connection(here))
    yield ch, Connection(there)
    ch._closed = True
    ch.replies.close()
    there.close()


def _poll_in_thread(ch: _Channel, waiter: channel._Waiter, out: list) -> threading.Thread:
    def run() -> None:
        with ch._lock:
            assert ch.replies.lead(waiter)  # in the waiting thread, as `DirectChannel.wait` does
        t0 = time.monotonic()
        out.append((ch.replies.wait(waiter, 20), time.monotonic() - t0))

    t = threading.Thread(target=run, name="caller")
    t.start()
    return t


def test_the_waiting_caller_reads_its_replies_and_the_background_thread_those_nobody_waits_for():
    ch = _Channel()
    here, there = socket.socketpair()
    worker = Connection(there)
    waiter, out = channel._Waiter([]), []
    ch.waiters["mine"] = waiter
    try:
        caller = _poll_in_thread(ch, waiter, out)
        deadline = time.monotonic() + 10
        while ch.replies._polling is not waiter and time.monotonic() < deadline:
            time.sleep(0.01)
        # the connection's first reply arrives while the caller polls: the background thread (started with the
        # first connection) finds a caller polling and stays out of the set
        ch.replies.add("w0", Connection(here))
        worker.send([*frames("mine"), *frames("next")])  # two in one send: the second only in the reader's buffer
        caller.join(20)
        assert out and out[0][0] is True
        assert ch.read == [("mine", "caller"), ("next", "caller")]
        assert ch.replies._polling is None  # the next caller may poll
        worker.send(frames("later"))  # nobody waits: the background thread reads it
        while len(ch.read) < 3 and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert ch.read[2:] == [("later", "flowactors-direct replies")]
    finally:
        ch._closed = True
        ch.replies.close()
        there.close()


def test_a_caller_whose_reply_another_thread_read_is_woken_at_once(link, monkeypatch):
    ch, _ = link
    monkeypatch.setattr(channel._Replies, "CAP_S", 30.0)  # only the eventfd can end its poll within the test
    waiter, out = channel._Waiter([]), []
    caller = _poll_in_thread(ch, waiter, out)
    time.sleep(0.2)
    with ch._lock:  # as a reply read elsewhere (the background thread, a lost worker) completes its call
        waiter.lock.release()
        ch.replies.woke(waiter)
    caller.join(20)
    assert out and out[0][0] is True and out[0][1] < 10


def test_a_polling_caller_times_out_and_a_broken_connection_is_dropped(link):
    ch, worker = link
    waiter = channel._Waiter([])
    assert ch.replies.lead(waiter)
    t0 = time.monotonic()
    assert ch.replies.wait(waiter, 0.2) is False and 0.15 < time.monotonic() - t0 < 5
    worker.close()  # its worker died
    deadline = time.monotonic() + 10
    while not ch.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ch.broken == ["w0"] and not ch.replies._conns
