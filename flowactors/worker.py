"""`Worker` and `@endpoint`: the remote side of an actor group.

Remote methods are opt-in (monarch's `@endpoint`, verl's `@register`): only decorated methods are callable from
the controller, and each carries the transfer protocol that says how a group call's inputs are split over the
ranks and how the outputs are put back together. One instance of a worker class lives in each worker process
of its group, created there and never moved, so GPU-pinned state stays where it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from flowactors.protocols import DP, Layout, Protocol, get_protocol

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Worker", "endpoint", "endpoints_of", "link"]

F = TypeVar("F", bound=Callable[..., Any])
_ENDPOINT_ATTR = "__flowactors_protocol__"


def endpoint(fn: F | None = None, *, protocol: Protocol | str = DP) -> Any:
    """Mark a `Worker` method as callable from the controller with `protocol` (default: data parallel)."""
    proto = get_protocol(protocol)

    def mark(f: F) -> F:
        setattr(f, _ENDPOINT_ATTR, proto)
        return f

    return mark(fn) if fn is not None else mark


def endpoints_of(cls: type) -> dict[str, Protocol]:
    """Name -> protocol of every endpoint of a worker class (inherited ones included)."""
    out: dict[str, Protocol] = {}
    for name in dir(cls):
        proto = getattr(getattr(cls, name, None), _ENDPOINT_ATTR, None)
        if proto is not None:
            out[name] = proto
    return out


class Worker:
    """Base class of a model worker. Subclass it, decorate remote methods with `@endpoint`.

    Before `__init__` runs on a rank, the runtime sets: `rank`, `world_size`, `layout` (pp, dp, tp),
    `group_name`, `process_group` (the group's torch.distributed group) and `mesh` (a DeviceMesh with dims
    ("pp", "dp", "tp")), `subgroups` (the extra process groups the class asked for in `process_groups()`, keyed
    by their tuple of group ranks; only those this rank is a member of, so `{}` for a class that asks none), and
    `device` (the torch device of this slot). `__init__` may therefore run collectives.
    """

    rank: int
    world_size: int
    layout: Layout
    group_name: str
    process_group: "dist.ProcessGroup"
    mesh: "DeviceMesh"
    subgroups: dict[tuple[int, ...], "dist.ProcessGroup"]
    device: Any

    @classmethod
    def process_groups(cls, layout: Layout, *args: Any, **kwargs: Any) -> list[tuple[int, ...]]:
        """Extra process groups among this group's ranks (tuples of group ranks) that `__init__(*args, **kwargs)`
        will need. The runtime creates them with the group, on every rank of the torch.distributed world (torch
        requires every rank to take part, in one order, which ranks inside `__init__` cannot arrange), and a member
        rank finds each in `self.subgroups[ranks]`. Runs on the controller, before any rank starts: raise
        ValueError here for arguments that cannot work."""
        return []

    def shutdown(self) -> None:
        """Called on each rank when the group is closed: release what memory alone does not (threads, engines with
        process-global state). Local, no collectives; the default does nothing."""

    @property
    def coords(self) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of this rank."""
        return self.layout.coords(self.rank)

    def colocated(self, group_name: str) -> "Worker":
        """This process's instance of another group (colocated models live in one process: docs/design.md §3,
        Actors). Calls to one process run one at a time in the order issued, so a method may drive a colocated model
        too, e.g. two models trained in one fused pipeline schedule. Raises LookupError when that group has no rank here."""
        from flowactors import _runtime

        ctx = _runtime.context_of(group_name)
        if ctx is None or ctx.instance is None:
            raise LookupError(
                f"group {group_name!r} has no rank in this worker process (the one of {self.group_name!r}"
                f" rank {self.rank}); place both groups on the same slots"
            )
        return ctx.instance


def link(name: str) -> Any:
    """Inside a call: this process's place in link `name` (`Controller.link`): its `rank`, each linked group's
    link ranks (`groups`), the link's `process_group` and the `subgroups` it is a member of."""
    from flowactors import _runtime

    return _runtime.link(name)
