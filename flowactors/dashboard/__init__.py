"""A flowactors page on the Dask dashboard: the step's dataflow graph, a timeline per device slot, the metrics.

docs/design.md §3 promises that every call shows in the Dask dashboard under a readable name. Dask's own pages show
tasks (and not the direct path's calls at all); this page shows what the author of an actor program asks about:
which group calls the current step is made of and where each stands, which group (role) occupied which device slot
when (and how long each slot sat idle), and how the step metrics move.

The package: `plugin` (the `SchedulerPlugin` that records, `FlowactorsDashboard`, and `install_dashboard`),
`aggregate` (plain records and the pure functions that compute the page's data from them), `handlers` (the routes
`/flowactors`, `/flowactors/data.json` and `/flowactors/stack.json`), `page.html` (the self-contained page).

How it works, and the design decisions behind it: docs/design.md §3 (The dashboard page); using it:
docs/deployment.md (Watching a run).
"""

from flowactors.dashboard.aggregate import (  # noqa: F401 - tests'
    DEFAULT_METRIC_LIMIT,
    PALETTE,
    RUNTIME_COLORS,
    STATE_COLORS,
    Busy,
    Interval,
    TaskRecord,
    aggregate_graph,
    covered_length,
    metric_series,
    node_of,
    role_color,
    role_of,
    slot_usage,
    snapshot,
    stage_idle,
    union_of,
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
