"""Nothing listens beyond loopback unless asked, and nothing listens after its run.

Listening sockets are read the way `ss -ltnp` does: the LISTEN rows of /proc/net/tcp and /proc/net/tcp6, owned
by a process when their inode is one of its /proc/<pid>/fd links.
"""

import ipaddress
import os
import sys
import time
from pathlib import Path

import pytest

import flowactors as fa
from tests.runtime.workers import Reducer

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")

_LISTEN = "0A"


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == _LISTEN and cols[9] in inodes:
                    found.add(_address(cols[1]))
    return found


def _address(hex_address: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080): /proc prints each 32-bit word of the address in host byte order."""
    addr, port = hex_address.split(":")
    raw = b"".join(
        bytes.fromhex(addr[i : i + 8])[::-1] if sys.byteorder == "little" else bytes.fromhex(addr[i : i + 8])
        for i in range(0, len(addr), 8)
    )
    return str(ipaddress.ip_address(raw)), int(port, 16)


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _gloo_ifname() -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")  # read there (os.environ.get itself would travel as a copy)


def _store_port() -> int:
    from flowactors import _runtime

    return _runtime._WORLD["key"][2]


def test_a_default_run_listens_on_loopback_only():
    mine_before = listeners(os.getpid())
    with fa.Controller.local() as ctl:  # the defaults: 2 slots, dashboard on
        g = fa.ActorGroup(ctl, Reducer, name="ports")
        assert g.all_reduce(1.0).result() == [3.0, 3.0]  # gloo has connected its pairs
        pids = ctl.client.run(os.getpid)
        workers = {addr: listeners(pid) for addr, pid in pids.items()}
        ours = listeners(os.getpid()) - mine_before  # scheduler, nannies, dashboard
        store = ctl.client.run(_store_port, workers=[ctl.slots[0]])[ctl.slots[0]]
        gloo_ifname = ctl.client.run(_gloo_ifname)
    assert any(port == store for _, port in workers[ctl.slots[0]])  # rank 0 serves the store: it is looked at
    assert all(len(found) >= 2 for found in workers.values())  # Dask's own listener and gloo's, at least
    wide = {
        where: sorted(a for a in found if not _is_loopback(a[0]))
        for where, found in [*workers.items(), ("controller", ours)]
    }
    assert not any(wide.values()), f"listening beyond loopback: {wide}"
    assert set(gloo_ifname.values()) == {"lo"}  # gloo binds the loopback interface, whatever the host name is


def test_close_leaves_no_listener_in_a_long_lived_cluster():
    """`Controller.connect` to a cluster that outlives the run: after each close, its workers listen on exactly
    what they listened on before the first run (no rendezvous store or gloo listener left behind)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            resources={"slot": 1},
            dashboard_address=None,
            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        pids = client.run(os.getpid)
        before = {addr: listeners(pid) for addr, pid in pids.items()}
        for run in range(2):
            with fa.Controller.connect(cluster.scheduler_address, collective_timeout_s=120) as ctl:
                g = fa.ActorGroup(ctl, Reducer, name="long_lived")
                assert g.all_reduce(1.0).result() == [3.0, 3.0]
                rank0 = ctl.slots[0]
                assert listeners(pids[rank0]) - before[rank0], "the world's listeners were not seen"
            deadline = time.monotonic() + 10  # the store's thread closes its socket as it stops
            while (after := {a: listeners(p) for a, p in pids.items()}) != before and time.monotonic() < deadline:
                time.sleep(0.2)
            assert after == before, f"run {run}: left listening: { ({a: after[a] - before[a] for a in after}) }"
        assert set(client.run(_gloo_ifname).values()) == {None}  # undone with the world
