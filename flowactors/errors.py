"""Errors the controller raises for remote failures, each naming where it happened and what to do."""

from __future__ import annotations

__all__ = [
    "FlowactorsError",
    "RemoteError",
    "WorkerLostError",
    "EndpointError",
    "PlacementError",
    "HangError",
    "SchedulerUnreachableError",
    "ClusterStartError",
]


class FlowactorsError(RuntimeError):
    """Base class of the runtime's own errors."""


class RemoteError(FlowactorsError):
    """A method raised on one or more ranks; carries the remote traceback of the first failing rank."""

    def __init__(
        self,
        group: str,
        method: str,
        rank: int,
        exc_type: str,
        message: str,
        traceback: str,
        failed_ranks: list[int] | None = None,
    ) -> None:
        self.group, self.method, self.rank = group, method, rank
        self.exc_type, self.remote_message, self.remote_traceback = exc_type, message, traceback
        self.failed_ranks = failed_ranks or [rank]
        super().__init__(
            f"{group}.{method} failed on rank {rank} (ranks failed: {self.failed_ranks}): "
            f"{exc_type}: {message}\n--- remote traceback (rank {rank}) ---\n{traceback}"
        )

    def __reduce__(self) -> tuple:  # survive pickling between processes with all fields
        return (
            RemoteError,
            (
                self.group,
                self.method,
                self.rank,
                self.exc_type,
                self.remote_message,
                self.remote_traceback,
                self.failed_ranks,
            ),
        )


class WorkerLostError(FlowactorsError):
    """The worker process hosting a rank died (or, `retired`, its owner retired it) while a call was pending or its
    result was still needed."""

    def __init__(
        self, address: str, hosted: list[tuple[str, int]], call: str | None = None, retired: bool = False
    ) -> None:
        self.address, self.hosted, self.call, self.retired = address, hosted, call, retired
        roles = ", ".join(f"{g} rank {r}" for g, r in hosted) or "no group"
        what = f"{call} cannot complete: " if call else ""
        if retired:
            message = (
                f"{what}worker {address} was retired (it hosted {roles}); what it ran or held and was not taken "
                f"back before `retire_worker` is gone. Issue those calls again on live workers"
            )
        else:
            message = (
                f"{what}worker {address} died (it hosted {roles}); its pending calls were failed. "
                f"Rebuild the affected groups on live workers and restore the last checkpoint"
            )
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return (WorkerLostError, (self.address, self.hosted, self.call, self.retired))


class EndpointError(FlowactorsError, AttributeError):
    """A controller-side call to something that is not a remote endpoint."""


class PlacementError(FlowactorsError, ValueError):
    """A group cannot be placed as asked (too few slots, conflicting process-group settings, ...)."""


class HangError(FlowactorsError, TimeoutError):
    """A call ran past its watchdog; the message holds the Python stack of every rank involved."""

    def __init__(self, call: str, timeout_s: float, report: str) -> None:
        self.call, self.timeout_s, self.report = call, timeout_s, report
        super().__init__(
            f"{call} did not finish within {timeout_s:g} s; where each rank is:\n{report}\n"
            f"Ranks blocked in a collective wait for the ones that are not in it. Raise the watchdog "
            f"(call_timeout_s) if the work is just slow"
        )

    def __reduce__(self) -> tuple:
        return (HangError, (self.call, self.timeout_s, self.report))


class SchedulerUnreachableError(FlowactorsError, ConnectionError):
    """No Dask scheduler answered at the address given; the message says what is there and what to start."""


class ClusterStartError(FlowactorsError):
    """The embedded cluster did not start (a worker process died or failed while starting); the message says which
    part failed and what Dask said."""
