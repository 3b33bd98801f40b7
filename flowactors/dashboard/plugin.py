"""The scheduler plugin behind the flowactors page: it records what the page needs as the scheduler runs.

The scheduler forgets a task once no client holds its future, and keeps task-stream data only while a
`TaskStreamPlugin` runs, so `FlowactorsDashboard` keeps its own small records (`flowactors.dashboard.aggregate`):
per task key of the last `keep_steps` steps its state and dependencies (from `update_graph` and `transition`), per
finished task its compute span on its worker, and the items of the direct call path: the controller reports each
as it issues it (topic `flowactors.issued`: waiting), its worker when it starts and when it ends (topic
`flowactors.calls`: processing, then memory or erred), so a step's graph is whole while it runs, as on the
Dask-task path. Each call belongs to the step that issued it, whenever it runs or reports. On start it mounts the
page's routes on the scheduler's dashboard (`flowactors.dashboard.handlers`). See the package docstring.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from flowactors.dashboard.aggregate import (
    PALETTE,
    RUNTIME_COLORS,
    Interval,
    TaskRecord,
    node_of,
    record_state,
    role_color,
    role_of,
    snapshot,
)
from flowactors.transport.wire import CALLS_TOPIC, ISSUED_TOPIC, reports_of

__all__ = ["FlowactorsDashboard", "install_dashboard", "PLUGIN_NAME", "METRICS_TOPIC", "STEP_TOPIC"]

PLUGIN_NAME = "flowactors-dashboard"
METRICS_TOPIC = "flowactors.metrics"
STEP_TOPIC = "flowactors.step"


class FlowactorsDashboard(SchedulerPlugin):
    """Serves `/flowactors` and `/flowactors/data.json` on the scheduler's dashboard (see `flowactors.dashboard`).

    `window_s`: the recent window of the timeline and idle figures. `keep_steps`: steps whose task records are
    kept (the graph shows the latest). `metrics`: the metric names charted, in this order (None: every metric
    published, the first `DEFAULT_METRIC_LIMIT`). `role_colors`: fixed colours for roles (group names), CSS hex;
    other roles get the free palette colours in the order they appear. The scheduler must be able to import
    flowactors (it is, for the embedded cluster; install flowactors next to `dask scheduler` otherwise).
    """

    name = PLUGIN_NAME
    idempotent = True  # installing again keeps the running plugin and what it recorded

    def __init__(
        self,
        window_s: float = 60.0,
        keep_steps: int = 4,
        metrics: Sequence[str] | None = None,
        max_intervals: int = 20000,
        role_colors: Mapping[str, str] | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        if isinstance(metrics, str):
            raise TypeError(
                f"metrics must be a sequence of metric names, got the string {metrics!r}; pass ({metrics!r},)"
            )
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
        self._colors: dict[str, str] = {**RUNTIME_COLORS, **self.role_colors}  # grows as roles appear
        self._usual: dict[str, float] = {}  # call node -> its tasks' usual compute seconds (a moving average)

    def __getstate__(self) -> dict:  # only the settings travel to the scheduler
        return {
            "window_s": self.window_s,
            "keep_steps": self.keep_steps,
            "metrics": self.metrics,
            "role_colors": self.role_colors,
            "max_intervals": self.max_intervals,
        }

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
        if app is not None:
            from flowactors.dashboard.handlers import add_routes  # tornado's side, only where a dashboard runs

            add_routes(app, scheduler, registered_plugin)

    # -- recording -------------------------------------------------------------------------------------------
    def log_event(self, topic: str, msg: Any) -> None:
        if topic == CALLS_TOPIC and isinstance(msg, Mapping):
            self._direct_calls(str(msg.get("worker", "")), reports_of(msg))
            return
        if topic == ISSUED_TOPIC and isinstance(msg, Mapping):
            self._issued(reports_of(msg))
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
        """The records of `step`, created unless it is older than every kept step when `keep_steps` are kept (None:
        a step already dropped). Steps are kept in order, whatever order their first calls arrive in (the
        asynchronous pipeline issues calls of later steps early)."""
        records = self._steps.get(step)
        if records is None:
            if len(self._steps) >= self.keep_steps and step < next(iter(self._steps)):
                return None
            out_of_order = bool(self._steps) and step < next(reversed(self._steps))
            records = self._steps[step] = {}
            if out_of_order:
                for s in sorted(self._steps):
                    self._steps.move_to_end(s)
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
            records[key] = TaskRecord(
                key, record_state(ts.state), tuple(str(d.key) for d in ts.dependencies), _order_deps(ts)
            )
            self._color_role(role_of(node_of(key)))
            self._key_step[key] = self.step

    def _issued(self, calls: Iterable[Mapping]) -> None:
        """Items the controller sent on the direct path, as it sent them: waiting, in the step that issued them."""
        times = [t for t, _ in self._step_times]
        for c in calls:
            step = self._step_of(c, c.get("at"), times)
            if c.get("fanout"):  # one report for a call's ranks (flowactors.transport.channel): a list per field
                keys, workers, orders = c.get("keys") or (), c.get("workers") or (), c.get("orders") or ()
                each, deps = c.get("deps_each"), c.get("deps") or ()
                for i, key in enumerate(keys):
                    self._direct_record(
                        str(key),
                        step,
                        "waiting",
                        each[i] if each else deps,
                        orders[i] if i < len(orders) else None,
                        str(workers[i]) if i < len(workers) else "",
                    )
                continue
            self._direct_record(
                str(c.get("key")), step, "waiting", c.get("deps") or (), c.get("order"), str(c.get("worker") or "")
            )

    def _step_of(self, report: Mapping, when: Any, times: Sequence[float]) -> int:
        """A report's step: the controller's, else the one current at `when` (scheduler clock; reports arrive
        after the fact), else the current one."""
        if isinstance(report.get("step"), int):
            return report["step"]
        return self._step_at(when, times) if isinstance(when, (int, float)) else self.step

    def _direct_record(
        self, key: str, step: Any, state: str, deps: Iterable[Any], order: Any, worker: str
    ) -> TaskRecord | None:
        """The record of a direct item (made on its first report, whichever comes first), moved on to `state`
        unless a later state arrived first: reports of one item come from the controller and its worker apart."""
        known = self._key_step.get(key)
        if known is not None:
            rec = self._steps[known].get(key) if known in self._steps else None
        else:
            records = self._records(step if isinstance(step, int) else self.step)
            if records is None:
                return None
            data = tuple(str(d) for d in deps)
            order_deps = (str(order),) if order and str(order) not in data else ()  # as _order_deps
            rec = records[key] = TaskRecord(key, state, data + order_deps, order_deps, late=state in _FINAL)
            rec.done = state == "memory"  # its first report may be its last (a worker sends only that one
            # of an item that ended between two of its flushes)
            self._color_role(role_of(node_of(key)))
            self._key_step[key] = step if isinstance(step, int) else self.step
        if rec is None:
            return None
        if deps and not rec.deps:  # the first report did not know them
            data = tuple(str(d) for d in deps)
            rec.order_deps = (str(order),) if order and str(order) not in data else ()
            rec.deps = data + rec.order_deps
        if _PROGRESS[state] > _PROGRESS.get(rec.state, 0):
            rec.state = state
            rec.done = rec.done or state == "memory"
        if worker and not rec.worker:
            rec.worker = worker
        return rec

    def _direct_calls(self, worker: str, calls: Iterable[Mapping]) -> None:
        """What a worker reports of the items it ran on the direct call path (flowactors.transport.channel): each one
        received (waiting), started (processing) and ended (memory or erred, with its compute span)."""
        skew = self._skew(worker)
        times = [t for t, _ in self._step_times]
        for c in calls:
            key = str(c.get("key"))
            start, stop = c.get("start"), c.get("stop")
            state = c.get("state") or ("memory" if c.get("ok") else "erred")
            timed = isinstance(start, (int, float)) and isinstance(stop, (int, float))
            when = start if isinstance(start, (int, float)) else c.get("at")
            step = self._step_of(c, when + skew if isinstance(when, (int, float)) else None, times)
            rec = self._direct_record(key, step, state, c.get("deps") or (), c.get("order"), worker)
            if rec is not None and state == "processing" and isinstance(start, (int, float)):
                rec.started = start + skew
            if timed:
                self._intervals.append(Interval(worker, node_of(key), start + skew, stop + skew, step))
                self._note_duration(node_of(key), stop - start)

    def _note_duration(self, node: str, seconds: float) -> None:
        old = self._usual.get(node)
        self._usual[node] = seconds if old is None else 0.7 * old + 0.3 * seconds

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
            free = [c for c in PALETTE if c not in self._colors.values()]
            self._colors[role] = free[0] if free else role_color(role, self.role_colors)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        step = self._key_step.get(key)
        if step is not None:
            rec = self._steps[step][key]
            rec.state = record_state(finish)
            rec.done = rec.done or finish == "memory"
            if finish == "processing":
                from distributed.metrics import time

                ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
                on = getattr(ts, "processing_on", None)
                rec.started, rec.worker = time(), getattr(on, "address", rec.worker)
        worker = kwargs.get("worker")
        if start == "processing" and finish in ("memory", "erred") and worker:
            skew = self._skew(worker)
            for ss in kwargs.get("startstops") or ():
                if ss.get("action") == "compute":
                    self._intervals.append(
                        Interval(
                            worker,
                            node_of(key),
                            ss["start"] + skew,
                            ss["stop"] + skew,
                            self.step if step is None else step,
                        )
                    )
                    self._note_duration(node_of(key), ss["stop"] - ss["start"])

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

    def data(self, step: int | None = None) -> dict:
        """The page's data for `step` if its graph is kept, else the latest step with calls."""
        from distributed.metrics import time

        now = time()
        kept = [s for s in self._steps if self._steps[s]]
        shown = step if step in kept else (kept[-1] if kept else None)
        slots, names = self.slots()
        window_start = max(now - self.window_s, self._started)
        recent = [iv for iv in self._intervals if iv.stop > window_start or iv.step == shown]
        return snapshot(
            now=now,
            step=shown,
            tasks=list(self._steps.get(shown, {}).values()),
            intervals=recent,
            slots=slots,
            slot_names=names,
            window_start=window_start,
            events=self.scheduler.get_events(METRICS_TOPIC),
            metric_keys=self.metrics,
            role_colors=self._colors,
            steps=kept,
            usual=self._usual,
        )

    async def stack(self, key: str) -> dict:
        """What the rank running `key` is doing now: its task thread's stack (the watchdog's report, for one
        rank, on demand); {"key", "worker", "stack": [frames]} with no frames once it has finished."""
        step = self._key_step.get(key)
        rec = self._steps[step].get(key) if step is not None and step in self._steps else None
        if rec is None:
            raise KeyError(f"no call {key!r} in the steps kept ({list(self._steps)})")
        frames: list[str] = []
        if rec.worker and rec.state == "processing":
            from distributed.protocol.pickle import dumps
            from distributed.protocol.serialize import Serialized, deserialize

            from flowactors.transport.server import running_stack

            replies = await self.scheduler.broadcast(
                msg={
                    "op": "run",
                    "function": dumps(running_stack),
                    "args": dumps(()),
                    "kwargs": dumps({}),
                    "wait": True,
                },
                workers=[rec.worker],
            )
            reply = replies.get(rec.worker) or {}
            result = reply.get("result") if reply.get("status") == "OK" else None
            if isinstance(result, Serialized):  # the worker's reply, still in its wire form here
                result = deserialize(result.header, result.frames)
            frames = (result or {}).get(key, [])
            if not frames:  # a Dask task: the worker's own call stack of it
                try:
                    stacks = await self.scheduler.get_call_stack(keys=[key])
                except KeyError:  # forgotten meanwhile: it finished
                    stacks = {}
                frames = [line for per_key in (stacks or {}).values() for lines in per_key.values() for line in lines]
        return {"key": key, "worker": rec.worker, "state": rec.state, "stack": frames}


_FINAL = ("memory", "erred", "released")
_PROGRESS = {"waiting": 0, "processing": 1, "memory": 2, "erred": 2, "released": 3}


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
    except Exception:
        return ()


def _natural(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def registered_plugin(scheduler: Any) -> FlowactorsDashboard | None:
    """The flowactors plugin registered on `scheduler` now, if any (the page's handlers look it up per request)."""
    p = scheduler.plugins.get(PLUGIN_NAME)
    return p if isinstance(p, FlowactorsDashboard) else None


def install_dashboard(
    client: Any,
    plugin: FlowactorsDashboard | None = None,
    *,
    metrics: Sequence[str] | None = None,
    role_colors: Mapping[str, str] | None = None,
) -> str:
    """Register the plugin on the client's scheduler and return the page's URL.

    `metrics` and `role_colors` are the program's: the metric names to chart and fixed colours for its roles
    (see `FlowactorsDashboard`); pass them here or on a `plugin` of your own, not both. Idempotent: a scheduler
    that already runs the plugin keeps it (to change its settings, first
    `client.unregister_scheduler_plugin(flowactors.dashboard.PLUGIN_NAME)`). Raises RuntimeError when the
    scheduler runs without a dashboard (nothing would serve the page).
    """
    if plugin is not None and (metrics is not None or role_colors is not None):
        raise ValueError(
            "install_dashboard got both a plugin and metrics/role_colors; set them on the plugin "
            "(FlowactorsDashboard(metrics=..., role_colors=...)) or pass no plugin"
        )
    try:
        link = client.dashboard_link
    except Exception as e:
        raise RuntimeError(
            "the scheduler has no dashboard, so the flowactors page cannot be served; start it "
            "with a dashboard (Controller.local(dashboard='127.0.0.1:8787'), or "
            "`dask scheduler --dashboard-address 127.0.0.1:8787`)"
        ) from e
    client.register_plugin(plugin or FlowactorsDashboard(metrics=metrics, role_colors=role_colors))
    base = link.rstrip("/")
    if base.endswith("/status"):
        base = base[: -len("/status")]
    return f"{base}/flowactors"
