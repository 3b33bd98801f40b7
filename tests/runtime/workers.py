"""Worker classes used by the runtime tests (importable by module name on the worker processes)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from flowactors import MESH, ONE_TO_ALL, RANK_ZERO, Batch, Worker, endpoint


class Reducer(Worker):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.log: list[int] = []

    @endpoint(protocol=ONE_TO_ALL)
    def all_reduce(self, x: float) -> float:
        t = torch.tensor([x * (self.rank + 1) * self.scale], dtype=torch.float64)
        dist.all_reduce(t, group=self.process_group)
        return t.item()

    @endpoint(protocol=ONE_TO_ALL)
    def record(self, i: int, _dep=None) -> int:
        self.log.append(i)
        return i

    @endpoint(protocol=ONE_TO_ALL)
    def history(self) -> list[int]:
        return list(self.log)

    @endpoint(protocol=ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @endpoint(protocol=ONE_TO_ALL)
    def scale_of(self, group_name: str) -> tuple[float, int]:
        """The scale and rank of the colocated instance of `group_name` in this process (Worker.colocated)."""
        other = self.colocated(group_name)
        return other.scale, other.rank

    @endpoint(protocol=ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint(protocol=RANK_ZERO)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return self.rank

    @endpoint
    def add_rank(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] + 1, "rank": torch.full((len(batch),), self.rank)}, batch.rows)

    @endpoint
    def scale_x(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 2, "rank": batch["rank"]}, batch.rows)

    @endpoint(protocol=ONE_TO_ALL)
    def straggle(self, seconds: float) -> float:
        """Rank 1 is late to a collective: rank 0 blocks in all_reduce meanwhile."""
        if self.rank == 1:
            time.sleep(seconds)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.process_group)
        return t.item()

    @endpoint
    def join_x(self, a: Batch, b: Batch, scale: int = 1) -> Batch:
        return Batch({"x": (a["x"] + b["x"]) * scale, "rank": torch.full((len(a),), self.rank)})

    @endpoint
    def fail_rows(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return batch

    @endpoint
    def drop_last_on(self, batch: Batch, rank: int) -> Batch:
        """Rank `rank` returns one row fewer: the ranks' outputs differ in length."""
        return batch.slice(0, len(batch) - 1) if self.rank == rank else batch

    @endpoint
    def total_rows(self, batch: Batch) -> Batch:
        """A collective over the group: every rank learns how many rows the call had in all."""
        t = torch.tensor([len(batch)])
        dist.all_reduce(t, group=self.process_group)
        return Batch(
            {
                "x": batch["x"],
                "total": torch.full((len(batch),), int(t.item())),
                "rank": torch.full((len(batch),), self.rank),
            }
        )

    @endpoint(protocol=MESH)
    def mesh_fail(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return Batch({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

    def not_remote(self) -> None:
        pass


class BrokenInit(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot load weights on rank 1")


class PairReducer(Worker):
    """Declares pair subgroups ({0,1}, {2,3}, … or a stride) and all-reduces inside its own pair."""

    @classmethod
    def process_groups(cls, layout, stride: int = 1) -> list[tuple[int, ...]]:
        if layout.world_size % (2 * stride):
            raise ValueError(f"{layout.world_size} ranks cannot form pairs at stride {stride}")
        n = layout.world_size
        return [(i, i + stride) for i in range(n) if (i // stride) % 2 == 0]

    def __init__(self, stride: int = 1) -> None:
        self.pair = next(g for g in self.subgroups if self.rank in g)
        assert len(self.subgroups) == 1

    @endpoint(protocol=ONE_TO_ALL)
    def pair_sum(self) -> tuple[tuple[int, ...], float]:
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=self.subgroups[self.pair])
        return self.pair, t.item()


class HangInit(Worker):
    """Rank 0 all-reduces in `__init__`, the other ranks do not: rank 0 blocks until the process group's timeout."""

    def __init__(self) -> None:
        if self.rank == 0:
            dist.all_reduce(torch.ones(1), group=self.process_group)


def nap(seconds: float, _dep=None, _after=None) -> float:
    """A task that takes a while (its frame shows in stacks), for Controller.apply or submit_pinned."""
    time.sleep(seconds)
    return seconds
