"""Sharded state save/load on every rank of a group, with torch.distributed.checkpoint (DCP).

A worker calls these on every rank of its group, each with its own shard of the state (a DTensor, as FSDP2 and
DTensor tensor parallel produce, or a plain tensor that every rank holds whole), into the role's directory of a
pending checkpoint (``PendingCheckpoint.role_dir(role)``). DCP records each tensor's global shape and which
slice every rank saved, so a state saved under one sharding (data-parallel size 2, say) loads under another (size
1, or a different mesh): each loading rank reads exactly the slices its own shards cover. The files are DCP's own
format, so DCP's tools read them too.

Three departures from calling ``dcp.save`` / ``dcp.load`` directly, each measured on the 2-core development
machine (``benchmarks/checkpoint.py``):

- each rank checksums its files as DCP writes them (a filesystem layer under DCP's writer) and leaves the
  checksums in a sidecar the store's commit merges into the manifest, so nothing is read back, and the
  controller does not read the whole checkpoint (at scale that read is the controller alone against every
  rank's bytes);
- torch.save's per-record zip CRC is off while DCP writes (about 30% of the write time; the store's checksums
  cover every byte, and torch.load does not check it);
- loading reads several files at once (DCP's reader reads them one after another), 1.3-1.5x faster here.

The helpers are collective when a process group is in use: every rank of the group must call them, in the same
order, in the task thread (docs/design.md §3, Ordering). Without an initialised default group they run single-process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from flowactors._integrity import BlockCrc, CheckpointError, write_sidecar

__all__ = ["load_sharded", "save_sharded"]

_METADATA = ".metadata"  # DCP's global index, written by the group's coordinator rank
_SLICE_BYTES = 1 << 20  # checksummed right after it is written, while it is still in the CPU cache


def save_sharded(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    *,
    thread_count: int = 2,
    checksums: bool = True,
) -> None:
    """Save this rank's part of ``state_dict`` into ``directory`` (collective over ``process_group``).

    ``state_dict`` is what ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` returns,
    nested as the caller likes (``{"model": ..., "optim": ..., "scheduler": scheduler.state_dict()}``);
    non-tensor values are pickled by DCP. ``thread_count`` writer threads (and files) per rank; two wrote about
    twice as fast as one on the 2-core development machine, four no faster. Files are fsynced before this
    returns.

    With ``checksums``, each rank checksums the bytes of every file it writes as they are written (in DCP's
    writer threads) and records them in a hidden sidecar, so ``CheckpointStore.commit`` does not read every byte
    back on the controller. Files no sidecar covers are checksummed by the commit.

    torch.save's own per-record CRC-32 is switched off while DCP writes (see the module docstring).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True, overwrite=True)
    if checksums:
        writer.fs = _ChecksummingFileSystem()
    try:
        with _single_process_ok() as no_dist, _without_zip_crc32():
            dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    except CheckpointException as error:
        raise CheckpointError(
            f"saving sharded state into {directory} failed on some rank: {error}; check the disk space and that "
            "every rank of the group called save_sharded with the same state dict keys",
            path=directory,
        ) from error
    if checksums:
        rank = dist.get_rank(process_group) if _distributed() else 0
        written = {}
        for path, entry in writer.fs.written.items():
            # Only files still as written: anything else is left for the commit to read back.
            if path.parent == directory and path.is_file() and path.stat().st_size == entry["size"]:
                written[path.name] = entry
        write_sidecar(directory, written, name=f"rank{rank}")


def load_sharded(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    *,
    strict: bool = True,
    thread_count: int = 2,
) -> None:
    """Load ``directory`` into ``state_dict`` in place (collective over ``process_group``), resharding as needed.

    ``state_dict`` must already hold tensors of the loading layout (from ``get_state_dict`` on the freshly
    built, sharded model and optimizer); they are filled with the saved values, and non-tensor values are
    replaced. Apply the result with ``set_state_dict``. Saved keys that ``state_dict`` lacks are skipped (so the
    model loads alone from a checkpoint that also holds the optimizer); keys of ``state_dict`` that the checkpoint
    lacks are an error unless ``strict=False``, which leaves them as they are. ``thread_count`` files are read
    at once (DCP's own reader reads one after another).
    """
    directory = Path(directory)
    if not (directory / _METADATA).is_file():
        raise CheckpointError(
            f"{directory} holds no sharded state (no {_METADATA}); was this role saved with save_sharded into "
            "this checkpoint? Pick the role's directory with Checkpoint.role_dir(role)",
            path=directory,
            file=_METADATA,
        )
    reader = _ParallelFileSystemReader(directory, thread_count=thread_count)
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        with _single_process_ok() as no_dist:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
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
    no_dist = not _distributed()
    if not no_dist:
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield True


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save's zip CRC off for the duration. The setting is process-wide: a worker runs one call at a time
    (docs/design.md §3, Ordering), so nothing else in the process is saving meanwhile."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, checksumming every file it writes as the bytes go through (``written``: final
    path -> {"size", "crc32"}). DCP writes each file sequentially from one thread, then fsyncs and closes it;
    ``.metadata`` is written under a temporary name and renamed, which ``rename`` follows."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[Path, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        crc = BlockCrc()
        with super().create_stream(path, mode) as raw:
            yield _ChecksummingStream(raw, crc)
        with self._lock:
            self.written[Path(path)] = crc.result()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path) in self.written:
                self.written[Path(new_path)] = self.written.pop(Path(path))


class _ChecksummingStream(io.RawIOBase):
    """A write-only file that feeds every byte to a ``BlockCrc`` on its way to ``raw``."""

    def __init__(self, raw: Any, crc: BlockCrc) -> None:
        super().__init__()
        self._raw = raw
        self._crc = crc

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        # Slice by slice, write then checksum: the checksum reads bytes the copy just pulled into the CPU cache.
        # Checksumming a whole 16 MiB tensor before writing it made the save about 40% slower here.
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _SLICE_BYTES):
            part = view[start : start + _SLICE_BYTES]
            self._raw.write(part)
            self._crc.update(part)
        return len(view)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


class _ParallelFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, reading several files at once: the plan is split by file and each part handed to the
    stock ``read_data`` in its own thread (file reads, torch.load's copies and ``copy_`` release the GIL)."""

    def __init__(self, path: str | os.PathLike[str], thread_count: int) -> None:
        super().__init__(path)
        self.thread_count = thread_count

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        parts = [dataclasses.replace(plan, items=items) for items in by_file.values()]
        if self.thread_count <= 1 or len(parts) <= 1:
            return super().read_data(plan, planner)
        read_part = super().read_data
        with ThreadPoolExecutor(min(self.thread_count, len(parts)), thread_name_prefix="dcp-read") as pool:
            for done in pool.map(lambda part: read_part(part, planner), parts):
                done.wait()
        future: Future[None] = Future()
        future.set_result(None)
        return future
