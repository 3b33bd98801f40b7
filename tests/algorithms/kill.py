"""A real 2-worker cluster whose second worker process is SIGKILLed once a condition holds (recovery tests)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from distributed import Client, LocalCluster


def slot_cluster(n: int) -> LocalCluster:
    """A real cluster of `n` single-threaded worker processes advertising a slot each, as a user's would be."""
    return LocalCluster(
        n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
        resources={"slot": 1},
    )  # fmt: skip


@contextmanager
def worker_killed_when(
    ready: Callable[[], bool], *, timeout_s: float = 120.0
) -> Iterator[tuple[str, str, threading.Event]]:
    """Yields (scheduler address, the victim's address, an event set once it was killed). The kill happens when
    `ready()` first holds while the block runs (checked every 50 ms, for at most `timeout_s`)."""
    cluster = slot_cluster(2)
    client = Client(cluster)
    try:
        victim, pid = list(client.run(os.getpid).items())[1]
        over, killed = threading.Event(), threading.Event()

        def kill() -> None:
            deadline = time.monotonic() + timeout_s
            while not ready() and time.monotonic() < deadline and not over.is_set():
                time.sleep(0.05)
            if ready() and not over.is_set():
                os.kill(pid, signal.SIGKILL)
                killed.set()

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        try:
            yield cluster.scheduler_address, victim, killed
        finally:
            over.set()
            killer.join()
    finally:
        client.close()
        cluster.close()
