"""CheckpointStore: layout, controller state round trip, verification and fallback, retention, resume."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from flowactors.checkpoint import (
    SAVE_PHASES,
    CheckpointError,
    CheckpointStore,
    capture_rng,
    restore_rng,
    save_sharded,
)

from .conftest import save_step, write_role_files


def _controller_state() -> dict:
    """Everything the controller saves per the issue, in the shapes it will have."""
    return {
        "data": {"epoch": 2, "index_in_epoch": 37, "shuffle_seed": 1234},
        "rng": {"controller": capture_rng(), "actor": [capture_rng(), capture_rng()]},
        "algorithm": {"kl_coef": 0.0375, "lagrange_multiplier": 1.25, "global_step": 12, "updates": 48},
        "config": {
            "model": {"hidden": 64, "layers": 2},
            "lr": 1e-5,
            "roles": ["actor", "critic"],
            "seed": None,
            "nan_ok": float("nan"),
            "flags": (True, False),
        },
        "tensor_state": {"running_mean": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
        "array": np.arange(10, dtype=np.int64).reshape(2, 5),
        "blob": b"\x00\x01binary",
        "numpy_scalar": np.float32(0.5),
    }


def _assert_same(a, b, where="state"):
    assert type(a) is type(b) or (isinstance(a, np.generic) and isinstance(b, float)), f"{where}: {type(a)} {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def test_round_trip_of_every_piece_of_state(store: CheckpointStore) -> None:
    state = _controller_state()
    committed = save_step(store, 12, state)

    assert committed.path == store.root / "step_000012"
    assert (store.root / "latest").read_text() == "step_000012\n"
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".")] == []

    loaded = store.latest_complete()
    assert loaded is not None and loaded.step == 12 and loaded.path == committed.path
    assert loaded.roles == ("actor", "critic")
    _assert_same(state, loaded.controller_state())
    assert (loaded.role_dir("actor") / "rank1.bin").read_bytes() == b"\x0d" * 3000 + b"actor1"
    weights = torch.load(loaded.role_dir("critic") / "sub" / "weights.pt", weights_only=True)
    assert torch.equal(weights["w"], torch.full((4, 4), 12.0))
    with pytest.raises(CheckpointError, match="no shards for role 'reward'"):
        loaded.role_dir("reward")

    manifest = json.loads((committed.path / "MANIFEST.json").read_text())
    on_disk = {
        p.relative_to(committed.path).as_posix(): p.stat().st_size
        for p in committed.path.rglob("*")
        if p.is_file() and p.name != "MANIFEST.json"
    }
    assert {rel: entry["size"] for rel, entry in manifest["files"].items()} == on_disk
    assert "controller/state.json" in on_disk and "controller/tensors.pt" in on_disk
    assert manifest["step"] == 12 and manifest["roles"] == ["actor", "critic"]


def test_restored_rng_replays_the_same_draws() -> None:
    state = capture_rng()
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    restore_rng(state)
    second = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_rng_round_trips_through_a_checkpoint(store: CheckpointStore) -> None:
    save_step(store, 1, {"rng": capture_rng()})
    expected = (random.random(), np.random.rand(2).tolist(), torch.randn(2))
    restore_rng(store.latest_complete().controller_state()["rng"])
    assert (random.random(), np.random.rand(2).tolist()) == expected[:2]
    assert torch.equal(torch.randn(2), expected[2])


@dataclasses.dataclass
class _Config:
    lr: float = 1e-5


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"config": _Config()}, r"controller_state\['config'\] is a _Config.*dataclasses.asdict"),
        ({"by_rank": {0: 1.0}}, r"has key 0: controller state keys must be strings"),
        ({"x": [object()]}, r"controller_state\['x'\]\[0\] is a object"),
        ({"x": {"__tensor__": 1}}, r"has key '__tensor__'"),
    ],
)
def test_controller_state_that_cannot_be_saved_is_named(store: CheckpointStore, state, message) -> None:
    pending = store.begin(1)
    with pytest.raises(TypeError, match=message):
        store.commit(pending, state)
    assert store.latest_complete() is None


def _flip_one_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda p: _flip_one_byte(p / "actor" / "rank1.bin", 1500),
            r"corrupt: actor/rank1.bin bytes 0\.\.\d+ have CRC-32",
        ),
        (lambda p: _flip_one_byte(p / "controller" / "state.json", 3), r"corrupt: controller/state.json"),
        (lambda p: (p / "critic" / "sub" / "weights.pt").unlink(), r"partial: critic/sub/weights.pt is listed"),
        (lambda p: os.truncate(p / "actor" / "rank0.bin", 10), r"actor/rank0.bin is 10 bytes, MANIFEST.json says 1006"),
        (lambda p: (p / "MANIFEST.json").unlink(), r"partial: it has no MANIFEST.json"),
        (lambda p: _flip_one_byte(p / "MANIFEST.json", 40), r"MANIFEST.json does not parse or fails its own checksum"),
        (lambda p: os.truncate(p / "MANIFEST.json", 50), r"MANIFEST.json does not parse"),
    ],
    ids=[
        "flipped-byte",
        "flipped-controller-byte",
        "missing-file",
        "truncated-file",
        "no-manifest",
        "flipped-manifest-byte",
        "truncated-manifest",
    ],
)
def test_damage_is_detected_and_the_previous_checkpoint_used(store: CheckpointStore, damage, problem) -> None:
    save_step(store, 1)
    newest = save_step(store, 2)
    damage(newest.path)

    with pytest.raises(CheckpointError, match=problem):
        store.load(newest.path)
    with capture_logs() as logs:
        chosen = store.latest_complete()
    assert chosen is not None and chosen.step == 1
    assert chosen.controller_state() == {"step": 1}
    warnings = [entry for entry in logs if entry["event"] == "checkpoint_invalid"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["path"] == str(newest.path)
    assert "previous checkpoint" in warnings[0]["action"]


def test_flipped_byte_in_a_later_block_of_a_large_file(tmp_path: Path) -> None:
    import flowactors.checkpoint as checkpoint

    store = CheckpointStore(tmp_path, keep_last=1)
    pending = store.begin(5)
    big = pending.role_dir("actor") / "big.bin"
    big.write_bytes(os.urandom(checkpoint.BLOCK_BYTES + 4096))
    done = store.commit(pending, {})
    assert len(done.manifest["files"]["actor/big.bin"]["crc32"]) == 2
    _flip_one_byte(big.parent.parent.parent / "step_000005" / "actor" / "big.bin", checkpoint.BLOCK_BYTES + 7)
    with pytest.raises(CheckpointError, match=rf"bytes {checkpoint.BLOCK_BYTES}\.\."):
        store.load(done.path)
    with capture_logs():
        assert store.latest_complete() is None


def test_all_damaged_means_no_checkpoint_and_resume_auto_refuses_to_start_over(store: CheckpointStore) -> None:
    first, only = save_step(store, 1), save_step(store, 2)
    _flip_one_byte(first.path / "actor" / "rank0.bin", 0)
    (only.path / "MANIFEST.json").unlink()
    with capture_logs():
        assert store.latest_complete() is None
        # starting from step 0 would silently discard the run: the error lists what was found and why it failed
        with pytest.raises(
            CheckpointError,
            match=r"(?s)resume=auto found 2 checkpoint directories under .* and none "
            r"verifies:\n  - step_000002: .*partial: it has no MANIFEST.json.*"
            r"\n  - step_000001: .*corrupt: actor/rank0.bin.*"
            r"resume=never starts over",
        ):
            store.resolve("auto")
    assert store.resolve("never") is None


def test_resume_auto_over_nothing_that_verifies_lists_every_step_directory(store: CheckpointStore) -> None:
    """A step directory `latest` does not name and that has no manifest is listed too, not silently left out."""
    first, second = save_step(store, 1), save_step(store, 2)
    _flip_one_byte(first.path / "actor" / "rank0.bin", 0)
    _flip_one_byte(second.path / "actor" / "rank0.bin", 0)
    stray = store.root / "step_000003"
    (stray / "actor").mkdir(parents=True)
    with capture_logs():
        with pytest.raises(CheckpointError) as raised:
            store.resolve("auto")
    lines = str(raised.value).splitlines()
    assert lines[0].startswith("resume=auto found 3 checkpoint directories under")
    assert [x.split(":")[0] for x in lines[1:4]] == ["  - step_000003", "  - step_000002", "  - step_000001"]
    assert "no MANIFEST.json" in lines[1] and "corrupt: actor/rank0.bin" in lines[2]


def test_one_run_at_a_time_holds_a_checkpoint_directory(store: CheckpointStore, tmp_path: Path) -> None:
    import subprocess
    import sys

    store.acquire()
    other = CheckpointStore(store.root)
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint directory {store.root} is in use by another run "
        rf"\(pid {os.getpid()} on .* since .*\); give this run another",
    ):
        other.acquire()
    store.release()
    other.acquire()  # free once released
    other.release()
    # a process that dies holding the lock (SIGKILL: no cleanup) leaves it free: the kernel drops flocks
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from flowactors.checkpoint import "
            f"CheckpointStore; s = CheckpointStore({str(store.root)!r}); s.acquire(); print('held', "
            "flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {holder.pid} "):
            store.acquire()
    finally:
        holder.kill()
        holder.wait()
    store.acquire()
    store.release()


def test_seeded_rng_states_are_the_same_in_identical_runs() -> None:
    from flowactors.checkpoint import seed_rng

    seed_rng(7)
    a = capture_rng()
    random.random(), torch.rand(3)
    seed_rng(7)
    b = capture_rng()
    _assert_same(a, b)
    seed_rng(8)
    assert capture_rng()["python"] != a["python"]


def test_retention_keeps_last_k_and_every_nth(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 11):
        save_step(store, step)
        assert store.steps()[-1] == step  # the newest is never deleted
    store.close()
    assert store.steps() == [4, 8, 9, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_000004",
        "step_000008",
        "step_000009",
        "step_000010",
    ]


def test_retention_keeps_only_the_newest_with_keep_last_1(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    for step in (3, 7, 9):
        save_step(store, step)
    assert store.steps() == [9] and store.latest_complete().step == 9


def test_invalid_retention_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointStore(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every=0"):
        CheckpointStore(tmp_path, keep_every=0)


def test_abort_and_stale_temporary_directories(store: CheckpointStore) -> None:
    save_step(store, 1)
    pending = store.begin(2)
    write_role_files(pending, 2)
    store.abort(pending)
    assert not pending.path.exists()

    # A killed save leaves its temporary directory (and maybe a half-written latest): never read, removed later.
    left = store.root / ".tmp-step_000003-deadbeef"
    write_role_files(type(pending)(step=3, path=left), 3)
    (store.root / ".latest-cafe0000").write_text("step_000003\n")
    assert store.latest_complete().step == 1
    live = store.begin(4)
    assert not left.exists() and not (store.root / ".latest-cafe0000").exists() and live.path.exists()
    with pytest.raises(CheckpointError, match="already in progress"):
        store.begin(4)
    other = store.begin(5)  # a second save in flight is not "stale" to this store
    assert live.path.exists()
    store.commit(live, {})
    store.commit(other, {})
    assert store.steps() == [1, 4, 5]


def test_commit_requires_begin(store: CheckpointStore, tmp_path: Path) -> None:
    pending = store.begin(1)
    store.commit(pending, {})
    with pytest.raises(CheckpointError, match="call begin"):
        store.commit(pending, {})


def test_role_names_are_checked(store: CheckpointStore) -> None:
    pending = store.begin(1)
    for bad in ("controller", "../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="role="):
            pending.role_dir(bad)


def test_saving_a_step_again_replaces_it(store: CheckpointStore) -> None:
    save_step(store, 1)
    save_step(store, 2, {"timeline": "old"})
    # The run resumed from step 1 and reaches step 2 again: the new save supersedes the old step 2.
    save_step(store, 2, {"timeline": "new"})
    assert store.steps() == [1, 2]
    assert store.latest_complete().controller_state() == {"timeline": "new"}


def test_newer_checkpoints_than_latest_are_not_used(store: CheckpointStore) -> None:
    save_step(store, 1)
    save_step(store, 2)
    save_step(store, 3)
    # A run resumed explicitly from step 1: its next save (step 2) must win over the abandoned step 3.
    resumed = store.resolve(store.root / "step_000001")
    assert resumed.step == 1
    save_step(store, 2, {"timeline": "resumed"})
    assert store.latest_complete().controller_state() == {"timeline": "resumed"}
    assert 3 in store.steps()  # retention leaves the abandoned run's checkpoint to the user


def test_unreadable_latest_pointer_falls_back_to_a_scan(store: CheckpointStore) -> None:
    save_step(store, 1)
    save_step(store, 2)
    (store.root / "latest").write_text("garbage\n")
    with capture_logs() as logs:
        assert store.latest_complete().step == 2
    assert logs[0]["event"] == "checkpoint_latest_unreadable"
    (store.root / "latest").unlink()
    assert store.latest_complete().step == 2


def test_latest_pointing_at_a_deleted_checkpoint_falls_back(store: CheckpointStore) -> None:
    import shutil

    save_step(store, 1)
    two = save_step(store, 2)
    shutil.rmtree(two.path)
    with capture_logs() as logs:
        assert store.latest_complete().step == 1
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["event"] for entry in warnings] == ["checkpoint_invalid"]
    assert "does not exist" in warnings[0]["problem"]


def test_resolve(store: CheckpointStore) -> None:
    assert store.resolve("auto") is None
    save_step(store, 1)
    save_step(store, 2)
    assert store.resolve("never") is None
    assert store.resolve("auto").step == 2
    assert store.resolve("step_000001").step == 1  # relative to the root
    assert store.resolve(str(store.root / "step_000001")).step == 1
    with pytest.raises(CheckpointError, match=r"resume='nope' is neither 'auto', 'never'.*step_000001"):
        store.resolve("nope")
    _flip_one_byte(store.root / "step_000001" / "actor" / "rank0.bin", 5)
    with pytest.raises(CheckpointError, match="corrupt: actor/rank0.bin"):  # an explicit choice does not fall back
        store.resolve("step_000001")


class _Crash(BaseException):
    """Stands in for the process dying: not an Exception, so nothing on the save path can swallow it."""


@pytest.mark.parametrize("phase", SAVE_PHASES)
def test_failure_at_each_phase_keeps_the_previous_checkpoint(tmp_path: Path, phase: str) -> None:
    root = tmp_path / "ckpt"
    save_step(CheckpointStore(root, keep_last=1), 1, {"step": 1})

    def crash(reached: str) -> None:
        if reached == phase:
            raise _Crash(phase)

    failing = CheckpointStore(root, keep_last=1, phase_hook=crash)
    with pytest.raises(_Crash):
        save_step(failing, 2, {"step": 2})

    restarted = CheckpointStore(root, keep_last=1)  # a fresh controller after the crash
    published = SAVE_PHASES.index(phase) >= SAVE_PHASES.index("latest_updated")
    current = restarted.latest_complete()
    assert current.step == (2 if published else 1)
    assert current.controller_state() == {"step": current.step}
    if not published:
        assert restarted.load(root / "step_000001").step == 1  # intact, not only present
    save_step(restarted, 3)
    restarted.close()
    assert restarted.latest_complete().step == 3
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_rank_checksums_are_merged_and_not_read_back(store: CheckpointStore, monkeypatch) -> None:
    import flowactors.checkpoint as checkpoint

    pending = store.begin(1)
    save_sharded({"w": torch.arange(1000.0), "meta": {"epoch": 1}}, pending.role_dir("actor"))
    sidecars = list(pending.path.rglob(".flowactors-crc32-*"))
    assert [p.name for p in sidecars] == [".flowactors-crc32-rank0.json"]
    vouched = set(json.loads(sidecars[0].read_text())["files"])
    assert vouched == {p.name for p in (pending.path / "actor").iterdir() if not p.name.startswith(".flowactors")}

    read_back: list[str] = []
    real = checkpoint.block_crcs
    monkeypatch.setattr(
        checkpoint,
        "block_crcs",
        lambda directory, sizes, **kw: read_back.extend(sizes) or real(directory, sizes, **kw),
    )
    done = store.commit(pending, {"x": 1})
    assert sorted(read_back) == ["controller/state.json"]  # the rank's files were taken from its sidecar
    assert not list(done.path.rglob(".flowactors-crc32-*"))
    assert {f"actor/{name}" for name in vouched} <= set(done.manifest["files"])
    monkeypatch.undo()
    assert store.load(done.path).step == 1


@pytest.mark.parametrize("sidecar_damage", ["garbage", "stale-size", "lying-crc"])
def test_bad_rank_checksums_never_make_a_bad_checkpoint_pass(store: CheckpointStore, sidecar_damage) -> None:
    pending = store.begin(1)
    role = pending.role_dir("actor")
    save_sharded({"w": torch.arange(1000.0)}, role)
    sidecar = role / ".flowactors-crc32-rank0.json"
    body = json.loads(sidecar.read_text())
    shard = next(name for name in body["files"] if name.endswith(".distcp"))
    if sidecar_damage == "garbage":
        sidecar.write_text('{"block_bytes": 671')  # a rank died while writing it
    elif sidecar_damage == "stale-size":
        with open(role / shard, "ab") as f:  # the file changed after the rank checksummed it
            f.write(b"more")
    else:
        body["files"][shard]["crc32"] = ["00000000"]
        sidecar.write_text(json.dumps(body))
    done = store.commit(pending, {})
    if sidecar_damage == "lying-crc":
        # The commit takes a rank's word for its own files; a wrong word is caught on load, never accepted.
        with pytest.raises(CheckpointError, match=f"corrupt: actor/{shard}"):
            store.load(done.path)
    else:
        assert store.load(done.path).step == 1


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 4096, 5000])
def test_streamed_block_checksums_equal_read_back_ones(tmp_path: Path, monkeypatch, size: int) -> None:
    import flowactors._integrity as integrity

    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1024)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    streamed = integrity.BlockCrc()
    for start in range(0, size, 333):  # writes that straddle block boundaries
        streamed.update(data[start : start + 333])
    read_back = integrity.block_crcs(tmp_path, {"f": size}, threads=2, fsync=False)
    assert streamed.result() == {"size": size, "crc32": read_back["f"]}
