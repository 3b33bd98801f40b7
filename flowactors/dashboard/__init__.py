"""A flowactors page on the Dask dashboard: the step's dataflow graph, a timeline per device slot, the metrics.

docs/design.md §3 promises that every call shows in the Dask dashboard under a readable name. Dask's own pages show
tasks; this page shows what the author of an actor program asks about: which group calls the current step is
made of and where each stands, which group (role) occupied which device slot when (and how long each slot sat
idle), and how the step metrics move. It is a `SchedulerPlugin` (`FlowactorsDashboard`) that adds two routes to
the scheduler's running tornado application, `/flowactors` (a self-contained page, `page.html`: inline SVG, CSS and
JS, no CDN, works offline and with the dashboard bound to 127.0.0.1), `/flowactors/data.json`, which the page
polls every 1.5 s, and `/flowactors/stack.json` (a running task's stack).

The package: `aggregate` (plain records and the pure functions that compute the page's data), `plugin` (the
scheduler plugin that records, and `install_dashboard`), `handlers` (the two routes), `page.html` (the page).

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
- **Direct calls, live.** Calls on the direct path (flowactors._direct) are not Dask tasks, so the runtime
  reports them itself: the controller each item as it sends it (topic `flowactors.issued`, gathered over
  `_direct.ISSUE_REPORT_S`, from a timer thread: the call site does not wait), the worker when it receives it,
  starts it and ends it (topic `flowactors.calls`, every `_direct.REPORT_S`). Whichever report comes first makes
  the record and none moves it back, so a step's graph is whole while it runs, with waiting / processing /
  memory / erred per rank as on the Dask-task path (where the scheduler's own transitions give them). A task first
  recorded already finished is counted as `late` on its node (the tests hold it at 0).
- **Steps in flight.** Every item carries the controller's step when it was issued, so a call stays in the step
  that issued it whenever it runs; the last `keep_steps` (4) steps keep their graphs, in step order even when a
  later step's calls come first (the asynchronous pipeline), and the page lets the user pick one
  (`data.json?step=N`).
- **Slow calls.** Per call node the plugin keeps a moving average of its tasks' compute time; a task processing
  for longer than max(3 x that, that + 1 s) is marked slow, with a link to `/flowactors/stack.json?key=K`, which
  asks that rank's worker what its task thread runs now (the watchdog's report, for one rank, on demand; Dask's
  own call stack for a Dask task).
- **Idle time** is measured over a recent window (default 60 s, never before the plugin started): per slot,
  window length minus the union of its compute spans; per stage (node), over the stage's span in the window,
  the slot-seconds in which a slot ran nothing at all (the cost of a stage that does not use every device).
"""

from flowactors.dashboard.aggregate import (  # noqa: F401 - tests'
    _PALETTE,
    _RUNTIME_COLORS,
    DEFAULT_METRIC_LIMIT,
    STATE_COLORS,
    Interval,
    TaskRecord,
    _Busy,
    _length,
    _union,
    aggregate_graph,
    metric_series,
    node_of,
    role_color,
    role_of,
    slot_usage,
    snapshot,
    stage_idle,
)
from flowactors.dashboard.plugin import METRICS_TOPIC, PLUGIN_NAME, STEP_TOPIC, FlowactorsDashboard, install_dashboard

__all__ = [
    "FlowactorsDashboard",
    "install_dashboard",
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
    "DEFAULT_METRIC_LIMIT",
    "STATE_COLORS",
    "PLUGIN_NAME",
    "METRICS_TOPIC",
    "STEP_TOPIC",
]
