"""Sharded state save/load on every rank of a group, with torch.distributed.checkpoint (DCP).

A worker calls these on every rank of its group, each with its own shard of the state (a DTensor, as FSDP2 and
DTensor tensor parallel produce, or a plain tensor that every rank holds whole), into the role's directory of a
pending checkpoint (``PendingCheckpoint.role_dir(role)``). DCP records each tensor's global shape and which
slice every rank saved, so a state saved under one sharding (data-parallel size 2, say) loads under another (size
1, or a different mesh): each loading rank reads exactly the slices its own shards cover. Nothing here depends
on the checkpoint store: the store only checksums and publishes whatever files DCP wrote.

The helpers are collective when a process group is in use: every rank of the group must call them, in the same
order, in the task thread (DESIGN.md section 3). Without an initialised default group they run single-process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["load_sharded", "save_sharded"]

_METADATA = ".metadata"  # DCP's global index, written by the group's coordinator rank


def save_sharded(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    *,
    thread_count: int = 2,
) -> None:
    """Save this rank's part of ``state_dict`` into ``directory`` (collective over ``process_group``).

    ``state_dict`` is what ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns,
    nested as the caller likes (``{"model": ..., "optim": ..., "scheduler": scheduler.state_dict()}``);
    non-tensor values are pickled by DCP. ``thread_count`` writer threads per rank (two reached about 1.6× the
    throughput of one on the 2-core development machine). Files are fsynced before this returns.
    """
    from flowactors.checkpoint import CheckpointError

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True, overwrite=True)
    try:
        with _single_process_ok() as no_dist:
            dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    except CheckpointException as error:
        raise CheckpointError(
            f"saving sharded state into {directory} failed on some rank: {error}; check the disk space and that "
            "every rank of the group called save_sharded with the same state dict keys",
            path=directory,
        ) from error


def load_sharded(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    *,
    strict: bool = True,
) -> None:
    """Load ``directory`` into ``state_dict`` in place (collective over ``process_group``), resharding as needed.

    ``state_dict`` must already hold tensors of the loading layout (from ``get_state_dict`` on the freshly
    built, sharded model and optimizer); they are filled with the saved values, and non-tensor values are
    replaced. Apply the result with ``set_state_dict``. Saved keys that ``state_dict`` lacks are skipped (so the
    model loads alone from a checkpoint that also holds the optimizer); keys of ``state_dict`` that the checkpoint
    lacks are an error unless ``strict=False``, which leaves them as they are.
    """
    from flowactors.checkpoint import CheckpointError

    directory = Path(directory)
    if not (directory / _METADATA).is_file():
        raise CheckpointError(
            f"{directory} holds no sharded state (no {_METADATA}); was this role saved with save_sharded into "
            "this checkpoint? Pick the role's directory with Checkpoint.role_dir(role)",
            path=directory, file=_METADATA,
        )
    reader = dcp.FileSystemReader(directory)
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        with _single_process_ok() as no_dist:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                     no_dist=no_dist)
    except CheckpointException as error:
        raise CheckpointError(
            f"loading sharded state from {directory} failed: {error}; every key of the state dict must be in the "
            "checkpoint (pass strict=False to leave the missing ones as they are)",
            path=directory,
        ) from error


@contextlib.contextmanager
def _single_process_ok() -> Iterator[bool]:
    """Yields whether to run without a process group; DCP then warns that it assumes one process, which is the
    intent here, so that one warning is silenced (only then: with a group, nothing is filtered)."""
    no_dist = not (dist.is_available() and dist.is_initialized())
    if not no_dist:
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield True
