"""The Dask-task transport with pushed results: small outputs reach the controller one message after they are computed.

A call's value otherwise comes back through Dask's return path: the worker tells the scheduler the task finished,
the scheduler tells the client, and the client then gathers the value (through the scheduler, or from the worker):
three to four more messages after the work is done, about half of a no-op call's latency on the 2-core CI machine.
With an inbox, each rank of a group call also sends its output (or its failure) straight to the controller right
after computing it, when it is small (`PUSH_BYTES`); `CallFuture.result()` returns as soon as every rank's has
arrived. Everything else is unchanged: the task still finishes in Dask (its output stays in the worker's memory
for later calls, the dashboard and the task stream see it), and `result()` falls back to the Dask path when a
rank's output is larger, a push did not arrive, a future failed or was cancelled (a lost worker), or the watchdog
runs out.

The inbox is a Dask comm server on the client's event loop. It listens on the interface the client reaches the
scheduler from, with the cluster's own scheme and security (TLS with the run's credentials for the embedded
cluster). It is used by default only with the embedded cluster (127.0.0.1, `Controller.local`) when direct calls
are off; a controller joining a cluster (`Controller.connect`) keeps the plain path unless asked
(`push_results=True`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distributed import Client, Future

from flowactors.transport import by_call
from flowactors.transport.payload import TOO_LARGE
from flowactors.transport.tasks import DaskTransport

if TYPE_CHECKING:
    from flowactors.futures import CallFuture

__all__ = ["PushTransport", "ResultInbox"]

_MISSING = object()
_POLL_S = 0.005
"""How often a waiting `result()` also checks the Dask futures (a failure or a lost worker ends the wait)."""


class ResultInbox:
    """The controller's end: receives pushed outputs by task key."""

    def __init__(self, client: Client, host: str) -> None:
        from distributed.core import Server

        self._cond = threading.Condition()
        self._values: dict[str, Any] = {}
        self._server = Server({"flowactors_push": self._receive})
        security = client.security  # the cluster's own scheme and credentials: it lets in only what the cluster does
        scheme = client.scheduler.address.split("://")[0]

        async def listen() -> str:
            await self._server.listen(f"{scheme}://{host}:0", **security.get_listen_args("client"))
            return self._server.address

        self._client = client
        self.address: str = client.sync(listen)

    def _receive(self, comm: Any = None, key: str | None = None, value: Any = None) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def wait(self, futures: Sequence[Future], timeout: float | None) -> list[Any] | None:
        """Every future's pushed output, waiting up to `timeout` seconds; None when the Dask path must answer
        instead (see the module docstring)."""
        keys = [f.key for f in futures]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                got = [self._values.get(k, _MISSING) for k in keys]
                if all(v is not _MISSING for v in got):
                    return None if any(isinstance(v, str) and v == TOO_LARGE for v in got) else got
                if any(f.status in ("error", "cancelled", "lost") for f in futures):
                    return None
                if all(f.status == "finished" for f in futures):
                    return None  # finished in Dask without every push: fetch it there
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(_POLL_S if remaining is None else min(_POLL_S, remaining))

    def forget(self, keys: Sequence[str]) -> None:
        """Drop the outputs of a call nobody can ask for any more."""
        with self._cond:
            for k in keys:
                self._values.pop(k, None)

    def close(self) -> None:
        try:
            self._client.sync(self._server.close)
        except Exception:
            pass


class PushTransport(DaskTransport):
    """Dask tasks whose ranks also push small outputs to this controller's inbox (`inbox`)."""

    pushes_results = True

    def __init__(self, client: Client) -> None:
        super().__init__(client)
        self.inbox = ResultInbox(client, _client_host(client))

    def task_kwargs(self, key: str) -> dict[str, Any]:
        return {"push": (self.inbox.address, key)}

    def track(self, call: "CallFuture") -> None:
        if call.pushed:  # its pushed outputs are dropped once nobody can ask for them
            weakref.finalize(call, self.inbox.forget, [f.key for f in call.futures])

    def resolve(self, calls: Sequence["CallFuture"], timeout: float | None, values: bool = True) -> list[list]:
        """Values of pushed calls from the inbox; the Dask path (with what is left of `timeout`) where one is
        missing (see the module docstring)."""
        left = timeout
        if values and calls and all(c.pushed for c in calls):
            start = time.monotonic()
            pushed = self.inbox.wait([f for c in calls for f in c.futures], timeout)
            if pushed is not None:
                return by_call(pushed, calls)
            if timeout is not None:
                left = max(0.0, timeout - (time.monotonic() - start))
        return super().resolve(calls, left, values)

    def close(self) -> None:
        self.inbox.close()


def _client_host(client: Client) -> str:
    """The interface this client reaches its scheduler from (where workers can reach it back)."""
    from distributed.comm import get_address_host

    comm = getattr(client.scheduler_comm, "comm", None)
    local = getattr(comm, "local_address", None)
    return get_address_host(local) if local else "127.0.0.1"
