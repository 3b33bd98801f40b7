"""A pool worker told to stop (SIGTERM: a scale-down, a preemption notice, a Slurm job at its time limit) says so
before it goes, so that the owner of its groups can take back what they hold first (a graceful retire).

`LeaveHandler`, a worker plugin the controller registers once, installs the handler on every worker that is no
slot (a pool worker) as it registers, on its event loop: the main thread, where signal handlers are set, and before
any group is built there, so a joining replica pays nothing for it. On the first SIGTERM the worker publishes
`TOPIC` with its address and waits to be retired (`Controller.retire_worker`), up to `grace_s`; then, or at a
second SIGTERM, it ends as the signal would have ended it. A worker nobody retires is therefore only `grace_s`
late, and one retired in time loses nothing it had finished. (A nanny closes its worker with a stop message, then
SIGKILL: never by SIGTERM, so an embedded cluster's shutdown is not delayed by this.)

A worker run by a nanny (`dask worker`, as dask-jobqueue's jobs run it) would still be lost: Slurm signals every
process of a job, and Dask's command line closes its nannies, and their workers, at the first SIGTERM.
`NannyLeaveHandler`, a nanny plugin, takes that signal in a pool worker's nanny instead: the nanny closes gracefully
(it ends once its worker does, never starting another) and passes the signal on to its worker, which may not have
had it (a `kill` of the job's process). The worker takes a SIGTERM within `REPEAT_S` of its first as the same notice
delivered twice. A second SIGTERM to the nanny later than that does what Dask's own handler does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

__all__ = ["LeaveHandler", "NannyLeaveHandler", "TOPIC", "install"]

TOPIC = "flowactors.leaving"
REPEAT_S = 1.0
"""A SIGTERM this soon after the first is the same notice again (Slurm's to the worker and its nanny's, passed on)."""


async def install(grace_s: float, dask_worker: Any = None) -> bool:
    """Announce a SIGTERM on this worker instead of dying of it (installed again: the latest grace); False where
    no handler can be set (not on the main thread)."""
    loop = asyncio.get_running_loop()
    worker = dask_worker
    state: dict[str, float | None] = {"at": None}

    def end() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def announce() -> None:
        worker.log_event(TOPIC, {"worker": worker.address, "grace_s": grace_s})
        loop.call_later(grace_s, end)

    def on_term(signum: int, frame: Any) -> None:
        first = state["at"]
        if first is None:
            state["at"] = time.monotonic()
            loop.call_soon_threadsafe(announce)
        elif time.monotonic() - first > REPEAT_S:
            end()

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        return False
    return True


def _is_slot(resources: Any, slot_resources: Sequence[str]) -> bool:
    return bool(set(slot_resources) & set(resources or ()))


class LeaveHandler(WorkerPlugin):
    """`install` on each worker that carries none of `slot_resources` (slots keep dying of SIGTERM: a lost slot is
    the controller's recovery, which nothing retires)."""

    name = "flowactors-leaving"

    def __init__(self, grace_s: float, slot_resources: Sequence[str]) -> None:
        self.grace_s, self.slot_resources = grace_s, tuple(slot_resources)

    async def setup(self, worker: Any) -> None:
        if not _is_slot(worker.state.total_resources, self.slot_resources):
            await install(self.grace_s, worker)

    async def teardown(self, worker: Any) -> None:
        """The controller is gone (it unregisters the plugin as it closes): nobody would retire this worker."""
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:
            pass


class NannyLeaveHandler(NannyPlugin):
    """In the nanny of each worker that carries none of `slot_resources` and runs in the main thread of its process
    (Dask's command line, one or several nannies; an embedded cluster's nannies share the controller's process and
    are left alone): a SIGTERM closes the nanny gracefully and passes the signal on to its worker (module
    docstring)."""

    name = "flowactors-leaving-nanny"

    def __init__(self, slot_resources: Sequence[str]) -> None:
        self.slot_resources = tuple(slot_resources)

    def setup(self, nanny: Any) -> None:
        if not _is_slot(nanny.resources, self.slot_resources):
            _NANNIES.take(nanny, asyncio.get_running_loop())

    def teardown(self, nanny: Any) -> None:
        """The controller is gone (it unregisters the plugin as it closes), or the nanny closes."""
        _NANNIES.drop(nanny)


class _Nannies:
    """The pool nannies of this process and the one SIGTERM handler they share (a process has one handler; Dask's
    command line runs `--nworkers` nannies in one process). The handler Dask set is kept and given back."""

    def __init__(self) -> None:
        self._nannies: dict[int, tuple[Any, asyncio.AbstractEventLoop]] = {}
        self._previous: Any = None
        self._first: float | None = None

    def take(self, nanny: Any, loop: asyncio.AbstractEventLoop) -> None:
        if not self._nannies:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_term)
            except ValueError:  # not the main thread: the nanny shares a process it does not own
                return
        self._nannies[id(nanny)] = (nanny, loop)

    def drop(self, nanny: Any) -> None:
        if self._nannies.pop(id(nanny), None) is not None and not self._nannies:
            self._restore()

    def _restore(self) -> None:
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_term:
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        except ValueError:
            pass

    def _on_term(self, signum: int, frame: Any) -> None:
        if self._first is None:
            self._first = time.monotonic()
            for nanny, loop in list(self._nannies.values()):
                loop.call_soon_threadsafe(_leave, nanny)
        elif time.monotonic() - self._first > REPEAT_S:  # told again: what Dask's own handler would have done
            previous = self._previous
            self._restore()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)


def _leave(nanny: Any) -> None:
    """The nanny ends once its worker does (retired, or at the end of its grace), and its worker is told."""
    nanny.close_gracefully(reason="flowactors: SIGTERM; its worker leaves once retired or at the end of its grace")
    pid = nanny.pid
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


_NANNIES = _Nannies()
