"""flowactors: an actor runtime on Dask distributed for SPMD model groups (HybridFlow's single controller).

Knows nothing about LLMs or RLHF: it places worker classes on device slots as torch.distributed groups, turns
calls into ordered, pinned Dask tasks chained by futures, and moves `Batch`es between them.
"""

from flowactors import serialization as _serialization  # noqa: F401 - registers Batch with Dask
from flowactors.batch import Batch
from flowactors.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from flowactors.controller import CallFuture, Controller
from flowactors.dashboard import FlowactorsDashboard, install_dashboard
from flowactors.errors import (
    ClusterStartError,
    EndpointError,
    FlowactorsError,
    HangError,
    PlacementError,
    RemoteError,
    SchedulerUnreachableError,
    WorkerLostError,
)
from flowactors.group import ActorGroup
from flowactors.log import configure_from_env, configure_logging
from flowactors.protocols import (
    ALL_TO_ALL,
    DP,
    MESH,
    ONE_TO_ALL,
    RANK_ZERO,
    Layout,
    Protocol,
    ProtocolError,
    get_protocol,
    register_protocol,
)
from flowactors.worker import Worker, endpoint, link

configure_from_env()

__all__ = [
    "Batch",
    "Controller",
    "CallFuture",
    "ActorGroup",
    "Worker",
    "endpoint",
    "link",
    "Layout",
    "Protocol",
    "register_protocol",
    "get_protocol",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "RANK_ZERO",
    "DP",
    "MESH",
    "FlowactorsError",
    "RemoteError",
    "HangError",
    "WorkerLostError",
    "EndpointError",
    "PlacementError",
    "ProtocolError",
    "SchedulerUnreachableError",
    "ClusterStartError",
    "configure_logging",
    "install_dashboard",
    "FlowactorsDashboard",
    "CheckpointStore",
    "Checkpoint",
    "CheckpointError",
]
