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


def test_an_output_released_before_its_ready_mark_keeps_no_event_and_wakes_its_waiter():
    key, waited = "released-before-marked", "waited-then-released"
    server._STORE[key] = 1
    server._handle_release([key])
    server._mark_ready(key)  # the task thread marks after its reply; the release came first
    assert key not in server._READY and key not in server._STORE
    server._STORE[waited] = 2
    ev = server._ready(waited)  # a fetch waiting for it
    server._handle_release([waited])
    server._mark_ready(waited)
    assert ev.is_set() and waited not in server._READY
    server._STORE["kept"] = 3
    server._mark_ready("kept")  # the usual order: marked while stored
    assert server._READY["kept"].is_set()
    server._handle_release(["kept"])
    assert "kept" not in server._READY


def test_a_reply_counts_a_huge_int_by_its_size_and_small_scalars_without_measuring():
    from flowactors.transport.payload import payload_bytes
    from flowactors.transport.wire import INLINE_BYTES

    assert [payload_bytes(v) for v in (None, True, 3, -(2**63), 2.5)] == [16] * 5
    assert payload_bytes(10**200000) > INLINE_BYTES  # stays on its worker like any large output
    assert payload_bytes(torch.zeros(100, dtype=torch.float64)) == 800
