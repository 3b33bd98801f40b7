"""megatron-core's process groups for one flowactors group: any slots, several models side by side.

megatron-core's `parallel_state` is process-global and built over the whole torch.distributed world, which would
force every megatron model to span every slot with one (p, t, d). megatron-core 0.16 also accepts the groups
explicitly: a `ProcessGroupCollection` passed to GPTModel, its DDP, optimizer, schedules and gradient
finalisation. We build that collection from the flowactors group's own DeviceMesh (pp, dp, tp) — the same rank
order megatron uses (tp fastest, then dp, then pp) — plus a few subgroups created with the group
(`megatron_subgroups`, returned by the roles' `process_groups`), so `parallel_state` is never initialised: an actor
on two slots and a critic on two others, or two colocated models with different layouts, each have their own.

Group ranks: r = (pp_i · dp + dp_i) · tp + tp_i. No context or expert parallelism (cp = ep = 1): their groups are
this rank alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["MegatronGroups", "megatron_subgroups", "megatron_groups", "world_groups"]


def _rank(pp: int, dp: int, tp: int, p: int, d: int, t: int) -> int:
    return (p * dp + d) * tp + t


def megatron_subgroups(pp: int, dp: int, tp: int) -> list[tuple[int, ...]]:
    """Group-rank tuples megatron needs beyond the mesh's tp / dp / pp dimensions: model parallel (tp × pp at one
    dp index), tensor × data parallel (one stage), embedding (first and last stage at one (dp, tp)), each rank
    alone (context / expert parallel of size 1, the position-embedding group) and the whole group (gradient
    statistics of the distributed optimizer). Every world rank creates them, in this order."""
    mp = [tuple(_rank(pp, dp, tp, p, d, t) for p in range(pp) for t in range(tp)) for d in range(dp)]
    tp_dp = [tuple(_rank(pp, dp, tp, p, d, t) for d in range(dp) for t in range(tp)) for p in range(pp)]
    embd = [
        tuple(sorted({_rank(pp, dp, tp, 0, d, t), _rank(pp, dp, tp, pp - 1, d, t)}))
        for d in range(dp)
        for t in range(tp)
    ]
    alone = [(r,) for r in range(pp * dp * tp)]
    out: list[tuple[int, ...]] = []
    for sub in [*mp, *tp_dp, *embd, *alone, tuple(range(pp * dp * tp))]:
        if sub not in out:
            out.append(sub)
    return out


@dataclass
class MegatronGroups:
    """This rank's place in the model's (pp, dp, tp) grid and megatron's `ProcessGroupCollection` for it."""

    collection: Any
    tp_mesh: Any
    """This rank's TP dimension as a DeviceMesh (checkpoints describe TP shards as DTensors over it)."""
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, in stage order: ascending, or descending for a model whose stages run
    the other way over its slots (engines.training.megatron.pipeline_fusion). torch orders a process group's ranks by
    global rank,
    so megatron's own schedules and P2P, which read stages off the PP group, serve only ascending pipelines."""

    def __post_init__(self) -> None:
        if len(self.pp_ranks) != self.pp or (
            self.pp_ranks != tuple(sorted(self.pp_ranks))
            and self.pp_ranks != tuple(sorted(self.pp_ranks, reverse=True))
        ):
            raise ValueError(
                f"a pipeline's ranks run in stage order up or down the global ranks; got "
                f"{self.pp_ranks} for pp={self.pp}"
            )

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def reversed_stages(self) -> bool:
        """Stages run from higher global ranks to lower (a fused pipeline's second model)."""
        return self.pp > 1 and self.pp_ranks[0] > self.pp_ranks[-1]

    def last_stage_rank(self) -> int:
        """The global rank of the last pipeline stage in this rank's pipeline (a broadcast source)."""
        return self.pp_ranks[-1]


def megatron_groups(mesh: Any, subgroups: Mapping[tuple[int, ...], Any]) -> MegatronGroups:
    """The collection for this rank from its group's DeviceMesh (pp, dp, tp) and the subgroups it is a member of
    (`megatron_subgroups` of the mesh's shape, keyed by group-rank tuples)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pp, dp, tp = (int(s) for s in mesh.mesh.shape)
    p, d, t = (int(c) for c in mesh.get_coordinate())
    me = _rank(pp, dp, tp, p, d, t)

    def sub(ranks: tuple[int, ...]) -> Any:
        try:
            return subgroups[ranks]
        except KeyError:
            raise RuntimeError(
                f"the megatron subgroup {ranks} was not created with this group; the role's "
                "process_groups must return "
                "engines.training.megatron.groups.megatron_subgroups(pp, dp, tp)"
            ) from None

    whole = mesh.mesh.flatten().tolist()
    tp_g, dp_g, pp_g = mesh.get_group("tp"), mesh.get_group("dp"), mesh.get_group("pp")
    mp = sub(tuple(_rank(pp, dp, tp, q, d, s) for q in range(pp) for s in range(tp)))
    tp_dp = sub(tuple(_rank(pp, dp, tp, p, e, s) for e in range(dp) for s in range(tp)))
    embd_ranks = tuple(sorted({_rank(pp, dp, tp, 0, d, t), _rank(pp, dp, tp, pp - 1, d, t)}))
    alone = sub((me,))
    collection = ProcessGroupCollection(
        tp=tp_g,
        pp=pp_g,
        mp=mp,
        dp=dp_g,
        dp_cp=dp_g,
        intra_dp_cp=dp_g,
        expt_dp=dp_g,
        intra_expt_dp=dp_g,
        cp=alone,
        tp_cp=tp_g,
        hcp=[alone],
        ep=alone,
        expt_tp=tp_g,
        tp_ep=tp_g,
        tp_ep_pp=mp,
        tp_dp_cp=tp_dp,
        # the embedding group ties the first and last stages' word embeddings (only those ranks are members)
        embd=sub(embd_ranks) if p in (0, pp - 1) else None,
        pos_embd=alone if p == 0 else None,  # rotary embeddings: no learned position table to tie
        intra_dist_opt=sub(tuple(range(len(whole)))),
        inter_dist_opt=None,
    )
    pp_ranks = tuple(int(r) for r in mesh.mesh[:, d, t].tolist())
    return MegatronGroups(collection, mesh["tp"], pp, dp, tp, p, d, t, pp_ranks)


def world_groups(tp: int, pp: int, reverse_stages: bool = False) -> MegatronGroups:
    """The groups for a model spanning the whole torch.distributed world (a program of its own, or tests): every
    world rank calls this, with the same sizes. `reverse_stages` puts stage 0 on the highest ranks (the second
    model of a fused pipeline, engines.training.megatron.pipeline_fusion)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not a multiple of tp × pp = {tp} × {pp}; choose tp and pp whose "
            f"product divides the number of ranks (the rest is data parallel)"
        )
    dp = world // (tp * pp)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    grid = torch.arange(world).reshape(pp, dp, tp)
    mesh = DeviceMesh(device, grid.flip(0) if reverse_stages else grid, mesh_dim_names=("pp", "dp", "tp"))
    whole = mesh.mesh.flatten().tolist()
    me, mine = dist.get_rank(), {}
    for ranks in megatron_subgroups(pp, dp, tp):  # group ranks; whole[r] is group rank r's world rank
        members = [whole[r] for r in ranks]
        group = dist.new_group(members)
        if me in members:
            mine[ranks] = group
    return megatron_groups(mesh, mine)
