"""The update protocol: PPO-style mini-batches that mean the same thing at every data-parallel size.

A plain DP split gives rank r a contiguous slice, so "mini-batch k" of a rank would hold different samples at
dp=1 and dp=2. `MINIBATCH` instead shuffles the global batch (seeded, per epoch), cuts it into global
mini-batches of `mini_batch_samples`, and gives each DP rank its equal share of every mini-batch, in order.
Optimizer step k then sees the same samples whatever the DP size. Ranks that differ only in TP/PP coordinate get
the same data. Collect: the metrics dicts of the ranks, averaged.

The call carries its settings in the batch's meta: `mini_batch_samples` (global), `epochs`, `shuffle_seed`.
"""

from __future__ import annotations

import torch

from flowactors import Batch, Layout, Protocol, register_protocol

__all__ = ["MINIBATCH", "plan_minibatches"]


def plan_minibatches(batch: Batch, dp: int) -> list[list[Batch]]:
    """For each DP rank, one local batch per epoch; its consecutive chunks of mini_batch_samples/dp rows are its
    shares of the global mini-batches."""
    n = len(batch)
    mb = int(batch.meta.get("mini_batch_samples", n))
    epochs = int(batch.meta.get("epochs", 1))
    seed = batch.meta.get("shuffle_seed")
    if mb < 1 or n % mb:
        raise ValueError(f"mini_batch_samples={mb} does not divide the batch of {n} samples; choose a mini-batch "
                         f"size that divides prompts_per_step x samples_per_prompt")
    if mb % dp:
        raise ValueError(f"mini_batch_samples={mb} cannot be shared by data-parallel size {dp}; make it a multiple "
                         f"of {dp}")
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


def _distribute(args: tuple, kwargs: dict, layout: Layout) -> list[tuple[tuple, dict]]:
    batch, *rest = args
    if not isinstance(batch, Batch):
        raise TypeError(f"an update takes a Batch as its first argument, got {type(batch).__name__}")
    shares = plan_minibatches(batch, layout.dp)
    return [((shares[layout.coords(r)[1]], *rest), kwargs) for r in range(layout.world_size)]


def _collect(outputs: list, layout: Layout) -> dict[str, float]:
    keys = outputs[0].keys()
    return {k: sum(float(o[k]) for o in outputs) / len(outputs) for k in keys}


MINIBATCH = register_protocol(Protocol("minibatch", _distribute, _collect))
