"""Train → generate → train resharding of the 3D-HybridEngine (HybridFlow §5.4) and the two baselines it replaces.

`Resharder(method="micro-dp")` is the engine: going to generation, each micro-DP group (the d_g ranks of one
training replica whose shards tile one generation shard, see layout.py) all-gathers its members' training shards,
every group at once, with the local training shard passed in place as the local rank's piece, so the generation
shard is the training memory plus the d_g − 1 pieces received; going back to training drops those pieces. The
baselines ("all", "tp-pp") gather the whole model into a fresh buffer, for measurement. Each transition is counted
per rank (`ReshardStats`) from the tensors handed to the collectives, never from the formulas, and
`GenerationShard.named_weights` hands the result to a generation engine.

How the all-gather is done and why, the exact bytes each method receives, the accounting, the weight formats, and
how bad input fails: docs/engines.md (The 3D-HybridEngine).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist

from engines.hybrid.layout import HybridLayout
from engines.hybrid.limits import GenerationEngineLimits
from engines.hybrid.shards import (
    ModelGeometry,
    TrainShard,
    WeightFormat,
    check_model_fits,
    generation_pieces,
    generation_tensors,
    shard_layout,
    stage_layers,
)

__all__ = ["GenerationShard", "Method", "ReshardGroups", "ReshardStats", "Resharder"]

Method = Literal["micro-dp", "tp-pp", "all"]
METHODS: tuple[Method, ...] = get_args(Method)


@dataclass
class ReshardGroups:
    """This rank's process groups for the resharding methods; `create` is collective over the whole world."""

    layout: HybridLayout
    rank: int
    micro_dp: dist.ProcessGroup | None = None
    """This rank's micro-DP group; None when d_g = 1 (nothing to gather)."""
    stage_peers: dist.ProcessGroup | None = None
    """Same-TP-rank peers across the stages of this rank's generation stage; None when p_g = p."""
    model_parallel: dist.ProcessGroup | None = None
    """TP×PP group of this rank's training replica (baseline "tp-pp")."""
    train_pp: dist.ProcessGroup | None = None
    """Training pipeline column (dp, tp) (replicated tensors of the baselines); None when p = 1."""
    world: dist.ProcessGroup | None = None
    methods: tuple[Method, ...] = field(default=())
    global_ranks: tuple[int, ...] = ()
    """torch.distributed rank of each layout rank (the identity when the layout is the whole world)."""

    @staticmethod
    def needed(layout: HybridLayout, methods: Iterable[Method] = ("micro-dp",)) -> list[tuple[int, ...]]:
        """Every group (layout ranks, singletons left out) `methods` use, in creation order: what a runtime that
        creates process groups up front (flowactors' `Worker.subgroups`) must make."""
        needed: list[tuple[int, ...]] = []
        methods = tuple(methods)
        if "micro-dp" in methods:
            needed += layout.micro_dp_groups() + layout.stage_peer_groups()
        if "tp-pp" in methods:
            needed += layout.model_parallel_groups()
        if "tp-pp" in methods or "all" in methods:
            needed += layout.train_pp_groups()
        if "all" in methods:
            needed.append(tuple(range(layout.world_size)))
        return [g for g in dict.fromkeys(needed) if len(g) > 1]

    @classmethod
    def create(
        cls,
        layout: HybridLayout,
        methods: Iterable[Method] = ("micro-dp",),
        timeout: timedelta = timedelta(minutes=5),
        *,
        global_ranks: Iterable[int] | None = None,
        existing: Mapping[tuple[int, ...], dist.ProcessGroup] | None = None,
    ) -> ReshardGroups:
        """The groups `methods` need. Without `existing` the layout is the whole world and this creates them:
        collective over the world, every rank calling with the same arguments (torch creates a group only when all
        ranks call new_group for it, in the same order). With `existing` (this rank's groups, keyed by their layout
        ranks, as listed by `needed`) and `global_ranks` (the world rank of each layout rank), for a layout inside
        a larger world, nothing is created."""
        methods = tuple(methods)
        for method in methods:
            _check_method(method)
        ranks = _check_world(layout, global_ranks)
        rank = ranks.index(dist.get_rank())
        groups = cls(layout=layout, rank=rank, methods=methods, global_ranks=ranks)

        def make(all_groups: list[tuple[int, ...]]) -> dist.ProcessGroup | None:
            mine = None
            for members in all_groups:
                if len(members) == 1:
                    continue  # every rank skips the same singletons
                if existing is not None:
                    if rank in members:
                        if members not in existing:
                            raise ValueError(
                                f"process group {members} (layout ranks) was not created; create every "
                                f"group of ReshardGroups.needed(layout, {methods})"
                            )
                        mine = existing[members]
                    continue
                group = dist.new_group([ranks[m] for m in members], timeout=timeout)
                if rank in members:
                    mine = group
            return mine

        if "micro-dp" in methods:
            groups.micro_dp = make(layout.micro_dp_groups())
            groups.stage_peers = make(layout.stage_peer_groups())
        if "tp-pp" in methods:
            groups.model_parallel = make(layout.model_parallel_groups())
        if "tp-pp" in methods or "all" in methods:
            groups.train_pp = make(layout.train_pp_groups())
        if "all" in methods:
            groups.world = make([tuple(range(layout.world_size))]) if existing is not None else dist.group.WORLD
        return groups


@dataclass(frozen=True)
class ReshardStats:
    """One rank's figures for one train → generate transition (see the module docstring for definitions)."""

    method: Method
    received_bytes: int
    gen_param_bytes: int
    fresh_param_bytes: int
    redundant_bytes: int
    train_param_bytes: int
    seconds: float

    @property
    def resident_param_bytes(self) -> int:
        return self.train_param_bytes + self.fresh_param_bytes


class GenerationShard:
    """The parameters one rank generates with: gathered payload pieces, read out tensor by tensor.

    For method "micro-dp" this is generation shard (gen_stage, gen_tp_rank) of the layout; for the baselines it
    is the whole model. Pieces of the local training shard are the training memory itself. After
    `Resharder.to_training` the shard is released and reading it raises.
    """

    def __init__(
        self,
        geometry: ModelGeometry,
        layout: HybridLayout,
        gen_stage: int,
        gen_tp_rank: int,
        gen_pp: int,
        gen_tp: int,
        sharded: dict[tuple[int, int], torch.Tensor],
        replicated: dict[int, torch.Tensor],
    ) -> None:
        self.geometry: ModelGeometry = geometry
        self.layout: HybridLayout = layout
        self.gen_stage: int = gen_stage
        self.gen_tp_rank: int = gen_tp_rank
        self.gen_pp: int = gen_pp
        self.gen_tp: int = gen_tp
        self.layers: range = stage_layers(geometry.num_layers, gen_pp, gen_stage)
        self._sharded: dict[tuple[int, int], torch.Tensor] | None = sharded
        self._replicated: dict[int, torch.Tensor] | None = replicated

    @property
    def released(self) -> bool:
        return self._sharded is None

    def named_weights(self, fmt: WeightFormat = "hf") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in model order, with global HF layer indices. What is a single piece is a view of it;
        a tensor merged from r = t/t_g training sub-shards is concatenated when yielded, so streaming this into an
        engine (vLLM ``reload_weights(weights_iterator=...)``, ``param.copy_`` into a TP transformers model) holds
        at most one merged tensor at a time."""
        if self._sharded is None:
            raise RuntimeError("this generation shard was released by to_training(); call to_generation() again")
        return generation_tensors(
            self.geometry,
            self.layout,
            self.gen_stage,
            self.gen_tp_rank,
            self._sharded,
            self._replicated,
            fmt,
            gen_pp=self.gen_pp,
            gen_tp=self.gen_tp,
        )

    def named_pieces(self) -> Iterator[tuple[str, list[torch.Tensor], int | None]]:
        """(HF name, its r sub-shards, split dim) in model order, nothing copied: for an engine that computes on
        the sub-shards where they lie (engines.hybrid.actor), so the generation shard costs no memory beyond the
        gathered pieces."""
        if self._sharded is None:
            raise RuntimeError("this generation shard was released by to_training(); call to_generation() again")
        return generation_pieces(
            self.geometry,
            self.layout,
            self.gen_stage,
            self.gen_tp_rank,
            self._sharded,
            self._replicated,
            gen_pp=self.gen_pp,
            gen_tp=self.gen_tp,
        )

    def state_dict(self, fmt: WeightFormat = "hf") -> dict[str, torch.Tensor]:
        """All tensors at once (merged tensors are copies; single pieces stay views)."""
        return dict(self.named_weights(fmt))

    def pieces(self) -> list[torch.Tensor]:
        """The gathered 1-D payload buffers this shard is read from (the local ones are training memory)."""
        if self._sharded is None:
            return []
        return [*self._sharded.values(), *self._replicated.values()]

    def _release(self) -> None:
        self._sharded = self._replicated = None


class Resharder:
    """Moves one rank's actor weights between the training and the generation layout.

    Build it on every rank of the world with the same layout; `to_generation` and `to_training` are collective
    (SPMD: every rank calls them in the same order).
    """

    def __init__(
        self,
        geometry: ModelGeometry,
        layout: HybridLayout,
        groups: ReshardGroups,
        *,
        method: Method = "micro-dp",
        engine: GenerationEngineLimits | None = None,
    ) -> None:
        _check_method(method)
        check_model_fits(geometry, layout)
        if engine is not None and method == "micro-dp":
            engine.check(geometry, layout)
        _check_world(layout, groups.global_ranks)
        if groups.layout != layout or method not in groups.methods:
            raise ValueError(
                f"groups were created for {groups.layout.describe()} and methods {groups.methods}; "
                f"create them with ReshardGroups.create(layout, methods=[..., {method!r}])"
            )
        self.geometry, self.layout, self.groups, self.method = geometry, layout, groups, method
        self.rank = groups.rank
        self.coord = layout.train_coord(self.rank)
        self.train_layout = shard_layout(geometry, layout.train_pp, self.coord.pp, layout.train_tp)
        self.stats: ReshardStats | None = None
        self._generation: GenerationShard | None = None

    @property
    def in_generation(self) -> bool:
        return self._generation is not None

    @property
    def generation(self) -> GenerationShard | None:
        """The current generation shard (None in training)."""
        return self._generation

    def to_generation(self, train: TrainShard) -> GenerationShard:
        """All-gather the generation shard; the local piece is `train.flat` itself. Collective."""
        start = time.perf_counter()
        problem = self._check_train(train)
        main_group = {"micro-dp": self.groups.micro_dp, "tp-pp": self.groups.model_parallel, "all": self.groups.world}[
            self.method
        ]
        _agree(main_group, problem)
        if self.method == "micro-dp":
            gen, received = self._gather_micro_dp(train)
        else:
            gen, received = self._gather_full(train)
        self.stats = self._stats(train, gen, received, time.perf_counter() - start)
        self._generation = gen
        return gen

    def to_training(self) -> None:
        """Free the generation-only pieces; the training shard was never touched. Local, no communication."""
        if self._generation is None:
            raise RuntimeError("to_training() called while not in generation; call to_generation() first")
        self._generation._release()
        self._generation = None

    # ---- the engine ----------------------------------------------------------------------------------------

    def _gather_micro_dp(self, train: TrainShard) -> tuple[GenerationShard, int]:
        layout, p, t = self.layout, self.layout.train_pp, self.layout.train_tp
        sharded: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[tuple[torch.Tensor, int]] = []
        for member in layout.micro_dp_group(self.rank):
            c = layout.train_coord(member)
            piece = (
                train.sharded
                if member == self.rank
                else self._empty(shard_layout(self.geometry, p, c.pp, t).sharded_numel, train)
            )
            sharded[(c.pp, c.tp)] = piece
            sends.append((piece, member))
        replicated: dict[int, torch.Tensor] = {}
        peer_sends: list[tuple[torch.Tensor, int]] = []
        for peer in layout.stage_peers(self.rank):
            pp = layout.train_coord(peer).pp
            piece = (
                train.replicated
                if peer == self.rank
                else self._empty(shard_layout(self.geometry, p, pp, t).replicated_numel, train)
            )
            replicated[pp] = piece
            peer_sends.append((piece, peer))
        received = _broadcast_all(
            [(self.groups.micro_dp, sends), (self.groups.stage_peers, peer_sends)], self.rank, self.groups.global_ranks
        )
        g = layout.gen_coord(self.rank)
        gen = GenerationShard(self.geometry, layout, g.pp, g.tp, layout.gen_pp, layout.gen_tp, sharded, replicated)
        return gen, received

    # ---- the baselines: the whole model into a fresh buffer ------------------------------------------------

    def _gather_full(self, train: TrainShard) -> tuple[GenerationShard, int]:
        layout, p, t, d = self.layout, self.layout.train_pp, self.layout.train_tp, self.layout.train_dp
        specs = [shard_layout(self.geometry, p, pp, t) for pp in range(p)]
        full = self._empty(self.geometry.numel, train)  # the generation copy, allocated whole
        sharded, replicated, offset = {}, {}, 0
        for pp in range(p):
            for tp in range(t):
                sharded[(pp, tp)] = full[offset : offset + specs[pp].sharded_numel]
                offset += specs[pp].sharded_numel
        for pp in range(p):
            replicated[pp] = full[offset : offset + specs[pp].replicated_numel]
            offset += specs[pp].replicated_numel
        me = self.coord
        if self.method == "tp-pp":
            sharded[(me.pp, me.tp)].copy_(train.sharded)
            sends = [
                (sharded[(c.pp, c.tp)], r)
                for r in layout.model_parallel_group(self.rank)
                for c in [layout.train_coord(r)]
            ]
            main = self.groups.model_parallel
        else:  # "all": rank (pp, dp, tp) contributes part dp of shard (pp, tp)
            torch.tensor_split(sharded[(me.pp, me.tp)], d)[me.dp].copy_(torch.tensor_split(train.sharded, d)[me.dp])
            sends = [
                (torch.tensor_split(sharded[(c.pp, c.tp)], d)[c.dp], r)
                for r in range(layout.world_size)
                for c in [layout.train_coord(r)]
            ]
            main = self.groups.world
        replicated[me.pp].copy_(train.replicated)
        column = layout.train_pp_group(self.rank)
        peer_sends = [(replicated[layout.train_coord(r).pp], r) for r in column]
        received = _broadcast_all(
            [(main, sends), (self.groups.train_pp, peer_sends)], self.rank, self.groups.global_ranks
        )
        return GenerationShard(self.geometry, layout, 0, 0, 1, 1, sharded, replicated), received

    # ---- helpers -------------------------------------------------------------------------------------------

    @staticmethod
    def _empty(numel: int, like: TrainShard) -> torch.Tensor:
        return torch.empty(numel, dtype=like.flat.dtype, device=like.flat.device)

    def _check_train(self, train: TrainShard) -> str | None:
        if self._generation is not None:
            return f"rank {self.rank}: to_generation() called twice; call to_training() in between"
        if train.layout != self.train_layout:
            return (
                f"rank {self.rank}: the training shard is for stage {train.layout.stage} at TP size "
                f"{train.layout.tp_size}, this rank holds stage {self.coord.pp} at TP size {self.layout.train_tp}"
            )
        if train.flat.dim() != 1 or not train.flat.is_contiguous() or train.flat.numel() != train.layout.numel:
            return f"rank {self.rank}: TrainShard.flat must be one contiguous 1-D buffer of {train.layout.numel}"
        try:
            train.check_views()
        except ValueError as err:
            return f"rank {self.rank}: {err}"
        return None

    def _stats(self, train: TrainShard, gen: GenerationShard, received: int, seconds: float) -> ReshardStats:
        base = train.flat.untyped_storage().data_ptr()
        pieces = gen.pieces()
        gen_bytes = sum(piece.numel() * piece.element_size() for piece in pieces)
        aliased = sum(
            piece.numel() * piece.element_size() for piece in pieces if piece.untyped_storage().data_ptr() == base
        )
        # The generation set always holds the local shard's values (its own stage's replicated payload and its
        # own TP shard); whatever of them is not the training memory itself is a second copy.
        redundant = train.nbytes - aliased
        return ReshardStats(
            method=self.method,
            received_bytes=received,
            gen_param_bytes=gen_bytes,
            fresh_param_bytes=gen_bytes - aliased,
            redundant_bytes=redundant,
            train_param_bytes=train.nbytes,
            seconds=seconds,
        )


def _broadcast_all(
    batches: list[tuple[dist.ProcessGroup | None, list[tuple[torch.Tensor, int]]]],
    rank: int,
    global_ranks: tuple[int, ...],
) -> int:
    """Broadcast each (tensor, source layout rank) in its group, all in flight at once; return the bytes this rank
    received."""
    works, received = [], 0
    for group, sends in batches:
        if group is None:
            continue  # a group of one: the rank's own piece is all there is
        for tensor, src in sends:
            works.append(dist.broadcast(tensor, src=global_ranks[src], group=group, async_op=True))
            if src != rank:
                received += tensor.numel() * tensor.element_size()
    for work in works:
        work.wait()
    return received


def _agree(group: dist.ProcessGroup | None, problem: str | None) -> None:
    """Raise on every rank of `group` if any rank has a problem, before the group moves any payload."""
    if group is not None:
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if problem is None and flag.item():
            problem = (
                f"rank {dist.get_rank()}: another rank of its resharding group rejected its training shard "
                f"(its own error says why); nothing was exchanged"
            )
    if problem is not None:
        raise ValueError(problem)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown resharding method {method!r}; choose one of {', '.join(METHODS)}")


def _check_world(layout: HybridLayout, global_ranks: Iterable[int] | None) -> tuple[int, ...]:
    """The world rank of each layout rank, after checking they exist and include this process."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group before resharding")
    if global_ranks is None or not tuple(global_ranks):
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"{layout.describe()} needs {layout.world_size} ranks, the process group has {dist.get_world_size()}"
            )
        return tuple(range(layout.world_size))
    ranks = tuple(global_ranks)
    if len(ranks) != layout.world_size or len(set(ranks)) != len(ranks):
        raise ValueError(f"{layout.describe()} needs {layout.world_size} distinct ranks, got global_ranks={ranks}")
    if dist.get_rank() not in ranks:
        raise ValueError(f"world rank {dist.get_rank()} is not one of the layout's global_ranks {ranks}")
    return ranks
