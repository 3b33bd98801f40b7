"""Transfer protocols: how a group call's inputs reach each rank and how the ranks' outputs come back.

HybridFlow §4.2: a protocol is a pair of pure functions, `distribute(args, kwargs, layout) -> per-rank (args,
kwargs)` and `collect(per-rank outputs, layout) -> output`. They are unit-tested without a cluster and run
wherever the data is: on the controller for values it holds, on a worker for futures (so batch bytes never pass
through the controller).

A protocol may also say how its data is laid out over the ranks (`parts` for collect, `destinations` for
distribute). Then a call that takes the future of an earlier call gets, on each rank, only the part it needs:
between equal data-parallel layouts rank r receives part r straight from the worker that produced it, instead of
every rank receiving the whole batch and splitting it there (see `flowactors.group`). Protocols that do not say
(user protocols by default) get the whole inputs on every rank, split there with `distribute`.

`Layout` is the SPMD layout of a group, pipeline x data x tensor parallel, ranks ordered with tensor parallel
fastest, then data, then pipeline (Megatron's order), so tensor-parallel peers are neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flowactors.batch import Batch

__all__ = [
    "Layout",
    "Protocol",
    "ProtocolError",
    "register_protocol",
    "get_protocol",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "RANK_ZERO",
    "DP",
    "MESH",
]


class ProtocolError(ValueError):
    """A protocol produced something that does not fit the group (wrong number of per-rank inputs, ...)."""


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of a group: `pp` pipeline stages x `dp` data-parallel replicas x `tp` tensor shards."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a group of {self.world_size}")
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    @classmethod
    def data_parallel(cls, world_size: int) -> "Layout":
        return cls(dp=world_size)


PerRank = list[tuple[tuple, dict]]


@dataclass(frozen=True)
class Protocol:
    """A named (distribute, collect) pair. `distribute` must return one (args, kwargs) per rank.

    The two optional layout functions are promises about those two, which let a chained call move only the data
    each rank needs (both are checked against `distribute` / `collect` in the tests of the built-in protocols):

    - `parts(layout)`: collect's output is the parts concatenated in order (`Batch.concat`; one part: that part
      itself), and part i is the output of rank `parts[i][0]`. Every rank is listed in exactly one part: the
      other ranks of part i (TP peers, earlier pipeline stages) contribute nothing to the value, so their outputs
      are dropped on their worker and only their success or failure travels with part i.
    - `destinations(layout)`: distribute splits every Batch argument into `max(destinations) + 1` equal parts,
      hands rank r part `destinations[r]`, and gives every rank the other arguments unchanged.
    """

    name: str
    distribute: Callable[[tuple, dict, Layout], PerRank]
    collect: Callable[[list, Layout], Any]
    parts: Callable[[Layout], list[list[int]]] | None = None
    destinations: Callable[[Layout], list[int]] | None = None

    def __reduce__(self) -> Any:
        # A built-in protocol travels in every task that uses it: send its name, not its functions. (Not any
        # registered one: a worker process has not necessarily imported the module that registered it.)
        if self.name in _BUILTIN and _REGISTRY.get(self.name) is self:
            return get_protocol, (self.name,)
        return Protocol, (self.name, self.distribute, self.collect, self.parts, self.destinations)

    def split(self, args: tuple, kwargs: dict, layout: Layout) -> PerRank:
        """`distribute`, checked: exactly one (args, kwargs) pair per rank."""
        parts = self.distribute(args, kwargs, layout)
        if not isinstance(parts, (list, tuple)) or len(parts) != layout.world_size:
            n = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ProtocolError(
                f"protocol {self.name!r} returned {n} per-rank inputs for a group of "
                f"{layout.world_size} ranks; its distribute must return one (args, kwargs) "
                f"pair per rank"
            )
        checked = None
        for i, p in enumerate(parts):
            if p is checked:  # the same pair for every rank (one_to_all): checked once
                continue
            checked = p
            if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], tuple) and isinstance(p[1], dict)):
                raise ProtocolError(
                    f"protocol {self.name!r} returned {type(p).__name__} for rank {i}; "
                    f"expected an (args tuple, kwargs dict) pair"
                )
        return list(parts)


# -- building blocks ------------------------------------------------------------------------------------------


def _map_batches(args: tuple, kwargs: dict, fn: Callable[[Batch], list]) -> tuple[list[tuple], list[dict], int]:
    """Apply `fn` (Batch -> list of parts) to every Batch argument; others are repeated."""
    split_args = [fn(a) if isinstance(a, Batch) else None for a in args]
    split_kwargs = {k: fn(v) if isinstance(v, Batch) else None for k, v in kwargs.items()}
    n = next((len(s) for s in [*split_args, *split_kwargs.values()] if s is not None), 0)
    return split_args, split_kwargs, n  # type: ignore[return-value]


def _scatter_batches(args: tuple, kwargs: dict, parts: int, destinations: Sequence[int], world: int) -> PerRank:
    """Split every Batch argument into `parts`; rank r gets part destinations[r]; other args are replicated."""

    def split(b: Batch) -> list[Batch]:
        try:
            return b.split(parts)
        except ValueError as e:
            raise ValueError(f"{e} (the group has data-parallel size {parts})") from None

    sa, sk, _ = _map_batches(args, kwargs, split)
    out = []
    for r in range(world):
        i = destinations[r]
        out.append(
            (
                tuple(s[i] if s is not None else a for s, a in zip(sa, args)),
                {k: (sk[k][i] if sk[k] is not None else v) for k, v in kwargs.items()},
            )
        )
    return out


def _concat(outputs: list) -> Any:
    if all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    if all(o is None for o in outputs):
        return None
    raise ProtocolError(
        f"cannot concatenate rank outputs of types {sorted({type(o).__name__ for o in outputs})}; "
        f"data-parallel methods must return a Batch (or None) on every rank"
    )


# -- built-in protocols ----------------------------------------------------------------------------------------

ONE_TO_ALL = Protocol(
    "one_to_all",
    lambda args, kwargs, layout: [(args, kwargs)] * layout.world_size,
    lambda outputs, layout: list(outputs),
)
"""Every rank gets the same inputs; the output is the list of every rank's output."""


def _all_to_all_distribute(args: tuple, kwargs: dict, layout: Layout) -> PerRank:
    w = layout.world_size
    for i, a in enumerate([*args, *kwargs.values()]):
        if not isinstance(a, (list, tuple)) or len(a) != w:
            raise ValueError(
                f"all_to_all needs every argument to be a list with one item per rank "
                f"({w}); argument {i} is {type(a).__name__}"
                f"{' of length %d' % len(a) if isinstance(a, (list, tuple)) else ''}"
            )
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(w)]


ALL_TO_ALL = Protocol("all_to_all", _all_to_all_distribute, lambda outputs, layout: list(outputs))
"""Argument i is a list with one item per rank; rank r gets item r. Output: the list of outputs."""

RANK_ZERO = Protocol(
    "rank_zero",
    lambda args, kwargs, layout: [(args, kwargs)] * layout.world_size,
    lambda outputs, layout: outputs[0],
    parts=lambda layout: [list(range(layout.world_size))],
)
"""Every rank runs (SPMD collectives need them all); only rank 0's output is returned."""

DP = Protocol(
    "dp",
    lambda args, kwargs, layout: _scatter_batches(
        args, kwargs, layout.world_size, range(layout.world_size), layout.world_size
    ),
    lambda outputs, layout: _concat(outputs),
    parts=lambda layout: [[r] for r in range(layout.world_size)],
    destinations=lambda layout: list(range(layout.world_size)),
)
"""Batch arguments split over every rank (pure data parallel); outputs concatenated in rank order."""


def _mesh_distribute(args: tuple, kwargs: dict, layout: Layout) -> PerRank:
    dests = [layout.coords(r)[1] for r in range(layout.world_size)]
    return _scatter_batches(args, kwargs, layout.dp, dests, layout.world_size)


def _mesh_collect(outputs: list, layout: Layout) -> Any:
    last = layout.pp - 1
    return _concat([outputs[layout.rank(last, d, 0)] for d in range(layout.dp)])


def _mesh_parts(layout: Layout) -> list[list[int]]:
    last = layout.pp - 1
    return [
        [layout.rank(last, d, 0)]
        + [r for r in range(layout.world_size) if layout.coords(r)[1] == d and r != layout.rank(last, d, 0)]
        for d in range(layout.dp)
    ]


MESH = Protocol(
    "mesh",
    _mesh_distribute,
    _mesh_collect,
    parts=_mesh_parts,
    destinations=lambda layout: [layout.coords(r)[1] for r in range(layout.world_size)],
)
"""3D: split by DP rank, replicate over TP and PP ranks; collect from TP rank 0 of the last PP stage."""


_REGISTRY: dict[str, Protocol] = {p.name: p for p in (ONE_TO_ALL, ALL_TO_ALL, RANK_ZERO, DP, MESH)}
_BUILTIN = frozenset(_REGISTRY)


def register_protocol(protocol: Protocol) -> Protocol:
    """Make a custom protocol available by name (`@endpoint(protocol="name")`)."""
    if protocol.name in _REGISTRY and _REGISTRY[protocol.name] is not protocol:
        raise ValueError(f"a protocol named {protocol.name!r} is already registered; choose another name")
    _REGISTRY[protocol.name] = protocol
    return protocol


def get_protocol(protocol: "Protocol | str") -> Protocol:
    if isinstance(protocol, Protocol):
        return protocol
    try:
        return _REGISTRY[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; built in: {sorted(_REGISTRY)} "
            f"(register custom ones with flowactors.register_protocol)"
        ) from None
