"""A flowactors page on the Dask dashboard: the step's dataflow graph, a timeline per device slot, the metrics.

docs/design.md §3 promises that every call shows in the Dask dashboard under a readable name. Dask's own pages show
tasks; this page shows what the author of an actor program asks about: which group calls the current step is
made of and where each stands, which group (role) occupied which device slot when (and how long each slot sat
idle), and how the step metrics move. It is a `SchedulerPlugin` (`FlowactorsDashboard`) that adds two routes to
the scheduler's running tornado application, `/flowactors` (a self-contained page: inline SVG, CSS and JS, no
CDN, works offline and with the dashboard bound to 127.0.0.1) and `/flowactors/data.json`, which the page polls
every 1.5 s.

Design decisions, and why:

- **The plugin records, pure functions compute.** The scheduler forgets a task once no client holds its future,
  and keeps task-stream data only while a `TaskStreamPlugin` runs. So the plugin keeps its own small records:
  per task key (of the last `keep_steps` steps) its state and dependencies, from `update_graph` and `transition`;
  per finished task its compute span (`startstops`) on its worker. Everything shown is computed from those plain
  records by the module-level functions (`aggregate_graph`, `slot_usage`, `stage_idle`, `metric_series`,
  `snapshot`), which the tests check against hand-computed numbers without a cluster or a browser.
- **Steps.** The scheduler only sees keys; the step number exists in the metrics the controller publishes with
  `client.log_event("flowactors.metrics", {"step": i, ...})` after each step. Tasks submitted after step i's
  metrics belong to step i + 1 (tasks before the first metrics, such as group creation, count as step 0). An
  explicit `client.log_event("flowactors.step", {"step": i})` at the start of a step sets it directly.
- **Nodes are calls, not tasks.** A node is a key prefix `role.method` (`dask.utils.key_split`); a collect task
  (`role.method.collect-<hex>`, where the runtime uses one) is folded into its call, so edges read call → call.
  Helper tasks (`join`, `summarize`) are nodes of role `task`. Dependencies are aggregated by prefix and split in
  two kinds: *data* (a future passed as an argument) and *order* (the `_after` argument with which the
  controller chains calls pinned to one process, docs/design.md §3 Ordering). Only data edges decide the columns, so
  calls that read the same inputs stack in one column even when one process runs them in turn; order edges
  are drawn dashed.
- **The caller names what matters.** flowactors knows nothing of the program it serves (docs/design.md §2), so which
  metrics are charted and which roles get fixed colours are settings of the plugin (`metrics`, `role_colors`,
  also taken by `install_dashboard`). By default every metric published is charted (the first
  `DEFAULT_METRIC_LIMIT`, in the order they first appear). Only the runtime's own pseudo-roles have colours of
  their own: `task` (helper tasks) and `world` (forming the torch.distributed world). The plugin gives every
  other role the next palette colour nobody holds, in the order roles first submit work, so roles never share a
  colour while the palette lasts and one program looks the same from run to run; `role_color` alone (no such
  record) picks by a stable hash of the name.
- **Direct calls.** Calls on the direct path (flowactors._direct) are not Dask tasks: the workers report each
  item after it ran (key, inputs, the item before it on that process, compute span, the controller's step) on
  topic `flowactors.calls`, and the plugin records them as finished tasks and spans, the same records as above.
  They appear when finished (within `_direct.REPORT_S`), never as processing.
- **Idle time** is measured over a recent window (default 60 s, never before the plugin started): per slot,
  window length minus the union of its compute spans; per stage (node), over the stage's span in the window,
  the slot-seconds in which a slot ran nothing at all (the cost of a stage that does not use every device).
"""

from __future__ import annotations

import bisect
import json
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dask.utils import key_split
from distributed.diagnostics.plugin import SchedulerPlugin
import tornado.routing
from tornado import web

from flowactors._direct import CALLS_TOPIC
from flowactors.profiling import union_spans as _union

__all__ = ["FlowactorsDashboard", "install_dashboard", "TaskRecord", "Interval", "node_of", "role_of",
           "role_color", "aggregate_graph", "slot_usage", "stage_idle", "metric_series", "snapshot",
           "DEFAULT_METRIC_LIMIT", "STATE_COLORS"]

PLUGIN_NAME = "flowactors-dashboard"
METRICS_TOPIC = "flowactors.metrics"
STEP_TOPIC = "flowactors.step"
DEFAULT_METRIC_LIMIT = 12  # metrics charted when the caller names none: the first ones published

# The runtime's own pseudo-roles: helper tasks without a group, and forming the torch.distributed world.
_RUNTIME_COLORS = {"task": "#8c8c8c", "world": "#5f6b73"}
# Other roles get one of these (see the module docstring), never one the caller's `role_colors` took.
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#9c755f", "#76b7b2", "#edc948", "#ff9da7",
            "#6b6ecf", "#17a2b8", "#a0a336", "#d37295", "#8f6a3a")
STATE_COLORS = {"waiting": "#bdbdbd", "processing": "#ffb000", "memory": "#1b9e3e", "erred": "#d50000",
                "released": "#78909c"}
# A node shows the most urgent state among its tasks.
_STATE_RANK = {"erred": 0, "processing": 1, "waiting": 2, "memory": 3, "released": 4}
_SCHEDULER_STATES = {"no-worker": "waiting", "queued": "waiting", "waiting": "waiting", "processing": "processing",
                     "memory": "memory", "erred": "erred", "released": "released", "forgotten": "released"}


# -- plain records -----------------------------------------------------------------------------------------------

@dataclass
class TaskRecord:
    """One task as the page needs it: its key, its state, and the keys it depends on (order ones apart)."""

    key: str
    state: str = "waiting"
    deps: tuple[str, ...] = ()
    order_deps: tuple[str, ...] = ()
    done: bool = False


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
    fixed = {**_RUNTIME_COLORS, **(role_colors or {})}
    if role in fixed:
        return fixed[role]
    free = [c for c in _PALETTE if c not in fixed.values()] or list(_PALETTE)
    return free[zlib.crc32(role.encode()) % len(free)]


def _state(scheduler_state: str) -> str:
    return _SCHEDULER_STATES.get(scheduler_state, "waiting")


# -- pure computations -----------------------------------------------------------------------------------------

def aggregate_graph(tasks: Iterable[TaskRecord], seconds: Mapping[str, float] | None = None,
                    role_colors: Mapping[str, str] | None = None) -> dict:
    """Aggregate tasks into call nodes and call → call edges with a layered layout.

    Dependencies on keys outside `tasks` (earlier steps) are left out. Columns come from the task graph, which
    is acyclic even when a call repeats within a step (the call graph then has a cycle): a task sits in its
    deepest producer's column, one further when that producer is another call; a call's column (`layer`) is that
    of its shallowest task. The order in which the scheduler reported the tasks does not matter: Dask handles graph
    updates concurrently, so a consumer can be reported before its producer. `row` is a node's place in its
    column, in first-seen order.
    """
    records = list(tasks)
    node_by_key = {r.key: node_of(r.key) for r in records}
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
    edge_list = [{"source": s, "target": t, "kind": k, "n": c} for (s, t, k), c in edges.items()
                 if not (k == "order" and (s, t, "data") in edges)]
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
        nodes.append({"id": n, "role": role_of(n), "method": n.split(".", 1)[1] if "." in n else n,
                      "state": state, "counts": dict(sorted(c.items())), "n": sum(c.values()), "done": done[n],
                      "layer": layer[n], "row": row, "seconds": round((seconds or {}).get(n, 0.0), 4),
                      "color": role_color(role_of(n), role_colors)})
    return {"nodes": nodes, "edges": edge_list, "layers": 1 + max(layer.values(), default=-1),
            "rows": max(rows.values(), default=0)}


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


def _length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def slot_usage(intervals: Iterable[Interval], slots: Sequence[str], start: float, stop: float, *,
               max_segments: int = 1500) -> list[dict]:
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
        busy = _length(_union(((iv.start, iv.stop) for iv in ivs), start, stop))
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
        out.append({"worker": slot, "busy_s": round(busy, 4), "idle_s": round(window - busy, 4),
                    "busy_frac": round(busy / window, 4),
                    "by_role": {k: round(v, 4) for k, v in sorted(by_role.items())},
                    "segments": [[round(a, 4), round(b, 4), r, n] for a, b, r, n in segments[-max_segments:]]})
    return out


class _Busy:
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


def stage_idle(intervals: Iterable[Interval], slots: Sequence[str], start: float, stop: float, *,
               max_stages: int = 40) -> list[dict]:
    """Per stage (a call node within one step) with work in [start, stop]: its span (first start to last stop,
    clipped), the slot-seconds its own tasks computed, and the slot-seconds within its span in which a slot ran
    nothing at all. The latest `max_stages`, sorted by start."""
    ivs = [iv for iv in intervals if iv.stop > start and iv.start < stop]
    busy = {s: _Busy(_union(((iv.start, iv.stop) for iv in ivs if iv.worker == s), start, stop)) for s in slots}
    stages: dict[tuple[int | None, str], list[Interval]] = {}
    for iv in ivs:
        stages.setdefault((iv.step, iv.node), []).append(iv)
    out = []
    for (step, node), mine in stages.items():
        lo, hi = max(min(iv.start for iv in mine), start), min(max(iv.stop for iv in mine), stop)
        span = max(hi - lo, 0.0)
        own = sum(_length(_union(((iv.start, iv.stop) for iv in mine if iv.worker == w), lo, hi))
                  for w in {iv.worker for iv in mine})
        idle = sum(span - b.between(lo, hi) for b in busy.values())
        out.append({"stage": node, "step": step, "role": role_of(node), "start": round(lo - start, 4),
                    "span_s": round(span, 4), "busy_s": round(own, 4), "idle_s": round(idle, 4),
                    "idle_frac": round(idle / (span * len(slots)), 4) if span > 0 and slots else 0.0})
    return sorted(out, key=lambda d: d["start"])[-max_stages:]


def metric_series(events: Iterable[tuple[float, Any]], keys: Sequence[str] | None = None, *,
                  limit: int = DEFAULT_METRIC_LIMIT) -> dict[str, list]:
    """`[[step, value], ...]` per metric from `(timestamp, {"step": i, ...})` events, for the `keys` present, in
    their order; a step published twice (a resumed run) keeps its latest value. Without `keys`: every numeric
    metric, in the order they first appear, the first `limit` of them."""
    series: dict[str, dict[int, float]] = {}
    for _, msg in events:
        if not isinstance(msg, Mapping) or not isinstance(msg.get("step"), int):
            continue
        for k in (msg if keys is None else keys):
            v = msg.get(k)
            if k == "step" or not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                continue
            if k in series or keys is not None or len(series) < limit:
                series.setdefault(k, {})[msg["step"]] = float(v)
    order = series if keys is None else [k for k in keys if k in series]
    return {k: [[s, v] for s, v in sorted(series[k].items())] for k in order}


def snapshot(*, now: float, step: int | None, tasks: Iterable[TaskRecord], intervals: Sequence[Interval],
             slots: Sequence[str], slot_names: Mapping[str, str] | None = None, window_start: float,
             events: Iterable[tuple[float, Any]] = (), metric_keys: Sequence[str] | None = None,
             role_colors: Mapping[str, str] | None = None) -> dict:
    """Everything `/flowactors/data.json` serves, from plain records."""
    seconds: dict[str, float] = {}
    for iv in intervals:
        if iv.step == step:
            seconds[iv.node] = seconds.get(iv.node, 0.0) + (iv.stop - iv.start)
    graph = aggregate_graph(tasks, seconds, role_colors)
    usage = slot_usage(intervals, slots, window_start, now)
    for i, u in enumerate(usage):
        u["name"] = (slot_names or {}).get(u["worker"], str(i))
    roles = {n["role"] for n in graph["nodes"]} | {r for u in usage for r in u["by_role"]}
    events = list(events)
    last = events[-1][1] if events and isinstance(events[-1][1], Mapping) else {}
    return {
        "now": now, "step": step,
        "window": {"start": window_start, "stop": now, "seconds": round(now - window_start, 4)},
        "graph": graph, "slots": usage, "stages": stage_idle(intervals, slots, window_start, now),
        "roles": {r: role_color(r, role_colors) for r in sorted(roles)}, "states": STATE_COLORS,
        "metrics": metric_series(events, metric_keys),
        "last_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
    }


# -- the scheduler plugin ----------------------------------------------------------------------------------------

class FlowactorsDashboard(SchedulerPlugin):
    """Serves `/flowactors` and `/flowactors/data.json` on the scheduler's dashboard (see the module docstring).

    `window_s`: the recent window of the timeline and idle figures. `keep_steps`: steps whose task records are
    kept (the graph shows the latest). `metrics`: the metric names charted, in this order (None: every metric
    published, the first `DEFAULT_METRIC_LIMIT`). `role_colors`: fixed colours for roles (group names), CSS hex;
    other roles get the free palette colours in the order they appear. The scheduler must be able to import
    flowactors (it is, for the embedded cluster; install flowactors next to `dask scheduler` otherwise).
    """

    name = PLUGIN_NAME
    idempotent = True  # installing again keeps the running plugin and what it recorded

    def __init__(self, window_s: float = 60.0, keep_steps: int = 2, metrics: Sequence[str] | None = None,
                 max_intervals: int = 20000, role_colors: Mapping[str, str] | None = None) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        if isinstance(metrics, str):
            raise TypeError(f"metrics must be a sequence of metric names, got the string {metrics!r}; "
                            f"pass ({metrics!r},)")
        self.window_s, self.keep_steps = float(window_s), int(keep_steps)
        self.metrics = None if metrics is None else tuple(metrics)
        self.role_colors = dict(role_colors or {})
        self.max_intervals = int(max_intervals)
        self._reset()

    def _reset(self) -> None:
        self.scheduler: Any = None
        self.step = 0
        self._started = 0.0
        self._steps: OrderedDict[int, dict[str, TaskRecord]] = OrderedDict()
        self._key_step: dict[str, int] = {}
        self._step_times: deque[tuple[float, int]] = deque(maxlen=1000)  # (when, step from then on)
        self._intervals: deque[Interval] = deque(maxlen=self.max_intervals)
        self._colors: dict[str, str] = {**_RUNTIME_COLORS, **self.role_colors}  # grows as roles appear

    def __getstate__(self) -> dict:  # only the settings travel to the scheduler
        return {"window_s": self.window_s, "keep_steps": self.keep_steps, "metrics": self.metrics,
                "role_colors": self.role_colors, "max_intervals": self.max_intervals}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    async def start(self, scheduler: Any) -> None:
        from distributed.metrics import time

        self.scheduler, self._started = scheduler, time()
        past = [m for _, m in scheduler.get_events(METRICS_TOPIC) if isinstance(m, Mapping)]
        if past and isinstance(past[-1].get("step"), int):
            self.step = past[-1]["step"] + 1
        app = getattr(scheduler, "http_application", None)
        if app is not None and not getattr(app, "_flowactors_routes", False):
            # Routes are added once per scheduler; handlers look the plugin up by name on every request, so a
            # plugin unregistered and registered again is served without a second set of routes.
            prefix = _http_prefix(app)
            kw = {"scheduler": scheduler, "data_url": f"{prefix}flowactors/data.json"}
            app.add_handlers(r".*", [(rf"{prefix}flowactors/?", _PageHandler, kw),
                                     (rf"{prefix}flowactors/data\.json", _DataHandler, kw)])
            app._flowactors_routes = True

    # -- recording -------------------------------------------------------------------------------------------
    def log_event(self, topic: str, msg: Any) -> None:
        if topic == CALLS_TOPIC and isinstance(msg, Mapping):
            self._direct_calls(str(msg.get("worker", "")), msg.get("calls") or ())
            return
        if not isinstance(msg, Mapping) or not isinstance(msg.get("step"), int):
            return
        if topic == METRICS_TOPIC:
            self.step = msg["step"] + 1
        elif topic == STEP_TOPIC:
            self.step = msg["step"]
        else:
            return
        from distributed.metrics import time

        self._step_times.append((time(), self.step))

    def _records(self, step: int) -> dict[str, TaskRecord] | None:
        """The records of `step` (created when it is the newest; None for a step already dropped)."""
        records = self._steps.get(step)
        if records is None:
            if self._steps and step < next(reversed(self._steps)):
                return None
            records = self._steps[step] = {}
            while len(self._steps) > self.keep_steps:
                _, old = self._steps.popitem(last=False)
                for k in old:
                    self._key_step.pop(k, None)
        return records

    def update_graph(self, scheduler: Any, *, tasks: Sequence[Any] = (), **kwargs: Any) -> None:
        records = self._records(self.step)
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or key in self._key_step or not isinstance(key, str) or records is None:
                continue
            records[key] = TaskRecord(key, _state(ts.state), tuple(str(d.key) for d in ts.dependencies),
                                      _order_deps(ts))
            self._color_role(role_of(node_of(key)))
            self._key_step[key] = self.step

    def _direct_calls(self, worker: str, calls: Iterable[Mapping]) -> None:
        """Items a worker ran on the direct call path (flowactors._direct), reported after they finished: each
        becomes a finished task of its step (the controller's step when it had one) and a span on the worker."""
        skew = self._skew(worker)
        times = [t for t, _ in self._step_times]
        for c in calls:
            key = str(c.get("key"))
            start, stop = c.get("start"), c.get("stop")
            timed = isinstance(start, (int, float)) and isinstance(stop, (int, float))
            step = c["step"] if isinstance(c.get("step"), int) else \
                self._step_at(start + skew, times) if timed else self.step
            records = self._records(step)
            if records is not None and key not in self._key_step:
                data = tuple(str(d) for d in c.get("deps") or ())
                order = (str(c["order"]),) if c.get("order") and str(c["order"]) not in data else ()  # as _order_deps
                records[key] = TaskRecord(key, "memory" if c.get("ok") else "erred", data + order, order,
                                          done=bool(c.get("ok")))
                self._color_role(role_of(node_of(key)))
                self._key_step[key] = step
            if timed:
                self._intervals.append(Interval(worker, node_of(key), start + skew, stop + skew, step))

    def _step_at(self, when: float, times: Sequence[float]) -> int:
        """The step that was current at time `when` (scheduler clock): reports arrive after the fact. `times`:
        the times of `_step_times`, taken once per report."""
        i = bisect.bisect_right(times, when)
        return self._step_times[i - 1][1] if i else (self._step_times[0][1] - 1 if times else self.step)

    def _skew(self, worker: str) -> float:
        """Spans are in the worker's clock; shift them only for a real skew (the estimate includes latency)."""
        ws = self.scheduler.workers.get(worker) if self.scheduler is not None else None
        skew = getattr(ws, "time_delay", 0.0) or 0.0
        return skew if abs(skew) > 0.1 else 0.0

    def _color_role(self, role: str) -> None:
        if role not in self._colors:
            free = [c for c in _PALETTE if c not in self._colors.values()]
            self._colors[role] = free[0] if free else role_color(role, self.role_colors)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        step = self._key_step.get(key)
        if step is not None:
            rec = self._steps[step][key]
            rec.state = _state(finish)
            rec.done = rec.done or finish == "memory"
        worker = kwargs.get("worker")
        if start == "processing" and finish in ("memory", "erred") and worker:
            skew = self._skew(worker)
            for ss in kwargs.get("startstops") or ():
                if ss.get("action") == "compute":
                    self._intervals.append(Interval(worker, node_of(key), ss["start"] + skew, ss["stop"] + skew,
                                                    self.step if step is None else step))

    # -- serving ---------------------------------------------------------------------------------------------
    def slots(self) -> tuple[list[str], dict[str, str]]:
        """Device-slot workers (resource `slot` or `GPU`; all workers if none has one) in the controller's
        order (host, then name), plus workers gone since that still have spans in the window."""
        ws = list(self.scheduler.workers.values())
        dev = [w for w in ws if any(w.resources.get(r) for r in ("slot", "GPU"))] or ws
        dev.sort(key=lambda w: (w.host, *_natural(str(w.name))))
        addresses = [w.address for w in dev]
        names = {w.address: str(w.name) for w in dev}
        for iv in self._intervals:
            if iv.worker not in names:
                addresses.append(iv.worker)
                names[iv.worker] = "gone"
        return addresses, names

    def data(self) -> dict:
        from distributed.metrics import time

        now = time()
        shown = next((s for s in reversed(self._steps) if self._steps[s]), None)
        slots, names = self.slots()
        window_start = max(now - self.window_s, self._started)
        recent = [iv for iv in self._intervals if iv.stop > window_start or iv.step == shown]
        return snapshot(now=now, step=shown, tasks=list(self._steps.get(shown, {}).values()), intervals=recent,
                        slots=slots, slot_names=names, window_start=window_start,
                        events=self.scheduler.get_events(METRICS_TOPIC), metric_keys=self.metrics,
                        role_colors=self._colors)


def _order_deps(ts: Any) -> tuple[str, ...]:
    """Keys behind the task's `_after` argument (the controller's per-process ordering chain) that it does not
    also take as data: with rank-to-rank parts, rank r's input is often the previous call on its own process."""
    try:
        spec = ts.run_spec
        after = set(getattr(spec.kwargs.get("_after"), "dependencies", ()) or ())
        data: set = set()
        for v in (*spec.args, *(v for k, v in spec.kwargs.items() if k != "_after")):
            data |= set(getattr(v, "dependencies", ()) or ())
        return tuple(str(k) for k in after - data)
    except Exception:  # noqa: BLE001 - not a flowactors call, or an older task spec
        return ()


def _natural(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _http_prefix(app: Any) -> str:
    """The dashboard's URL prefix (`Scheduler(http_prefix=...)`), read off the route of its /health page."""
    stack = [app.wildcard_router, app.default_router]
    while stack:
        router = stack.pop()
        for rule in getattr(router, "rules", ()):
            if isinstance(rule.target, tornado.routing.RuleRouter):
                stack.append(rule.target)
            elif isinstance(rule.matcher, tornado.routing.PathMatches):
                pattern = rule.matcher.regex.pattern.rstrip("$")
                if pattern.endswith("/health"):
                    return pattern[: -len("health")]
    return "/"


class _Handler(web.RequestHandler):
    def initialize(self, scheduler: Any, data_url: str) -> None:
        self.dask_scheduler, self.data_url = scheduler, data_url

    def plugin(self) -> FlowactorsDashboard | None:
        p = self.dask_scheduler.plugins.get(PLUGIN_NAME)
        return p if isinstance(p, FlowactorsDashboard) else None


class _PageHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(_PAGE.replace("__DATA_URL__", json.dumps(self.data_url)))


class _DataHandler(_Handler):
    def get(self) -> None:
        p = self.plugin()
        if p is None:
            self.set_status(404)
            self.write({"error": "the flowactors dashboard plugin is not registered on this scheduler; "
                                 "call flowactors.dashboard.install_dashboard(client)"})
            return
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(p.data()))


def install_dashboard(client: Any, plugin: FlowactorsDashboard | None = None, *,
                      metrics: Sequence[str] | None = None, role_colors: Mapping[str, str] | None = None) -> str:
    """Register the plugin on the client's scheduler and return the page's URL.

    `metrics` and `role_colors` are the program's: the metric names to chart and fixed colours for its roles
    (see `FlowactorsDashboard`); pass them here or on a `plugin` of your own, not both. Idempotent: a scheduler
    that already runs the plugin keeps it (to change its settings, first
    `client.unregister_scheduler_plugin(flowactors.dashboard.PLUGIN_NAME)`). Raises RuntimeError when the
    scheduler runs without a dashboard (nothing would serve the page).
    """
    if plugin is not None and (metrics is not None or role_colors is not None):
        raise ValueError("install_dashboard got both a plugin and metrics/role_colors; set them on the plugin "
                         "(FlowactorsDashboard(metrics=..., role_colors=...)) or pass no plugin")
    try:
        link = client.dashboard_link
    except Exception as e:  # noqa: BLE001 - no dashboard service on the scheduler
        raise RuntimeError("the scheduler has no dashboard, so the flowactors page cannot be served; start it "
                           "with a dashboard (Controller.local(dashboard='127.0.0.1:8787'), or "
                           "`dask scheduler --dashboard-address 127.0.0.1:8787`)") from e
    client.register_plugin(plugin or FlowactorsDashboard(metrics=metrics, role_colors=role_colors))
    base = link.rstrip("/")
    if base.endswith("/status"):
        base = base[: -len("/status")]
    return f"{base}/flowactors"


# -- the page ----------------------------------------------------------------------------------------------------
# One self-contained document: no network access beyond data.json, so it works on an offline cluster.

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>flowactors</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{margin:0;font:13px/1.35 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;background:#fafafa}
 header{display:flex;align-items:baseline;gap:14px;padding:8px 16px;background:#263238;color:#eceff1}
 header h1{font-size:17px;margin:0} #status{color:#b0bec5;font-size:12px}
 main{padding:6px 16px} section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;margin:8px 0;
 padding:6px 10px} h2{font-size:13px;margin:2px 0 6px;color:#455a64}
 .legend{display:flex;flex-wrap:wrap;gap:10px;font-size:12px;margin:2px 0 4px}
 .sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
 svg text{font-family:inherit} .row{display:flex;gap:10px;flex-wrap:wrap}
 table{border-collapse:collapse;font-size:12px} td,th{padding:1px 8px;text-align:right}
 td:first-child,th:first-child{text-align:left} th{color:#607d8b;font-weight:600}
 .chart{border:1px solid #eee;border-radius:4px;padding:2px 6px}
 .empty{color:#90a4ae;padding:8px}
</style></head>
<body>
<header><h1>flowactors</h1><span id="step">step –</span><span id="status">connecting…</span></header>
<main>
 <section><h2 id="graph-title">Dataflow</h2><div class="legend" id="legend"></div><div id="graph"></div></section>
 <section><h2 id="slots-title">Device slots</h2><div id="timeline"></div><div id="stages"></div></section>
 <section><h2>Metrics</h2><div class="row" id="metrics"></div></section>
</main>
<script>
const DATA_URL = __DATA_URL__;
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));
const fmt = (v, d=3) => (Math.abs(v) >= 1000 ? v.toFixed(0) : Number(v).toPrecision(d));
const secs = v => v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";

function legend(d) {
  const roles = Object.entries(d.roles).map(([r, c]) =>
    `<span class="role" data-role="${esc(r)}"><span class="sw" style="background:${c}"></span>${esc(r)}</span>`);
  const states = Object.entries(d.states).map(([s, c]) =>
    `<span><span class="sw" style="background:#fff;border:3px solid ${c};width:5px;height:5px"></span>${s}</span>`);
  return roles.join("") + '<span style="width:18px"></span>' + states.join("");
}

function graph(d) {
  const g = d.graph;
  if (!g.nodes.length) return '<div class="empty">no calls yet</div>';
  const W = 196, H = 46, GX = 64, GY = 14, P = 8, LOOP = 48;  // LOOP: room for edges back into a column
  const pos = {};
  for (const n of g.nodes) pos[n.id] = [P + n.layer * (W + GX), P + n.row * (H + GY)];
  const width = P * 2 + g.layers * (W + GX) - GX + LOOP, height = P * 2 + g.rows * (H + GY) - GY;
  // Natural size, scaled down (never up) to fit the section.
  let s = `<svg id="graph-svg" viewBox="0 0 ${width} ${height}" width="${width}" height="${height}" `
        + `style="max-width:100%;height:auto;max-height:320px" preserveAspectRatio="xMinYMin meet"><defs>`
        + `<marker id="arr" viewBox="0 0 8 8" refX="8" refY="4" `
        + `markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0L8,4L0,8z" fill="#546e7a"/></marker></defs>`;
  for (const e of g.edges) {
    const [x1, y1] = pos[e.source], [x2, y2] = pos[e.target];
    let path;
    if (x2 > x1) {  // forward: right side of the source to the left side of the target
      const a = [x1 + W, y1 + H / 2], b = [x2, y2 + H / 2], k = Math.max(24, (b[0] - a[0]) / 2);
      path = `M${a[0]},${a[1]} C${a[0] + k},${a[1]} ${b[0] - k},${b[1]} ${b[0]},${b[1]}`;
    } else {  // same or earlier column: a loop out of the right sides
      const a = [x1 + W, y1 + H * 0.35], b = [x2 + W, y2 + H * 0.65], k = 22 + Math.abs(y2 - y1) / 8;
      path = `M${a[0]},${a[1]} C${a[0] + k},${a[1]} ${b[0] + k},${b[1]} ${b[0]},${b[1]}`;
    }
    const dash = e.kind === "order" ? ' stroke-dasharray="4 3" stroke="#b0bec5"' : ' stroke="#546e7a"';
    s += `<path d="${path}" fill="none"`
       + `${dash} stroke-width="1.5" marker-end="url(#arr)"><title>${esc(e.source)} → ${esc(e.target)} `
       + `(${e.kind}, ${e.n} task dependencies)</title></path>`;
  }
  for (const n of g.nodes) {
    const [x, y] = pos[n.id], sc = d.states[n.state] || "#999";
    const tip = Object.entries(n.counts).map(([k, v]) => `${k}: ${v}`).join(", ");
    s += `<g class="node" data-node="${esc(n.id)}" data-state="${n.state}"><title>${esc(n.id)} — ${tip}`
       + `; compute ${secs(n.seconds)}</title>`
       + `<rect x="${x}" y="${y}" width="${W}" height="${H}" rx="6" fill="${n.color}" stroke="${sc}" stroke-width="4"/>`
       + `<text x="${x + 10}" y="${y + 18}" fill="#fff" font-size="13" font-weight="600">${esc(n.id)}</text>`
       + `<text x="${x + 10}" y="${y + 36}" fill="#fff" font-size="11">${n.state} · ${n.done}/${n.n} done`
       + `${n.seconds ? " · " + secs(n.seconds) : ""}</text></g>`;
  }
  return s + "</svg>";
}

function timeline(d) {
  if (!d.slots.length) return '<div class="empty">no device slots</div>';
  const L = 150, R = 170, RH = 22, width = 1200, span = Math.max(d.window.seconds, 1e-3);
  const plotW = width - L - R, height = d.slots.length * (RH + 6) + 22;
  const X = t => L + plotW * t / span;
  let s = `<svg id="timeline-svg" viewBox="0 0 ${width} ${height}" width="100%">`;
  d.slots.forEach((u, i) => {
    const y = i * (RH + 6) + 4;
    s += `<text x="0" y="${y + 15}" font-size="12">slot ${esc(u.name)}</text>`
       + `<text x="60" y="${y + 15}" font-size="10" fill="#90a4ae">${esc(u.worker.replace(/^\w+:\/\//, ""))}</text>`
       + `<rect x="${L}" y="${y}" width="${plotW}" height="${RH}" fill="#eceff1"/>`;
    for (const [a, b, role, node] of u.segments) {
      const w = Math.max(X(b) - X(a), 1);
      s += `<rect class="seg" x="${X(a).toFixed(2)}" y="${y}" width="${w.toFixed(2)}" height="${RH}" `
         + `fill="${d.roles[role] || "#999"}"><title>${esc(node)}: ${secs(b - a)}</title></rect>`;
    }
    s += `<text x="${width - R + 8}" y="${y + 15}" font-size="12">busy ${(100 * u.busy_frac).toFixed(0)}% · `
       + `idle ${secs(u.idle_s)}</text>`;
  });
  const y = d.slots.length * (RH + 6) + 16;
  s += `<text x="${L}" y="${y}" font-size="10" fill="#78909c">−${span.toFixed(0)} s</text>`
     + `<text x="${L + plotW}" y="${y}" font-size="10" fill="#78909c" text-anchor="end">now</text>`;
  return s + "</svg>";
}

function stages(d) {
  if (!d.stages.length) return "";
  const rows = d.stages.slice(-8).map(t => `<tr><td><span class="sw" style="background:${d.roles[t.role] || "#999"}">`
    + `</span>${esc(t.stage)}</td><td>${t.step === null ? "–" : t.step}</td><td>${secs(t.span_s)}</td>`
    + `<td>${secs(t.busy_s)}</td><td>${secs(t.idle_s)}</td><td>${(100 * t.idle_frac).toFixed(0)}%</td></tr>`);
  return `<table id="stage-table"><tr><th>stage (recent)</th><th>step</th><th>span</th><th>compute</th>`
       + `<th>idle slot-time</th><th>idle</th></tr>${rows.join("")}</table>`;
}

function chart(name, pts) {
  const w = 260, h = 110, l = 38, r = 8, t = 18, b = 16;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const X = v => l + (w - l - r) * (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5);
  const Y = v => h - b - (h - t - b) * (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5);
  const line = pts.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
  const last = pts[pts.length - 1];
  return `<div class="chart" data-metric="${esc(name)}"><svg width="${w}" height="${h}">`
    + `<text x="0" y="12" font-size="12" font-weight="600">${esc(name)}</text>`
    + `<text x="${w}" y="12" font-size="12" text-anchor="end">${fmt(last[1])} @ step ${last[0]}</text>`
    + `<text x="${l - 4}" y="${t + 8}" font-size="9" text-anchor="end" fill="#78909c">${fmt(y1)}</text>`
    + `<text x="${l - 4}" y="${h - b}" font-size="9" text-anchor="end" fill="#78909c">${fmt(y0)}</text>`
    + `<text x="${l}" y="${h - 3}" font-size="9" fill="#78909c">${x0}</text>`
    + `<text x="${w - r}" y="${h - 3}" font-size="9" text-anchor="end" fill="#78909c">${x1}</text>`
    + `<line x1="${l}" y1="${h - b}" x2="${w - r}" y2="${h - b}" stroke="#cfd8dc"/>`
    + `<polyline points="${line}" fill="none" stroke="#37474f" stroke-width="1.8"/>`
    + pts.map(p => `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="2" fill="#37474f"/>`).join("")
    + `</svg></div>`;
}

function render(d) {
  const step = d.step === null ? "–" : d.step;
  document.title = `flowactors · step ${step}`;
  document.getElementById("step").textContent = `step ${step}`;
  document.getElementById("graph-title").textContent = `Dataflow · step ${step}`;
  document.getElementById("legend").innerHTML = legend(d);
  document.getElementById("graph").innerHTML = graph(d);
  document.getElementById("slots-title").textContent =
    `Device slots · last ${d.window.seconds.toFixed(0)} s`;
  document.getElementById("timeline").innerHTML = timeline(d);
  document.getElementById("stages").innerHTML = stages(d);
  const m = Object.entries(d.metrics);
  document.getElementById("metrics").innerHTML =
    m.length ? m.map(([k, v]) => chart(k, v)).join("") : '<div class="empty">no metrics published yet</div>';
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const r = await fetch(DATA_URL, {cache: "no-store"});
    if (!r.ok) throw new Error((await r.json()).error || r.statusText);
    render(await r.json());
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    status.textContent = "disconnected: " + e.message;
  }
}
refresh();
setInterval(refresh, 1500);
</script>
</body></html>
"""
