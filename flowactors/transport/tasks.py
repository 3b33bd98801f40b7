"""The Dask-task transport: every call is one pinned task per rank, ordered per process, sent in one graph update.

docs/design.md §3 (Calls are pinned Dask tasks; Ordering). Dask runs tasks submitted close together in any order
and prefers tasks whose inputs are local; colocated groups would then issue collectives in different orders on
different ranks, and gloo silently returns wrong sums. So every task pinned to a worker process depends on the
previous one pinned there (its `_after` argument) and carries a decreasing priority (`DaskTransport.submit`).

Many pinned tasks in one graph update: what `Client.submit` does for one task, for all ranks of a call at once.

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

import itertools
import secrets
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask._expr import HLGExpr
from dask._task_spec import Task, parse_input
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from distributed import Client, Future
from distributed.client import _wait
from distributed.spans import SpanMetadata
from distributed.utils import TimeoutError as DaskTimeoutError

from flowactors.batch import Batch
from flowactors.transport import CallTimeout, ResultRecomputed, Transport, Work, WorkerGone, by_call

if TYPE_CHECKING:
    from flowactors.futures import CallFuture

__all__ = ["DaskTransport", "PinnedTask", "Rerun", "failure_story", "once", "scatter_to", "submit_pinned_tasks"]

SCATTER_BYTES = 64 * 1024
"""Batch arguments of a group call from this size up are sent straight to their rank's worker (`DaskTransport.ship`)."""


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
            {
                t.key: Task(
                    t.key, t.fn, *(parse_input(a) for a in t.args), **{k: parse_input(v) for k, v in t.kwargs.items()}
                )
            },
            annotations={"workers": [t.address], "allow_other_workers": False, "priority": t.priority},
        )
        for t in tasks
    }
    graph = HighLevelGraph(layers, {k: set() for k in keys})  # dependencies are on futures outside the graph
    futures = client._graph_to_futures(
        HLGExpr(dsk=graph, output_keys=keys),
        keys,
        span_metadata=SpanMetadata(collections=[{"type": "Future"}]),
        internal_priority={k: 0 for k in keys},
        fifo_timeout="100 ms",
    )
    return [futures[k] for k in keys]


def scatter_to(client: Client, items: Sequence[tuple[str, Any]]) -> list[Future]:
    """Send each (address, value) straight to its worker (not through the scheduler), all at once; one future each."""
    import asyncio

    async def send() -> list[Future]:
        return list(
            await asyncio.gather(
                *(client.scatter(v, workers=[a], direct=True, hash=False, asynchronous=True) for a, v in items)
            )
        )

    return client.sync(send) if items else []


class Rerun:
    """What a pinned task returns when Dask asks its worker to run it a second time (`once`): the value of a call
    whose result was lost, in place of running the call again."""

    __slots__ = ("key",)

    def __init__(self, key: str | None) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Rerun({self.key!r})"


_RAN: dict[str, int] = {}
"""(In a worker process.) Each controller's (its transport's `ident`) highest issue number run here."""


def once(ident: str, seq: int | None, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """(On the worker: every task of the Dask path.) Run `fn(*args, **kwargs)` unless this worker ran the task
    already, and never on an input that was such a rerun.

    Dask recomputes a result lost with its worker while a client still holds its future, and with it every released
    task that result came from: the worker-ordering links (`_after`) chain a worker's calls back to its group's
    construction. An actor's call is not a pure function, so a second run would apply a train step twice or tear
    down a group built since. Pinned tasks run on a worker in their issue order (`seq`), so one numbered at or below
    the highest run there is a rerun: it returns a `Rerun` at once. A task whose data input is a `Rerun` (a task
    that can run on several workers, `seq` None, recomputed elsewhere) raises instead of computing on it."""
    if seq is not None:
        if seq <= _RAN.get(ident, -1):
            from distributed.worker import thread_state

            return Rerun(getattr(thread_state, "key", None))
        _RAN[ident] = seq
    lost = _rerun_in(args) or _rerun_in([v for k, v in kwargs.items() if k != "_after"])
    if lost is not None:
        raise ResultRecomputed(
            f"an input of this task, the result of {lost.key}, was lost with its worker and Dask asked for it again; "
            "flowactors does not run an actor's call twice, so it is gone: issue the calls again"
        )
    return fn(*args, **kwargs)


_HOLDERS = (list, tuple, dict, set, frozenset, Rerun)
"""The types `_rerun_in` looks into (or at): Dask puts the values of futures found in these containers."""


def _rerun_in(value: Any) -> Rerun | None:
    """The first `Rerun` in `value` (one of `_HOLDERS`) or in the lists, tuples, sets and dicts inside it."""
    if type(value) is Rerun:
        return value
    for v in value.values() if type(value) is dict else value:
        if type(v) in _HOLDERS and (found := _rerun_in(v)) is not None:
            return found
    return None


class DaskTransport(Transport):
    """Calls as pinned Dask tasks: the task stream shows every call, and the scheduler moves the data. Each task
    runs under `once`: Dask's recomputation of a lost result never runs an actor's call a second time."""

    def __init__(self, client: Client) -> None:
        super().__init__(client)
        self.ident = secrets.token_hex(8)  # this controller's in `once`
        self._seq = itertools.count()
        self._last: dict[str, Future] = {}  # the latest task issued to each worker: the next one runs after it
        self._gone: dict[str, str] = {}  # key -> the dead worker of its call, for finished results written off

    def submit(self, tasks: Sequence[Work], step: int | None) -> list[Future]:
        """Every rank of one call in one graph update (`submit_pinned_tasks`): one scheduler round of work per
        call instead of one per rank. They share one place in the issue order (a priority below every earlier
        call's); a task depends on the previous one issued to its worker. A task with several addresses runs on
        one of them, where the scheduler puts it, after nothing, with the next priority."""
        out: list[Future] = []
        batch: list[PinnedTask] = []
        seq = next(self._seq)
        for address, fn, args, kwargs, key in tasks:
            if isinstance(address, tuple):
                out += self._send(batch)
                batch, seq = [], next(self._seq)
                out.append(
                    self.client.submit(
                        once,
                        self.ident,
                        None,
                        fn,
                        *args,
                        key=key,
                        pure=False,
                        priority=-seq,
                        workers=list(address),
                        allow_other_workers=False,
                        **kwargs,
                    )
                )
                continue
            if any(t.address == address for t in batch):  # a second task for one worker orders after the first
                out += self._send(batch)
                batch, seq = [], next(self._seq)
            prev = self._last.get(address)
            if prev is not None and prev.status in ("error", "cancelled"):
                prev = None
            args = (self.ident, seq, fn, *args)
            batch.append(PinnedTask(address, once, key, args, {**kwargs, "_after": prev}, priority=-seq))
        return out + self._send(batch)

    def _send(self, batch: list[PinnedTask]) -> list[Future]:
        futures = submit_pinned_tasks(self.client, batch)
        for t, f in zip(batch, futures):
            self._last[t.address] = f
        return futures

    def ship(self, addresses: Sequence[str], per_rank: list) -> list:
        """Large Batch arguments replaced by futures of data sent straight to each rank's worker: values embedded
        in a task travel through the scheduler, which unpickles and re-pickles them; a direct scatter moves the
        bytes once, controller to worker."""
        sends = [
            (r, i, k, v)
            for r, (a, kw) in enumerate(per_rank)
            for i, k, v in [*((i, None, x) for i, x in enumerate(a)), *((None, k, x) for k, x in kw.items())]
            if isinstance(v, Batch) and v.nbytes >= SCATTER_BYTES
        ]
        if not sends:
            return per_rank
        futures = scatter_to(self.client, [(addresses[r], v) for r, _, _, v in sends])
        out = [(list(a), dict(kw)) for a, kw in per_rank]
        for (r, i, k, _), f in zip(sends, futures):
            if k is None:
                out[r][0][i] = f
            else:
                out[r][1][k] = f
        return [(tuple(a), kw) for a, kw in out]

    def resolve(self, calls: Sequence["CallFuture"], timeout: float | None, values: bool = True) -> list[list]:
        """Without a timeout the values are gathered at once (Dask waits for them); a cancelled future raises
        Dask's cancellation error, which the controller turns into a lost worker where one was."""
        futures = [f for c in calls for f in c.futures]
        for c in calls if self._gone else ():  # (nothing to look up on a run that lost no worker)
            gone = next((self._gone[f.key] for f in c.futures if f.key in self._gone), None)
            if gone is not None:
                raise WorkerGone(gone, c.label)
        if timeout is not None or not values:
            try:  # this client's own wait: `distributed.wait` looks for a default client, and this one is not
                self.client.sync(_wait, futures, timeout=timeout)
            except (DaskTimeoutError, TimeoutError) as e:
                raise CallTimeout() from e
        if not values:
            return []
        try:
            values_ = self.client.gather(futures)
        except AttributeError as e:  # distributed's gather, on a future failed with no error to raise (its bug)
            failed = [f.key for f in futures if f.status != "finished"]
            if not failed:
                raise
            story = self.client.run_on_scheduler(failure_story, failed)
            raise RuntimeError(f"Dask failed {failed} without an error to raise; the scheduler's story: {story}") from e
        rerun = next((v for v in values_ if type(v) is Rerun), None)
        if rerun is not None:
            raise ResultRecomputed(
                f"the result of {rerun.key} was lost (its worker died, or this client's connection to the scheduler "
                "broke and it asked for the result again) and Dask recomputed it; flowactors does not run an actor's "
                "call twice, so the value is gone: issue the call again"
            )
        return by_call(values_, calls)

    def settle(self, futures: Sequence[Future], timeout: float) -> None:
        self.client.sync(_wait, list(futures), timeout=timeout)

    def fetched_bytes(self, call: Any) -> dict[str, int]:
        """From the workers' own logs of what they fetched (Dask's `transfer_incoming_log`, sizes as Dask
        estimates them), for the inputs the scheduler lists for `call`'s tasks; an input fetched there for an
        earlier call counts again."""
        deps = self.client.run_on_scheduler(_inputs_of, [f.key for f in call.futures])
        if not deps:
            return {}
        total: Counter[str] = Counter()
        for sizes in self.client.run(_fetched, deps, workers=list(set(call.addresses))).values():
            total.update(sizes)
        return dict(total)

    def detach(self, futures: Sequence[Future]) -> None:
        """Dask would forget a task once its client closed; `fire_and_forget` keeps it (and what it waits on)."""
        from distributed import fire_and_forget

        fire_and_forget(list(futures))

    def busy(self, addresses: Sequence[str]) -> set[str]:
        """Asked of the workers (their event loops answer while a task runs): the scheduler forgets a task whose
        futures were all dropped, but the worker still runs it."""
        if not addresses:
            return set()
        counts = self.client.run(_executing, workers=list(addresses), on_error="ignore")
        return {a for a, n in counts.items() if n}

    async def worker_lost(self, address: str, futures: Sequence[Future]) -> None:
        last = self._last.pop(address, None)
        futures = [*futures, last] if last is not None else list(futures)
        # A finished result is written off here, not cancelled (`_newest_first`): gathering it is refused in
        # `resolve`, since Dask would recompute a lost result, and an actor's call is not a pure function.
        for f in futures:
            if f.done() or f.status == "lost":  # "lost": finished, its value gone with the worker
                if f.key not in self._gone:  # kept while a future can still ask for it, not for the run's life
                    weakref.finalize(f, self._gone.pop, f.key, None)
                self._gone[f.key] = address
        for f in _newest_first(futures):
            await self.client.cancel([f], asynchronous=True, reason="worker-lost", msg=f"worker {address} died")

    def reset(self, stale: Sequence[Future]) -> None:
        """Cancels the forgotten calls' unfinished tasks (a finished one keeps its value; one of a dead worker was
        written off in `worker_lost`)."""
        stale = [*stale, *self._last.values()]
        self._last.clear()
        for f in _newest_first(stale):
            self.client.cancel([f], reason="recovery", msg="the controller rebuilt its groups after a lost worker")


def _inputs_of(keys: Sequence[Any], dask_scheduler: Any = None) -> list:
    """The keys of the tasks `keys` depend on (`DaskTransport.fetched_bytes`)."""
    return [d.key for k in keys if (ts := dask_scheduler.tasks.get(k)) is not None for d in ts.dependencies]


def _fetched(keys: Sequence[Any], dask_worker: Any = None) -> dict[str, int]:
    """{peer: bytes} of `keys` this worker fetched, from its log of incoming transfers."""
    wanted, out = set(keys), Counter()
    for transfer in list(dask_worker.transfer_incoming_log):
        out[transfer["who"]] += sum(size for key, size in transfer["keys"].items() if key in wanted)
    return {peer: n for peer, n in out.items() if n}


def _executing(dask_worker: Any = None) -> int:
    """The tasks this worker runs or has ready to run (`DaskTransport.busy`)."""
    return dask_worker.state.executing_count + len(dask_worker.state.ready)


def failure_story(keys: Sequence[str], dask_scheduler: Any = None) -> list[dict]:
    """(Run on the scheduler.) What the scheduler knows of each of `keys`: its state, the task it blames for an
    error, its dependencies' states and its last transitions; where Dask fails a task without an error to raise,
    the controller's message carries this instead of distributed's own AttributeError."""
    out = []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        blame = ts.exception_blame if ts is not None else None
        out.append(
            {
                "key": key,
                "state": ts.state if ts is not None else "forgotten",
                "blame": (blame.key, blame.state) if blame is not None else None,
                "dependencies": [(d.key, d.state) for d in ts.dependencies] if ts is not None else [],
                "transitions": [f"{t[1]}->{t[2]} ({t[4]})" for t in dask_scheduler.story(key)[-6:]],
            }
        )
    return out


def _newest_first(futures: Sequence[Future]) -> list[Future]:
    """The `futures` that have not run, to be cancelled one at a time, the last issued first. Dask's cancel recurses
    into a task's dependents and asserts that each is wanted by a client; one the client released but that a later
    task still needs (a per-worker ordering link) is not, and the failed assertion breaks the client's stream (it
    reconnects, and Dask recomputes every key it holds: setup tasks included). A task that ran is never cancelled:
    finished, or "lost" (finished on a worker that died: Dask puts it back to be recomputed, with its released
    links); cancelling the later tasks first lets the scheduler forget a link before its predecessor's turn."""
    seen: set[str] = set()
    out = []
    for f in reversed(futures):
        if f.status == "pending" and f.key not in seen:
            seen.add(f.key)
            out.append(f)
    return out
