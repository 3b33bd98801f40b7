"""Helpers for tests that run gloo ranks in spawned processes: a free port, and a clean way out of the world.

Why `leave_world` and not `dist.destroy_process_group()`: tearing gloo down while a peer still finishes its last
collective, or running its C++ destructors at interpreter exit, can abort a rank now and then with "terminate
called without an active exception" (SIGABRT), which fails a test whose results were all written. A rank that
succeeded therefore waits, through files, until every rank has passed its last collective, and then exits without
running gloo's destructors. A rank that failed raises as usual.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist


def join_world(rank: int, world: int, port: int, megatron: bool = False) -> None:
    """Start a spawned rank: one torch thread, a gloo world over 127.0.0.1:port, and for megatron-core the test-only
    CUDA shim first (tests/engines/megatron_shim.py)."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if megatron:
        from tests.engines import megatron_shim

        megatron_shim.apply()
    dist.init_process_group("gloo", rank=rank, world_size=world)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leave_world(meeting_dir: str | os.PathLike, timeout_s: float = 120.0) -> None:
    """End a spawned rank that succeeded: barrier, wait until every rank got here, exit 0 without teardown.

    `meeting_dir` is a directory every rank of this world can see and that only this world uses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    here = Path(meeting_dir)
    (here / f".left-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((here / f".left-{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: not every rank of {world} left the world within {timeout_s} s")
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
