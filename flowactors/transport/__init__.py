"""How pinned work reaches the workers and how its results come back: one interface, three ways.

docs/design.md §3. The controller decides *what* runs where and in which order (the issue order, the watchdog, the
failures it reports); a `Transport` carries it. The controller holds exactly one, chosen when it opens
(`flowactors.controller.open_transport`) and kept for its life:

- **Dask tasks** (`flowactors.transport.tasks.DaskTransport`): one pinned task per rank, chained to the previous task on
  the same process, every rank of a call in one graph update; the task stream shows each call.
- **Dask tasks with pushed results** (`flowactors.transport.pushed.PushTransport`): the same tasks; each rank also sends a
  small output straight to the controller, which `result()` returns without Dask's return path.
- **Direct calls** (`flowactors.transport.channel.DirectTransport`; its wire,
  `flowactors.transport.wire`, and the workers' end, `flowactors.transport.server`): requests on one socket per worker, not through the
  scheduler; the default with the embedded cluster (~10x faster for a small call).

A transport reports what it sees in its own terms: `CallTimeout` when a wait ran out, `WorkerGone` when it found
a worker dead before the scheduler said so, and Dask's own cancellation errors for futures the controller
cancelled. The controller turns those into `HangError` (with every rank's stack, `flowactors.watchdog`) and
`WorkerLostError` (naming role and rank), the same for every transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowactors.futures import CallFuture
    from flowactors.transport.fanout import Fanout

__all__ = ["Transport", "CallTimeout", "WorkerGone", "ResultRecomputed", "Work", "by_call"]

Work = tuple[str | tuple[str, ...], Any, tuple, dict, str]
"""(address, fn, args, kwargs, key): `fn(*args, **kwargs)` to run on the worker at `address` under `key`. A tuple
of addresses (a `Controller.apply` where `apply_site` named several): any one of them, where the scheduler puts it."""


class CallTimeout(Exception):
    """The calls waited for did not all finish within the timeout (the controller reports where each rank is)."""


class WorkerGone(Exception):
    """The worker at `address` is gone: the transport lost its connection while `label` (a call) waited on it."""

    def __init__(self, address: str, label: str) -> None:
        super().__init__(f"worker {address} died during {label}")
        self.address, self.label = address, label


class ResultRecomputed(RuntimeError):
    """A call met a result that was lost with its worker and recomputed (Dask does so for a result still wanted, and
    for the released tasks it came from): an actor's call is not run twice, so the call fails; it failed for a
    worker's death, which the controller names once the scheduler has reported it."""


class Transport(ABC):
    """What the controller asks of a call path. `direct`: work bypasses the scheduler (`Controller.direct_calls`);
    `pushes_results`: group calls' ranks push their outputs to the controller (`Controller.pushes_results`)."""

    direct: bool = False
    pushes_results: bool = False
    fans_out: bool = False
    """Whether `submit_fanout` does better than one item per rank (it sends a call down a tree)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    # -- sending --------------------------------------------------------------------------------------------
    @abstractmethod
    def submit(self, tasks: Sequence[Work], step: int | None) -> list[Any]:
        """Start `tasks`, each on its worker after everything issued there before (docs/design.md §3, Ordering);
        one future per task, in order. The caller holds the controller's lock: this is the issue order."""

    def submit_fanout(self, call: "Fanout", step: int | None) -> list[Any]:
        """Start every rank of `call` (`flowactors.transport.fanout`); one future per rank, in order. By default
        its per-rank items, through `submit`."""
        from flowactors.transport.fanout import expand

        return self.submit(expand(call), step)

    def apply_site(self, args: tuple, kwargs: dict, slots: Sequence[str]) -> str | tuple[str, ...]:
        """The worker a `Controller.apply` over these (unwrapped) arguments runs on, one of `slots` (the world's
        live workers); all of them as a tuple: the scheduler places it among them, where its inputs are. Never a
        pool worker: those come and go with their owner (an elastic fleet's replica), and a step's data placed on
        one would be lost with it."""
        return tuple(slots)

    def ship(self, addresses: Sequence[str], per_rank: list) -> list:
        """Each rank's (args, kwargs) of a group call as they travel to `addresses` (unchanged by default)."""
        return per_rank

    def task_kwargs(self, key: str) -> dict[str, Any]:
        """Keywords a group call's rank task `key` takes besides its inputs (where to push its output)."""
        return {}

    def track(self, call: "CallFuture") -> None:
        """`call` was issued and is watched by the controller (a transport may tie state to its lifetime)."""

    # -- results --------------------------------------------------------------------------------------------
    @abstractmethod
    def resolve(self, calls: Sequence["CallFuture"], timeout: float | None, values: bool = True) -> list[list]:
        """Wait until `calls` finished, within `timeout` seconds (None: forever) or raise `CallTimeout`; then, with
        `values`, each call's per-rank outputs (raising what a runtime function raised), else []."""

    @abstractmethod
    def fetched_bytes(self, call: "CallFuture") -> dict[str, int]:
        """{worker: bytes} that `call`'s ranks fetched from it for their inputs (`Controller.fetched_bytes`)."""

    def detach(self, futures: Sequence[Any]) -> None:
        """Let `futures`' items run though the controller goes before they do (a direct item runs anyway)."""

    def busy(self, addresses: Sequence[str]) -> set[str]:
        """Those of `addresses` with an item sent and not finished, as far as this transport can tell (none where
        it cannot: the controller adds its own live calls)."""
        return set()

    @abstractmethod
    def settle(self, futures: Sequence[Any], timeout: float) -> None:
        """Wait up to `timeout` for `futures`, whatever their outcome (closing: errors may be raised or not)."""

    def connect(self, addresses: Sequence[str]) -> None:
        """Open what calls to `addresses` will need, before any is issued (nothing on the Dask transports): a
        worker that joins a running job is dialled outside the controller's lock, not by the first submission,
        which holds it."""

    # -- failures -------------------------------------------------------------------------------------------
    @abstractmethod
    async def worker_lost(self, address: str, futures: Sequence[Any]) -> None:
        """The scheduler removed the worker at `address`: fail every future pending there (`futures`: those of
        the calls the controller tracked on it). Runs on the client's event loop."""

    @abstractmethod
    def reset(self, stale: Sequence[Any]) -> None:
        """After recovery: cancel the `stale` futures of the forgotten groups, forget issue-order state."""

    # -- reports --------------------------------------------------------------------------------------------
    def stacks(self) -> dict[str, dict[str, list[str]]]:
        """{worker: {key: stack frames}} of work the Dask task stream does not show (for the hang report)."""
        return {}

    def records(self, start: float, stop: float) -> list[dict]:
        """What ran between `start` and `stop` (workers' clocks) outside Dask's task stream, shaped like its
        records: {"key", "worker", "startstops": [{"action": "compute", "start", "stop"}]}."""
        return []

    def spans(self, start: float, stop: float) -> list[tuple[float, float]]:
        """Compute spans of `records` (for `Controller.profile`)."""
        return [(s["start"], s["stop"]) for r in self.records(start, stop) for s in r["startstops"]]

    def close(self) -> None:
        """Release what the transport opened (sockets, listeners, plugins)."""


def by_call(outputs: Sequence[Any], calls: Sequence["CallFuture"]) -> list[list]:
    """The per-rank `outputs` of several calls, in one list, cut into one list per call."""
    out, i = [], 0
    for c in calls:
        out.append(list(outputs[i : i + len(c.futures)]))
        i += len(c.futures)
    return out
