"""save_sharded / load_sharded: a state saved under data-parallel size 2 (FSDP2) loads under size 1, and back.

Model parameters, AdamW state after one step (exp_avg, exp_avg_sq, step) and the LR scheduler all round trip
through the checkpoint store, each direction compared with the full state gathered on the saving side.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from flowactors.checkpoint import CheckpointError, CheckpointStore, load_sharded, save_sharded
from tests.ranks import leave_world

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # Odd sizes, so FSDP2's dim-0 shards are uneven over 2 ranks (7 rows: 4 + 3).
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optim, torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)


def _single_process(seed: int):
    model = _model(seed)
    return (model, *_optimizer(model))


def _train_one_step(model: nn.Module, optim: torch.optim.Optimizer, sched) -> None:
    torch.manual_seed(123)
    model(torch.randn(6, 5)).square().mean().backward()
    optim.step()
    sched.step()
    optim.zero_grad()


def _full_state(model, optim, sched, options=None) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}


def _save_state(model, optim, sched, directory: Path) -> None:
    save_sharded(_full_state(model, optim, sched), directory)


def _load_state(model, optim, sched, directory: Path) -> None:
    state = _full_state(model, optim, sched)  # the loading layout; values are overwritten in place
    load_sharded(state, directory)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])


def _fsdp_rank(rank: int, world: int, store_file: str, mode: str, directory: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    # A file rendezvous: no port to pick and lose to another process on a shared machine.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        model = _model(seed=0 if mode == "save" else 99)
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim, sched = _optimizer(model)  # over the sharded parameters
        if mode == "save":
            _train_one_step(model, optim, sched)
            _save_state(model, optim, sched, Path(directory))
        else:
            _load_state(model, optim, sched, Path(directory))
        full = _full_state(model, optim, sched, options=_FULL)  # collective: every rank takes part
        if rank == 0:
            torch.save(full, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world(store_file + ".left")


def _run_fsdp(mode: str, directory: Path, out: Path) -> dict:
    store_file = out.with_suffix(".rendezvous")
    Path(f"{store_file}.left").mkdir()
    mp.spawn(_fsdp_rank, args=(2, str(store_file), mode, str(directory), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


def _assert_equal(a, b, where="state") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_saved_under_dp2_loads_under_dp1(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    pending = store.begin(1)
    role = pending.role_dir("actor")
    expected = _run_fsdp("save", role, tmp_path / "full.pt")
    # Each rank checksummed its own files; between them they cover every file the commit will list.
    sidecars = sorted(role.glob(".flowactors-crc32-*"))
    assert [p.name for p in sidecars] == [".flowactors-crc32-rank0.json", ".flowactors-crc32-rank1.json"]
    vouched = [set(json.loads(p.read_text())["files"]) for p in sidecars]
    assert not vouched[0] & vouched[1]
    assert vouched[0] | vouched[1] == {p.name for p in role.iterdir() if not p.name.startswith(".flowactors")}
    assert all(any(name.startswith(f"__{rank}_") for name in files) for rank, files in enumerate(vouched))
    store.commit(pending, {})

    checkpoint = store.latest_complete()
    model, optim, sched = _single_process(seed=99)
    _load_state(model, optim, sched, checkpoint.role_dir("actor"))
    _assert_equal(_full_state(model, optim, sched), expected)
    assert sched.get_last_lr() == [5e-3]

    # The loaded optimizer continues exactly as the reference trained in one process does.
    reference, ref_optim, ref_sched = _single_process(seed=0)
    _train_one_step(reference, ref_optim, ref_sched)
    _train_one_step(reference, ref_optim, ref_sched)
    _train_one_step(model, optim, sched)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_saved_under_dp1_loads_under_dp2(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    model, optim, sched = _single_process(seed=0)
    _train_one_step(model, optim, sched)
    pending = store.begin(1)
    _save_state(model, optim, sched, pending.role_dir("actor"))
    checkpoint = store.commit(pending, {})

    loaded = _run_fsdp("load", checkpoint.role_dir("actor"), tmp_path / "full.pt")
    _assert_equal(loaded, _full_state(model, optim, sched))


def test_load_errors_name_the_directory_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"holds no sharded state \(no .metadata\)"):
        load_sharded({"w": torch.zeros(2)}, tmp_path / "nothing")
    save_sharded({"w": torch.ones(2)}, tmp_path / "saved")
    with pytest.raises(CheckpointError, match="strict=False"):
        load_sharded({"w": torch.zeros(2), "extra": torch.zeros(1)}, tmp_path / "saved")
    partial = {"w": torch.zeros(2), "extra": torch.zeros(1)}
    load_sharded(partial, tmp_path / "saved", strict=False)
    assert torch.equal(partial["w"], torch.ones(2)) and torch.equal(partial["extra"], torch.zeros(1))
    subset = {}  # saved keys the state dict lacks are simply not loaded
    load_sharded(subset, tmp_path / "saved")
    assert subset == {}
