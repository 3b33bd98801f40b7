"""A rollout replica decoding in a thread of its own, between the worker's calls (asynchronous RL's streaming
partial rollouts: `async_rl.deterministic=false`, docs/asynchronous.md).

A worker runs its calls one at a time in its task thread; a replica that should keep generating while the
controller is busy elsewhere therefore decodes in a second thread, one segment at a time. Every call that touches
what the loop uses (admitting prompts, handing out finished groups, loading new weights, a checkpoint's snapshot)
runs inside `paused()`: it waits for the segment in progress to end, the loop waits while it runs, and decoding
resumes after it. A weight sync thus lands between two segments, never inside one, so every token is sampled by
one version, the one it records.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["DecodeLoop"]


class DecodeLoop:
    """Calls `step()` (one segment of every unfinished sequence; False when there was nothing to decode) in a
    daemon thread until `stop()`; idle after a False until the next `paused()` block, which may have admitted
    work. An exception in `step` stops the loop and is raised, with its traceback, by every later `paused()`."""

    def __init__(self, step: Callable[[], bool], name: str = "rollout-decode") -> None:
        self._step = step
        self._cond = threading.Condition()
        self._count = threading.Lock()
        self._waiting = 0  # callers in or entering paused(): the loop yields to them between segments
        self._idle = False
        self._stopped = False
        self.error: str | None = None
        self.progress = threading.Event()
        """Set after every segment (and when the loop stops): a caller waiting for finished work clears it inside
        `paused()` and waits on it outside."""
        # the current CUDA device is per thread: decode on the one the worker pinned, not on device 0
        self._device = (
            torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or not (self._waiting or self._idle))
                if self._stopped:
                    return
                try:
                    self._idle = not self._step()
                except BaseException as e:
                    self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                    self._stopped = True
                    self.progress.set()
                    return
            self.progress.set()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run the block between two segments, with the loop waiting."""
        with self._count:
            self._waiting += 1
        try:
            with self._cond:
                if self.error is not None:
                    raise RuntimeError(f"this replica's decode loop failed: {self.error}")
                yield
                self._idle = False  # the block may have admitted work
        finally:
            with self._count:
                self._waiting -= 1
            with self._cond:
                self._cond.notify_all()

    @property
    def alive(self) -> bool:
        """Decoding, or ready to: not stopped and not failed."""
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 60.0) -> None:
        """End the loop after the segment in progress."""
        with self._count:
            self._waiting += 1
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        with self._count:
            self._waiting -= 1
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
