"""`ActorGroup`: a worker class instantiated on N slots as one SPMD program, called from the controller.

HybridFlow §4.1: the controller sees one object per model; `group.method(batch)` distributes the inputs with the
method's protocol, runs the method on every rank, collects the outputs and returns a `CallFuture` at once.
Futures of earlier calls are accepted as inputs; their data moves worker to worker, never through the controller.

Where each rank's inputs come from (`_route`):

- Values the controller holds are split here and each rank's part travels in its own task or request (on the
  Dask transports large batches are sent straight to the rank's worker first, `DaskTransport.ship`).
- The future of an earlier call whose output is made of parts (`Protocol.parts`: DP, MESH), taken by a call that
  splits its batches into as many parts (`Protocol.destinations`), is passed part for part: rank r receives the
  producing rank's output for its part straight from that rank's worker, and nothing else of the batch. This is
  the common case in an RLHF step (generate, then log-probs, values and rewards over the same DP size). Rows stay
  where they were produced: when the producing ranks return unequal numbers of rows the parts stay unequal,
  where a concatenate-and-split would have moved rows between ranks (the collected value, in rank order, is the
  same). Because each rank sees only its own part, the ranks of such a call first agree that every part arrived
  intact (`_runtime._agree`, one small all-reduce) so that all of them fail together if one input failed.
- Any other future (different DP sizes, a protocol that does not describe its layout) travels whole to every
  rank, which takes its part there. Split tasks on the producer's worker sending each rank only its part were
  measured against this for 2 ranks (benchmarks/dispatch.py, `resplit`) and were not faster: see `_route`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distributed import Future

from flowactors import _runtime
from flowactors.batch import Batch
from flowactors.controller import Controller
from flowactors.errors import EndpointError, HangError, PlacementError, RemoteError
from flowactors.futures import CallFuture, new_token, unwrap
from flowactors.protocols import Layout, Protocol
from flowactors.transport.fanout import Fanout, Parts, Rank, Split
from flowactors.worker import Worker, endpoints_of

__all__ = ["ActorGroup"]


class _Method:
    """A bound group endpoint: calling it issues the call on every rank."""

    __slots__ = ("group", "name", "protocol")

    def __init__(self, group: "ActorGroup", name: str, protocol: Protocol) -> None:
        self.group, self.name, self.protocol = group, name, protocol

    def __call__(self, *args: Any, **kwargs: Any) -> CallFuture:
        return self.group._call(self.name, self.protocol, args, kwargs)

    def __repr__(self) -> str:
        return f"<endpoint {self.group.name}.{self.name} protocol={self.protocol.name}>"


class ActorGroup:
    """One instance of `cls` on each of `slots`, forming one process group with `layout`.

    Created through `ActorGroup(controller, cls, name=..., ...)`; blocks until every rank's `__init__` ran, so a
    constructor error surfaces here, naming the rank, and a rank that does not finish within the controller's
    watchdog (`call_timeout_s`) is a `HangError` with the stack of every rank still running.

    `own_world=True` puts the group on pool workers outside the controller's world (`Controller.workers_with`:
    workers that joined a running job), its ranks forming a torch.distributed world of their own; such a group
    cannot be linked, and losing one of its workers fails only its own calls.
    """

    def __init__(
        self,
        controller: Controller,
        cls: type[Worker],
        *,
        name: str,
        slots: Sequence[Any] | None = None,
        layout: Layout | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        backend: str | None = None,
        own_world: bool = False,
    ) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"{cls!r} is not a flowactors.Worker subclass; derive the model worker from Worker")
        if name in controller.groups:
            raise PlacementError(
                f"a group named {name!r} already exists on this controller; choose another "
                f"name or close it first (group.close())"
            )
        if own_world and slots is None:
            raise PlacementError(f"group {name!r} has a world of its own: give it its workers (slots=...)")
        if slots is None:
            n = layout.world_size if layout is not None else len(controller.slots)
            slots = controller.slots[:n]
        else:
            n = len(slots)
        if n > len(controller.slots) and not own_world:
            raise PlacementError(
                f"group {name!r} needs {n} slots but the cluster has {len(controller.slots)} "
                f"usable ones; start more workers (Controller.local(n_slots={n})) or use a "
                f"smaller layout"
            )
        addresses = [getattr(s, "address", s) for s in slots]
        layout = layout or Layout.data_parallel(len(addresses))
        if len(addresses) != layout.world_size:
            raise PlacementError(
                f"group {name!r} has layout {layout} ({layout.world_size} ranks) but was given "
                f"{len(addresses)} slots; give one slot per rank"
            )
        if len(set(addresses)) != len(addresses):
            raise PlacementError(
                f"group {name!r} was given the same slot twice; one rank per worker process "
                f"(colocate models by creating several groups on the same slots)"
            )
        unknown = [a for a in addresses if a not in controller.slots and not own_world]
        if unknown:
            raise PlacementError(
                f"group {name!r} was given slots the cluster does not have: {unknown}; use "
                f"addresses from controller.slots"
            )
        subgroups = [tuple(int(r) for r in g) for g in cls.process_groups(layout, *args, **(kwargs or {}))]
        bad = [g for g in subgroups if not g or any(not 0 <= r < layout.world_size for r in g) or len(set(g)) < len(g)]
        if bad:
            raise PlacementError(
                f"{cls.__name__}.process_groups returned {bad}: each must be distinct group ranks "
                f"in 0..{layout.world_size - 1}"
            )
        self.controller, self.cls, self.name, self.layout = controller, cls, name, layout
        self.addresses = addresses
        self.own_world = own_world
        self.endpoints = endpoints_of(cls)
        self._closed = False
        try:
            self._build(args, kwargs or {}, backend, subgroups)
        except HangError:
            self.close(wait=False)  # the close queues behind the stuck rank; nothing more is waited for here
            raise

    def _build(self, args: tuple, kwargs: dict, backend: str | None, subgroups: list[tuple[int, ...]]) -> None:
        """Form the process group on every world rank, then run `__init__` on every rank of this group, each
        wait under the controller's watchdog (a rank stuck in a collective is a HangError with its stack)."""
        controller, name, addresses = self.controller, self.name, self.addresses
        if self.own_world:
            controller.new_own_world(name, addresses, self.layout, backend, subgroups)
        else:
            controller.new_group_ranks(name, addresses, self.layout, backend, subgroups)
        controller.groups[name] = self
        for method, proto in self.endpoints.items():
            setattr(self, method, _Method(self, method, proto))
        token = new_token()
        futs = controller.submit_pinned_all(
            [
                (a, _runtime.construct, (name, self.cls, tuple(args), dict(kwargs)), {}, f"{name}.__init__-{r}-{token}")
                for r, a in enumerate(addresses)
            ]
        )
        try:
            controller.await_setup(name, "__init__", futs, addresses)
        except RemoteError:
            self.close()
            raise

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def __getattr__(self, attr: str) -> Any:
        # Only reached for names that are not endpoints: explain how to make them callable.
        if attr.startswith("__") or attr in ("cls", "endpoints", "name"):
            raise AttributeError(attr)
        cls = self.__dict__.get("cls")
        eps = sorted(self.__dict__.get("endpoints", {}))
        if cls is not None and callable(getattr(cls, attr, None)):
            raise EndpointError(
                f"{cls.__name__}.{attr} is not a remote endpoint; decorate it with "
                f"@endpoint(protocol=...) to call it from the controller (endpoints: {eps})"
            )
        raise EndpointError(f"group {self.__dict__.get('name')!r} has no endpoint {attr!r}; endpoints: {eps}")

    def _call(self, method: str, protocol: Protocol, args: tuple, kwargs: dict) -> CallFuture:
        if self._closed:
            raise PlacementError(f"group {self.name!r} is closed; create it again to call {method}")
        ctl = self.controller
        if ctl.transport.fans_out:
            outs = ctl.submit_fanout(self._fanout(method, protocol, args, kwargs))
        else:
            outs = ctl.submit_pinned_all(self._per_rank(method, protocol, args, kwargs))
        return ctl._track(
            CallFuture(ctl, outs, protocol, self.layout, self.name, method, self.addresses, pushed=ctl.pushes_results)
        )

    def _per_rank(self, method: str, protocol: Protocol, args: tuple, kwargs: dict) -> list:
        """The call as one work item per rank, its inputs split here (the Dask transports)."""
        ctl, layout = self.controller, self.layout
        split: tuple[Protocol, Layout] | None = None
        agree = False
        if not _contains_future((*args, *kwargs.values())):
            per_rank = protocol.split(args, kwargs, layout)
        elif protocol.destinations is None:  # an opaque protocol: whole inputs to every rank, split there
            per_rank = [(_unwrap(args), {k: unwrap(v) for k, v in kwargs.items()})] * self.world_size
            split = (protocol, layout)
        else:
            per_rank, agree = _route(protocol, layout, args, kwargs)
        per_rank = ctl.transport.ship(self.addresses, per_rank)  # large batches straight to their worker, on Dask
        keep = _kept_ranks(protocol, layout)
        agree = agree and self.world_size > 1
        token, label = new_token(), f"{self.name}.{method}"
        return [
            (
                a,
                _runtime.call,
                (self.name, method, r, per_rank[r][0], per_rank[r][1], split, ctl.step, agree, r in keep),
                ctl.push_target(f"{label}-{r}-{token}"),
                f"{label}-{r}-{token}",
            )
            for r, a in enumerate(self.addresses)
        ]

    def _fanout(self, method: str, protocol: Protocol, args: tuple, kwargs: dict) -> Fanout:
        """The call described once (`flowactors.transport.fanout`): its inputs with `Split`/`Parts` where each rank
        takes a part, so the transport splits them on the way (the direct path's tree) rather than here."""
        layout, world = self.layout, self.world_size
        split: tuple[Protocol, Layout] | None = None
        agree = False
        if protocol.destinations is not None:
            dest = protocol.destinations(layout)
            n = max(dest) + 1
            marked = None  # with futures: found by walking the routed inputs
            if _contains_future((*args, *kwargs.values())):
                inputs, agree = _route_parts(n, args, kwargs)
            else:
                inputs = (tuple(_split_mark(a, n) for a in args), {k: _split_mark(v, n) for k, v in kwargs.items()})
                marked = any(isinstance(v, Batch) for v in (*args, *kwargs.values()))  # each became a Split
            parts = dest
        elif _contains_future((*args, *kwargs.values())):  # an opaque protocol: whole inputs, split on the rank
            inputs, parts, split, marked = (
                (_unwrap(args), {k: unwrap(v) for k, v in kwargs.items()}),
                [-1] * world,
                (protocol, layout),
                False,
            )
        else:
            per_rank = protocol.split(args, kwargs, layout)
            if len(set(map(id, per_rank))) == 1:  # every rank the very same inputs (one_to_all, rank_zero)
                inputs, parts, marked = per_rank[0], [-1] * world, False
            else:
                inputs, parts, marked = Parts(per_rank), list(range(world)), True
        keep = _kept_ranks(protocol, layout)
        agree = agree and world > 1
        token, label, ctl = new_token(), f"{self.name}.{method}", self.controller
        keys = [f"{label}-{r}-{token}" for r in range(world)]
        pushed = ctl.pushes_results
        return Fanout(
            _runtime.call_rank,
            (self.name, method, inputs, split, ctl.step, agree),
            {},
            [
                Rank(a, keys[r], parts[r], (r, r in keep), ctl.push_target(keys[r]) if pushed else _NO_KWARGS)
                for r, a in enumerate(self.addresses)
            ],
            marked,
        )

    def close(self, wait: bool = True) -> None:
        """Drop the instances (their memory is freed on the workers). The process group stays with the world (a
        world of the group's own goes with it)."""
        if self._closed:
            return
        self._closed = True
        token, lost = new_token(), self.controller.lost_workers
        fn, args = (_runtime.teardown_world, ()) if self.own_world else (_runtime.destroy, (self.name,))
        futs = self.controller.submit_pinned_all(
            [(a, fn, args, {}, f"{self.name}.close-{r}-{token}") for r, a in enumerate(self.addresses) if a not in lost]
        )
        try:
            if wait:
                self.controller.gather(futs)
        finally:
            self.controller.forget_group(self.name)

    def __repr__(self) -> str:
        return f"<ActorGroup {self.name} {self.cls.__name__} {self.layout} endpoints={sorted(self.endpoints)}>"


class _Held:
    """Stands for a future argument while the protocol distributes the others (it is replicated as a non-Batch)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _route(protocol: Protocol, layout: Layout, args: tuple, kwargs: dict) -> tuple[list, bool]:
    """Per-rank (args, kwargs) of a call with future arguments, for a protocol that states its destinations.

    Controller-held values are distributed by the protocol; each future argument becomes, for rank r, a reference
    to what rank r needs of it (`_share`). Returns the per-rank inputs and whether any rank receives a part alone
    (then the ranks must agree before running, see the module docstring).

    The alternative for a future whose layout differs (one task per rank on the producer's worker, each splitting
    out one rank's part, so a rank fetches only its part) puts a task, and its scheduler round trips, between
    the producer and the call; moving the other half of the batch over the workers' connection costs less. For 2
    ranks and a 4 MiB batch from a one-rank group (`resplit` in benchmarks/dispatch.py), three runs of 100
    interleaved calls on this 2-core machine gave a median of 77-132 ms for the whole batch to every rank against
    90-133 ms with split tasks, so differing layouts keep the whole-batch path."""
    dest = protocol.destinations(layout)
    n = max(dest) + 1

    def hold(v: Any) -> Any:
        return _Held(v) if isinstance(v, (CallFuture, Future)) else unwrap(v)

    per_rank = protocol.split(tuple(hold(a) for a in args), {k: hold(v) for k, v in kwargs.items()}, layout)
    direct = False

    def share(v: Any, part: int) -> Any:
        nonlocal direct
        if not isinstance(v, _Held):
            return v
        ref, alone = _share(v.value, n, part)
        direct = direct or alone
        return ref

    out = [
        (tuple(share(a, dest[r]) for a in a_r), {k: share(v, dest[r]) for k, v in kw_r.items()})
        for r, (a_r, kw_r) in enumerate(per_rank)
    ]
    return out, direct


_NO_KWARGS: dict = {}  # shared by every rank that takes no keywords of its own (never written to)


def _split_mark(value: Any, parts: int) -> Any:
    """A Batch argument of a call whose protocol splits it into `parts` (checked here, at the call site)."""
    if isinstance(value, Batch):
        try:
            value.check_split(parts)
        except ValueError as e:
            raise ValueError(f"{e} (the group has data-parallel size {parts})") from None
        return Split(value, parts)
    return value


def _route_parts(parts: int, args: tuple, kwargs: dict) -> tuple[tuple, bool]:
    """`_route` for a fan-out: the inputs once, each future argument as `Parts` (what rank r needs of it for its
    part, `_share`) and each Batch as a `Split`; and whether a rank receives a part alone."""
    alone = False

    def mark(v: Any) -> Any:
        nonlocal alone
        if not isinstance(v, (CallFuture, Future)):
            return _split_mark(unwrap(v), parts)
        shares = [_share(v, parts, p) for p in range(parts)]
        alone = alone or shares[0][1]
        return Parts([ref for ref, _ in shares])

    return (tuple(mark(a) for a in args), {k: mark(v) for k, v in kwargs.items()}), alone


def _share(value: Any, parts: int, part: int) -> tuple[Any, bool]:
    """What of a future argument a rank that takes part `part` of `parts` receives, and whether that is its part
    alone: the producer's part itself when the producer is made of as many parts, else the whole value (joined
    on the rank) with an instruction to split it there."""
    if isinstance(value, CallFuture):
        own = value.parts
        if own is not None and len(own) == parts:
            return value._part_ref(part), True
        value = value._ref()
    return (_runtime.SPLIT_REF, parts, part, value), False


def _kept_ranks(protocol: Protocol, layout: Layout) -> set[int]:
    """Ranks whose output is part of the call's value (Protocol.parts); the others return only their outcome."""
    if protocol.parts is None:
        return set(range(layout.world_size))
    return {p[0] for p in protocol.parts(layout)}


def _unwrap(args: tuple) -> tuple:
    return tuple(unwrap(a) for a in args)


def _contains_future(values: tuple) -> bool:
    def has(v: Any) -> bool:
        return isinstance(v, (Future, CallFuture)) or (isinstance(v, (list, tuple)) and any(has(x) for x in v))

    return any(has(v) for v in values)
