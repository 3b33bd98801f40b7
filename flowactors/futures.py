"""`CallFuture`: the future of one group call, what the controller hands back and later calls take as inputs.

A module of its own so that the transports, the watchdog and the groups refer to it without importing the
controller: a future knows its controller only as the object that resolves it (`resolve`, `lost_input_error`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from flowactors import _runtime
from flowactors.errors import RemoteError
from flowactors.protocols import Layout, Protocol

__all__ = ["CallFuture", "new_token", "unwrap"]


class CallFuture:
    """The future of one group call: one future per rank (its transport's) plus the protocol that joins their outputs.

    There is no separate collect task (it would add a scheduling hop to every call): `.result()` gathers the
    rank outputs and joins them on the controller, and a later call or `Controller.apply` that takes this future
    receives the rank outputs on its worker and joins them there, so the bytes never pass through the controller.
    A later call whose ranks take the same parts (`parts`, see `flowactors.group`) receives on each rank only the
    output of the rank that produced its part.
    """

    __slots__ = (
        "_controller",
        "futures",
        "protocol",
        "layout",
        "group",
        "method",
        "addresses",
        "pushed",
        "__weakref__",
    )

    def __init__(
        self,
        controller: Any,
        futures: Sequence[Any],
        protocol: Protocol,
        layout: Layout,
        group: str,
        method: str,
        addresses: Sequence[str],
        pushed: bool = False,
    ) -> None:
        """`pushed`: the ranks also push their outputs to the controller (flowactors.transport.pushed)."""
        self._controller, self.futures, self.pushed = controller, list(futures), pushed
        self.protocol, self.layout, self.group, self.method = protocol, layout, group, method
        self.addresses = tuple(addresses)

    @property
    def label(self) -> str:
        return f"{self.group}.{self.method}"

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> Any:
        """The joined output. Past `timeout` (default: the controller's watchdog, `call_timeout_s`) a
        `HangError` reports the stack of every rank of this call."""
        ctl = self._controller
        outputs = ctl.resolve([self], ctl.call_timeout_s if timeout is None else timeout)[0]
        try:
            return _runtime.collect(self.group, self.method, self.protocol, self.layout, *outputs)
        except RemoteError as e:
            lost = ctl.lost_input_error(e, self.label)
            if lost is not None:
                raise lost from e
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:
            return e
        return None

    @property
    def direct(self) -> bool:
        """Whether this call went on the direct path (flowactors.transport.channel), not through the scheduler."""
        return bool(self.futures) and self._controller.transport.direct

    @property
    def parts(self) -> list[list[int]] | None:
        """The ranks of each part of the output (Protocol.parts), or None when the protocol does not say."""
        return self.protocol.parts(self.layout) if self.protocol.parts is not None else None

    def _ref(self) -> tuple:
        """What travels in a task's arguments: Dask resolves the futures, the worker joins the outputs."""
        return (_runtime.CALL_REF, self.group, self.method, self.protocol, self.layout, list(self.futures))

    def _part_ref(self, part: int) -> tuple:
        """Part `part` of the output alone: its rank's output, and the outcome of the part's other ranks."""
        ranks = self.parts[part]  # type: ignore[index]
        return (_runtime.PART_REF, self.group, self.method, ranks, [self.futures[r] for r in ranks])

    def __repr__(self) -> str:
        return f"<CallFuture {self.label} {[f.status for f in self.futures]}>"


def unwrap(v: Any) -> Any:
    """CallFutures (also inside a list or tuple) become their Dask futures, which Dask then resolves."""
    if isinstance(v, CallFuture):
        return v._ref()
    if isinstance(v, (list, tuple)) and any(isinstance(x, CallFuture) for x in v):
        return type(v)(unwrap(x) for x in v)
    return v


def new_token() -> str:
    """A 16-hex-digit token unique to this call: the process's random prefix and a counter (a `uuid4` reads the
    kernel's random source on every call: ~5 us of each group call's latency)."""
    return f"{_PREFIX}{next(_COUNTER) & 0xFFFFFFFF:08x}"


def _reseed() -> None:
    """A new prefix and counter (at import, and in a forked child: it must not repeat its parent's tokens)."""
    global _PREFIX, _COUNTER
    _PREFIX, _COUNTER = os.urandom(4).hex(), itertools.count()


_PREFIX, _COUNTER = "", itertools.count()
_reseed()
os.register_at_fork(after_in_child=_reseed)
