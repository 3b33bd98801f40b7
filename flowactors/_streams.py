"""Shorter batching on Dask's message streams: a group call's latency is a chain of stream messages.

Dask batches the messages of each long-lived stream (`distributed.batched.BatchedSend`): after a send, the next
one waits until a fixed interval has passed — 10 ms client → scheduler, 5 ms scheduler → worker, 2 ms worker →
scheduler and scheduler → client. That trades latency for fewer messages under a flood of small tasks. A
flowactors step is the opposite: a few calls, each waiting on the one before, where the previous call's release
message has just used the stream when the next call's task is sent, so most hops pay the interval. Measured on
the 2-core CI machine (`benchmarks/dispatch.py`, no-op call over 2 ranks): ~21 ms with Dask's intervals, ~7.5 ms
with 1 ms on every stream.

`shorten(client, interval_s)` sets the interval on the client's stream, and installs a scheduler plugin and a
worker plugin that set it on the scheduler's streams (to the workers, present and joining later, and to the
clients) and on each worker's stream to the scheduler. Batching still happens: a burst within one interval goes
as one message.
"""

from __future__ import annotations

from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

__all__ = ["shorten"]

PLUGIN_NAME = "flowactors-streams"


class _SchedulerStreams(SchedulerPlugin):
    """The scheduler's streams to its workers (also those that join later: recovery) and to its clients."""

    name = PLUGIN_NAME

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    def start(self, scheduler: Any) -> None:
        for stream in (*scheduler.stream_comms.values(), *scheduler.client_comms.values()):
            stream.interval = self.interval_s

    def add_worker(self, scheduler: Any, worker: str) -> None:
        stream = scheduler.stream_comms.get(worker)  # created just before the plugins are told
        if stream is not None:
            stream.interval = self.interval_s


class _WorkerStream(WorkerPlugin):
    """A worker's stream to the scheduler (set up on every worker, present and future)."""

    name = PLUGIN_NAME

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    def setup(self, worker: Any) -> None:
        worker.batched_stream.interval = self.interval_s


def shorten(client: Client, interval_s: float) -> None:
    """Batch every stream between `client`, its scheduler and the workers at most `interval_s` seconds."""
    if not interval_s >= 0:
        raise ValueError(f"stream interval must be >= 0 seconds, got {interval_s!r}")
    client.scheduler_comm.interval = interval_s

    def reuse(dask_scheduler: Any, interval_s: float = interval_s) -> bool:
        """A scheduler that already has the plugin (a second controller) gets the new interval; True: it has none."""
        plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
        if plugin is None:
            return True
        plugin.interval_s = interval_s
        plugin.start(dask_scheduler)
        return False

    if client.run_on_scheduler(reuse):
        client.register_plugin(_SchedulerStreams(interval_s), name=PLUGIN_NAME)
    client.register_plugin(_WorkerStream(interval_s), name=PLUGIN_NAME)
