"""A minimal single-controller program on flowactors: two colocated groups, a collective, chained futures.

python examples/hello_groups.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flowactors as fa
from flowactors import ONE_TO_ALL, Batch, Worker, endpoint


class Scaler(Worker):
    """Each rank holds a factor; `scale` multiplies its data-parallel share of the batch by it."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    @endpoint  # default protocol: split Batch arguments by data-parallel rank, concatenate the outputs
    def scale(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * self.factor, "rank": torch.full((len(batch),), self.rank)})

    @endpoint(protocol=ONE_TO_ALL)
    def total(self, value: float) -> float:
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t, group=self.process_group)  # an SPMD collective inside the group
        return t.item()


def main() -> None:
    with fa.Controller.local(n_slots=2, dashboard=None) as ctl:
        double = fa.ActorGroup(ctl, Scaler, name="double", args=(2.0,))
        triple = fa.ActorGroup(ctl, Scaler, name="triple", args=(3.0,))  # same processes: colocated
        batch = Batch({"x": torch.arange(8.0)})
        out = triple.scale(double.scale(batch))  # chained: the data moves worker to worker
        print("x * 6 =", out.result()["x"].tolist())
        print("all_reduce over 2 ranks:", double.total(1.0).result())


if __name__ == "__main__":
    main()
