"""A process killed (SIGKILL) at each phase of a save leaves the previous checkpoint intact and in use.

The saving process is a fork of the test process, so each case costs milliseconds rather than a Python start;
it kills itself from the phase hook, which is as abrupt as a kill from outside but lands exactly on the phase.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from flowactors.checkpoint import SAVE_PHASES, CheckpointStore, save_sharded

from .conftest import save_step

_WHILE_WRITING = "writing_shards"


def _save_and_die(root: Path, phase: str) -> None:
    def die(reached: str) -> None:
        if reached == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    store = CheckpointStore(root, keep_last=1, phase_hook=die)
    pending = store.begin(2)
    save_sharded({"w": torch.full((64, 64), 2.0), "meta": {"step": 2}}, pending.role_dir("actor"), thread_count=1)
    if phase == _WHILE_WRITING:
        with open(pending.role_dir("critic") / "shard.bin", "wb") as f:
            f.write(b"\x02" * 10_000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    store.commit(pending, {"step": 2, "tensor": torch.ones(3)})
    os._exit(0)


@pytest.mark.parametrize("phase", (_WHILE_WRITING, *SAVE_PHASES))
def test_kill_at_each_phase(tmp_path: Path, phase: str) -> None:
    root = tmp_path / "ckpt"
    save_step(CheckpointStore(root, keep_last=1), 1, {"step": 1})

    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(root, phase))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL

    store = CheckpointStore(root, keep_last=1)  # the controller, restarted
    published = phase in SAVE_PHASES and SAVE_PHASES.index(phase) >= SAVE_PHASES.index("latest_updated")
    current = store.latest_complete()
    assert current.step == (2 if published else 1)
    if published:
        assert current.controller_state()["step"] == 2
        assert torch.equal(current.controller_state()["tensor"], torch.ones(3))
    else:
        assert current.controller_state() == {"step": 1}
        assert store.load(root / "step_000001").step == 1  # every byte of the previous checkpoint verifies

    # The next save cleans what the killed one left and publishes normally.
    save_step(store, 3)
    store.close()
    assert store.latest_complete().step == 3
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
