"""The update protocol: PPO-style mini-batches that mean the same thing at every data-parallel size.

A plain DP split gives rank r a contiguous slice, so "mini-batch k" of a rank would hold different samples at
dp=1 and dp=2. `MINIBATCH` instead shuffles the global batch (seeded, per epoch), cuts it into global
mini-batches of `mini_batch_samples`, and gives each DP rank its equal share of every mini-batch, in order.
Optimizer step k then sees the same samples whatever the DP size. Ranks that differ only in TP/PP coordinate get
the same data. Collect: the metrics dicts of the ranks, averaged.

The call carries its settings as an `UpdateSpec` argument (`update_actor(batch, loss_fn, spec)`, third positional or
`spec=`): `mini_batch_samples` (global), `epochs`, `shuffle_seed`. The spec reaches every rank unchanged.
"""

from __future__ import annotations

import torch

from engines.specs import UpdateSpec
from flowactors import Batch, Layout, Protocol, register_protocol

__all__ = ["MINIBATCH", "plan_minibatches"]


def plan_minibatches(batch: Batch, dp: int, spec: UpdateSpec) -> list[list[Batch]]:
    """For each DP rank, one local batch per epoch; its consecutive chunks of mini_batch_samples/dp rows are its
    shares of the global mini-batches."""
    if not isinstance(spec, UpdateSpec):
        raise TypeError(
            f"plan_minibatches takes an UpdateSpec, got {type(spec).__name__}; pass UpdateSpec(mini_batch_samples=...)"
        )
    n = len(batch)
    mb, epochs, seed = spec.mini_batch_samples, spec.epochs, spec.shuffle_seed
    if n % mb:
        raise ValueError(
            f"mini_batch_samples={mb} does not divide the batch of {n} samples; choose a mini-batch "
            f"size that divides prompts_per_step x samples_per_prompt"
        )
    if mb % dp:
        raise ValueError(
            f"mini_batch_samples={mb} cannot be shared by data-parallel size {dp}; make it a multiple of {dp}"
        )
    share = mb // dp
    per_rank: list[list[Batch]] = [[] for _ in range(dp)]
    for epoch in range(epochs):
        if seed is None:
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 7919 + epoch))
        for r in range(dp):
            idx = [int(order[k * mb + r * share + j]) for k in range(n // mb) for j in range(share)]
            per_rank[r].append(batch.take(idx))
    return per_rank


def _spec_of(rest: list, kwargs: dict) -> UpdateSpec:
    """The call's UpdateSpec: its third positional argument or its `spec=` keyword."""
    if len(rest) >= 2:
        spec = rest[1]
    elif "spec" in kwargs:
        spec = kwargs["spec"]
    else:
        raise TypeError(
            "an update takes its settings as an UpdateSpec: pass update_actor(batch, loss_fn, "
            "UpdateSpec(mini_batch_samples=..., epochs=..., shuffle_seed=...)) (or spec=UpdateSpec(...))"
        )
    if not isinstance(spec, UpdateSpec):
        raise TypeError(
            f"an update's third argument (spec) must be an UpdateSpec, got {type(spec).__name__}; pass "
            f"UpdateSpec(mini_batch_samples=...)"
        )
    return spec


def _distribute(args: tuple, kwargs: dict, layout: Layout) -> list[tuple[tuple, dict]]:
    if not args or not isinstance(args[0], Batch):
        got = type(args[0]).__name__ if args else "nothing"
        raise TypeError(f"an update takes a Batch as its first argument, got {got}")
    batch, *rest = args
    shares = plan_minibatches(batch, layout.dp, _spec_of(rest, kwargs))
    return [((shares[layout.coords(r)[1]], *rest), kwargs) for r in range(layout.world_size)]


def _collect(outputs: list, layout: Layout) -> dict[str, float]:
    keys = outputs[0].keys()
    return {k: sum(float(o[k]) for o in outputs) / len(outputs) for k in keys}


MINIBATCH = register_protocol(Protocol("minibatch", _distribute, _collect))
