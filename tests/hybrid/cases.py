"""Rank programs for the distributed resharding tests (run under tests.hybrid.spawn).

Each rank gets the full HF state dict from a file the test wrote, cuts its training shard, reshards with each
method, checks what it received against slices of the full weights computed independently, and returns the
figures; the test process asserts on them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engines.hybrid import (
    HybridLayout,
    ModelGeometry,
    Resharder,
    ReshardGroups,
    build_train_shard,
    expected_generation_state_dict,
)

LR = 0.05


def sgd_reference(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights after the cycle's optimizer step: SGD on loss = Σ sin(w), so w ← w − LR·cos(w)."""
    return {name: w - LR * torch.cos(w) for name, w in full.items()}


def _matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = True) -> bool:
    if got.keys() != want.keys():
        return False
    if exact:
        return all(torch.equal(got[k], want[k]) for k in got)
    return all(torch.allclose(got[k], want[k], rtol=1e-6, atol=1e-6) for k in got)


def run_jobs(rank: int, jobs) -> list:
    """Run several rank programs in one world, one after the other (a spawn of 8 ranks costs ~20 s here)."""
    return [fn(rank, *args) for fn, args in jobs]


def reshard_case(rank: int, path: str, layout_sizes: tuple[int, ...], methods: tuple[str, ...]) -> dict:
    """Every method once; then, with micro-DP, train → generate → train (SGD step) → generate → train."""
    case = torch.load(path, weights_only=False)
    full, geometry = case["state_dict"], ModelGeometry(**case["geometry"])
    layout = HybridLayout(*layout_sizes)
    groups = ReshardGroups.create(layout, methods)
    train = build_train_shard(full, geometry, layout, rank)
    before = train.flat.clone()
    out: dict = {"gen_coord": tuple(layout.gen_coord(rank)), "methods": {}}

    for method in methods:
        resharder = Resharder(geometry, layout, groups, method=method)
        gen = resharder.to_generation(train)
        state = gen.state_dict("hf")
        want = expected_generation_state_dict(full, geometry, layout, rank) if method == "micro-dp" else full
        local_is_training = any(p.data_ptr() == train.flat.data_ptr() for p in gen.pieces())
        record = {
            "stats": resharder.stats,
            "matches": _matches(state, want),
            "fused_names": sorted(gen.state_dict("fused")),
            "local_piece_is_training_memory": local_is_training,
        }
        if method == "micro-dp":
            record["gen_state"] = {k: v.clone() for k, v in state.items()}
        resharder.to_training()
        record["released"] = gen.released
        record["training_untouched"] = torch.equal(train.flat, before)
        out["methods"][method] = record

    # The cycle: train on the training views between two generations.
    resharder = Resharder(geometry, layout, groups, method="micro-dp")
    params = [torch.nn.Parameter(view) for view in train.tensors.values()]
    optimizer = torch.optim.SGD(params, lr=LR)
    first = {k: v.clone() for k, v in resharder.to_generation(train).state_dict().items()}
    resharder.to_training()
    loss = sum(p.sin().sum() for p in params)
    loss.backward()
    optimizer.step()
    second = resharder.to_generation(train).state_dict()
    want = expected_generation_state_dict(sgd_reference(full), geometry, layout, rank)
    out["cycle"] = {
        "first_matches": _matches(first, expected_generation_state_dict(full, geometry, layout, rank)),
        "second_matches": _matches(second, want, exact=False),
        "second_changed": not _matches(second, first),
        "second_state": {k: v.clone() for k, v in second.items()},
        "params_are_training_views": all(p.data_ptr() == v.data_ptr() for p, v in zip(params, train.tensors.values())),
    }
    resharder.to_training()
    dist.barrier()
    return out


def bad_shard_case(rank: int, path: str) -> dict:
    """Rank 1 hands over a training shard of the wrong stage: every rank of its group must raise, none hang."""
    case = torch.load(path, weights_only=False)
    full, geometry = case["state_dict"], ModelGeometry(**case["geometry"])
    layout = HybridLayout(2, 1, 1, 1, 1)  # two stages, one micro-DP group of both ranks
    groups = ReshardGroups.create(layout)
    resharder = Resharder(geometry, layout, groups)
    train = build_train_shard(full, geometry, layout, 0 if rank == 1 else rank)  # rank 1 gets stage 0's shard
    try:
        resharder.to_generation(train)
    except ValueError as err:
        error = str(err)
    else:
        error = None
    # The engine still works afterwards with the right shards.
    good = resharder.to_generation(build_train_shard(full, geometry, layout, rank)).state_dict()
    ok = _matches(good, expected_generation_state_dict(full, geometry, layout, rank))
    resharder.to_training()
    return {"error": error, "recovered": ok}
