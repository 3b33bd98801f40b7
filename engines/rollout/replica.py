"""The actor's endpoints of asynchronous RL's weight sync (algorithms.rollout.asynchronous drives them): the
trainer's policy out of the trainer's ranks, into a rollout replica's (docs/asynchronous.md), and the replica's
partial rollouts (engines.rollout.partial: sequences in flight across versions).

Two paths. `send_policy` / `receive_policy` (sharded): over a link (flowactors.Controller.link: one process group
over the trainer's and the replicas' ranks, formed once), every trainer rank broadcasts only the blocks of the
parameters it holds (its FSDP2 / TP shard; of replicated parameters, its round-robin share) to the replica ranks
that hold them, bucket by bucket (`bucket_bytes`), two buckets in flight; a replica rank copies each block into its
weights as it arrives: its whole copy, or, for a replica with generation TP (a 3D-HybridEngine whose training and
generation TP sizes are equal), its TP shard, the only part of a split parameter it receives (`address` cuts each
trainer block to the replica layout's shards). No rank holds more than two buckets beyond its model, and with
`changed_only` only the parameters the trainer trains travel (LoRA: the adapters). `policy_weights` /
`load_policy` (rank 0): the whole policy gathered on trainer rank 0 and sent from there to every replica rank, kept
for comparison.

A mixin of engines.roles.ActorWorker: it uses the worker's training engine, rank and weights version.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from engines.rollout.decode_loop import DecodeLoop
from engines.rollout.partial import PartialRollouts
from flowactors import ALL_TO_ALL, MESH, ONE_TO_ALL, RANK_ZERO, Batch, Layout, endpoint, link

__all__ = [
    "ReplicaEndpoints",
    "between_segments",
    "Piece",
    "SyncPlan",
    "plan_sync",
    "address",
    "local_block",
    "sync_subgroups",
]


def between_segments(fn: Callable) -> Callable:
    """A replica endpoint that touches what streaming rollouts decode with (weights, held sequences): it runs
    between two of their segments (engines.rollout.decode_loop), or as it is when the replica does not stream."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with self._quiet():
            return fn(self, *args, **kwargs)

    return run


_ALIGN = 16
"""Byte alignment of each block in a bucket's buffer (so a block's bytes can be viewed as its dtype)."""

Region = tuple[tuple[int, ...], tuple[int, ...]]
"""(offset, shape) of a block in a whole tensor."""


@dataclass(frozen=True)
class Piece:
    """One block of one parameter that one trainer rank sends: `shape` at `offset` in the whole tensor, to the
    replica link ranks `dests` (those whose layout holds it; () before `address` decides)."""

    name: str
    source: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    dests: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class SyncPlan:
    """The buckets of a sync: for each, each (source, dests) buffer's pieces with their byte offsets in it."""

    buckets: list[dict[tuple[int, tuple[int, ...]], list[tuple[Piece, int]]]]
    """bucket → (source link rank, destination link ranks) → [(piece, byte offset)]."""

    def sizes(self, b: int) -> dict[tuple[int, tuple[int, ...]], int]:
        """Bytes of each (source, dests) buffer in bucket `b`."""
        return {k: _aligned(p[-1][1] + p[-1][0].nbytes) for k, p in self.buckets[b].items()}

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for bucket in self.buckets for pieces in bucket.values() for p, _ in pieces)

    def bytes_to(self, rank: int) -> int:
        """What link rank `rank` receives."""
        return sum(p.nbytes for b in self.buckets for (_, d), ps in b.items() if rank in d for p, _ in ps)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def sync_subgroups(trainer_ranks: int, replicas: Layout) -> list[tuple[int, ...]]:
    """The link subgroups a sharded sync broadcasts over (`Controller.link(..., subgroups)`): every trainer rank
    with all replica ranks (what every rank holds whole), and, for replicas with generation TP, with the replica
    ranks of each TP coordinate (each gets only its TP shard of a split parameter)."""
    everyone = tuple(trainer_ranks + r for r in range(replicas.world_size))
    out = [(s, *everyone) for s in range(trainer_ranks)]
    if replicas.tp > 1:
        for c in range(replicas.tp):
            ranks = tuple(trainer_ranks + r for r in range(replicas.world_size) if replicas.coords(r)[2] == c)
            out += [(s, *ranks) for s in range(trainer_ranks)]
    return out


def _region(param: torch.Tensor) -> Region:
    """Where this rank's part of `param` sits in the whole tensor (a DTensor's local shard; a plain tensor: all)."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(int(o) for o in offset), tuple(int(s) for s in shape)
    return (0,) * param.dim(), tuple(param.shape)


def _intersect(a: Region, b: Region) -> Region | None:
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1])]
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi))


def _block(tensor: torch.Tensor, at: tuple[int, ...], region: Region) -> torch.Tensor:
    """The part `region` (in whole-tensor coordinates) of `tensor`, which holds the whole tensor's block at `at`."""
    offset, shape = region
    return tensor[tuple(slice(o - a, o - a + s) for o, a, s in zip(offset, at, shape))]


def local_block(param: torch.Tensor, rank: int, world: int, index: int) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """What of `param` (the `index`-th parameter) this trainer rank sends, and where it sits in the whole tensor:
    a DTensor's local shard, unless another rank holds the same data (replicated mesh dimensions: the rank at
    coordinate 0 sends); a plain tensor, which every rank holds, from rank `index % world`. None: nothing."""
    if hasattr(param, "to_local"):
        coords = param.device_mesh.get_coordinate()
        if coords is None or any(pl.is_replicate() and c != 0 for pl, c in zip(param.placements, coords)):
            return None
        local = _local(param)
        return (local, _region(param)[0]) if local.numel() else None
    if index % world != rank:
        return None
    return param, (0,) * param.dim()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, a plain tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def address(pieces: list[Piece], needs: dict[int, dict[str, list[Region]]]) -> list[Piece]:
    """Cut each trainer piece to what the replica ranks hold of it (`needs`: link rank → parameter → the regions
    its layout holds): one piece per distinct cut, addressed to every rank that holds it. Whole-copy replicas
    take each piece whole; replicas with generation TP take their shard of a split parameter only."""
    cuts: dict[tuple, set[int]] = {}
    for piece in pieces:
        for rank, held in needs.items():
            for region in held.get(piece.name, ()):
                cut = _intersect((piece.offset, piece.shape), region)
                if cut is not None:
                    cuts.setdefault((piece.name, piece.source, *cut, piece.dtype), set()).add(rank)
    return [Piece(n, s, o, sh, d, tuple(sorted(r))) for (n, s, o, sh, d), r in cuts.items()]


def plan_sync(pieces: list[Piece], order: list[str], bucket_bytes: int) -> SyncPlan:
    """Pieces (of every source) into buckets of about `bucket_bytes`, in parameter order, each (source, dests)'s
    pieces of a bucket packed into one aligned buffer; every rank computes the same plan from the same pieces."""
    rank_of = {name: i for i, name in enumerate(order)}
    ordered = sorted(pieces, key=lambda p: (rank_of[p.name], p.source, p.dests, p.offset))
    buckets: list[dict[tuple[int, tuple[int, ...]], list[tuple[Piece, int]]]] = []
    filled = bucket_bytes
    for piece in ordered:
        if filled + piece.nbytes > bucket_bytes and filled > 0:
            buckets.append({})
            filled = 0
        bucket = buckets[-1]
        mine = bucket.setdefault((piece.source, piece.dests), [])
        at = _aligned(mine[-1][1] + mine[-1][0].nbytes) if mine else 0
        mine.append((piece, at))
        filled += piece.nbytes
    return SyncPlan(buckets)


def _subgroup(ctx, source: int, dests: tuple[int, ...]):
    group = ctx.subgroups.get((source, *dests))
    if group is None:
        raise ValueError(
            f"the link has no subgroup {(source, *dests)} for a sharded sync; create it with "
            f"Controller.link(name, [trainer, replicas], sync_subgroups(trainer.world_size, replicas.layout))"
        )
    return group


def _tied_head(model: torch.nn.Module) -> tuple[str, str] | None:
    """(output head, input embedding) parameter names of a model that has both, else None."""
    try:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    head_name = names.get(id(getattr(head, "weight", None)))
    embed_name = names.get(id(getattr(embed, "weight", None)))
    return (head_name, embed_name) if head_name and embed_name else None


def _targets(order: list[str], own: dict[str, Region], tied: tuple[str, str] | None) -> dict[str, list[str]]:
    """Which of a replica's parameters each trainer parameter fills: its namesake, and a head the replica holds
    apart from its embedding while the trainer ties them (the 3D-HybridEngine unties them: Megatron shards the
    two apart) from the embedding."""
    out = {n: [n] for n in order if n in own}
    if tied is not None:
        head, embed = tied
        if head not in order and embed in out:
            out[embed].append(head)
    return out


def _check_covered(
    order: list[str], own: dict[str, Region], targets: dict[str, list[str]], sent: set[str], changed_only: bool
) -> None:
    """Every parameter the trainer sends has a place on the replica, and (a whole sync) every replica parameter
    a source; the same check on every link rank, so all raise together."""
    homeless = sorted(sent - set(targets))
    fed = {n for names in targets.values() for n in names}
    unfed = [] if changed_only else sorted(set(own) - fed)
    if homeless or unfed:
        raise ValueError(
            f"the trainer's and the replicas' parameters differ (the trainer's without a place on a replica: "
            f"{homeless[:3]}; a replica's without a source: {unfed[:3]}); build the replicas from the trainer's "
            f"model with its LoRA settings"
        )


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
    @between_segments
    def load_policy(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Become a rollout replica of the trainer's policy `version` (asynchronous RL): load `weights`
        (`policy_weights` of the trainer, any layout) into this rank's whole copy; the generation engine takes
        them at the next generate. Returns the bytes received and the seconds it took."""
        t0 = time.perf_counter()
        if self.hybrid is not None:
            raise ValueError(
                "load_policy sends whole tensors; a replica with generation TP takes its shards by the sharded "
                "sync (async_rl.sync=sharded)"
            )
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # whole tensors in, this rank's layout out (plain, replicated or sharded parameters alike); every rank
        # of the replica group calls this, so a layout that distributes tensors may use collectives
        set_model_state_dict(self.engine.model, weights, options=StateDictOptions(full_state_dict=True))
        self._base_loaded = False  # a LoRA replica's base came too
        self.weights_version += 1
        self.policy_version = int(version)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in weights.values())),
            "seconds": time.perf_counter() - t0,
        }

    # -- the sharded path ---------------------------------------------------------------------------------------
    def _sync_plan(self, link_name: str, changed_only: bool, bucket_bytes: int) -> SyncPlan:
        """The sync's plan, agreed once per link and kind: every member gathers every trainer rank's pieces and
        every replica rank's layout (where its shard of each parameter sits), so each piece goes only to the
        replica ranks that hold it."""
        import torch.distributed as dist

        plans = self.__dict__.setdefault("_sync_plans", {})
        key = (link_name, changed_only, bucket_bytes)
        if key not in plans:
            ctx = link(link_name)
            params = list(self.engine.model.named_parameters())
            if self.group_name == next(iter(ctx.groups)):  # the link's first group sends: a trainer rank
                ranks = ctx.groups[self.group_name]
                mine: list[Piece] = []
                for i, (name, p) in enumerate(params):
                    if changed_only and not p.requires_grad:
                        continue
                    block = local_block(p, self.rank, self.world_size, i)
                    if block is not None:
                        local, offset = block
                        dtype = str(local.dtype).removeprefix("torch.")
                        mine.append(Piece(name, ranks[self.rank], offset, tuple(local.shape), dtype))
                report: tuple = ("trainer", [n for n, _ in params], mine)
            else:
                report = ("replica", {n: _region(p) for n, p in params}, _tied_head(self.engine.model))
            gathered: list = [None] * dist.get_world_size(ctx.process_group)
            dist.all_gather_object(gathered, report, group=ctx.process_group)
            order = next(r[1] for r in gathered if r[0] == "trainer")
            pieces = [p for r in gathered if r[0] == "trainer" for p in r[2]]
            needs, targets = {}, {}
            for rank, (kind, regions, tied) in enumerate(gathered):
                if kind == "replica":
                    targets[rank] = _targets(order, regions, tied)
                    needs[rank] = {t: [regions[n] for n in names] for t, names in targets[rank].items()}
                    _check_covered(order, regions, targets[rank], {p.name for p in pieces}, changed_only)
            self.__dict__.setdefault("_sync_targets", {})[link_name] = targets.get(ctx.rank, {})
            plans[key] = plan_sync(address(pieces, needs), order, bucket_bytes)
        return plans[key]

    @endpoint(protocol=ONE_TO_ALL)
    def send_policy(self, link_name: str, bucket_bytes: int, changed_only: bool = False) -> dict[str, float]:
        """Trainer side of a sharded sync (every rank; the replicas run `receive_policy` with the same
        arguments at the same time): broadcast this rank's blocks, bucket by bucket, each to the replica ranks
        that hold it. Returns the bytes of the blocks this rank sent and the most bucket bytes it held at once."""
        import torch.distributed as dist

        self._end_receiving()
        t0 = time.perf_counter()
        ctx = link(link_name)
        plan = self._sync_plan(link_name, changed_only, bucket_bytes)
        params = dict(self.engine.model.named_parameters())
        at_of: dict[str, tuple[int, ...]] = {}
        in_flight: list[list[tuple[object, torch.Tensor]]] = []
        sent = peak = 0
        with torch.no_grad():
            for b, bucket in enumerate(plan.buckets):
                sizes, works = plan.sizes(b), []
                for (source, dests), pieces in bucket.items():
                    if source != ctx.rank:
                        continue
                    buf = torch.empty(sizes[(source, dests)], dtype=torch.uint8)
                    for piece, at in pieces:
                        param = params[piece.name]
                        if piece.name not in at_of:
                            at_of[piece.name] = _region(param)[0]
                        data = _block(_local(param), at_of[piece.name], (piece.offset, piece.shape))
                        buf[at : at + piece.nbytes].view(data.dtype).view(piece.shape).copy_(data)
                        sent += piece.nbytes
                    group = _subgroup(ctx, source, dests)
                    works.append((dist.broadcast(buf, group_src=0, group=group, async_op=True), buf))
                if not works:
                    continue
                while len(in_flight) >= 2:
                    for work, _ in in_flight.pop(0):
                        work.wait()
                in_flight.append(works)
                peak = max(peak, sum(buf.numel() for held in in_flight for _, buf in held))
            for held in in_flight:
                for work, _ in held:
                    work.wait()
        return {"bytes": float(sent), "peak_bucket_bytes": float(peak), "seconds": time.perf_counter() - t0}

    @endpoint(protocol=ONE_TO_ALL)
    @between_segments
    def receive_policy(
        self, link_name: str, bucket_bytes: int, version: int, changed_only: bool = False
    ) -> dict[str, float]:
        """Replica side of a sharded sync (`send_policy` on the trainer at the same time): receive each bucket
        from every trainer rank that has blocks for this rank in it, two buckets in flight, and copy the blocks
        into this rank's weights: its whole copy, or its TP shard of a replica with generation TP (the
        3D-HybridEngine's training buffer, which it generates from). An engine that holds its own weights (vLLM)
        on a whole copy is fed as the buckets arrive: one reload whose weights iterator yields each parameter once
        its last block is in (then, from the whole copy, those that did not travel), so loading overlaps
        receiving and the next generate reloads nothing. With LoRA (vLLM takes the base once and the adapters as
        a LoRA request, or merged weights) or generation TP (the engine takes its shard from the 3D-HybridEngine)
        the engine reloads at the next generate instead.
        Returns the bytes received and loaded, the seconds it took and the most bucket bytes held at once."""
        t0 = time.perf_counter()
        plan = self._sync_plan(link_name, changed_only, bucket_bytes)
        params = dict(self.engine.model.named_parameters())
        stats = {"bytes": 0.0, "loaded_bytes": 0.0, "peak_bucket_bytes": 0.0}
        targets = self._sync_targets[link_name]
        buckets = self._receive_buckets(link(link_name), plan, params, targets, stats)
        whole = self.hybrid is None and getattr(self.engine, "lora_scale", None) is None
        if self.generator.holds_weights and whole:

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
        if not changed_only:
            self._base_loaded = False  # every parameter travelled: a LoRA replica's base too
        self.weights_version += 1
        self.policy_version = int(version)
        return {**stats, "seconds": time.perf_counter() - t0}

    def _receive_buckets(
        self,
        ctx,
        plan: SyncPlan,
        params: dict[str, torch.Tensor],
        targets: dict[str, list[str]],
        stats: dict[str, float],
    ):
        """Receive this rank's buffers of the plan's buckets into `params` (each trainer parameter into its
        `targets` here), two buckets in flight; yields, after each bucket, the parameters it completed."""
        import torch.distributed as dist

        me = ctx.rank
        regions = {name: _region(p) for name, p in params.items()}
        posted: list[tuple[int, list[tuple[object, tuple, torch.Tensor]]]] = []
        missing: dict[str, int] = {}  # trainer parameter -> bytes still to arrive here
        for bucket in plan.buckets:
            for (_, dests), pieces in bucket.items():
                if me in dests:
                    for piece, _ in pieces:
                        missing[piece.name] = missing.get(piece.name, 0) + piece.nbytes
        mine = [b for b, bucket in enumerate(plan.buckets) if any(me in d for _, d in bucket)]

        def post(b: int) -> None:
            works = []
            for (source, dests), size in plan.sizes(b).items():
                if me in dests:
                    buf = torch.empty(size, dtype=torch.uint8)
                    work = dist.broadcast(buf, group_src=0, group=_subgroup(ctx, source, dests), async_op=True)
                    works.append((work, (source, dests), buf))
            posted.append((b, works))

        with torch.no_grad():
            for b in mine[:2]:
                post(b)
            for i, _ in enumerate(mine):
                held = sum(buf.numel() for _, works in posted for _, _, buf in works)
                stats["peak_bucket_bytes"] = max(stats["peak_bucket_bytes"], float(held))
                b, works = posted.pop(0)
                done = []
                for work, key, buf in works:
                    work.wait()
                    for piece, at in plan.buckets[b][key]:
                        block = buf[at : at + piece.nbytes].view(getattr(torch, piece.dtype)).view(piece.shape)
                        for name in targets[piece.name]:
                            cut = _intersect((piece.offset, piece.shape), regions[name])
                            if cut is not None:
                                _block(_local(params[name]), regions[name][0], cut).copy_(
                                    _block(block, piece.offset, cut)
                                )
                        stats["bytes"] += piece.nbytes
                        missing[piece.name] -= piece.nbytes
                        if not missing[piece.name]:
                            done.extend(targets[piece.name])
                del works
                if i + 2 < len(mine):
                    post(mine[i + 2])
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
        replicas, index = self.layout.dp, self.coords[1]  # a replica's TP ranks decode its rows together
        if groups % replicas:
            raise ValueError(
                f"{groups} prompt groups per step cannot be shared by {replicas} replicas; use a multiple of "
                f"{replicas} prompts per step"
            )
        local = groups // replicas
        part = self._partial_rollouts()
        part.admit(prompts)
        out = part.run(self._segment_generate(part), self.policy_version, local, segment)
        return Batch({**out.tensors, "group": out["group"] + index * local}, out.rows, out.meta)

    def _segment_generate(self, part: PartialRollouts):
        """What decodes one segment of `part`: a generate over a prompt batch, or, for multi-turn episodes, a turn
        of every running episode."""
        if part.episodes is not None:
            return lambda eps: part.episodes.advance(self._replica_model(), eps, self.sampling)
        return lambda b: self._generate(b, None)

    # -- streaming partial rollouts (async_rl.deterministic=false) ------------------------------------------------
    @endpoint(protocol=ALL_TO_ALL)
    def stream_partial(self, prompts: Batch, segment: int, wait_s: float) -> dict:
        """Streaming partial rollouts: admit `prompts` (this rank's fresh prompt groups, possibly none) and keep
        decoding everything held, a segment at a time, in a thread of this worker's own (engines.rollout.decode_loop)
        under whatever policy version the replica has when the segment starts; a weight sync lands between two
        segments. Returns at once what has finished since the last call, waiting up to `wait_s` seconds for at
        least one group when none has: {"samples": the finished groups (generate_sequences' layout, `group` from
        0), "held": the uids still held, "version": the replica's version, "first_ready_s": seconds from this
        replica's first call to its first finished group, None before (an elastic fleet's join time)}."""
        if self.policy_version is None:
            raise ValueError("stream_partial runs on a rollout replica: load_policy or receive_policy first")
        if self.hybrid is not None:
            raise ValueError(
                "streaming partial rollouts need whole-copy replicas (a generation TP group decodes in lockstep); "
                "set async_rl.deterministic=true or rollout_tp=0"
            )
        part = self._partial_rollouts()
        loop = self.__dict__.get("_decoding")
        if loop is None or not loop.alive or self.__dict__.get("_decoding_segment") != segment:
            if loop is not None and loop.error is not None:
                with loop.paused():  # raises the loop's error
                    pass
            self._stop_decoding()
            generate = self._segment_generate(part)
            loop = self._decoding = DecodeLoop(lambda: part.decode(generate, self.policy_version, segment))
            self._decoding_segment = segment
        first_call = self.__dict__.setdefault("_first_stream_call", time.monotonic())
        with loop.paused():
            part.admit(prompts)
        deadline = time.monotonic() + wait_s
        while True:
            with loop.paused():
                if part.ready or not part.running() or time.monotonic() >= deadline:
                    first = None if part.first_ready is None else part.first_ready - first_call
                    return {
                        "samples": part.hand_out(),
                        "held": part.held(),
                        "version": self.policy_version,
                        "first_ready_s": first,
                    }
                loop.progress.clear()
            loop.progress.wait(max(0.0, deadline - time.monotonic()))

    @endpoint(protocol=ONE_TO_ALL)
    def hand_back(self) -> dict:
        """A replica's graceful leave (an elastic fleet's retire): stop decoding after the segment in progress, hand
        out every group that has finished, and drop the unfinished ones (the controller gives their prompts to
        other replicas). Returns `stream_partial`'s {"samples", "held"}, "held" the groups dropped."""
        self._stop_decoding()
        part = self._partial_rollouts()
        out = {"samples": part.hand_out(), "held": part.held(), "version": self.policy_version}
        part.groups.clear()
        return out

    @endpoint(protocol=ONE_TO_ALL)
    def stop_streaming(self) -> bool:
        """End streaming partial rollouts' decode loop (after its segment in progress); what it holds stays."""
        return self._stop_decoding()

    def _stop_decoding(self) -> bool:
        loop = self.__dict__.pop("_decoding", None)
        if loop is None:
            return False
        loop.stop()
        return True

    def _quiet(self):
        """A block the streaming decode loop waits for (between two segments); nothing without a running one (a
        loop that failed decodes nothing more: a weight sync still takes part in its collective, and the failure
        is raised by the next `stream_partial`)."""
        loop = self.__dict__.get("_decoding")
        return loop.paused() if loop is not None and loop.alive else nullcontext()

    @endpoint(protocol=ONE_TO_ALL)
    @between_segments
    def partial_held(self) -> list[int]:
        """The prompt groups (uids) this rank's partial rollouts hold: the controller's ledger check (a replica's
        TP rank 0 answers for it: its other TP ranks hold the same)."""
        return self._partial_rollouts().held() if self.coords[2] == 0 else []

    @endpoint(protocol=ONE_TO_ALL)
    @between_segments
    def partial_state(self) -> dict:
        """What this rank's partial rollouts hold (for a checkpoint: `load_partial_state` restores it)."""
        return self._partial_rollouts().state_dict()

    @endpoint(protocol=ONE_TO_ALL)
    @between_segments
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
