"""Stage fusion (RLHFuse, Zhong et al. 2024, inter-stage fusion): score samples while the long tail of generation is
still running, and optionally migrate that tail to fewer actor ranks so scorers start on the freed ones.

`rollout` is what every program calls for a step's samples: plain, fused, or the asynchronous pipeline's. The
settings are the `fusion.` section (`FusionConfig`); how it works, what is bit-identical and why, and what is not
done: docs/fusion.md. The actor's endpoints it drives are engines.rollout.fused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import flowactors as fa
from algorithms.rollout.asynchronous import Generated
from algorithms.run.errors import ConfigError
from engines.rollout.stream import ROW_INDEX
from flowactors import Batch

__all__ = [
    "FusionConfig",
    "Rollout",
    "rollout",
    "FusedRollout",
    "fused_rollout",
    "merge_chunks",
    "reassemble",
    "colocated",
    "migration_threshold",
    "overlap_note",
]


@dataclass
class FusionConfig:
    """Stage fusion (RLHFuse; algorithms/rollout/fusion.py), the `fusion.` section of every RL program. Each field has a
    short form on the command line (`fuse=true` for `fusion.enabled=true`: RLConfig.short_forms)."""

    enabled: bool = False
    """Score finished samples in chunks while generation goes on (scorers on the actor's slots still wait).
    The same samples, scores and update as without it."""
    chunk_samples: int = 8
    """Samples per chunk on each generation (actor data-parallel) rank: smaller chunks start scoring sooner, at
    the cost of more calls."""
    migrate: bool = False
    """Long-tail migration (RLHFuse; needs fuse and an actor of dp >= 2, tp = pp = 1, no rollout_tp): once at
    most `fusion.migrate_below` of a generation rank's rows are still running, the rank hands them to one of the
    first `fusion.migrate_to` actor ranks, which admits them into its running decode (hf: with their KV caches;
    vllm: re-prefilled, with their seeds and sampling generators), and scorers on the freed slots start at once.
    The same samples and update; rollout log-probs of rows that change decode batch (the moved rows, and with hf
    the receiver's own after they join) may differ in the last bit."""
    migrate_below: float = 0.25
    """The fraction of a generation rank's rows still running at which its tail migrates."""
    migrate_to: int = 1
    """Actor ranks that finish the migrated tails (the first ones; fewer than the actor's data-parallel size):
    each other rank's tail goes, whole, to the one with the fewest rows so far. `--placement fused` keeps the
    scorers off their slots."""
    train: bool = False
    """Train the actor and the critic as one fused pipeline (RLHFuse's intra-stage fusion;
    engines.training.megatron.pipeline_fusion): needs critics, and a plan that puts the actor and the critic in one
    pool with the same train sizes, p >= 2, on a pipeline-parallel engine (megatron). The critic's stages then run
    the other way over the slots, so each model fills the other's pipeline bubbles; Safe-RLHF's cost critic joins
    the same pipeline where the plan gives it the actor's pool and sizes too. The same updates as without it."""

    def __post_init__(self) -> None:
        if self.chunk_samples < 1:
            raise ConfigError(f"fuse_chunk_samples must be >= 1, got {self.chunk_samples}")
        if not 0 < self.migrate_below < 1:
            raise ConfigError(
                f"fuse_migrate_below is a fraction of each generation rank's rows and must be in "
                f"(0, 1), got {self.migrate_below}"
            )
        if self.migrate_to < 1:
            raise ConfigError(
                f"fuse_migrate_to is how many actor ranks finish the migrated tails, at least 1; got {self.migrate_to}"
            )
        if self.migrate and not self.enabled:
            raise ConfigError("fuse_migrate moves the long tail of a fused rollout; set fuse=true with it")


Scorer = Callable[[Any], fa.CallFuture]
"""A bound group endpoint that scores a batch, e.g. `critic.compute_values`."""


@dataclass(frozen=True)
class FusedRollout:
    """The futures of a fused generate-and-score stage."""

    chunks: list[fa.CallFuture]
    """Generated chunks in completion order; every row carries `row_index`, its row in the prompts."""
    parts: tuple[fa.CallFuture, ...]
    """Results about the same rows in the original order: first the generated batch joined with the scores
    computed per chunk, then the whole-batch results of the colocated scorers. Their union is the unfused
    `join(samples, *scores)`."""
    streamed: tuple[str, ...]
    """Scorers that ran per chunk, as `group.method`."""
    deferred: tuple[str, ...]
    """Scorers that shared the actor's slots and scored the whole batch after generation."""


def colocated(a: fa.ActorGroup, b: "fa.ActorGroup | Sequence[str]") -> bool:
    """Whether a group shares a device slot with another group (or with the given slot addresses): then one
    waits for the other."""
    return bool(set(a.addresses) & set(b.addresses if isinstance(b, fa.ActorGroup) else b))


def overlap_note(
    actor: fa.ActorGroup, scorers: Sequence[fa.ActorGroup], migrate: bool, receivers: int = 1
) -> str | None:
    """What to tell a user whose placement leaves fusion nothing to overlap: every scorer shares a slot that is
    still generating (all of the actor's, or with migration those of the `receivers` ranks that finish the
    tail), so scoring waits for the whole batch."""
    busy = actor.addresses[:receivers] if migrate else actor
    if not scorers or not all(colocated(g, busy) for g in scorers):
        return None
    what = (
        f"fuse_migrate: every scorer shares the slot of an actor rank that decodes the tail (ranks 0..{receivers - 1})"
        if migrate
        else "fuse: every scorer shares the actor's slots"
    )
    return (
        f"{what}, so scoring waits for the whole batch as unfused (same results, no overlap); "
        f"--placement {'fused' if migrate else 'split'} gives scorers slots of their own"
    )


def _group_of(scorer: Scorer) -> fa.ActorGroup:
    group = getattr(scorer, "group", None)
    if not isinstance(group, fa.ActorGroup):
        raise TypeError(f"fused scorers must be group endpoints such as critic.compute_values, got {scorer!r}")
    return group


def _chunk_rows(n_rows: int, dp: int, chunk_samples: int) -> list[int]:
    """Rows of each chunk of the whole call: every actor DP rank contributes `chunk_samples` rows (fewer to the
    last chunk)."""
    per_rank = n_rows // dp
    sizes = [chunk_samples] * (per_rank // chunk_samples) + (
        [per_rank % chunk_samples] if per_rank % chunk_samples else []
    )
    return [s * dp for s in sizes]


@dataclass(frozen=True)
class Rollout:
    """A step's generate-and-score stage, fused or not: what the advantage stage joins and the stage timer waits on."""

    generated: list[fa.CallFuture]
    """The generation calls (the fused stage's chunks, or the one generate_sequences call)."""
    parts: tuple[fa.CallFuture, ...]
    """The samples and every scorer's results about them; their union is the scored batch."""


def rollout(
    ctl: fa.Controller,
    actor: fa.ActorGroup,
    prompts: Batch | Generated,
    scorers: Sequence[Scorer],
    fusion: FusionConfig,
) -> Rollout:
    """Generate `prompts` on `actor` and score the samples with each of `scorers`: fused as `fusion` says
    (`fused_rollout`, scoring finished chunks while the tail generates) or one call after the other. Same samples
    and scores either way; every call is issued before this returns. Samples generated ahead by rollout replicas
    (`Generated`, asynchronous RL: algorithms.rollout.asynchronous) are only scored."""
    if isinstance(prompts, Generated):  # the samples last: stages joining the parts run where the first one is
        samples = prompts.samples  # (the trainer's slots), not behind the replicas' next rollout
        return Rollout(
            [samples] if isinstance(samples, fa.CallFuture) else [],
            (*(score(samples) for score in scorers), samples, prompts.meta()),
        )
    if fusion.enabled:
        fused = fused_rollout(
            ctl,
            actor,
            prompts,
            scorers,
            chunk_samples=fusion.chunk_samples,
            migrate_below=fusion.migrate_below if fusion.migrate else None,
            migrate_to=fusion.migrate_to,
        )
        return Rollout(fused.chunks, fused.parts)
    samples = actor.generate_sequences(prompts)
    return Rollout([samples], (samples, *(score(samples) for score in scorers)))


def fused_rollout(
    ctl: fa.Controller,
    actor: fa.ActorGroup,
    prompts: Batch,
    scorers: Sequence[Scorer],
    *,
    chunk_samples: int,
    migrate_below: float | None = None,
    migrate_to: int = 1,
) -> FusedRollout:
    """Generate `prompts` on `actor` and score the samples with `scorers`, overlapping the two (see the module
    docstring). Every call is issued before this returns; nothing waits.

    `migrate_below=f` (long-tail migration): once at most a fraction f of a generation rank's rows is still
    running, the rank hands them to one of the first `migrate_to` ranks, which finish every rank's tail; the
    scorers on the freed actor slots then score the chunks already taken (see the module docstring)."""
    if not isinstance(prompts, Batch):
        raise TypeError(
            f"fused_rollout needs the prompts as a Batch on the controller (it counts the chunks to take), "
            f"got {type(prompts).__name__}"
        )
    if chunk_samples < 1:
        raise ValueError(f"chunk_samples must be >= 1, got {chunk_samples}")
    dp = actor.layout.dp
    if not len(prompts) or len(prompts) % dp:
        raise ValueError(
            f"{len(prompts)} prompts cannot be shared by the actor's data-parallel size {dp}; use a "
            f"positive multiple of {dp}"
        )
    per_rank = len(prompts) // dp
    if migrate_below is None:
        rows, keep = _chunk_rows(len(prompts), dp, chunk_samples), None
    else:
        keep = migration_threshold(actor.layout, per_rank, migrate_below, migrate_to)
        taken = (per_rank - keep) // chunk_samples
        rows = [chunk_samples * dp] * taken + [len(prompts) - taken * chunk_samples * dp]
    # With migration the tail decodes on the receiving ranks' slots only, so only scorers there wait for it.
    busy = actor if migrate_below is None else actor.addresses[:migrate_to]
    streamed = [s for s in scorers if not colocated(_group_of(s), busy)]
    deferred = [s for s in scorers if colocated(_group_of(s), busy)]
    for s in streamed:
        sdp = _group_of(s).layout.dp
        if any(r % sdp for r in rows):
            raise ValueError(
                f"fused scoring splits every chunk over {_label(s)}'s data-parallel size {sdp}, but the "
                f"chunks hold {sorted(set(rows))} rows ({chunk_samples} samples per chunk on each of "
                f"{dp} generation ranks, {per_rank} per rank"
                f"{'' if keep is None else ', the rest after migration'}); choose fuse_chunk_samples "
                f"so that every chunk's rows are a multiple of {sdp}"
            )

    scores: list[list[fa.CallFuture]] = [[] for _ in streamed]

    def score(chunks: list[fa.CallFuture]) -> None:
        for chunk in chunks:  # chunk by chunk, so each scorer slot finishes a chunk before it starts the next
            for out, scorer in zip(scores, streamed):
                out.append(scorer(chunk))

    if keep is None:
        started = actor.start_generation(prompts, chunk_samples)
        chunks = [actor.next_generated_chunk(k) for k in range(len(rows))]
        score(chunks)
    else:
        started = actor.start_generation(prompts, chunk_samples, None, keep, migrate_to)
        chunks = [actor.next_generated_chunk(k) for k in range(len(rows) - 1)]
        handed_over = actor.hand_over_tail()
        score(chunks)  # issued before finish_tail: on a freed slot they run as soon as its rank handed over
        chunks.append(ctl.apply(_receivers_rows, actor.finish_tail(handed_over), name="fusion.tail"))
        score(chunks[-1:])
    merged = ctl.apply(merge_chunks, started, chunks, *scores, name="fusion.merge_chunks")
    parts: tuple[fa.CallFuture, ...] = (merged,)
    if deferred:
        samples = ctl.apply(reassemble, *chunks, name="fusion.reassemble")
        parts += tuple(score(samples) for score in deferred)
    return FusedRollout(chunks, parts, tuple(_label(s) for s in streamed), tuple(_label(s) for s in deferred))


def migration_threshold(layout: fa.Layout, rows_per_rank: int, fraction: float, receivers: int = 1) -> int:
    """Running rows per generation rank at which it hands its tail over: `fraction` of its rows, at least 1 and
    fewer than all; refuses an actor layout migration cannot run (or `receivers` it cannot have)."""
    if not 0 < fraction < 1:
        raise ValueError(
            f"migrate_below is the fraction of a generation rank's rows still running at which they "
            f"migrate; it must be in (0, 1), got {fraction}"
        )
    if layout.dp < 2 or layout.tp != 1 or layout.pp != 1:
        raise ValueError(
            f"long-tail migration moves the unfinished rows of data-parallel generation ranks onto "
            f"the first ones, so it needs an actor of dp >= 2 with tp = pp = 1; this actor's layout is "
            f"{layout}. Run without migration (fuse_migrate=False) or place the actor on more slots"
        )
    if not 1 <= receivers < layout.dp:
        raise ValueError(
            f"long-tail migration moves the tails of the actor's generation ranks onto its first "
            f"`migrate_to` ranks, which must be at least 1 and fewer than its {layout.dp} data-parallel "
            f"ranks (some rank must hand over); got migrate_to={receivers}"
        )
    if rows_per_rank < 2:
        raise ValueError(
            f"long-tail migration needs at least 2 rows per generation rank (one to finish, one to "
            f"move); this step has {rows_per_rank}"
        )
    return min(rows_per_rank - 1, max(1, round(fraction * rows_per_rank)))


def _receivers_rows(per_rank: list[Batch | None]) -> Batch:
    """`finish_tail`'s results, one per actor rank (None from ranks that handed over), as one chunk."""
    return Batch.concat([rows for rows in per_rank if rows is not None and len(rows)])


def _label(scorer: Scorer) -> str:
    return f"{_group_of(scorer).name}.{getattr(scorer, 'name', '?')}"


def merge_chunks(_started: None, chunks: list[Batch], *scores: list[Batch]) -> Batch:
    """Each generated chunk joined with its per-chunk scores (`scores[j][k]` is scorer j's result for chunk k),
    all rows back in the original order.

    `_started` is the result of `start_generation` (None): taking it makes a failed start the error this raises,
    rather than the chunk calls' "no generation is running"."""
    if any(len(s) != len(chunks) for s in scores):
        raise ValueError(f"every scorer needs one result per chunk ({len(chunks)}); got {[len(s) for s in scores]}")
    return reassemble(*(chunk.union(*(s[k] for s in scores)) for k, chunk in enumerate(chunks)))


def reassemble(*chunks: Batch) -> Batch:
    """Chunks in completion order → one batch in the original row order (by `row_index`, which is dropped)."""
    whole = Batch.concat(chunks)
    index = whole[ROW_INDEX]
    order = torch.argsort(index)
    if not torch.equal(index[order], torch.arange(len(whole), dtype=index.dtype)):
        raise ValueError(
            f"the chunks do not hold rows 0..{len(whole) - 1} once each (row_index "
            f"{sorted(index.tolist())}); they are not all the chunks of one generation"
        )
    out = whole.take(order)
    return Batch({k: v for k, v in out.tensors.items() if k != ROW_INDEX}, out.rows, out.meta)
