"""Where a stretch of wall time went: seconds some worker computed, and the share in which none did.

A single-controller program is fast when the workers are never waiting on the controller. `controller_share`
measures that for a block of controller code (one step, say): with Dask's task stream recording, it runs the
block and then takes the union of every task's compute spans on every worker, clipped to the block's wall time.
What is left, as a fraction of the wall time, is time in which no worker computed anything: the controller
issuing calls, serialising arguments, waiting on the scheduler, or transfers between workers. It is an upper
bound on the controller's own cost, and 0 means the workers were busy throughout.

The arithmetic (`union_spans`, `busy_seconds`) is plain functions of spans, tested without a cluster; the
dashboard's per-slot figures use the same union. Task-stream times are the workers' wall clocks
(`distributed.metrics.time`), so the block is timed with that clock too; on one host they agree, across hosts
they agree up to the clock skew between machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["ComputeProfile", "busy_seconds", "compute_spans", "controller_share", "union_spans"]


def union_spans(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """Spans clipped to [lo, hi], overlapping or touching ones merged, empty ones dropped, sorted."""
    out: list[list[float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_seconds(spans: Iterable[tuple[float, float]], start: float, stop: float) -> float:
    """Seconds within [start, stop] covered by at least one span (overlaps count once)."""
    return sum(b - a for a, b in union_spans(spans, start, stop))


def compute_spans(tasks: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """The compute spans of task-stream records (their `startstops` of action "compute"; transfers and disk
    reads are not computation)."""
    return [(s["start"], s["stop"]) for t in tasks for s in t.get("startstops", ()) if s.get("action") == "compute"]


@dataclasses.dataclass
class ComputeProfile:
    """What `controller_share` measured, filled in when its block ends."""

    wall_s: float = 0.0
    """The block's wall time."""
    busy_s: float = 0.0
    """Seconds of it in which at least one worker computed a task."""

    @property
    def controller_share(self) -> float:
        """The fraction of the wall time in which no worker computed anything (0 for an empty block)."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@contextlib.contextmanager
def controller_share(client: Any, extra: Any = None) -> Iterator[ComputeProfile]:
    """Profile the block: `with controller_share(client) as p: ...`, then read `p.controller_share`.

    `Controller.profile()` calls this with its client. Records Dask's task stream while the block runs (the
    scheduler's `TaskStreamPlugin`, added on first use), so it costs a scheduler round trip at each end.
    `extra(start, stop)`: compute spans of work that is not a Dask task (the direct call path's items).
    """
    from distributed import get_task_stream
    from distributed.metrics import time

    profile = ComputeProfile()
    with get_task_stream(client=client) as stream:
        start = time()
        yield profile
        stop = time()
    profile.wall_s = stop - start
    spans = compute_spans(stream.data) + (list(extra(start, stop)) if extra is not None else [])
    profile.busy_s = busy_seconds(spans, start, stop)
