"""Small helpers shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowactors.checkpoint import CheckpointStore, PendingCheckpoint


def write_role_files(pending: PendingCheckpoint, step: int) -> None:
    """Stand-in for two roles' ranks writing their shards: distinct bytes per step, nested directories."""
    actor = pending.role_dir("actor")
    (actor / "rank0.bin").write_bytes(bytes([step % 256]) * 1000 + b"actor0")
    (actor / "rank1.bin").write_bytes(bytes([(step + 1) % 256]) * 3000 + b"actor1")
    critic = pending.role_dir("critic")
    (critic / "sub").mkdir(exist_ok=True)
    torch.save({"w": torch.full((4, 4), float(step))}, critic / "sub" / "weights.pt")
    (critic / "empty.txt").write_bytes(b"")


def save_step(store: CheckpointStore, step: int, state: dict | None = None):
    pending = store.begin(step)
    write_role_files(pending, step)
    return store.commit(pending, state if state is not None else {"step": step})


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", keep_last=3)
