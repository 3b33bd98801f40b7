"""What the flowactors page shows, computed from plain records: pure functions, no scheduler, no browser.

The scheduler plugin (`flowactors.dashboard.plugin`) keeps small records, a `TaskRecord` per task key and an
`Interval` per compute span; everything the page shows is computed from those here (`aggregate_graph`,
`slot_usage`, `stage_idle`, `metric_series`, `snapshot`), so tests check it against hand-computed numbers. Why the
graph, timeline and idle figures are computed the way they are: see the package docstring (`flowactors.dashboard`).
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dask.utils import key_split

from flowactors.profiling import union_spans as union_of

__all__ = [
    "TaskRecord",
    "Interval",
    "node_of",
    "role_of",
    "role_color",
    "aggregate_graph",
    "slot_usage",
    "stage_idle",
    "metric_series",
    "snapshot",
    "is_slow",
    "DEFAULT_METRIC_LIMIT",
    "STATE_COLORS",
]

DEFAULT_METRIC_LIMIT = 12  # metrics charted when the caller names none: the first ones published

# The runtime's own pseudo-roles: helper tasks without a group, and forming the torch.distributed world.
RUNTIME_COLORS = {"task": "#8c8c8c", "world": "#5f6b73"}
# Other roles get one of these (see the module docstring), never one the caller's `role_colors` took.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#e15759",
    "#9c755f",
    "#76b7b2",
    "#edc948",
    "#ff9da7",
    "#6b6ecf",
    "#17a2b8",
    "#a0a336",
    "#d37295",
    "#8f6a3a",
)
STATE_COLORS = {
    "waiting": "#bdbdbd",
    "processing": "#ffb000",
    "memory": "#1b9e3e",
    "erred": "#d50000",
    "released": "#78909c",
}
# A node shows the most urgent state among its tasks.
_STATE_RANK = {"erred": 0, "processing": 1, "waiting": 2, "memory": 3, "released": 4}
_SCHEDULER_STATES = {
    "no-worker": "waiting",
    "queued": "waiting",
    "waiting": "waiting",
    "processing": "processing",
    "memory": "memory",
    "erred": "erred",
    "released": "released",
    "forgotten": "released",
}


# -- plain records -----------------------------------------------------------------------------------------------


@dataclass
class TaskRecord:
    """One task as the page needs it: its key, its state, and the keys it depends on (order ones apart)."""

    key: str
    state: str = "waiting"
    deps: tuple[str, ...] = ()
    order_deps: tuple[str, ...] = ()
    done: bool = False
    worker: str = ""
    """Where it runs (its rank's worker), once known."""
    started: float | None = None
    """When it started computing (scheduler clock), while it is processing."""
    late: bool = False
    """First recorded already finished: the page could not show it waiting or running (counted per node)."""


SLOW_FACTOR, SLOW_MARGIN_S = 3.0, 1.0
"""A running task is marked slow past max(SLOW_FACTOR x its call's usual compute time, usual + SLOW_MARGIN_S)."""


def is_slow(running_s: float, usual_s: float | None) -> bool:
    """Whether a task running for `running_s` is slow for a call that usually takes `usual_s` (None: no finished
    task of that call yet, so nothing to compare with)."""
    return usual_s is not None and running_s > max(SLOW_FACTOR * usual_s, usual_s + SLOW_MARGIN_S)


@dataclass(frozen=True)
class Interval:
    """A task's compute span on a worker (seconds, scheduler clock)."""

    worker: str
    node: str
    start: float
    stop: float
    step: int | None = None


def node_of(key: Any) -> str:
    """The call a task belongs to: `learner.update-0-<hex>` and its `.collect-<hex>` both give `learner.update`;
    `join-<hex>` gives `join`."""
    prefix = key_split(key)
    return prefix[: -len(".collect")] if prefix.endswith(".collect") else prefix


def role_of(node: str) -> str:
    """`learner.update` → `learner`; a helper task without a role (`join`) → `task`."""
    return node.split(".", 1)[0] if "." in node else "task"


def role_color(role: str, role_colors: Mapping[str, str] | None = None) -> str:
    """The caller's colour for `role` if it fixed one, the runtime's for `task` and `world`, else a palette
    colour by a stable hash of the name, skipping the colours the caller fixed (while any are left)."""
    fixed = {**RUNTIME_COLORS, **(role_colors or {})}
    if role in fixed:
        return fixed[role]
    free = [c for c in PALETTE if c not in fixed.values()] or list(PALETTE)
    return free[zlib.crc32(role.encode()) % len(free)]


def record_state(scheduler_state: str) -> str:
    return _SCHEDULER_STATES.get(scheduler_state, "waiting")


# -- pure computations -----------------------------------------------------------------------------------------


def aggregate_graph(
    tasks: Iterable[TaskRecord],
    seconds: Mapping[str, float] | None = None,
    role_colors: Mapping[str, str] | None = None,
    *,
    now: float | None = None,
    usual: Mapping[str, float] | None = None,
) -> dict:
    """Aggregate tasks into call nodes and call → call edges with a layered layout.

    Dependencies on keys outside `tasks` (earlier steps) are left out. Columns come from the task graph, which
    is acyclic even when a call repeats within a step (the call graph then has a cycle): a task sits in its
    deepest producer's column, one further when that producer is another call; a call's column (`layer`) is that
    of its shallowest task. The order in which the scheduler reported the tasks does not matter: Dask handles graph
    updates concurrently, so a consumer can be reported before its producer. `row` is a node's place in its
    column, in first-seen order.

    Per node, `ranks` lists its tasks (key, worker, state, and how long a running one has run at `now`), `late`
    counts tasks first recorded already finished, and `slow` the running ones past `is_slow` for the node's
    `usual` compute seconds.
    """
    records = list(tasks)
    node_by_key = {r.key: node_of(r.key) for r in records}
    ranks: dict[str, list[dict]] = {}
    for r in records:
        entry = {"key": r.key, "worker": r.worker, "state": r.state}
        if r.state == "processing" and r.started is not None and now is not None:
            entry["running_s"] = round(max(now - r.started, 0.0), 3)
            entry["slow"] = is_slow(entry["running_s"], (usual or {}).get(node_by_key[r.key]))
        ranks.setdefault(node_by_key[r.key], []).append(entry)
    order: dict[str, int] = {}
    counts: dict[str, dict[str, int]] = {}
    done: dict[str, int] = {}
    edges: dict[tuple[str, str, str], int] = {}
    producers: dict[str, list[str]] = {}
    for r in records:
        n = node_by_key[r.key]
        order.setdefault(n, len(order))
        c = counts.setdefault(n, {})
        c[r.state] = c.get(r.state, 0) + 1
        done[n] = done.get(n, 0) + int(r.done)
        producers[r.key] = [d for d in r.deps if d in node_by_key and d not in r.order_deps]
        for dep in r.deps:
            src = node_by_key.get(dep)
            if src is None or src == n:
                continue
            kind = "order" if dep in r.order_deps else "data"
            edges[(src, n, kind)] = edges.get((src, n, kind), 0) + 1
    # An order edge that duplicates a data edge says nothing more.
    edge_list = [
        {"source": s, "target": t, "kind": k, "n": c}
        for (s, t, k), c in edges.items()
        if not (k == "order" and (s, t, "data") in edges)
    ]
    depth = _task_depths(producers, node_by_key)
    layer: dict[str, int] = {}
    for key, d in depth.items():
        n = node_by_key[key]
        layer[n] = min(layer.get(n, d), d)
    order = dict(sorted(order.items(), key=lambda kv: (layer[kv[0]], kv[1])))
    rows: dict[int, int] = {}
    nodes = []
    for n in order:
        c = counts[n]
        state = min(c, key=lambda s: _STATE_RANK.get(s, 9))
        row = rows.get(layer[n], 0)
        rows[layer[n]] = row + 1
        nodes.append(
            {
                "id": n,
                "role": role_of(n),
                "method": n.split(".", 1)[1] if "." in n else n,
                "state": state,
                "counts": dict(sorted(c.items())),
                "n": sum(c.values()),
                "done": done[n],
                "layer": layer[n],
                "row": row,
                "seconds": round((seconds or {}).get(n, 0.0), 4),
                "color": role_color(role_of(n), role_colors),
                "ranks": ranks[n],
                "late": sum(r.late for r in records if node_by_key[r.key] == n),
                "slow": [t for t in ranks[n] if t.get("slow")],
                "usual_s": round((usual or {})[n], 4) if n in (usual or {}) else None,
            }
        )
    return {
        "nodes": nodes,
        "edges": edge_list,
        "layers": 1 + max(layer.values(), default=-1),
        "rows": max(rows.values(), default=0),
    }


def _task_depths(producers: Mapping[str, Sequence[str]], node_by_key: Mapping[str, str]) -> dict[str, int]:
    """Each task's column: 0 without producers, else the deepest producer's, plus one across calls."""
    depth: dict[str, int] = {}
    for root in producers:
        stack = [root]
        while stack:  # iterative depth-first search: a long chain of tasks must not exhaust the recursion limit
            key = stack[-1]
            if key in depth:
                stack.pop()
                continue
            todo = [p for p in producers[key] if p not in depth]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            depth[key] = max((depth[p] + (node_by_key[p] != node_by_key[key]) for p in producers[key]), default=0)
    return depth


def covered_length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def slot_usage(
    intervals: Iterable[Interval], slots: Sequence[str], start: float, stop: float, *, max_segments: int = 1500
) -> list[dict]:
    """Per slot over [start, stop]: busy and idle seconds, busy seconds per role, and the timeline segments
    `[start, stop, role, node]` relative to `start` (neighbours of one node closer than 1/2000 of the window
    are merged, and only the latest `max_segments` are kept, so the page stays light)."""
    window = max(stop - start, 1e-9)
    per_slot: dict[str, list[Interval]] = {s: [] for s in slots}
    for iv in intervals:
        if iv.worker in per_slot and iv.stop > start and iv.start < stop:
            per_slot[iv.worker].append(iv)
    out = []
    for slot in slots:
        ivs = sorted(per_slot[slot], key=lambda iv: iv.start)
        busy = covered_length(union_of(((iv.start, iv.stop) for iv in ivs), start, stop))
        by_role: dict[str, float] = {}
        segments: list[list] = []
        for iv in ivs:
            a, b = max(iv.start, start) - start, min(iv.stop, stop) - start
            role = role_of(iv.node)
            by_role[role] = by_role.get(role, 0.0) + (b - a)
            if segments and segments[-1][3] == iv.node and a - segments[-1][1] < window / 2000:
                segments[-1][1] = max(segments[-1][1], b)
            else:
                segments.append([a, b, role, iv.node])
        out.append(
            {
                "worker": slot,
                "busy_s": round(busy, 4),
                "idle_s": round(window - busy, 4),
                "busy_frac": round(busy / window, 4),
                "by_role": {k: round(v, 4) for k, v in sorted(by_role.items())},
                "segments": [[round(a, 4), round(b, 4), r, n] for a, b, r, n in segments[-max_segments:]],
            }
        )
    return out


class Busy:
    """A slot's merged busy spans with prefix sums: busy seconds within any [lo, hi] in O(log n)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self.starts = [a for a, _ in spans]
        self.spans = spans
        self.before = [0.0]
        for a, b in spans:
            self.before.append(self.before[-1] + b - a)

    def between(self, lo: float, hi: float) -> float:
        if hi <= lo or not self.spans:
            return 0.0
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        j = bisect.bisect_left(self.starts, hi)
        if j <= i:
            return 0.0
        total = self.before[j] - self.before[i]
        total -= max(0.0, min(lo, self.spans[i][1]) - self.spans[i][0])  # the part of the first span before lo
        total -= max(0.0, self.spans[j - 1][1] - max(hi, self.spans[j - 1][0]))  # the part of the last after hi
        return total


def stage_idle(
    intervals: Iterable[Interval], slots: Sequence[str], start: float, stop: float, *, max_stages: int = 40
) -> list[dict]:
    """Per stage (a call node within one step) with work in [start, stop]: its span (first start to last stop,
    clipped), the slot-seconds its own tasks computed, and the slot-seconds within its span in which a slot ran
    nothing at all. The latest `max_stages`, sorted by start."""
    ivs = [iv for iv in intervals if iv.stop > start and iv.start < stop]
    busy = {s: Busy(union_of(((iv.start, iv.stop) for iv in ivs if iv.worker == s), start, stop)) for s in slots}
    stages: dict[tuple[int | None, str], list[Interval]] = {}
    for iv in ivs:
        stages.setdefault((iv.step, iv.node), []).append(iv)
    out = []
    for (step, node), mine in stages.items():
        lo, hi = max(min(iv.start for iv in mine), start), min(max(iv.stop for iv in mine), stop)
        span = max(hi - lo, 0.0)
        own = sum(
            covered_length(union_of(((iv.start, iv.stop) for iv in mine if iv.worker == w), lo, hi))
            for w in {iv.worker for iv in mine}
        )
        idle = sum(span - b.between(lo, hi) for b in busy.values())
        out.append(
            {
                "stage": node,
                "step": step,
                "role": role_of(node),
                "start": round(lo - start, 4),
                "span_s": round(span, 4),
                "busy_s": round(own, 4),
                "idle_s": round(idle, 4),
                "idle_frac": round(idle / (span * len(slots)), 4) if span > 0 and slots else 0.0,
            }
        )
    return sorted(out, key=lambda d: d["start"])[-max_stages:]


def metric_series(
    events: Iterable[tuple[float, Any]], keys: Sequence[str] | None = None, *, limit: int = DEFAULT_METRIC_LIMIT
) -> dict[str, list]:
    """`[[step, value], ...]` per metric from `(timestamp, {"step": i, ...})` events, for the `keys` present, in
    their order; a step published twice (a resumed run) keeps its latest value. Without `keys`: every numeric
    metric, in the order they first appear, the first `limit` of them."""
    series: dict[str, dict[int, float]] = {}
    for _, msg in events:
        if not isinstance(msg, Mapping) or not isinstance(msg.get("step"), int):
            continue
        for k in msg if keys is None else keys:
            v = msg.get(k)
            if k == "step" or not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                continue
            if k in series or keys is not None or len(series) < limit:
                series.setdefault(k, {})[msg["step"]] = float(v)
    order = series if keys is None else [k for k in keys if k in series]
    return {k: [[s, v] for s, v in sorted(series[k].items())] for k in order}


def snapshot(
    *,
    now: float,
    step: int | None,
    tasks: Iterable[TaskRecord],
    intervals: Sequence[Interval],
    slots: Sequence[str],
    slot_names: Mapping[str, str] | None = None,
    window_start: float,
    events: Iterable[tuple[float, Any]] = (),
    metric_keys: Sequence[str] | None = None,
    role_colors: Mapping[str, str] | None = None,
    steps: Sequence[int] = (),
    usual: Mapping[str, float] | None = None,
) -> dict:
    """Everything `/flowactors/data.json` serves, from plain records; `steps` are the steps whose graphs are
    kept (the page offers them), `step` the one shown."""
    seconds: dict[str, float] = {}
    for iv in intervals:
        if iv.step == step:
            seconds[iv.node] = seconds.get(iv.node, 0.0) + (iv.stop - iv.start)
    graph = aggregate_graph(tasks, seconds, role_colors, now=now, usual=usual)
    usage = slot_usage(intervals, slots, window_start, now)
    for i, u in enumerate(usage):
        u["name"] = (slot_names or {}).get(u["worker"], str(i))
    roles = {n["role"] for n in graph["nodes"]} | {r for u in usage for r in u["by_role"]}
    events = list(events)
    last = events[-1][1] if events and isinstance(events[-1][1], Mapping) else {}
    return {
        "now": now,
        "step": step,
        "steps": list(steps),
        "window": {"start": window_start, "stop": now, "seconds": round(now - window_start, 4)},
        "graph": graph,
        "slots": usage,
        "stages": stage_idle(intervals, slots, window_start, now),
        "roles": {r: role_color(r, role_colors) for r in sorted(roles)},
        "states": STATE_COLORS,
        "metrics": metric_series(events, metric_keys),
        "last_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
    }
