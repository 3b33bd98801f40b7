"""One call to many workers, described once: the inputs every rank shares, and the parts only some ranks take.

docs/design.md §3 (Fan-out). A group call used to be one work item per rank, each serialized and sent by the
controller: its cost grew with the ranks it addressed. A `Fanout` says the same thing once: the function and the
inputs, in which a `Split` (a batch cut into equal row parts) or `Parts` (one value per part) stands where rank r
takes only part `part_r`. A transport that cannot do better expands it into per-rank items (`expand`, the split
done once on the controller); the direct path sends it down a tree (`flowactors.transport.channel`), where each
node hands a child only the parts of the ranks below that child (`trim`) and a rank resolves its own (`resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FANOUT",
    "Fanout",
    "Parts",
    "Rank",
    "Split",
    "expand",
    "has_parts",
    "resolve",
    "subtree_of",
    "subtrees",
    "trim",
]

FANOUT = 8
"""Children per node of a call's tree."""
ROOTS = 2
"""Ranks the controller sends a call to (the roots of its tree): its cost per call then hardly grows with the ranks
(what does grow is the bookkeeping of one future per rank); 1,024 ranks are 4 levels deep."""


class Split:
    """A batch (anything with `len`, `slice` and `split`, i.e. `flowactors.Batch`) holding `count` equal row parts,
    the first of which is part `first` of the call."""

    __slots__ = ("value", "count", "first")

    def __init__(self, value: Any, count: int, first: int = 0) -> None:
        self.value, self.count, self.first = value, count, first

    def __reduce__(self) -> tuple:
        return (Split, (self.value, self.count, self.first))


class Parts:
    """One value per part, `values[i]` being part `first + i` of the call (e.g. references to a producing call's
    per-part outputs)."""

    __slots__ = ("values", "first")

    def __init__(self, values: Sequence[Any], first: int = 0) -> None:
        self.values, self.first = list(values), first

    def __reduce__(self) -> tuple:
        return (Parts, (self.values, self.first))


@dataclass
class Rank:
    """One rank of a fan-out: run `fn(*extra, *args, **kwargs)` on `address` under `key`, with the markers of
    the inputs resolved to part `part` (-1: the inputs hold none)."""

    address: str
    key: str
    part: int = -1
    extra: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Fanout:
    """`fn` on every rank of `ranks`, over inputs `args`/`kwargs` that hold `Split`/`Parts` markers where the
    ranks take parts (anywhere in tuples, lists and dict values)."""

    fn: Any
    args: tuple
    kwargs: dict
    ranks: list[Rank]
    marked: bool | None = None
    """Whether the inputs hold markers, when the caller knows (None: found by walking them, `has_parts`)."""


SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
"""Types no marker or reference hides in: walks pass values of exactly these types over."""


def map_leaves(value: Any, kinds: type | tuple[type, ...], leaf: Any) -> Any:
    """`value` with every object of `kinds` inside it (in tuples, lists and dict values, not named tuples) replaced
    by `leaf(object)`: how markers, and on the workers references to stored outputs, are found and resolved. A
    container with nothing to replace inside is returned as it is (its own type kept). `kinds` are never plain
    scalars: those are passed over without a call (most of a call's inputs are names, numbers and flags)."""
    if isinstance(value, kinds):
        return leaf(value)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        new = [v if type(v) in SCALARS else map_leaves(v, kinds, leaf) for v in value]
        if all(a is b for a, b in zip(new, value)):
            return value  # nothing inside changed: the very object (a list subclass stays one)
        return tuple(new) if isinstance(value, tuple) else new
    if isinstance(value, dict):
        items = {k: v if type(v) in SCALARS else map_leaves(v, kinds, leaf) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        return items
    return value


def _walk(value: Any, leaf: Any) -> Any:
    return map_leaves(value, (Split, Parts), leaf)


def has_parts(value: Any) -> bool:
    """Whether `value` holds a `Split` or `Parts` marker."""
    found = False

    def leaf(m: Any) -> Any:
        nonlocal found
        found = True
        return m

    _walk(value, leaf)
    return found


def part_refs(value: Any) -> tuple[Any, list[Parts]]:
    """`value` with its markers taken out (None in their place), and its `Parts` markers: what every rank refers to
    and what only some do (the dashboard's dependencies of each rank, without cutting any rows)."""
    found: list[Parts] = []

    def leaf(m: Any) -> Any:
        if isinstance(m, Parts):
            found.append(m)
        return None

    return _walk(value, leaf), found


def resolve(value: Any, part: int) -> Any:
    """`value` with every marker replaced by its part `part` (of the call's numbering)."""

    def leaf(m: Any) -> Any:
        if isinstance(m, Parts):
            return m.values[part - m.first]
        size = len(m.value) // m.count
        i = part - m.first
        return m.value.slice(i * size, (i + 1) * size)

    return _walk(value, leaf)


def trim(value: Any, lo: int, hi: int) -> Any:
    """`value` with every marker cut down to parts `lo..hi` (inclusive): what a subtree whose ranks take only
    those parts needs of it."""

    def leaf(m: Any) -> Any:
        if isinstance(m, Parts):
            return Parts(m.values[lo - m.first : hi + 1 - m.first], lo)
        size = len(m.value) // m.count
        return Split(m.value.slice((lo - m.first) * size, (hi + 1 - m.first) * size), hi + 1 - lo, lo)

    return _walk(value, leaf)


def expand(call: Fanout) -> list[tuple[str, Any, tuple, dict, str]]:
    """The per-rank work items of `call` (`flowactors.transport.Work`), each part computed once."""
    cache: dict[int, tuple] = {}
    items = []
    for r in call.ranks:
        if r.part not in cache:
            cache[r.part] = (resolve(call.args, r.part), resolve(call.kwargs, r.part)) if r.part >= 0 else None
        args, kwargs = cache[r.part] or (call.args, call.kwargs)
        items.append((r.address, call.fn, (*r.extra, *args), {**kwargs, **r.kwargs}, r.key))
    return items


def subtrees(n: int, fanout: int) -> list[tuple[int, int]]:
    """Cut `n` consecutive ranks into at most `fanout` contiguous (start, stop) runs, as equal as can be: the
    subtrees below one node, or the controller (`ROOTS`); each run's first rank is the node of its subtree."""
    k = min(n, fanout)
    if k == 0:
        return []
    size, extra = divmod(n, k)
    out, at = [], 0
    for i in range(k):
        stop = at + size + (1 if i < extra else 0)
        out.append((at, stop))
        at = stop
    return out


def subtree_of(n: int, index: int, fanout: int = FANOUT, roots: int = ROOTS) -> tuple[int, int]:
    """The (start, stop) ranks of the subtree whose node is rank `index` of a tree over `n` ranks."""
    start, stop, runs = 0, n, subtrees(n, roots)
    while True:
        for a, b in runs:
            if a + start <= index < b + start:
                start, stop = a + start, b + start
                break
        if index == start:
            return start, stop
        runs = subtrees(stop - start - 1, fanout)
        start += 1


def depth(n: int, fanout: int = FANOUT, roots: int = ROOTS) -> int:
    """Levels of the tree over `n` ranks (1: the controller reaches every rank itself)."""
    if n <= 0:
        return 0
    return 1 + max((depth(stop - start - 1, fanout, fanout) for start, stop in subtrees(n, roots)), default=0)
