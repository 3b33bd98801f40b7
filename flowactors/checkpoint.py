"""Atomic, checksummed checkpoint directories: the storage half of docs/design.md §6.

Every role's ranks and the controller write a checkpoint into a temporary directory (``begin``); ``commit`` writes
the controller's state and ``MANIFEST.json`` (every file's block checksums) last, renames the directory into place
and only then updates ``latest``, so a process killed at any point leaves either the previous checkpoint or the new
one. Loading verifies every block and walks back to the last complete checkpoint; retention and the run's lock on
the root (``acquire``) are here too. The torch.distributed.checkpoint helpers that ranks call live in
``flowactors/_dcp.py`` and are re-exported here; the checksum layer both use (block CRCs, sidecars,
``CheckpointError``) lives below both, in ``flowactors/_integrity.py``, so imports point one way.

The layout, the save and load protocol step by step with its reasons, and why CRC-32: docs/checkpoints.md.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from flowactors._dcp import load_sharded, save_sharded
from flowactors._integrity import (
    BLOCK_BYTES,
    CheckpointError,
    block_crcs,
    collect_sidecars,
    fsync_dir,
    write_durable,
)

__all__ = [
    "SAVE_PHASES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "PendingCheckpoint",
    "capture_rng",
    "load_sharded",
    "restore_rng",
    "save_sharded",
    "seed_rng",
]

_log = structlog.get_logger("flowactors.checkpoint")

MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
LOCK_NAME = ".lock"
CONTROLLER_DIR = "controller"
_STATE_JSON = "state.json"
_STATE_TENSORS = "tensors.pt"
_FORMAT = "flowactors-checkpoint"
_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_LATEST_TMP_PREFIX = ".latest-"

SAVE_PHASES = (
    "begun",  # the temporary directory exists; ranks write their shards after this
    "controller_state_written",
    "checksummed",  # every file checksummed (from the ranks' sidecars, or read back) and fsynced
    "manifest_written",  # MANIFEST.json written and fsynced inside the temporary directory
    "renamed",  # the checkpoint is in place under its final name; `latest` still names the previous one
    "latest_updated",
    "retained",  # old checkpoints deleted
)
"""The points a save passes, in order. ``CheckpointStore(phase_hook=...)`` is called with each name as it is
reached; tests use it to kill or fail a save at each phase."""


# --------------------------------------------------------------------------------------------------------------
# Checkpoints


@dataclasses.dataclass(frozen=True)
class PendingCheckpoint:
    """A save in progress: ranks write into ``path`` (a temporary directory) until the store commits it."""

    step: int
    path: Path

    def role_dir(self, role: str) -> Path:
        """The directory a role's ranks write into (``path / role``), created if missing."""
        _check_role_name(role)
        directory = self.path / role
        directory.mkdir(parents=True, exist_ok=True)
        return directory


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete, verified checkpoint."""

    path: Path
    step: int
    manifest: Mapping[str, Any] = dataclasses.field(repr=False)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles that wrote into this checkpoint (top-level directories other than ``controller``)."""
        return tuple(self.manifest["roles"])

    def role_dir(self, role: str) -> Path:
        """Where ``role``'s shards are; raises ``CheckpointError`` if the checkpoint holds none for it."""
        if role not in self.roles:
            raise CheckpointError(
                f"checkpoint {self.path} holds no shards for role {role!r} (it has {list(self.roles)}); "
                "load that role from another checkpoint or initialise it from scratch",
                path=self.path,
            )
        return self.path / role

    def controller_state(self) -> dict[str, Any]:
        """The ``controller_state`` that was committed, with tuples, tensors, arrays and bytes restored."""
        directory = self.path / CONTROLLER_DIR
        tensors: dict[str, torch.Tensor] = {}
        if (directory / _STATE_TENSORS).exists():
            tensors = torch.load(directory / _STATE_TENSORS, map_location="cpu", weights_only=True)
        with open(directory / _STATE_JSON, encoding="utf-8") as f:
            return _decode(json.load(f), tensors)


class CheckpointStore:
    """Checkpoint directories under ``root``: atomic saves, verified loads, retention.

    ``keep_last`` newest checkpoints are kept, plus every step divisible by ``keep_every`` when it is set.
    ``io_threads`` read and checksum blocks in parallel. ``phase_hook`` is called with each name in
    ``SAVE_PHASES`` as a save reaches it (a test seam for crash injection; ``None`` in normal use).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int = 3,
        keep_every: int | None = None,
        *,
        io_threads: int | None = None,
        phase_hook: Callable[[str], None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: at least the newest checkpoint must be kept; use keep_last >= 1")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every={keep_every}: must be a positive step interval, or None to keep no extra")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.io_threads = io_threads or min(8, max(2, os.cpu_count() or 1))
        self._phase_hook = phase_hook
        self._pending: dict[Path, PendingCheckpoint] = {}
        self._lock = threading.Lock()
        self._deleting: list[threading.Thread] = []
        self._lockfile: Any = None

    # -- ownership ---------------------------------------------------------------------------------------------

    def acquire(self) -> None:
        """Lock the root for this process's run; CheckpointError if another run holds it."""
        import fcntl
        import socket

        if self._lockfile is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise CheckpointError(
                f"checkpoint directory {self.root} is in use by another run ({holder}); give this "
                f"run another --checkpoint-dir, or wait for that one to end",
                path=path,
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._lockfile = f

    def release(self) -> None:
        """Give up the lock `acquire` took (also when the process ends)."""
        if self._lockfile is not None:
            self._lockfile.close()  # closing the file drops the flock
            self._lockfile = None

    # -- saving ------------------------------------------------------------------------------------------------

    def begin(self, step: int) -> PendingCheckpoint:
        """Start a save of ``step``: clean what killed saves left behind and make a fresh temporary directory."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: checkpoint steps are non-negative integers")
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if any(p.step == step for p in self._pending.values()):
                raise CheckpointError(
                    f"a save of step {step} is already in progress in {self.root}; commit or abort it first"
                )
            self._remove_stale()
            path = self.root / f"{_TMP_PREFIX}{_step_name(step)}-{uuid.uuid4().hex[:8]}"
            path.mkdir()
            pending = PendingCheckpoint(step=step, path=path)
            self._pending[path] = pending
        self._phase("begun")
        return pending

    def commit(self, pending: PendingCheckpoint, controller_state: Mapping[str, Any] | None = None) -> Checkpoint:
        """Publish ``pending`` once every rank has finished writing into it; returns the new checkpoint.

        ``controller_state`` is plain data (dict, list, tuple, str, int, float, bool, None) with tensors, numpy
        arrays and bytes allowed as leaves. If this raises, the previous checkpoint is still the current one; the
        temporary directory is left for ``abort`` or the next ``begin`` to remove.
        """
        if self._pending.get(pending.path) != pending:
            raise CheckpointError(f"{pending.path} is not a save in progress of this store; call begin() first")
        started = time.perf_counter()
        _write_controller_state(pending.path / CONTROLLER_DIR, controller_state or {})
        self._phase("controller_state_written")
        files = self._checksum_tree(pending.path)
        self._phase("checksummed")
        manifest = _write_manifest(pending.path, pending.step, files)
        self._phase("manifest_written")
        final = self._publish(pending)
        self._phase("renamed")
        self._write_latest(final.name)
        self._phase("latest_updated")
        self._apply_retention(newest=pending.step)
        self._phase("retained")
        total = sum(entry["size"] for entry in files.values())
        _log.info(
            "checkpoint_saved",
            step=pending.step,
            path=str(final),
            files=len(files),
            bytes=total,
            commit_seconds=round(time.perf_counter() - started, 3),
        )
        return Checkpoint(path=final, step=pending.step, manifest=manifest)

    def close(self) -> None:
        """Wait for background deletions (retention, replaced checkpoints) to finish."""
        while self._deleting:
            self._deleting.pop().join()

    def abort(self, pending: PendingCheckpoint) -> None:
        """Drop a save in progress and everything written into it."""
        with self._lock:
            self._pending.pop(pending.path, None)
        shutil.rmtree(pending.path, ignore_errors=True)
        _log.info("checkpoint_aborted", step=pending.step, path=str(pending.path))

    # -- loading -----------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps whose directory holds a manifest, oldest first (not verified; see ``latest_complete``)."""
        return sorted(step for step, _ in self._published())

    def latest(self) -> Path | None:
        """The checkpoint directory the ``latest`` pointer names, or None if there is no readable pointer."""
        try:
            name = (self.root / LATEST_NAME).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        if not _STEP_DIR.match(name):
            _log.warning("checkpoint_latest_unreadable", path=str(self.root / LATEST_NAME), content=name[:80])
            return None
        return self.root / name

    def latest_complete(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, starting from the one ``latest`` names; None if there is none.

        Each one that fails verification is reported with a ``checkpoint_invalid`` warning naming the problem,
        and the next older one is tried.
        """
        for path in self._candidates():
            try:
                return self.load(path)
            except CheckpointError as error:
                _log.warning(
                    "checkpoint_invalid",
                    path=str(path),
                    file=error.file,
                    problem=str(error),
                    action="falling back to the previous checkpoint",
                )
        return None

    def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Verify the checkpoint at ``path`` (manifest, sizes, checksums) and return it.

        Raises ``CheckpointError`` naming the missing, truncated or corrupt file.
        """
        path = Path(path)
        started = time.perf_counter()
        manifest = _read_manifest(path)
        self._verify_files(path, manifest)
        _log.info(
            "checkpoint_verified",
            path=str(path),
            step=manifest["step"],
            seconds=round(time.perf_counter() - started, 3),
        )
        return Checkpoint(path=path, step=manifest["step"], manifest=manifest)

    def resolve(self, resume: str | os.PathLike[str]) -> Checkpoint | None:
        """The checkpoint a run resumes from: ``"auto"`` (newest verified; None when the root holds no checkpoint
        at all), ``"never"`` (None), or a path (absolute, or relative to the store root), which must verify: there
        is no fallback for an explicit choice. ``"auto"`` over checkpoints of which none verifies is an error
        listing each one's problem: starting over from step 0 silently would discard a run the user meant to
        continue."""
        if resume == "never":
            return None
        if resume == "auto":
            found = self.latest_complete()
            step_dirs = self._step_dirs()
            if found is None and step_dirs:
                problems = [f"{path.name}: {self._problem(path)}" for path in step_dirs]
                raise CheckpointError(
                    f"resume=auto found {len(step_dirs)} checkpoint director{'y' if len(step_dirs) == 1 else 'ies'} "
                    f"under {self.root} and none verifies:\n  - "
                    + "\n  - ".join(problems)
                    + "\nresume=never starts over (saving over them), or resume=PATH names another checkpoint",
                    path=self.root,
                )
            return found
        path = Path(resume)
        if not path.exists() and (self.root / path).exists():
            path = self.root / path
        if not path.is_dir():
            raise CheckpointError(
                f"resume={str(resume)!r} is neither 'auto', 'never' nor an existing checkpoint directory; "
                f"choose one of {[_step_name(s) for s in self.steps()]} under {self.root}, or 'auto'",
                path=path,
            )
        return self.load(path)

    # -- internals ---------------------------------------------------------------------------------------------

    def _phase(self, name: str) -> None:
        if self._phase_hook is not None:
            self._phase_hook(name)

    def _published(self) -> Iterator[tuple[int, Path]]:
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / MANIFEST_NAME).is_file():
                yield int(match.group(1)), entry

    def _step_dirs(self) -> list[Path]:
        """Every directory named like a checkpoint's, newest first, whether or not it holds a manifest."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), e) for e in self.root.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir()]
        return [path for _, path in sorted(found, reverse=True)]

    def _problem(self, path: Path) -> str:
        """Why the step directory `path` cannot be resumed from, in words."""
        try:
            self.load(path)
        except CheckpointError as error:
            return str(error)
        return "verifies, but is newer than the checkpoint `latest` names (an interrupted publish): resume=PATH"

    def _candidates(self) -> list[Path]:
        """Checkpoint directories to try, best first: the one ``latest`` names, then older ones by step."""
        published = sorted(self._published(), reverse=True)
        latest = self.latest()
        if latest is None:
            return [path for _, path in published]
        latest_step = int(_STEP_DIR.match(latest.name).group(1))
        newer = [path.name for step, path in published if step > latest_step]
        if newer:
            _log.info(
                "checkpoint_newer_than_latest_ignored",
                latest=latest.name,
                ignored=newer,
                reason="not published by `latest`: an interrupted save or an abandoned run",
            )
        return [latest] + [path for step, path in published if step < latest_step]

    def _remove_stale(self) -> None:
        live = set(self._pending)
        for entry in self.root.iterdir():
            stale_tmp = entry.name.startswith(_TMP_PREFIX) and entry not in live
            if stale_tmp or entry.name.startswith((_TRASH_PREFIX, _LATEST_TMP_PREFIX)):
                _log.info("checkpoint_stale_removed", path=str(entry))
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _checksum_tree(self, directory: Path) -> dict[str, dict[str, Any]]:
        """Size and block checksums of every file under ``directory``; fsyncs every file and directory.

        Checksums that ranks computed right after writing (``save_sharded`` sidecars) are taken for files whose
        size still matches, so the controller reads back only what no rank vouched for.
        """
        vouched = collect_sidecars(directory)
        sizes: dict[str, int] = {}
        for dirpath, dirnames, filenames in os.walk(directory):
            for name in filenames:
                full = Path(dirpath, name)
                rel = full.relative_to(directory).as_posix()
                if full.is_symlink() or not full.is_file():
                    raise CheckpointError(
                        f"{rel} in {directory} is not a regular file; write files, not links, into a checkpoint",
                        path=directory,
                        file=rel,
                    )
                sizes[rel] = full.stat().st_size
            dirnames.sort()
        unvouched = {rel: size for rel, size in sizes.items() if rel not in vouched or vouched[rel]["size"] != size}
        blocks = block_crcs(directory, unvouched, threads=self.io_threads, fsync=True)
        for dirpath, _, _ in os.walk(directory, topdown=False):
            fsync_dir(Path(dirpath))
        _log.debug("checkpoint_checksummed", files=len(sizes), read_back=len(unvouched))
        return {
            rel: {"size": size, "crc32": blocks[rel] if rel in blocks else vouched[rel]["crc32"]}
            for rel, size in sorted(sizes.items())
        }

    def _verify_files(self, path: Path, manifest: Mapping[str, Any]) -> None:
        files: dict[str, Any] = manifest["files"]
        for rel, entry in files.items():
            full = path / rel
            if not full.is_file():
                raise CheckpointError(
                    f"checkpoint {path} is partial: {rel} is listed in {MANIFEST_NAME} but missing; "
                    "restore the file or resume from the previous checkpoint",
                    path=path,
                    file=rel,
                )
            size = full.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"checkpoint {path} is corrupt: {rel} is {size} bytes, {MANIFEST_NAME} says {entry['size']} "
                    "(truncated or rewritten after the save); restore the file or resume from the previous checkpoint",
                    path=path,
                    file=rel,
                )
        sizes = {rel: entry["size"] for rel, entry in files.items()}
        actual = block_crcs(path, sizes, threads=self.io_threads, fsync=False)
        for rel, entry in files.items():
            for index, (got, want) in enumerate(zip(actual[rel], entry["crc32"], strict=True)):
                if got != want:
                    start = index * manifest["block_bytes"]
                    raise CheckpointError(
                        f"checkpoint {path} is corrupt: {rel} bytes {start}..{start + manifest['block_bytes']} have "
                        f"CRC-32 {got}, {MANIFEST_NAME} says {want} (the file changed after the save); restore "
                        "the file or resume from the previous checkpoint (resume='auto' falls back on its own)",
                        path=path,
                        file=rel,
                    )

    def _publish(self, pending: PendingCheckpoint) -> Path:
        final = self.root / _step_name(pending.step)
        with self._lock:
            if final.exists():
                # A checkpoint of this step from an interrupted or abandoned timeline: the new save supersedes it.
                trash = self.root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                _log.warning("checkpoint_replaced", path=str(final), reason="a new save of the same step")
            else:
                trash = None
            os.rename(pending.path, final)
            fsync_dir(self.root)
            self._pending.pop(pending.path, None)
        if trash is not None:
            self._delete_later(trash)
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f"{_LATEST_TMP_PREFIX}{uuid.uuid4().hex[:8]}"
        write_durable(tmp, (name + "\n").encode())
        os.replace(tmp, self.root / LATEST_NAME)
        fsync_dir(self.root)

    def _apply_retention(self, newest: int) -> None:
        published = sorted(self._published())
        # Checkpoints above the newest save belong to an abandoned run (resumed from earlier); retention leaves them.
        current = [(step, path) for step, path in published if step <= newest]
        keep = {step for step, _ in current[-self.keep_last :]} | {newest}
        if self.keep_every:
            keep |= {step for step, _ in current if step % self.keep_every == 0}
        latest = self.latest()
        for step, path in current:
            if step in keep or path == latest:
                continue
            trash = self.root / f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            self._delete_later(trash)
            _log.info("checkpoint_deleted", step=step, path=str(path), reason="retention")
        fsync_dir(self.root)

    def _delete_later(self, trash: Path) -> None:
        """Remove a directory already renamed out of the way, off the save's critical path (freeing a large
        checkpoint takes tens of milliseconds). If the process dies first, the next ``begin`` removes it."""
        self._deleting = [thread for thread in self._deleting if thread.is_alive()]
        thread = threading.Thread(
            target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, name="checkpoint-delete", daemon=True
        )
        thread.start()
        self._deleting.append(thread)


# --------------------------------------------------------------------------------------------------------------
# Manifest


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _check_role_name(role: str) -> None:
    if not role or role != Path(role).name or role.startswith(".") or role in (CONTROLLER_DIR, MANIFEST_NAME):
        raise ValueError(
            f"role={role!r}: a role directory is one plain name, not starting with '.', and not "
            f"{CONTROLLER_DIR!r} (the controller's own state)"
        )


def _manifest_crc(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"


def _write_manifest(directory: Path, step: int, files: Mapping[str, Any]) -> dict[str, Any]:
    roles = sorted({rel.split("/", 1)[0] for rel in files if "/" in rel} - {CONTROLLER_DIR})
    body = {
        "format": _FORMAT,
        "version": _FORMAT_VERSION,
        "step": step,
        "created_unix": time.time(),
        "checksum": "crc32",
        "block_bytes": BLOCK_BYTES,
        "roles": roles,
        "files": dict(files),
    }
    manifest = {**body, "manifest_crc32": _manifest_crc(body)}
    write_durable(directory / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
    fsync_dir(directory)
    return manifest


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST_NAME
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist", path=path)
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is partial: it has no {MANIFEST_NAME} (the save did not finish); "
            "resume from the previous checkpoint (resume='auto') or delete the directory",
            path=path,
            file=MANIFEST_NAME,
        )
    try:
        manifest = json.loads(manifest_path.read_bytes())
        body = {key: value for key, value in manifest.items() if key != "manifest_crc32"}
        valid = manifest.get("manifest_crc32") == _manifest_crc(body) and manifest.get("format") == _FORMAT
    except (ValueError, AttributeError):
        valid = False
    if not valid:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {MANIFEST_NAME} does not parse or fails its own checksum; "
            "resume from the previous checkpoint (resume='auto') or restore the manifest from a copy",
            path=path,
            file=MANIFEST_NAME,
        )
    if manifest["version"] > _FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {manifest['version']}, this flowactors reads up to "
            f"{_FORMAT_VERSION}; load it with a newer flowactors",
            path=path,
            file=MANIFEST_NAME,
        )
    return manifest


# --------------------------------------------------------------------------------------------------------------
# Controller state: JSON for plain data, with typed markers for what JSON cannot hold, tensors in a side file


_TUPLE, _TENSOR, _NDARRAY, _BYTES = "__tuple__", "__tensor__", "__ndarray__", "__bytes__"
_MARKERS = frozenset((_TUPLE, _TENSOR, _NDARRAY, _BYTES))


def _write_controller_state(directory: Path, state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(f"controller_state must be a dict, got {type(state).__name__}")
    directory.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors, "controller_state")
    write_durable(directory / _STATE_JSON, json.dumps(encoded, indent=1).encode())
    if tensors:
        with open(directory / _STATE_TENSORS, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or key in _MARKERS:
                raise TypeError(
                    f"{where} has key {key!r}: controller state keys must be strings other than {sorted(_MARKERS)}; "
                    "convert the key with str() or nest the data differently"
                )
            out[key] = _encode(item, tensors, f"{where}[{key!r}]")
        return out
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().clone()
        return {_TENSOR: key}
    if isinstance(value, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(value).decode("ascii")}
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        data = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii")
        return {_NDARRAY: {"dtype": value.dtype.str, "shape": list(value.shape), "data": data}}
    if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()  # numpy scalars come back as Python numbers
    fix = "convert it with dataclasses.asdict()" if dataclasses.is_dataclass(value) else "convert it to plain data"
    raise TypeError(
        f"{where} is a {type(value).__name__}, which a checkpoint's controller state cannot hold; {fix} "
        "(dict, list, tuple, str, int, float, bool, None, tensors, numpy arrays and bytes are kept)"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((marker, payload),) = value.items()
        if marker == _TUPLE:
            return tuple(_decode(item, tensors) for item in payload)
        if marker == _TENSOR:
            return tensors[payload]
        if marker == _BYTES:
            return base64.b64decode(payload)
        if marker == _NDARRAY:
            np = _numpy()
            array = np.frombuffer(base64.b64decode(payload["data"]), dtype=np.dtype(payload["dtype"]))
            return array.reshape(payload["shape"]).copy()
    return {key: _decode(item, tensors) for key, item in value.items()}


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# --------------------------------------------------------------------------------------------------------------
# RNG state


def seed_rng(seed: int) -> None:
    """Seed every generator `capture_rng` captures (Python, numpy, torch, CUDA), so the RNG states a checkpoint
    saves are the same in identical runs."""
    random.seed(seed)
    torch.manual_seed(seed)  # all CUDA devices too
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process: Python ``random``, numpy's global generator (if numpy is installed),
    torch CPU and every visible CUDA device (if CUDA is available). Plain data a checkpoint's controller state
    holds as is; a worker returns it to the controller, which saves one per rank."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=False)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what ``capture_rng`` captured. Generators missing from ``state`` are left alone; saved CUDA
    states are applied to as many devices as both sides have (a warning says when the counts differ)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np = _numpy()
        if np is None:
            _log.warning("rng_not_restored", generator="numpy", reason="numpy is not installed")
        else:
            np.random.set_state(state["numpy"])
    if "cuda" in state:
        saved = list(state["cuda"])
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices != len(saved):
            _log.warning(
                "rng_cuda_device_count_differs", saved=len(saved), visible=devices, restored=min(devices, len(saved))
            )
        for index in range(min(devices, len(saved))):
            torch.cuda.set_rng_state(saved[index], device=index)
