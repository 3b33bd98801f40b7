"""A pool worker told to stop (SIGTERM: a scale-down, a preemption notice, a Slurm job at its time limit) says so
before it goes, so that the owner of its groups can take back what they hold first (a graceful retire).

`install` runs on the worker's event loop (`Client.run` of a coroutine: the main thread, where signal handlers
are set). On the
first SIGTERM the worker publishes `TOPIC` with its address and waits to be retired (`Controller.retire_worker`),
up to `grace_s`; then, or at a second SIGTERM, it ends as the signal would have ended it. A worker nobody retires
is therefore only `grace_s` late, and one retired in time loses nothing it had finished.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

__all__ = ["TOPIC", "install"]

TOPIC = "flowactors.leaving"


async def install(grace_s: float, dask_worker: Any = None) -> bool:
    """Announce a SIGTERM on this worker instead of dying of it (installed again: the latest grace); False where
    no handler can be set (not on the main thread)."""
    loop = asyncio.get_running_loop()
    worker = dask_worker
    state = {"signalled": False}

    def end() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def announce() -> None:
        worker.log_event(TOPIC, {"worker": worker.address, "grace_s": grace_s})
        loop.call_later(grace_s, end)

    def on_term(signum: int, frame: Any) -> None:
        if state["signalled"]:
            end()
            return
        state["signalled"] = True
        loop.call_soon_threadsafe(announce)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        return False
    return True
