"""The watchdog's report: where every unfinished rank of a stuck call is, with its Python stack.

docs/design.md §3. `call_timeout_s` bounds every wait of the controller for workers: calls, and equally the steps
that form the world and build a group, since a rank stuck in a collective inside `__init__` hangs just like one in
a method. Past it the controller raises a `HangError` (`hang_error`) whose report (`hang_report`) says, for every
rank: the stack of its task if it runs, else what its worker runs instead; for a task that is not pinned
(`Controller.apply` on the Dask path), what the scheduler says of it (the worker it runs on, the inputs it still
waits for, or that it waits for a worker). Stacks come from Dask (`Client.call_stack`) and, for work Dask does not
see (the direct path), from the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowactors.errors import HangError

if TYPE_CHECKING:
    from distributed import Client

    from flowactors.futures import CallFuture
    from flowactors.transport import Transport

__all__ = ["hang_error", "hang_report"]


def hang_error(calls: Sequence["CallFuture"], timeout: float | None, report: Any) -> HangError:
    """The error for `calls` still unfinished after `timeout` seconds; `report(pending calls)` gives its report."""
    pending = [c for c in calls if not c.done()]
    label = ", ".join(sorted({c.label for c in pending})) or "calls"
    return HangError(label, float(timeout or 0), report(pending))


def hang_report(client: "Client", transport: "Transport", calls: Sequence["CallFuture"]) -> str:
    """What every rank of `calls` is doing (see the module docstring), one paragraph per unfinished rank."""
    stacks = client.call_stack()  # {worker: {key: [frames]}} of every executing task
    for addr, running in transport.stacks().items():
        stacks.setdefault(addr, {}).update(running)
    running_on = {key: addr for addr, tasks in stacks.items() for key in tasks}
    free = [f.key for c in calls if not c.addresses for f in c.futures if not f.done() and f.key not in running_on]
    states = _scheduler_states(client, free) if free else {}
    lines = []
    for c in calls:
        for rank, f in enumerate(c.futures):
            if f.done():
                continue
            if c.addresses and c.method != "apply":
                addr = c.addresses[rank]
                head = f"{c.group} rank {rank} on {addr}"
            elif c.addresses:  # a direct-path apply, pinned where its first input is
                addr = c.addresses[0]
                head = f"{c.label} task {f.key} on {addr}"
            else:
                addr = running_on.get(f.key) or states.get(f.key, {}).get("worker")
                head = f"{c.label} task {f.key} on {addr or 'no worker yet'}"
            running = stacks.get(addr, {}) if addr else {}
            if f.key in running:
                where = f"running {c.label}"
                frames = running[f.key]
            elif c.addresses:
                others = ", ".join(str(k) for k in running) or "nothing"
                where = f"waiting; its worker is running: {others}"
                frames = next(iter(running.values()), [])
            else:
                where = _describe_waiting(states.get(f.key), running)
                frames = next(iter(running.values()), [])
            tail = "".join(frames[-6:]).rstrip() if frames else "    (no Python stack)"
            lines.append(f"- {head}: {where}\n{tail}")
    return "\n".join(lines) or "(no rank is still running)"


def _task_states(keys: Sequence[str], dask_scheduler: Any = None) -> dict[str, dict]:
    """Run on the scheduler: the state of each task, the worker it is assigned to, and the inputs it waits for."""
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            out[key] = {"state": "forgotten", "worker": None, "waiting_on": []}
            continue
        worker = ts.processing_on.address if ts.processing_on is not None else None
        out[key] = {"state": ts.state, "worker": worker, "waiting_on": sorted(str(d.key) for d in ts.waiting_on or ())}
    return out


def _scheduler_states(client: "Client", keys: Sequence[str]) -> dict[str, dict]:
    try:
        return client.run_on_scheduler(_task_states, list(keys))
    except Exception:
        return {}


def _describe_waiting(state: dict | None, running: dict) -> str:
    """Why an unpinned task is not running, from the scheduler's state of it (see `_task_states`)."""
    if state is None:
        return "not running on any worker (the scheduler could not be asked why)"
    if state["waiting_on"]:
        return f"waiting for its inputs: {', '.join(state['waiting_on'])}"
    if state["state"] == "processing":
        others = ", ".join(str(k) for k in running) or "nothing"
        return f"assigned to {state['worker']}, queued there; that worker is running: {others}"
    if state["state"] in ("queued", "no-worker"):
        return f"{state['state']}: waiting for a worker to run it"
    return f"not running (scheduler state: {state['state']})"
