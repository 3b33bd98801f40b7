"""The actor's endpoints of asynchronous RL's weight sync (algorithms.rollout.asynchronous drives them): the
trainer's policy out of the trainer's ranks, into a rollout replica's (docs/asynchronous.md), and the replica's
partial rollouts (engines.rollout.partial: sequences in flight across versions).

Two paths. `send_policy` / `receive_policy` (sharded): over a link (flowactors.Controller.link: one process group
over the trainer's and the replicas' ranks, formed once), every trainer rank broadcasts only the blocks of the
parameters it holds (its FSDP2 / TP shard; of replicated parameters, its round-robin share) to the replica ranks,
bucket by bucket (`bucket_bytes`), two buckets in flight; a replica rank copies each block into its whole copy as
it arrives. No rank holds more than two buckets beyond its model, and with `changed_only` only the parameters the
trainer trains travel (LoRA: the adapters). `policy_weights` / `load_policy` (rank 0): the whole policy gathered
on trainer rank 0 and sent from there to every replica rank, kept for comparison.

A mixin of engines.roles.ActorWorker: it uses the worker's training engine, rank and weights version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engines.rollout.partial import PartialRollouts
from flowactors import MESH, ONE_TO_ALL, RANK_ZERO, Batch, endpoint, link

__all__ = ["ReplicaEndpoints", "Piece", "SyncPlan", "plan_sync", "local_block"]

_ALIGN = 16
"""Byte alignment of each block in a bucket's buffer (so a block's bytes can be viewed as its dtype)."""


@dataclass(frozen=True)
class Piece:
    """One block of one parameter that one trainer rank sends: `shape` at `offset` in the whole tensor."""

    name: str
    source: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class SyncPlan:
    """The buckets of a sync: for each, each source's pieces with their byte offsets in that source's buffer."""

    buckets: list[dict[int, list[tuple[Piece, int]]]]
    """bucket → source link rank → [(piece, byte offset)]."""

    def sizes(self, b: int) -> dict[int, int]:
        """Bytes of each source's buffer in bucket `b`."""
        return {s: _aligned(p[-1][1] + p[-1][0].nbytes) for s, p in self.buckets[b].items()}

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for bucket in self.buckets for pieces in bucket.values() for p, _ in pieces)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def local_block(param: torch.Tensor, rank: int, world: int, index: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """What of `param` (the `index`-th parameter) this trainer rank sends, and where it sits in the whole tensor:
    a DTensor's local shard, unless another rank holds the same data (replicated mesh dimensions: the rank at
    coordinate 0 sends); a plain tensor, which every rank holds, from rank `index % world`. None: nothing."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        coords = param.device_mesh.get_coordinate()
        if coords is None or any(pl.is_replicate() and c != 0 for pl, c in zip(param.placements, coords)):
            return None
        local = _local(param)
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return (local, tuple(int(o) for o in offset)) if local.numel() else None
    if index % world != rank:
        return None
    return param, (0,) * param.dim()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, a plain tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def plan_sync(pieces: list[Piece], order: list[str], bucket_bytes: int) -> SyncPlan:
    """Pieces (of every source) into buckets of about `bucket_bytes`, in parameter order, each source's pieces of a
    bucket packed into one aligned buffer; every rank computes the same plan from the same pieces."""
    rank_of = {name: i for i, name in enumerate(order)}
    ordered = sorted(pieces, key=lambda p: (rank_of[p.name], p.source, p.offset))
    buckets: list[dict[int, list[tuple[Piece, int]]]] = []
    filled = bucket_bytes
    for piece in ordered:
        if filled + piece.nbytes > bucket_bytes and filled > 0:
            buckets.append({})
            filled = 0
        bucket = buckets[-1]
        mine = bucket.setdefault(piece.source, [])
        at = _aligned(mine[-1][1] + mine[-1][0].nbytes) if mine else 0
        mine.append((piece, at))
        filled += piece.nbytes
    return SyncPlan(buckets)


class ReplicaEndpoints:
    """send_policy on the trainer with receive_policy on the replicas (sharded); or policy_weights on the trainer
    into load_policy on a replica (rank 0)."""

    policy_version: int | None = None
    """The trainer's policy version this replica's weights are (load_policy); None on the trainer itself."""

    @endpoint(protocol=RANK_ZERO)
    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy (Hugging Face names, unsharded, on CPU) for rollout replicas: every rank takes part in
        the gather, rank 0's copy is the call's result, so it travels from that worker to the replicas."""
        self._end_receiving()
        state = self.engine.full_state_dict()
        return state if self.rank == 0 else {}

    @endpoint(protocol=ONE_TO_ALL)
    def load_policy(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Become a rollout replica of the trainer's policy `version` (asynchronous RL): load `weights`
        (`policy_weights` of the trainer, any layout) into this rank's whole copy; the generation engine takes
        them at the next generate. Returns the bytes received and the seconds it took."""
        t0 = time.perf_counter()
        if self.hybrid is not None:
            raise ValueError("a rollout replica generates from its own weights: build it without rollout_tp")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # whole tensors in, this rank's layout out (plain, replicated or sharded parameters alike); every rank
        # of the replica group calls this, so a layout that distributes tensors may use collectives
        set_model_state_dict(self.engine.model, weights, options=StateDictOptions(full_state_dict=True))
        self.weights_version += 1
        self.policy_version = int(version)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in weights.values())),
            "seconds": time.perf_counter() - t0,
        }

    # -- the sharded path ---------------------------------------------------------------------------------------
    def _sync_plan(self, link_name: str, changed_only: bool, bucket_bytes: int) -> SyncPlan:
        """The sync's plan, agreed once per link and kind (every member gathers every trainer rank's pieces)."""
        import torch.distributed as dist

        plans = self.__dict__.setdefault("_sync_plans", {})
        key = (link_name, changed_only, bucket_bytes)
        if key not in plans:
            ctx = link(link_name)
            mine: list[Piece] = []
            order: list[str] = []
            if self.group_name == next(iter(ctx.groups)):  # the link's first group sends: a trainer rank
                ranks = ctx.groups[self.group_name]
                params = list(self.engine.model.named_parameters())
                order = [n for n, _ in params]
                for i, (name, p) in enumerate(params):
                    if changed_only and not p.requires_grad:
                        continue
                    block = local_block(p, self.rank, self.world_size, i)
                    if block is not None:
                        local, offset = block
                        dtype = str(local.dtype).removeprefix("torch.")
                        mine.append(Piece(name, ranks[self.rank], offset, tuple(local.shape), dtype))
            gathered: list = [None] * dist.get_world_size(ctx.process_group)
            dist.all_gather_object(gathered, (order, mine), group=ctx.process_group)
            order = next(o for o, _ in gathered if o)
            plans[key] = plan_sync([p for _, ps in gathered for p in ps], order, bucket_bytes)
        return plans[key]

    @endpoint(protocol=ONE_TO_ALL)
    def send_policy(self, link_name: str, bucket_bytes: int, changed_only: bool = False) -> dict[str, float]:
        """Trainer side of a sharded sync (every rank; the replicas run `receive_policy` with the same
        arguments at the same time): broadcast this rank's blocks, bucket by bucket. Returns the bytes of the blocks
        this rank sent and the most bucket bytes it held at once."""
        import torch.distributed as dist

        self._end_receiving()
        t0 = time.perf_counter()
        ctx = link(link_name)
        plan = self._sync_plan(link_name, changed_only, bucket_bytes)
        params = dict(self.engine.model.named_parameters())
        replicas = [r for g, ranks in ctx.groups.items() if g != self.group_name for r in ranks]
        group = ctx.subgroups[(ctx.rank, *replicas)]
        in_flight: list[tuple[object, torch.Tensor]] = []
        sent = peak = 0
        with torch.no_grad():
            for b, bucket in enumerate(plan.buckets):
                pieces = bucket.get(ctx.rank)
                if not pieces:
                    continue
                buf = torch.empty(plan.sizes(b)[ctx.rank], dtype=torch.uint8)
                for piece, at in pieces:
                    data = _local(params[piece.name])
                    buf[at : at + piece.nbytes].view(data.dtype).view(piece.shape).copy_(data)
                while len(in_flight) >= 2:
                    in_flight.pop(0)[0].wait()
                in_flight.append((dist.broadcast(buf, group_src=0, group=group, async_op=True), buf))
                peak = max(peak, sum(x[1].numel() for x in in_flight))
                sent += sum(piece.nbytes for piece, _ in pieces)
            for work, _ in in_flight:
                work.wait()
        return {"bytes": float(sent), "peak_bucket_bytes": float(peak), "seconds": time.perf_counter() - t0}

    @endpoint(protocol=ONE_TO_ALL)
    def receive_policy(
        self, link_name: str, bucket_bytes: int, version: int, changed_only: bool = False
    ) -> dict[str, float]:
        """Replica side of a sharded sync (`send_policy` on the trainer at the same time): receive each bucket
        from every trainer rank that has blocks in it, two buckets in flight, and copy the blocks into this
        rank's whole copy. An engine that holds its own weights (vLLM) is fed as the buckets arrive: one reload
        whose weights iterator yields each parameter once its last block is in (then, from the whole copy, those
        that did not travel), so loading overlaps receiving and the next generate reloads nothing. With LoRA
        (vLLM takes the adapters merged) the engine reloads the merged weights at the next generate instead.
        Returns the bytes received and loaded, the seconds it took and the most bucket bytes held at once."""
        t0 = time.perf_counter()
        if self.hybrid is not None:
            raise ValueError("a rollout replica generates from its own weights: build it without rollout_tp")
        plan = self._sync_plan(link_name, changed_only, bucket_bytes)
        params = dict(self.engine.model.named_parameters())
        stats = {"bytes": 0.0, "loaded_bytes": 0.0, "peak_bucket_bytes": 0.0}
        buckets = self._receive_buckets(link(link_name), plan, params, stats)
        if self.generator.holds_weights and getattr(self.engine, "lora_scale", None) is None:

            def stream():
                sent: set[str] = set()
                for done in buckets:
                    for name in done:
                        sent.add(name)
                        stats["loaded_bytes"] += params[name].numel() * params[name].element_size()
                        yield name, params[name].detach()
                for name, tensor in self.engine.model.state_dict().items():  # what did not travel
                    if name not in sent:
                        stats["loaded_bytes"] += tensor.numel() * tensor.element_size()
                        yield name, tensor

            self.generator.load_weights(stream())
            self._loaded_version = self.weights_version + 1
        else:
            for _ in buckets:
                pass
        self.weights_version += 1
        self.policy_version = int(version)
        return {**stats, "seconds": time.perf_counter() - t0}

    def _receive_buckets(self, ctx, plan: SyncPlan, params: dict[str, torch.Tensor], stats: dict[str, float]):
        """Receive the plan's buckets into `params`, two in flight; yields, after each bucket, the parameters
        whose last block it held."""
        import torch.distributed as dist

        replicas = ctx.groups[self.group_name]
        posted: list[tuple[int, list[tuple[object, int, torch.Tensor]]]] = []
        missing: dict[str, int] = {}  # parameter -> bytes still to arrive
        for bucket in plan.buckets:
            for pieces in bucket.values():
                for piece, _ in pieces:
                    missing[piece.name] = missing.get(piece.name, 0) + piece.nbytes

        def post(b: int) -> None:
            works = []
            for source, size in plan.sizes(b).items():
                buf = torch.empty(size, dtype=torch.uint8)
                group = ctx.subgroups[(source, *replicas)]
                works.append((dist.broadcast(buf, group_src=0, group=group, async_op=True), source, buf))
            posted.append((b, works))

        with torch.no_grad():
            for b in range(min(2, len(plan.buckets))):
                post(b)
            while posted:
                held = sum(buf.numel() for _, works in posted for _, _, buf in works)
                stats["peak_bucket_bytes"] = max(stats["peak_bucket_bytes"], float(held))
                b, works = posted.pop(0)
                done = []
                for work, source, buf in works:
                    work.wait()
                    for piece, at in plan.buckets[b][source]:
                        target = params[piece.name]
                        block = buf[at : at + piece.nbytes].view(getattr(torch, piece.dtype)).view(piece.shape)
                        target[tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.shape))].copy_(block)
                        stats["bytes"] += piece.nbytes
                        missing[piece.name] -= piece.nbytes
                        if not missing[piece.name]:
                            done.append(piece.name)
                del works
                if b + 2 < len(plan.buckets):
                    post(b + 2)
                yield done

    # -- partial rollouts ---------------------------------------------------------------------------------------
    @endpoint(protocol=MESH)
    def generate_partial(self, prompts: Batch, groups: int, segment: int) -> Batch:
        """Partial rollouts (engines.rollout.partial): admit this rank's share of a step's fresh prompt groups,
        decode everything this rank holds in segments of `segment` tokens under its current policy version until
        its share of `groups` whole groups has finished, and return those (their `group` numbered after the lower
        ranks'). Unfinished sequences stay, and continue under the next version."""
        if self.policy_version is None:
            raise ValueError("generate_partial runs on a rollout replica: load_policy or receive_policy first")
        if groups % self.world_size:
            raise ValueError(
                f"{groups} prompt groups per step cannot be shared by {self.world_size} replica ranks; use a "
                f"multiple of {self.world_size} prompts per step"
            )
        local = groups // self.world_size
        part = self._partial_rollouts()
        part.admit(prompts)
        if part.episodes is not None:  # multi-turn: a segment is a turn of every running episode
            out = part.run(
                lambda eps: part.episodes.advance(self._replica_model(), eps, self.sampling),
                self.policy_version,
                local,
                segment,
            )
        else:
            out = part.run(lambda b: self._generate(b, None), self.policy_version, local, segment)
        return Batch({**out.tensors, "group": out["group"] + self.rank * local}, out.rows, out.meta)

    @endpoint(protocol=ONE_TO_ALL)
    def partial_held(self) -> list[int]:
        """The prompt groups (uids) this rank's partial rollouts hold: the controller's ledger check."""
        return self._partial_rollouts().held()

    @endpoint(protocol=ONE_TO_ALL)
    def partial_state(self) -> dict:
        """What this rank's partial rollouts hold (for a checkpoint: `load_partial_state` restores it)."""
        return self._partial_rollouts().state_dict()

    @endpoint(protocol=ONE_TO_ALL)
    def load_partial_state(self, states: list[dict]) -> int:
        """Restore every rank's partial rollouts from `partial_state()`'s list (one per rank); returns how many
        unfinished sequences this rank holds again."""
        if len(states) != self.world_size:
            raise ValueError(
                f"the checkpoint holds partial rollouts of {len(states)} replica ranks, this replica group has "
                f"{self.world_size}; resume with the same async_rollout_slots"
            )
        part = self._partial_rollouts()
        part.load_state_dict(states[self.rank])
        return sum(not s.done for g in part.groups.values() for s in g)

    def _partial_rollouts(self) -> PartialRollouts:
        if "_partial" not in self.__dict__:
            episodes = self.generator if hasattr(self.generator, "advance") else None  # an EpisodeEngine
            self._partial = PartialRollouts(
                self.sampling, eos=self.generator.eos, pad=self.generator.pad, episodes=episodes
            )
        return self._partial

    def _replica_model(self):
        """What a replica's generator decodes with: None for an engine that holds its own weights (vLLM, after
        taking the latest), else the worker's model."""
        self._end_receiving()
        return self._generation_target()
