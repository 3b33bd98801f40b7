"""The direct path's wire and small runtime pieces on the call's critical path (docs/design.md §3, Direct calls):
buffered reads that keep every message whole, call tokens that stay unique across a fork, an output released
before its ready mark keeps nothing."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import pytest
import torch

from flowactors.futures import new_token
from flowactors.transport import server, wire


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


# Sizes around the read buffer's (a message held whole in it, one that fills it exactly, one a byte past it) and
# far past it (read straight into its own bytearray).
SIZES = [0, 1, 100, wire._READ_CHUNK - 1, wire._READ_CHUNK, wire._READ_CHUNK + 1, 3 << 20]


def test_messages_of_every_size_arrive_whole_and_in_order_through_the_read_buffer():
    a, b = _pair()
    sent = [("small", i, "x" * i) for i in range(5)]
    sent += [("tensor", n, torch.arange(n, dtype=torch.uint8)) for n in SIZES]
    sent += [("two", torch.ones(n // 2 + 1), torch.zeros(7)) for n in SIZES[:4]]
    with a, b:
        out, recv = wire.Connection(a), wire.Connection(b)

        def send() -> None:
            for msg in sent:
                out.send(wire.frames(msg))

        t = threading.Thread(target=send)
        t.start()
        got = [recv.receive() for _ in sent]
        t.join()
    for want, have in zip(sent, got):
        assert len(want) == len(have) and want[0] == have[0]
        for w, h in zip(want[1:], have[1:]):
            assert torch.equal(w, h) if isinstance(w, torch.Tensor) else w == h
    # Out-of-band buffers are the received tensors' own storage: each its own, writable.
    big, small = (next(h[2] for h in got if h[0] == "tensor" and h[1] == n) for n in (3 << 20, 100))
    big[0], small[1] = 255, 254
    assert int(big[0]) == 255 and int(small[1]) == 254 and int(small[0]) == 0 and int(big[1]) == 1


def test_a_message_trickling_in_byte_by_byte_and_back_to_back_ones_are_both_read_whole():
    a, b = _pair()
    msgs = [("first", list(range(50))), ("second", torch.arange(10)), ("third", "y" * 300)]
    data = b"".join(bytes(memoryview(f).cast("B")) for m in msgs for f in wire.frames(m))
    with a, b:
        recv = wire.Connection(b)

        def trickle() -> None:  # the first message a byte at a time, the rest in one write
            first = sum(memoryview(f).nbytes for f in wire.frames(msgs[0]))
            for i in range(first):
                a.send(data[i : i + 1])
                if i % 40 == 0:
                    time.sleep(0.001)
            a.sendall(data[first:])

        t = threading.Thread(target=trickle)
        t.start()
        got = [recv.receive() for _ in msgs]
        t.join()
    assert got[0] == msgs[0] and torch.equal(got[1][1], msgs[1][1]) and got[2] == msgs[2]


def test_a_connection_closed_mid_message_raises_connection_error():
    a, b = _pair()
    frames = wire.frames(("cut", torch.arange(1000)))
    whole = b"".join(bytes(memoryview(f).cast("B")) for f in frames)
    with b:
        a.sendall(whole[: len(whole) // 2])
        a.close()
        with pytest.raises(ConnectionError, match="closed"):
            wire.Connection(b).receive()


def _child_tokens(q) -> None:
    q.put([new_token() for _ in range(100)])


def test_call_tokens_are_unique_in_a_process_and_not_repeated_by_a_forked_child():
    mine = [new_token() for _ in range(1000)]
    assert len(set(mine)) == 1000 and all(len(t) == 16 and int(t, 16) >= 0 for t in mine)
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_child_tokens, args=(q,))
    child.start()
    theirs = q.get(timeout=60)
    child.join(60)
    after = [new_token() for _ in range(100)]
    assert not set(theirs) & set(mine + after)


def test_only_an_awaited_output_wakes_the_event_loop_and_a_release_keeps_nothing():
    import asyncio
    from types import SimpleNamespace

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker = SimpleNamespace(loop=SimpleNamespace(asyncio_loop=loop))
    replies = []
    try:
        fetch = asyncio.run_coroutine_threadsafe(server._lookup("awaited"), loop)  # a fetch before its item ran
        for _ in range(500):
            if "awaited" in server._WAITING:
                break
            time.sleep(0.01)
        assert not fetch.done()
        server._job(worker, replies.append, None, "awaited", None, lambda: 7, (), {}, None, [])
        assert fetch.result(timeout=10) == {"status": "ok", "value": 7}
        assert "awaited" not in server._WAITING
        server._job(worker, replies.append, None, "quiet", None, lambda: 8, (), {}, None, [])  # nobody waits
        assert "quiet" not in server._WAITING and server._STORE["quiet"] == 8
        done = asyncio.run_coroutine_threadsafe(server._lookup("quiet"), loop)  # stored: answered at once
        assert done.result(timeout=10) == {"status": "ok", "value": 8}
        assert replies == [("awaited", "ok", 7, False), ("quiet", "ok", 8, False)]
        server._handle_release(["awaited", "quiet"])
        assert "awaited" not in server._STORE and "quiet" not in server._STORE and not server._WAITING
        assert server._fetched("quiet") == {"status": "missing", "message": "quiet was released"}
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_an_output_released_before_its_item_ran_is_dropped_when_the_item_stores_it(monkeypatch):
    from types import SimpleNamespace

    worker = SimpleNamespace(loop=SimpleNamespace(asyncio_loop=None))
    replies = []
    monkeypatch.setattr(server, "_EARLY", {})
    monkeypatch.setattr(server, "_EARLY_KEEP", 3)
    server._handle_release(["early"])  # its future was dropped while the item still waited its turn
    server._job(worker, replies.append, None, "early", None, lambda: 9, (), {}, None, [])
    assert replies == [("early", "ok", 9, False)]  # it still answers its call
    assert "early" not in server._STORE and "early" not in server._EARLY
    server._job(worker, replies.append, None, "kept", None, lambda: 10, (), {}, None, [])
    assert server._STORE["kept"] == 10  # not released: stored until it is
    server._handle_release(["kept", "never1", "never2", "never3", "never4"])  # items that never come here
    assert "kept" not in server._STORE and list(server._EARLY) == ["never2", "never3", "never4"]


def test_inputs_made_in_this_process_come_from_the_store_or_wait_there_for_their_item():
    import asyncio
    from types import SimpleNamespace

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker = SimpleNamespace(address="here", loop=SimpleNamespace(asyncio_loop=loop))
    replies = []
    ref = wire.DirectRef
    try:
        server._STORE["made"] = 5
        refs = {"made": ref("made", "here")}
        server._job(worker, replies.append, None, "used", None, lambda x: x + 1, (refs["made"],), {}, refs, ["made"])
        assert replies[-1] == ("used", "ok", 6, False)
        server._STORE["broke"] = server._Raised(ValueError("its producer raised"))
        refs = {"broke": ref("broke", "here")}
        server._job(worker, replies.append, None, "after", None, lambda x: x, (refs["broke"],), {}, refs, ["broke"])
        assert replies[-1][:2] == ("after", "error") and str(replies[-1][2]) == "its producer raised"
        refs = {"later": ref("later", "here")}  # not made yet (another task thread runs it): waits for it
        waiting = threading.Thread(
            target=server._job,
            args=(worker, replies.append, None, "next", None, lambda x: x * 2, (refs["later"],), {}, refs, ["later"]),
        )
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and replies[-1][0] == "after"
        server._job(worker, replies.append, None, "later", None, lambda: 21, (), {}, None, [])
        waiting.join(10)
        assert replies[-2:] == [("later", "ok", 21, False), ("next", "ok", 42, False)]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server._handle_release(["made", "broke", "used", "after", "later", "next"])


def test_a_flush_does_not_report_running_an_item_that_ended_since_the_last():
    from types import SimpleNamespace

    sent = []
    worker = SimpleNamespace(address="w", log_event=lambda topic, msg: sent.append((topic, msg)))
    server._REPORTS.clear()
    server._REPORTS.extend(
        [
            {"key": "a", "state": "waiting", "deps": [], "order": None, "step": 1, "at": 1.0},
            {"key": "a", "state": "processing", "start": 1.5, "step": 1},
            {"key": "b", "state": "waiting", "deps": ["a"], "order": "a", "step": 1, "at": 1.6},
            {"key": "a", "deps": [], "order": None, "start": 1.5, "stop": 2.0, "ok": True, "step": 1},
            {"key": "b", "state": "processing", "start": 2.1, "step": 1},
        ]
    )
    server._flush_reports(worker)
    assert [(t, [(c["key"], c.get("state", "end")) for c in wire.reports_of(m)]) for t, m in sent] == [
        (wire.CALLS_TOPIC, [("a", "waiting"), ("b", "waiting"), ("a", "end"), ("b", "processing")])
    ]
    assert isinstance(sent[0][1]["calls"], bytes)  # one blob: the scheduler decodes no object of it
    server._flush_reports(worker)  # nothing new: nothing sent
    assert len(sent) == 1


def test_a_reply_counts_a_huge_int_by_its_size_and_small_scalars_without_measuring():
    from flowactors.transport.payload import payload_bytes
    from flowactors.transport.wire import INLINE_BYTES

    assert [payload_bytes(v) for v in (None, True, 3, -(2**63), 2.5)] == [16] * 5
    assert payload_bytes(10**200000) > INLINE_BYTES  # stays on its worker like any large output
    assert payload_bytes(torch.zeros(100, dtype=torch.float64)) == 800


def _listeners(secret: bytes) -> tuple[socket.socket, socket.socket, bytes, list]:
    """A TCP and an abstract Unix listener that authenticate peers with `secret`; the families of the connections
    that got through land in the returned list."""
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = b"\0flowactors-test-" + new_token().encode()
    unix.bind(name)
    unix.listen(8)
    seen: list = []

    def accept(listener: socket.socket) -> None:
        while True:
            try:
                s, _ = listener.accept()
            except OSError:
                return
            if wire.authenticate(s, secret):
                seen.append(s.family)
            s.close()

    for listener in (tcp, unix):
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
    return tcp, unix, name, seen


@pytest.mark.skipif(wire.host_key() is None, reason="abstract Unix sockets are Linux's")
def test_a_peer_on_this_host_is_dialled_by_its_unix_socket_and_any_other_by_tcp(monkeypatch):
    secret = b"s" * 32
    tcp, unix, name, seen = _listeners(secret)
    port = tcp.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    try:
        cases = [
            ((wire.host_key(), name), socket.AF_UNIX),  # this host: the Unix socket
            (("another-boot/1", name), socket.AF_INET),  # another host's key: TCP, even if the name exists here
            ((wire.host_key(), b"\0flowactors-nobody-" + new_token().encode()), socket.AF_INET),  # gone: TCP
            (None, socket.AF_INET),  # a listener without one
        ]
        for local, family in cases:
            conn = wire.dial(address, port, secret, local)
            assert conn.sock.family == family, local
            conn.close()
        monkeypatch.setenv(wire.LOCAL_SOCKETS_ENV, "0")
        conn = wire.dial(address, port, secret, (wire.host_key(), name))
        assert conn.sock.family == socket.AF_INET
        conn.close()
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == sorted([socket.AF_UNIX] + [socket.AF_INET] * 4)  # each authenticated where it chose
        with pytest.raises((ConnectionError, OSError)):  # the wrong secret is refused on the Unix socket too
            wire.dial(address, port, b"x" * 32, (wire.host_key(), name)).receive()
    finally:
        tcp.close()
        unix.close()


def _waiting(futures: int) -> tuple:
    """A channel, `futures` pending futures of it, a thread waiting for them all (registered when this returns),
    and the list its `wait` answer lands in."""
    from flowactors.transport.channel import DirectChannel, DirectFuture

    ch = DirectChannel(None, listeners={})
    futs = [DirectFuture(ch, new_token(), "tcp://nowhere:1") for _ in range(futures)]
    woke: list = []
    t = threading.Thread(target=lambda: woke.append(ch.wait(futs, None)))
    t.start()
    deadline = time.monotonic() + 10
    while not ch._waiters and time.monotonic() < deadline:
        time.sleep(0.001)
    return ch, futs, t, woke


def test_a_waiter_wakes_once_when_its_last_future_is_done_not_at_each_reply():
    ch, futs, t, woke = _waiting(3)
    for f in (futs[2], futs[0]):  # out of order: the waiter stays registered, asleep
        ch._finish(f, "finished", value=1)
        time.sleep(0.02)
        assert t.is_alive() and len(ch._waiters) == 1 and not woke
    ch._finish(futs[1], "finished", value=2)
    t.join(10)
    assert woke == [True] and ch._waiters == []
    assert [f.value for f in futs] == [1, 2, 1]


def test_a_lost_future_wakes_its_waiter_at_once_and_a_timeout_leaves_no_waiter():
    ch, futs, t, woke = _waiting(2)
    ch._finish(futs[1], "lost", error=ConnectionError("gone"))  # the other may never finish
    t.join(10)
    assert woke == [True] and futs[0].status == "pending"
    assert ch.wait(futs[:1], 0.05) is False and ch._waiters == []  # timed out: not left registered
    ch._finish(futs[0], "finished", value=3)
    assert ch.wait(futs[:1], 0.05) is True
