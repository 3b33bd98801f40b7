"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

The ranks are forked from a server that imported torch and the cases' modules once (a forkserver: fresh processes
without the test process's threads and state, each not paying the imports again on 2 cores).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ranks import free_port, leave_world


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
    )
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world(out_dir)


def run_ranks(world_size: int, fn, *args) -> list:
    """fn(rank, *args) on every rank; returns the per-rank results (torch.save-able), raising if any rank fails."""
    mp.get_context("forkserver").set_forkserver_preload([__name__, fn.__module__])
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size, start_method="forkserver"
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
