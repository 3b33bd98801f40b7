"""Many pinned tasks in one graph update: what `Client.submit` does for one task, for all ranks of a call at once.

Every `client.submit` is one `update-graph` message, and the scheduler handles each separately (deserialize,
materialize on a thread, create task states, assign workers); for a group call that is once per rank. Dask's
public ways to send several tasks at once apply one `workers=` and one priority to all of them (`Client.map`,
`Client.get`, `Client.compute`), while each rank's task must be pinned to its own worker. Per-key restrictions
do exist in Dask's graph format: a `HighLevelGraph` layer carries annotations (`workers`, `allow_other_workers`,
`priority`) that the scheduler applies to the layer's keys (`Scheduler._apply_annotations`). So each task gets a
one-key layer with its own annotations, and the whole graph goes through the same private entry point `submit`
uses (`Client._graph_to_futures`), with the same internal priority (0, so no `dask.order` pass) and the same
`fifo_timeout`. This is the one place flowactors relies on Dask's private client API; the tests in
tests/runtime/test_submit.py check the restrictions, priorities and dependencies the scheduler ends up with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dask._expr import HLGExpr
from dask._task_spec import Task, parse_input
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from distributed import Client, Future
from distributed.spans import SpanMetadata

__all__ = ["PinnedTask", "submit_pinned_tasks"]


@dataclass
class PinnedTask:
    """`fn(*args, **kwargs)` to run on worker `address` only, under `key`, with scheduling priority `priority`
    (higher runs first among tasks ready on the same worker)."""

    address: str
    fn: Any
    key: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    priority: int = 0


def submit_pinned_tasks(client: Client, tasks: Sequence[PinnedTask]) -> list[Future]:
    """Send `tasks` to the scheduler in one graph update; one future per task, in order. Futures among the
    arguments (also inside lists, tuples and dicts) become dependencies, as with `client.submit`."""
    if not tasks:
        return []
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"task keys must be distinct, got {keys}")
    layers = {
        t.key: MaterializedLayer(
            {t.key: Task(t.key, t.fn, *(parse_input(a) for a in t.args),
                         **{k: parse_input(v) for k, v in t.kwargs.items()})},
            annotations={"workers": [t.address], "allow_other_workers": False, "priority": t.priority})
        for t in tasks
    }
    graph = HighLevelGraph(layers, {k: set() for k in keys})  # dependencies are on futures outside the graph
    futures = client._graph_to_futures(
        HLGExpr(dsk=graph, output_keys=keys), keys,
        span_metadata=SpanMetadata(collections=[{"type": "Future"}]),
        internal_priority={k: 0 for k in keys}, fifo_timeout="100 ms")
    return [futures[k] for k in keys]
