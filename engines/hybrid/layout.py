"""Rank and group arithmetic of the 3D-HybridEngine (HybridFlow §5.4, Figure 8), as pure functions.

The actor trains with parallel sizes (p, t, d) and generates with (p_g, t_g, d_g, d) on the same ranks, where the
micro data-parallel size is d_g = p·t / (p_g·t_g). Nothing here touches torch.distributed: every rank computes the
same answers from the same `HybridLayout`, which is what lets all ranks create the same process groups in the same
order and reject bad input before any collective starts.

Conventions
-----------
Training rank (Megatron order: TP fastest, then DP, then PP)::

    rank = (pp · d + dp) · t + tp

Write r = t / t_g (TP sub-shards per generation TP shard) and s = p / p_g (training stages per generation stage).
A training rank (pp, dp, tp) becomes, in generation,

* generation TP rank   tp // r          -> generation TP groups take training TP ranks at stride r = t/t_g
* generation PP stage  pp // s          -> generation PP groups take training stages at stride s = p/p_g
* micro-DP index       (pp % s) · r + tp % r
* generation DP index  dp · d_g + micro-DP index

A micro-DP group is the d_g ranks of one training DP replica whose training shards tile one generation shard:
r consecutive TP ranks (consecutive global ranks) times s consecutive stages. Generation TP shard j of a
column-parallel tensor is training TP shards j·r … j·r + r − 1 concatenated, and generation stage k holds the
layers of training stages k·s … k·s + s − 1, so a training rank's shard is a sub-shard of its generation shard:
the all-gather inside the micro-DP group is all the communication resharding needs, and the local training shard
is one of its pieces in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["GenCoord", "HybridLayout", "TrainCoord"]


class TrainCoord(NamedTuple):
    """Where a rank sits in the training mesh."""

    pp: int
    dp: int
    tp: int


class GenCoord(NamedTuple):
    """Where a rank sits in the generation mesh (p_g, t_g, d_g, d)."""

    pp: int  # generation pipeline stage, 0 … p_g − 1
    tp: int  # generation tensor-parallel rank, 0 … t_g − 1
    micro: int  # index inside its micro-DP group, 0 … d_g − 1
    dp: int  # generation data-parallel replica, 0 … d·d_g − 1 (= training dp · d_g + micro)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class HybridLayout:
    """Training (p, t, d) and generation (p_g, t_g) parallel sizes of one actor, validated."""

    train_pp: int
    """p: training pipeline stages; transformer layers split evenly and contiguously over them."""
    train_tp: int
    """t: training tensor-parallel size."""
    train_dp: int
    """d: training data-parallel size; generation keeps these replicas and splits each d_g ways."""
    gen_pp: int = 1
    """p_g: generation pipeline stages; must divide train_pp."""
    gen_tp: int = 1
    """t_g: generation tensor-parallel size; must divide train_tp."""

    def __post_init__(self) -> None:
        for name in ("train_pp", "train_tp", "train_dp", "gen_pp", "gen_tp"):
            _positive(name, getattr(self, name))
        if self.gen_tp > self.train_tp or self.train_tp % self.gen_tp:
            raise ValueError(
                f"gen_tp={self.gen_tp} must divide train_tp={self.train_tp}: a generation TP shard is built from "
                f"whole training TP shards; choose gen_tp among {_divisors(self.train_tp)}"
            )
        if self.gen_pp > self.train_pp or self.train_pp % self.gen_pp:
            raise ValueError(
                f"gen_pp={self.gen_pp} must divide train_pp={self.train_pp}: a generation stage is built from whole "
                f"training stages; choose gen_pp among {_divisors(self.train_pp)}"
            )

    # ---- sizes -------------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.train_pp * self.train_tp * self.train_dp

    @property
    def tp_ratio(self) -> int:
        """r = t / t_g: training TP shards per generation TP shard."""
        return self.train_tp // self.gen_tp

    @property
    def pp_ratio(self) -> int:
        """s = p / p_g: training stages per generation stage."""
        return self.train_pp // self.gen_pp

    @property
    def micro_dp(self) -> int:
        """d_g = p·t / (p_g·t_g): ranks of one training replica that become separate generation replicas."""
        return self.tp_ratio * self.pp_ratio

    @property
    def gen_dp(self) -> int:
        """Generation data-parallel size d·d_g."""
        return self.train_dp * self.micro_dp

    # ---- coordinates -------------------------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks ({self.describe()})")

    def train_coord(self, rank: int) -> TrainCoord:
        self._check_rank(rank)
        t, d = self.train_tp, self.train_dp
        return TrainCoord(pp=rank // (t * d), dp=(rank // t) % d, tp=rank % t)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The training rank at (pp, dp, tp)."""
        if not (0 <= pp < self.train_pp and 0 <= dp < self.train_dp and 0 <= tp < self.train_tp):
            raise ValueError(f"({pp=}, {dp=}, {tp=}) is outside {self.describe()}")
        return (pp * self.train_dp + dp) * self.train_tp + tp

    def gen_coord(self, rank: int) -> GenCoord:
        c = self.train_coord(rank)
        r, s = self.tp_ratio, self.pp_ratio
        micro = (c.pp % s) * r + c.tp % r
        return GenCoord(pp=c.pp // s, tp=c.tp // r, micro=micro, dp=c.dp * self.micro_dp + micro)

    # ---- groups (lists of global ranks, in a fixed order every rank agrees on) ---------------------------------

    def micro_dp_group(self, rank: int) -> tuple[int, ...]:
        """The d_g ranks whose training shards tile this rank's generation shard, ordered by micro-DP index."""
        c, g = self.train_coord(rank), self.gen_coord(rank)
        r, s = self.tp_ratio, self.pp_ratio
        return tuple(self.rank_of(g.pp * s + i, c.dp, g.tp * r + j) for i in range(s) for j in range(r))

    def micro_dp_groups(self) -> list[tuple[int, ...]]:
        """Every micro-DP group, each once, in ascending order of its first rank."""
        return _unique_groups(self.micro_dp_group(rank) for rank in range(self.world_size))

    def stage_peers(self, rank: int) -> tuple[int, ...]:
        """Ranks of this rank's micro-DP group with its training TP rank, one per training stage of the block.

        TP-replicated tensors (norms) are exchanged only over these, so a rank receives each missing stage's
        replicated tensors exactly once. Equal to (rank,) when p_g = p.
        """
        c = self.train_coord(rank)
        s, first = self.pp_ratio, self.gen_coord(rank).pp * self.pp_ratio
        return tuple(self.rank_of(first + i, c.dp, c.tp) for i in range(s))

    def stage_peer_groups(self) -> list[tuple[int, ...]]:
        return _unique_groups(self.stage_peers(rank) for rank in range(self.world_size))

    def gen_tp_group(self, rank: int) -> tuple[int, ...]:
        """The t_g ranks of this rank's generation TP group (training TP ranks at stride t/t_g)."""
        c = self.train_coord(rank)
        r = self.tp_ratio
        return tuple(self.rank_of(c.pp, c.dp, c.tp % r + j * r) for j in range(self.gen_tp))

    def gen_tp_groups(self) -> list[tuple[int, ...]]:
        return _unique_groups(self.gen_tp_group(rank) for rank in range(self.world_size))

    def gen_pp_group(self, rank: int) -> tuple[int, ...]:
        """The p_g ranks of this rank's generation pipeline (training stages at stride p/p_g)."""
        c = self.train_coord(rank)
        s = self.pp_ratio
        return tuple(self.rank_of(c.pp % s + k * s, c.dp, c.tp) for k in range(self.gen_pp))

    def gen_pp_groups(self) -> list[tuple[int, ...]]:
        return _unique_groups(self.gen_pp_group(rank) for rank in range(self.world_size))

    def model_parallel_group(self, rank: int) -> tuple[int, ...]:
        """The t·p ranks of this rank's training replica (the TP×PP group), ordered by (pp, tp)."""
        dp = self.train_coord(rank).dp
        return tuple(self.rank_of(pp, dp, tp) for pp in range(self.train_pp) for tp in range(self.train_tp))

    def model_parallel_groups(self) -> list[tuple[int, ...]]:
        return _unique_groups(self.model_parallel_group(rank) for rank in range(self.world_size))

    def train_pp_group(self, rank: int) -> tuple[int, ...]:
        """The p ranks holding the stages of one (dp, tp) column of the training mesh, ordered by stage."""
        c = self.train_coord(rank)
        return tuple(self.rank_of(pp, c.dp, c.tp) for pp in range(self.train_pp))

    def train_pp_groups(self) -> list[tuple[int, ...]]:
        return _unique_groups(self.train_pp_group(rank) for rank in range(self.world_size))

    def describe(self) -> str:
        return (
            f"train (p={self.train_pp}, t={self.train_tp}, d={self.train_dp}) -> "
            f"generate (p_g={self.gen_pp}, t_g={self.gen_tp}, d_g={self.micro_dp}, d={self.train_dp})"
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _unique_groups(groups) -> list[tuple[int, ...]]:
    return sorted(set(groups))
