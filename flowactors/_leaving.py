"""A pool worker told to stop (SIGTERM: a scale-down, a preemption notice, a Slurm job at its time limit) says so
before it goes, so that the owner of its groups can take back what they hold first (a graceful retire).

`LeaveHandler`, a worker plugin the controller registers once, installs the handler on every worker that is no
slot (a pool worker) as it registers, on its event loop: the main thread, where signal handlers are set, and before
any group is built there, so a joining replica pays nothing for it. On the first SIGTERM the worker publishes
`TOPIC` with its address and waits to be retired (`Controller.retire_worker`), up to `grace_s`; then, or at a
second SIGTERM, it ends as the signal would have ended it. A worker nobody retires is therefore only `grace_s`
late, and one retired in time loses nothing it had finished. (A nanny closes its worker with a stop message, then
SIGKILL: never by SIGTERM, so an embedded cluster's shutdown is not delayed by this.)
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["LeaveHandler", "TOPIC", "install"]

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


class LeaveHandler(WorkerPlugin):
    """`install` on each worker that carries none of `slot_resources` (slots keep dying of SIGTERM: a lost slot is
    the controller's recovery, which nothing retires)."""

    name = "flowactors-leaving"

    def __init__(self, grace_s: float, slot_resources: Sequence[str]) -> None:
        self.grace_s, self.slot_resources = grace_s, tuple(slot_resources)

    async def setup(self, worker: Any) -> None:
        if not set(self.slot_resources) & set(worker.state.total_resources):
            await install(self.grace_s, worker)

    async def teardown(self, worker: Any) -> None:
        """The controller is gone (it unregisters the plugin as it closes): nobody would retire this worker."""
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:
            pass
