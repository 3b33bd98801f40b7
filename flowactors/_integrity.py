"""The checksum layer under the checkpoint store: block CRC-32s, rank sidecars, durable writes, CheckpointError.

Both sides of a save need it: the ranks, which checksum their files as ``_dcp.save_sharded`` streams them out
(``BlockCrc``) and leave the result in a sidecar (``write_sidecar``), and the controller's store
(``checkpoint.py``), which merges the sidecars (``collect_sidecars``), reads back and checksums whatever no rank
vouched for (``block_crcs``) and verifies on load. It lives below both so that dependencies point one way:
``checkpoint`` imports ``_dcp`` and this module, ``_dcp`` imports this module only. Why CRC-32 over 64 MiB blocks
is explained in ``checkpoint.py``'s docstring.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["CheckpointError"]

BLOCK_BYTES = 64 << 20  # one checksum per block; blocks are the unit of parallel checksumming
_READ_BYTES = 1 << 20  # one read call, checksummed while still in the CPU cache (8 MiB was ~7% slower); reused
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_SIDECAR_PREFIX = ".flowactors-crc32-"  # per-rank checksums of the files it wrote; merged into the manifest
_SIDECAR_SUFFIX = ".json"


class CheckpointError(Exception):
    """A checkpoint is missing, partial or corrupt; the message names the file and what to do."""

    def __init__(self, message: str, *, path: Path | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic there
        pass
    finally:
        os.close(fd)


def block_crcs(directory: Path, sizes: Mapping[str, int], *, threads: int, fsync: bool) -> dict[str, list[str]]:
    """CRC-32 (8 hex digits) of every ``BLOCK_BYTES`` block of every file, read by ``threads`` threads; with
    ``fsync``, each file is also fsynced (the writers may have been other processes)."""
    tasks = [
        (rel, offset, min(BLOCK_BYTES, size - offset))
        for rel, size in sizes.items()
        for offset in range(0, max(size, 1), BLOCK_BYTES)
    ]
    # Largest blocks first, so a big file's tail does not run alone at the end.
    tasks.sort(key=lambda task: task[2], reverse=True)
    local = threading.local()

    def crc(task: tuple[str, int, int]) -> tuple[str, int, str]:
        rel, offset, length = task
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = memoryview(bytearray(_READ_BYTES))
        value = 0
        with open(directory / rel, "rb", buffering=0) as f:
            if _WILLNEED is not None and length:
                # Ask for the whole block now: the kernel reads ahead while this thread checksums (~15% faster
                # from a cold cache here).
                os.posix_fadvise(f.fileno(), offset, length, _WILLNEED)
            f.seek(offset)
            remaining = length
            while remaining:
                n = f.readinto(buffer[: min(remaining, _READ_BYTES)])
                if not n:
                    raise CheckpointError(
                        f"checkpoint {directory}: {rel} ended at byte {offset + length - remaining}, expected "
                        f"{offset + length}; it was truncated while being read",
                        path=directory,
                        file=rel,
                    )
                value = zlib.crc32(buffer[:n], value)
                remaining -= n
            if fsync and offset == 0:
                os.fsync(f.fileno())
        return rel, offset, f"{value:08x}"

    out: dict[str, dict[int, str]] = {rel: {} for rel in sizes}
    if tasks:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="checkpoint-io") as pool:
            for rel, offset, value in pool.map(crc, tasks):
                out[rel][offset] = value
    return {rel: [by_offset[o] for o in sorted(by_offset)] for rel, by_offset in out.items()}


def write_sidecar(directory: Path, files: Mapping[str, Mapping[str, Any]], *, name: str) -> None:
    """Record checksums a rank computed for files it wrote ({name relative to ``directory``: {"size", "crc32"}},
    blocks of ``BLOCK_BYTES``) in a hidden sidecar that ``commit`` takes instead of reading the files back."""
    body = {"block_bytes": BLOCK_BYTES, "files": {rel: dict(files[rel]) for rel in sorted(files)}}
    tmp = Path(directory) / f"{_SIDECAR_PREFIX}{name}.tmp"
    write_durable(tmp, json.dumps(body).encode())
    os.replace(tmp, Path(directory) / f"{_SIDECAR_PREFIX}{name}{_SIDECAR_SUFFIX}")


class BlockCrc:
    """CRC-32 of every ``BLOCK_BYTES`` block of a byte stream, fed as it is written (same values as
    ``block_crcs`` gives reading the file back)."""

    def __init__(self) -> None:
        self.size = 0
        self._blocks: list[str] = []
        self._crc = 0
        self._in_block = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        position = 0
        while position < len(view):
            take = min(BLOCK_BYTES - self._in_block, len(view) - position)
            self._crc = zlib.crc32(view[position : position + take], self._crc)
            self._in_block += take
            position += take
            if self._in_block == BLOCK_BYTES:
                self._blocks.append(f"{self._crc:08x}")
                self._crc, self._in_block = 0, 0
        self.size += len(view)

    def result(self) -> dict[str, Any]:
        tail = [f"{self._crc:08x}"] if self._in_block or not self._blocks else []
        return {"size": self.size, "crc32": self._blocks + tail}


def collect_sidecars(root: Path) -> dict[str, dict[str, Any]]:
    """Merge and delete the sidecars under ``root``: {path relative to root: {"size", "crc32"}}. A sidecar that
    does not parse (a rank died while writing it) is dropped; its files are then checksummed by the commit."""
    vouched: dict[str, dict[str, Any]] = {}
    for sidecar in sorted(root.rglob(f"{_SIDECAR_PREFIX}*")):
        try:
            body = json.loads(sidecar.read_bytes()) if sidecar.name.endswith(_SIDECAR_SUFFIX) else None
        except ValueError:
            body = None
        if body is not None and body.get("block_bytes") == BLOCK_BYTES:
            base = sidecar.parent.relative_to(root)
            for rel, entry in body["files"].items():
                vouched[(base / rel).as_posix()] = entry
        sidecar.unlink()
    return vouched
