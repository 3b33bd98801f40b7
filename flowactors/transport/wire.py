"""The direct path's wire: message frames, the handshake, stored-output references and fetches.

What both ends of a direct call share (docs/design.md §3, Direct calls; docs/security.md): a message is one pickle
(protocol 5, tensors out of band) behind a fixed header; a connection serves only a peer that proves it holds the
listening worker's secret (an HMAC of a nonce); reads are bounded (`MAX_MESSAGE_BYTES`, `MAX_BUFFERS`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CALLS_TOPIC",
    "HANDSHAKE_S",
    "INLINE_BYTES",
    "ISSUED_TOPIC",
    "MAX_MESSAGE_BYTES",
    "Connection",
    "DirectRef",
    "Fetcher",
    "InputRaised",
    "ProtocolError",
    "answer",
    "authenticate",
    "dial",
    "frames",
    "host_key",
    "pack_reports",
    "raw_frames",
    "reports_of",
    "unwrap_reply",
]

INLINE_BYTES = 64 * 1024
"""Outputs up to this size (flowactors.transport.pushed.payload_bytes) come back in the reply; larger ones stay on the worker
until `result()` asks."""
CALLS_TOPIC = "flowactors.calls"
ISSUED_TOPIC = "flowactors.issued"
"""The controller's reports of the items it sends, as it sends them (the dashboard's waiting calls)."""


def pack_reports(reports: list[dict]) -> bytes:
    """Reports of items (`CALLS_TOPIC`, `ISSUED_TOPIC`) as one msgpack blob for a `log_event`: Dask sizes and
    decodes an event object by object (on the scheduler, which an embedded cluster runs in the controller's
    process), a blob at once; only the dashboard unpacks it (`reports_of`)."""
    import msgpack

    return msgpack.packb(reports, use_bin_type=True, default=str)


def reports_of(event: Any) -> list[dict]:
    """The reports an item-report event carries (its "calls": packed by `pack_reports`, or a plain list)."""
    calls = event.get("calls") if isinstance(event, Mapping) else None
    if isinstance(calls, (bytes, bytearray, memoryview)):
        import msgpack

        return msgpack.unpackb(calls, raw=False)
    return list(calls or ())


_READ_CHUNK = 64 * 1024
_FRAME = struct.Struct("!QI")  # pickle bytes, number of out-of-band buffers; then each buffer's length (!Q), data
MAX_MESSAGE_BYTES = 1 << 33
"""The most one direct-path message (a call's pickled arguments, or a reply) may hold: 8 GiB. Larger values travel
as Dask futures (`Client.scatter`) or as another call's output, worker to worker."""
MAX_BUFFERS = 1 << 16
HANDSHAKE_S = 10.0
"""How long a new connection has to answer the worker's nonce before it is closed."""
_HELLO = b"flowactors-direct/1"
_NONCE_BYTES = 32


class DirectRef:
    """An output held by a worker's direct store, as it travels in arguments (a `DirectFuture` pickles to this)."""

    __slots__ = ("key", "address")

    def __init__(self, key: str, address: str) -> None:
        self.key, self.address = key, address

    def __reduce__(self) -> tuple:
        return (DirectRef, (self.key, self.address))

    def __repr__(self) -> str:
        return f"<DirectRef {self.key} on {self.address}>"


class ProtocolError(ConnectionError):
    """A peer that did not authenticate, or sent a frame past the limits: its connection is closed."""


class Connection:
    """One socket between a controller and a worker, written whole-message at a time under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.lock = threading.Lock()
        # Reads go through a buffer: a small message (header, pickle, few buffers) costs one `recv`, not one per
        # part; each `recv` releases and retakes the GIL, ~5-10 us of a call's latency. One reader at a time.
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def send(self, frames: list) -> None:
        """All `frames` in order, in one system call where the kernel takes them whole (`sendmsg`)."""
        with self.lock:
            sent = self.sock.sendmsg(frames)
            for f in frames:
                n = memoryview(f).nbytes
                if sent >= n:
                    sent -= n
                    continue
                self.sock.sendall(memoryview(f).cast("B")[sent:])
                sent = 0

    def buffered(self) -> bool:
        """Whether bytes of a next message were read already (a poll of the socket would not see them)."""
        return self._end > self._start

    def receive(self) -> Any:
        """The next message (ConnectionError once the other end closed)."""
        import pickle

        data, buffers = self.receive_frames()
        return pickle.loads(data, buffers=buffers)

    def receive_frames(self) -> tuple[bytearray, list[bytearray]]:
        """The next message's pickle bytes and out-of-band buffers, not yet unpickled."""
        if self._end == self._start:  # (most messages: a reply, an item) one `recv`, then cut from the buffer
            self._fill()
        start = self._start
        if self._end - start >= _FRAME.size:
            n, count = _FRAME.unpack_from(self._buf, start)
            if not count and self._end - start - _FRAME.size >= n:  # whole in the buffer
                self._start = start + _FRAME.size + n
                return self._buf[start + _FRAME.size : self._start], []
            self._start = start + _FRAME.size
        else:
            n, count = _FRAME.unpack(self._exactly(_FRAME.size))
        if count > MAX_BUFFERS:
            raise ProtocolError(f"a message announced {count} buffers, more than the {MAX_BUFFERS} allowed")
        sizes = struct.unpack(f"!{count}Q", self._exactly(8 * count)) if count else ()
        if n + sum(sizes) > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"a message announced {n + sum(sizes)} bytes, more than MAX_MESSAGE_BYTES = "
                f"{MAX_MESSAGE_BYTES}; send values that large as Dask futures (Client.scatter)"
            )
        data = self._exactly(n)
        return data, [self._exactly(k) for k in sizes]

    def _exactly(self, n: int) -> bytearray:
        """The next `n` bytes, a new bytearray (a tensor unpickled from it keeps it): what the buffer holds, then
        straight from the socket for a large remainder, or through the buffer for a small one."""
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            have = self._end - self._start
            if have:
                k = min(have, n - got)
                view[got : got + k] = self._view[self._start : self._start + k]
                self._start += k
                got += k
            elif n - got >= _READ_CHUNK:
                k = self.sock.recv_into(view[got:])
                if not k:
                    raise ConnectionError("the connection was closed")
                got += k
            else:
                self._fill()
        return out

    def _fill(self) -> None:
        """(The buffer empty.) What the socket has, up to the buffer's size; waits for at least a byte."""
        k = self.sock.recv_into(self._view)
        if not k:
            raise ConnectionError("the connection was closed")
        self._start, self._end = 0, k

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def frames(obj: Any) -> list:
    """`obj` as the frames of one message: pickle protocol 5, tensors out of band; cloudpickle (by value) where
    plain pickle cannot, or would name something of `__main__` the other process does not have."""
    buffers: list = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        data = b"__main__"
    if b"__main__" in data:
        from distributed.protocol.pickle import dumps

        buffers = []
        data = dumps(obj, buffer_callback=buffers.append)
    if not buffers:  # (most messages: headers, replies, small inputs)
        return [_FRAME.pack(len(data), 0) + data]
    views = [b.raw() for b in buffers]
    return [
        _FRAME.pack(len(data), len(views)) + struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views)) + data,
        *views,
    ]


def raw_frames(data: Any, buffers: list) -> list:
    """The frames of a message received as `data` and `buffers` (`Connection.receive_frames`), to send it on
    unchanged without unpickling it."""
    views = [memoryview(b) for b in buffers]
    return [
        _FRAME.pack(len(data), len(views)) + struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views)) + bytes(data),
        *views,
    ]


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _HELLO + nonce, hashlib.sha256).digest()


def authenticate(sock: socket.socket, secret: bytes) -> bool:
    """The worker's side of the handshake: send a nonce, check the peer's HMAC of it within `HANDSHAKE_S`."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    try:
        sock.settimeout(HANDSHAKE_S)
        sock.sendall(_HELLO + nonce)
        ok = hmac.compare_digest(bytes(read_exactly(sock, hashlib.sha256().digest_size)), _proof(secret, nonce))
        sock.settimeout(None)
        return ok
    except (OSError, ConnectionError):  # timed out, or gone
        return False


def answer(sock: socket.socket, secret: bytes) -> None:
    """The controller's side: prove it holds the worker's secret."""
    hello = bytes(read_exactly(sock, len(_HELLO) + _NONCE_BYTES))
    if not hello.startswith(_HELLO):
        raise ProtocolError(f"{sock.getpeername()} is not a flowactors direct-path listener")
    sock.sendall(_proof(secret, hello[len(_HELLO) :]))


LOCAL_SOCKETS_ENV = "FLOWACTORS_LOCAL_SOCKETS"
"""Set to 0 to keep the direct path on TCP between processes of one host (read when a connection is made)."""


@functools.cache
def host_key() -> str | None:
    """Who can reach this process's abstract Unix sockets: the processes of the same kernel boot and network
    namespace (Linux; None elsewhere, where the direct path stays on TCP)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def _local_socket(local: tuple[str, bytes] | None) -> socket.socket | None:
    """A connected Unix socket to a listener of this host (`local`: its host key and abstract name), or None where
    it is elsewhere, turned off, or does not answer (then TCP)."""
    if local is None or local[0] != host_key() or os.environ.get(LOCAL_SOCKETS_ENV, "1") == "0":
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(local[1])
    except OSError:
        sock.close()
        return None
    return sock


def dial(address: str, port: int, secret: bytes, local: tuple[str, bytes] | None = None) -> Connection:
    """An authenticated connection to the direct listener of the worker at `address`: through its Unix socket
    (`local`) when it runs on this host (no TCP stack: a send costs the sender ~1 us instead of ~15, a round trip
    ~20 us less), else by TCP to `port`. The handshake is the same on either."""
    from distributed.comm import get_address_host

    sock = _local_socket(local) or socket.create_connection((get_address_host(address), port), timeout=30)
    try:
        answer(sock, secret)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock)


class Fetcher:
    """Fetches stored outputs from workers' direct listeners (a `get` per connection at a time, connections
    pooled per worker): the controller's `values()` and a worker's inputs held by a peer. The bytes of a large
    output travel here, authenticated but not encrypted, rather than on Dask's comms, which with TLS would encrypt
    them on a machine where no one else can read the loopback traffic anyway."""

    def __init__(self, listener: Any) -> None:
        self._listener = listener  # address -> (port, secret)
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()

    def get(self, address: str, key: str) -> dict:
        """The worker's reply for `key`: {"status": "ok", "value"}, "raised" (with "exception") or "missing"."""
        return self.get_sized(address, key)[0]

    def get_sized(self, address: str, key: str) -> tuple[dict, int]:
        """`get`'s reply and the bytes it took on the wire."""
        import pickle

        with self._lock:
            idle = self._idle.get(address)
            conn = idle.pop() if idle else None
        if conn is None:
            conn = dial(address, *self._listener(address))
        try:
            conn.send(frames(("get", key)))
            data, buffers = conn.receive_frames()
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(conn)
        return pickle.loads(data, buffers=buffers), len(data) + sum(len(b) for b in buffers)

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


def read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the connection was closed")
        got += k
    return buf


class InputRaised(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def unwrap_reply(reply: Any) -> Any:
    """The value of a fetch's reply (`_lookup`); raises `InputRaised` for an item that raised, LookupError for
    one that was released."""
    if isinstance(reply, dict) and reply.get("status") == "raised":
        raise InputRaised(reply.get("exception"))
    if isinstance(reply, dict) and reply.get("status") == "missing":
        raise LookupError(reply.get("message"))
    return reply.get("value") if isinstance(reply, dict) else reply
