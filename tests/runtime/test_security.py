"""Nobody else gets in (issue 41): on the embedded cluster every listener that deserializes serves only peers holding
the run's credentials, and no frame is allocated before its size is checked.

Each attack is made as another local user would make it: a Dask client with no credentials or with credentials of
its own, a pickle that would create a file sent to the scheduler, each nanny, each worker and each direct-call
socket, a header claiming 8 GiB, hundreds of connections held open. The control case (`secure=False`) shows the same
stranger getting in, so the tests would see a door left open."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

import flowactors as fa
from flowactors.transport import server, wire
from tests.runtime.workers import Reducer


class _Touch:
    """Unpickling this creates the file: proof that a listener ran a stranger's code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


@pytest.fixture(scope="module")
def ctl():
    with fa.Controller.local(2, dashboard=None, call_timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def group(ctl):
    g = fa.ActorGroup(ctl, Reducer, name="secured")
    assert g.all_reduce(1.0).result() == [3.0, 3.0]
    yield g
    g.close()


def _listeners(ctl) -> list[str]:
    """The Dask addresses of the scheduler, each worker and each nanny."""
    workers = ctl.client.scheduler_info(n_workers=-1)["workers"]
    return [ctl.cluster.scheduler_address, *workers, *(w["nanny"] for w in workers.values())]


async def _stranger_sends(address: str, marker: Path, security) -> str:
    """Connect as a stranger (plain TCP when `security` is None, else TLS with those credentials) and send a
    message whose unpickling would create `marker`; what happened, in words."""
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    scheme, rest = address.split("://")
    try:
        if security is None:
            comm = await connect(f"tcp://{rest}", timeout=5)
        else:
            comm = await connect(f"tls://{rest}", timeout=5, **security.get_connection_args("client"))
        await comm.write({"op": "identity", "payload": to_serialize(_Touch(marker)), "reply": True})
        return f"answered {await comm.read()}"
    except Exception as e:
        return f"refused: {type(e).__name__}"


def test_the_embedded_cluster_speaks_tls_and_a_stranger_is_refused_on_every_dask_listener(ctl, tmp_path):
    from distributed import Client
    from distributed.security import Security

    addresses = _listeners(ctl)
    assert len(addresses) == 5 and all(a.startswith("tls://127.0.0.1:") for a in addresses)
    own = Security.temporary()  # a stranger's own self-signed credentials
    for i, address in enumerate(addresses):
        for kind, security in (("plain", None), ("own-cert", own)):
            marker = tmp_path / f"{i}-{kind}"
            got = asyncio.run(_stranger_sends(address, marker, security))
            assert got.startswith("refused"), (address, kind, got)
            assert not marker.exists(), (address, kind)
    with pytest.raises(Exception):
        Client(ctl.cluster.scheduler_address, security=own, timeout=3, set_as_default=False)
    assert ctl.client.run(lambda: 1) == {a: 1 for a in ctl.slots}  # the run's own client still gets in


def test_without_security_the_same_stranger_gets_in(tmp_path):
    """The control: `secure=False` leaves Dask's listeners open, and the stranger's pickle runs."""
    with fa.Controller.local(1, dashboard=None, secure=False) as ctl:
        (address,) = ctl.slots
        assert address.startswith("tcp://")
        marker = tmp_path / "ran"
        asyncio.run(_stranger_sends(address, marker, None))
        assert marker.exists()
        # joining a plain-TCP cluster, the (authenticated) direct path is the default: no weaker than its door
        with fa.Controller.connect(ctl.cluster.scheduler_address) as joined:
            assert joined.direct_calls


def test_joining_a_tls_cluster_keeps_the_dask_path_unless_asked(ctl):
    """The direct path authenticates but does not encrypt: on a TLS cluster it would be the weaker door."""
    with fa.Controller.connect(ctl.cluster.scheduler_address, security=ctl.cluster.security) as joined:
        assert not joined.direct_calls
        assert len(joined.slots) == 2


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end closed `s` (a reset counts: it closed with our bytes unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _listener(ctl, address: str) -> tuple:
    """`address`'s direct listener as the controller learns it: port, secret, Unix socket (or None)."""
    return ctl.client.run(server.listen_port, workers=[address])[address]


def _direct_port(ctl, address: str) -> int:
    return _listener(ctl, address)[0]


def _connect(ctl, address: str, kind: str) -> socket.socket:
    """A stranger's connection to `address`'s direct listener: by TCP, or by its Unix socket (peers on this host)."""
    port, _, local = _listener(ctl, address)
    if kind == "tcp":
        return socket.create_connection(("127.0.0.1", port), timeout=30)
    if local is None:
        pytest.skip("no Unix socket on this platform (abstract names are Linux's)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(local[1])
    return s


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_strangers_pickle_on_a_direct_socket_is_never_read(ctl, group, tmp_path, kind):
    for address in ctl.slots:
        marker = tmp_path / address.rsplit(":", 1)[1]
        data = pickle.dumps(_Touch(marker), protocol=5)
        with _connect(ctl, address, kind) as s:
            hello = s.recv(64)
            assert hello.startswith(b"flowactors-direct/1")
            s.sendall(struct.pack("!QI", len(data), 0) + data)  # a frame, where the proof should be
            assert _closed_by_peer(s)  # at once: the frame was taken for a (wrong) proof
        assert not marker.exists()
        assert any("did not authenticate" in r for r in ctl.client.run(server.refused, workers=[address])[address])
    assert group.all_reduce(2.0).result() == [6.0, 6.0]


def test_a_header_claiming_8_gib_allocates_nothing(ctl, group):
    import psutil

    address = ctl.slots[0]
    port = _direct_port(ctl, address)
    pid = ctl.client.run(lambda: __import__("os").getpid(), workers=[address])[address]
    before = psutil.Process(pid).memory_info().rss
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.recv(64)
        s.sendall(struct.pack("!QI", 8 << 30, 0) + bytes(20))  # the 12-byte header of the report, then the rest
        assert _closed_by_peer(s)
    assert psutil.Process(pid).memory_info().rss - before < 64 << 20
    assert group.all_reduce(1.0).result() == [3.0, 3.0]


def test_an_authenticated_peer_past_the_size_limit_is_cut_off_before_allocation():
    """Past the handshake too, a header is checked before its bytes are allocated (1 TiB would raise MemoryError)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    with a, b:
        a.sendall(struct.pack("!QI", 1 << 40, 0))
        with pytest.raises(wire.ProtocolError, match="more than MAX_MESSAGE_BYTES"):
            wire.Connection(b).receive_frames()
        a.sendall(struct.pack("!QI", 8, 1 << 20))
        with pytest.raises(wire.ProtocolError, match="buffers"):
            wire.Connection(b).receive_frames()


def test_hundreds_of_held_connections_do_not_stall_the_run(ctl, group):
    """300 idle connections to each direct socket and to the scheduler: calls go on, and each held direct
    connection is closed once its handshake time is up."""
    held: list[socket.socket] = []
    host_ports = [("127.0.0.1", _direct_port(ctl, a)) for a in ctl.slots]
    host_ports.append(("127.0.0.1", int(ctl.cluster.scheduler_address.rsplit(":", 1)[1])))
    try:
        for hp in host_ports:
            held += [socket.create_connection(hp, timeout=30) for _ in range(300)]
        start = time.monotonic()
        for i in range(20):
            assert group.all_reduce(float(i)).result() == [3.0 * i, 3.0 * i]
        assert time.monotonic() - start < 10
        direct = held[:600]
        deadline = time.monotonic() + wire.HANDSHAKE_S + 20
        closed = 0
        for s in direct:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                s.recv(64)  # the hello
                closed += _closed_by_peer(s)
            except (TimeoutError, OSError):
                pass
        assert closed == len(direct)
    finally:
        for s in held:
            s.close()


def test_a_controller_that_knows_the_secret_gets_through_and_one_that_guesses_does_not(ctl, group):
    address = ctl.slots[0]
    port, secret, _ = _listener(ctl, address)
    results = {}

    def attempt(name: str, key: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            wire.answer(s, key)
            conn = wire.Connection(s)
            conn.send(wire.frames(("release", [])))  # a message the worker acts on without replying
            s.settimeout(2)
            try:
                results[name] = "closed" if _closed_by_peer(s) else "sent something"
            except TimeoutError:
                results[name] = "open"

    threads = [
        threading.Thread(target=attempt, args=("right", secret)),
        threading.Thread(target=attempt, args=("wrong", bytes(32))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"right": "open", "wrong": "closed"}
