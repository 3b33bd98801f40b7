"""Intra-stage fusion (RLHFuse): two models' pipeline-parallel training on the same slots, scheduled as one.

Trained alone, a p-stage 1F1B pipeline idles (p - 1) forward + backward steps on every stage: the warm-up
bubble before the last stage gets its first micro-batch, and the cool-down bubble after the first stage sent its
last. RLHFuse trains the actor and the critic (same slots, same step) as one pipeline whose two models run in
opposite directions: the actor's stage s on slot s, the critic's on slot p - 1 - s, so while the actor's first
micro-batch has not reached the last slot, that slot runs the critic's first stage, and the other way round. Each
model fills the other's bubbles.

`plan_pipelines` is the scheduler: a greedy list scheduler over every slot's forward (F) and backward (B) steps,
with the step costs given, which never holds more of a model's micro-batches' activations on a stage than 1F1B
would (p - s on stage s). A slot holds both models' activations at once, so its peak is the sum of the two
bounds (p + 1 micro-batches on every slot for opposite pipelines, against at most p for one model alone), unless
a `slot_budget` bounds it (at some cost in time).

Each slot then runs its list in order (`run_plan`). Activations travel on each model's PP process group and
gradients on its model-parallel group, so every channel between two ranks carries one model's messages in one
direction, in micro-batch order: matched by tag on gloo, and by order as NCCL matches them, with no send of one
rank queued behind a receive the peer has not reached. Sends never block the rank, and a rank waits only for a
receive whose send comes earlier in the plan, so the plan cannot deadlock (run on gloo here; the NCCL path has
not run yet). Every micro-batch's arithmetic is the one megatron's own 1F1B runs, in the same order per model, so
a fused step gives the separate steps' gradients and updates (bit for bit, but for collectives over more than two
ranks, such as the gradient norm with tp > 1, which a reversed model's ranks enter in another order).

What the plan's `bubble_fraction` reports is the scheduled idle share of the slots (step costs in units); the
runner's `RunTiming` measures the host's time waiting for a peer, which is the bubble on CPU (on CUDA, where
receives do not block the host, it is not).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flowactors import Batch

__all__ = ["Op", "PipelinePlan", "PipelineJob", "RunTiming", "plan_pipelines", "run_plan"]


@dataclass(frozen=True)
class Op:
    """One step on one slot: model `job`'s forward ("F") or backward ("B") of micro-batch `mb` at `stage`."""

    job: int
    kind: str
    mb: int
    stage: int


@dataclass(frozen=True)
class PipelinePlan:
    """Each slot's steps in the order it runs them, and the schedule's length under the costs it was planned with."""

    stages: int
    reverse: tuple[bool, ...]
    slots: tuple[tuple[Op, ...], ...]
    makespan: float
    busy: float

    @property
    def bubble_fraction(self) -> float:
        """Share of slot time idle under the planned costs: 1 - busy / (makespan · slots)."""
        return 1.0 - self.busy / (self.makespan * self.stages) if self.makespan else 0.0

    def slot_of(self, job: int, stage: int) -> int:
        return self.stages - 1 - stage if self.reverse[job] else stage


def plan_pipelines(
    stages: int,
    micro_batches: Sequence[int],
    *,
    reverse: Sequence[bool] | None = None,
    forward_cost: Sequence[float] | None = None,
    backward_cost: Sequence[float] | None = None,
    forward_only: bool = False,
    slot_budget: int | None = None,
) -> PipelinePlan:
    """Plan one step of `len(micro_batches)` pipelines over the same `stages` slots.

    `micro_batches[j]`: model j's micro-batch count; `reverse[j]`: model j's stage s runs on slot stages - 1 - s
    (default: the second model runs reversed); costs per model, one forward and one backward of one micro-batch on
    one stage (default 1 and 2, the usual ratio). A single model gives megatron's 1F1B order.

    Each model keeps its own 1F1B bound of activations per stage; `slot_budget` also bounds what a slot holds of
    all models together (e.g. `stages`, what one model's 1F1B holds on its first stage, the busiest slot of an
    unfused step; None: no such bound, p + 1 for two opposite models). A budget trades time for memory: `stages`
    lengthened 2 of 3 random two-model plans, by 5% on average and up to 23%. The plan is the shortest of: the list
    scheduler preferring forwards, preferring backwards, and the models one after the other (each 1F1B; the second
    starts on a slot when the first is done there), so fusing is never planned slower than not fusing."""
    jobs = len(micro_batches)
    if stages < 1 or jobs < 1 or any(m < 0 for m in micro_batches):
        raise ValueError(f"need stages >= 1 and micro-batch counts >= 0, got stages={stages}, {list(micro_batches)}")
    reverse = tuple(bool(r) for r in (reverse if reverse is not None else [j % 2 == 1 for j in range(jobs)]))
    fwd = tuple(float(c) for c in (forward_cost or [1.0] * jobs))
    bwd = tuple(float(c) for c in (backward_cost or [2.0] * jobs))
    if not len(reverse) == len(fwd) == len(bwd) == jobs:
        raise ValueError(f"reverse, forward_cost and backward_cost need one entry per model ({jobs})")
    budget = sum(micro_batches) if slot_budget is None else slot_budget
    if budget < 1:
        raise ValueError(f"slot_budget={slot_budget}: a slot must hold at least one micro-batch's activations")
    options = []
    for forward_first in (True, False):
        try:
            options.append(
                _list_schedule(stages, micro_batches, reverse, fwd, bwd, forward_only, forward_first, budget)
            )
        except _Stuck:  # the budget starved a slot; the in-turn plan below always fits it
            pass
    if jobs > 1:
        alone = [
            _list_schedule(stages, [micro_batches[j]], [reverse[j]], [fwd[j]], [bwd[j]], forward_only, True, budget)
            for j in range(jobs)
        ]
        options.append(
            [[Op(j, o.kind, o.mb, o.stage) for j, slots in enumerate(alone) for o in slots[d]] for d in range(stages)]
        )
    if not options:
        raise RuntimeError(f"no plan fits slot_budget={slot_budget}; raise it")
    timed = [(*_timeline(stages, slots, fwd, bwd), slots) for slots in options]
    makespan, busy, slots = min(timed, key=lambda t: t[0])
    return PipelinePlan(stages, reverse, tuple(tuple(o) for o in slots), makespan, busy)


class _Stuck(RuntimeError):
    """No step can start: the slot budget holds every slot's activations for backwards that wait on each other."""


def _list_schedule(
    stages: int,
    micro_batches: Sequence[int],
    reverse: Sequence[bool],
    fwd: Sequence[float],
    bwd: Sequence[float],
    forward_only: bool,
    forward_first: bool,
    budget: int,
) -> list[list[Op]]:
    """Greedy list scheduling: whenever a slot is free, it starts the best step whose inputs are there. A
    forward waits while its stage holds 1F1B's bound of activations (p - s), or its slot `budget` of all models';
    `forward_first` decides between a ready forward and a ready backward."""
    jobs = len(micro_batches)
    done: dict[tuple[int, str, int, int], float] = {}  # step -> finish time
    in_flight = [[0] * stages for _ in range(jobs)]  # forwards whose backward has not started, per (job, stage)
    next_f = [[0] * stages for _ in range(jobs)]  # next micro-batch to forward, per (job, stage)
    next_b = [[0] * stages for _ in range(jobs)]
    order: list[list[Op]] = [[] for _ in range(stages)]
    free_at = [0.0] * stages
    events: list[float] = [0.0]
    left = sum(micro_batches) * stages * (1 if forward_only else 2)

    def ready(key: tuple[int, str, int, int], now: float) -> bool:
        return key in done and done[key] <= now

    def best(d: int, now: float) -> tuple[Op, float] | None:
        out = []
        on = [stages - 1 - d if reverse[j] else d for j in range(jobs)]  # each model's stage on slot d
        held = sum(in_flight[j][on[j]] for j in range(jobs))
        for j in range(jobs):
            s, m = on[j], micro_batches[j]
            b = next_b[j][s]
            if not forward_only and b < next_f[j][s] and b < m:  # backward: after its forward here and the next
                after = (j, "F", b, s) if s == stages - 1 else (j, "B", b, s + 1)
                if ready(after, now):
                    out.append(((not forward_first, b, j), Op(j, "B", b, s), bwd[j]))
            f = next_f[j][s]
            cap = m if forward_only else min(m, stages - s)  # 1F1B's activation bound on stage s
            if (
                f < m
                and in_flight[j][s] < cap
                and (forward_only or held < budget)
                and (s == 0 or ready((j, "F", f, s - 1), now))
            ):
                out.append(((forward_first, in_flight[j][s] / max(cap, 1), f, j), Op(j, "F", f, s), fwd[j]))
        return min(out, key=lambda c: c[0])[1:] if out else None

    while left:
        if not events:
            raise _Stuck("no step can start")
        now = heapq.heappop(events)
        for d in range(stages):
            choice = best(d, now) if free_at[d] <= now else None
            if choice is None:
                continue
            op, cost = choice
            done[(op.job, op.kind, op.mb, op.stage)] = free_at[d] = now + cost
            heapq.heappush(events, now + cost)
            order[d].append(op)
            left -= 1
            if op.kind == "F":
                next_f[op.job][op.stage] += 1
                in_flight[op.job][op.stage] += 0 if forward_only else 1
            else:
                next_b[op.job][op.stage] += 1
                in_flight[op.job][op.stage] -= 1
    return order


def _timeline(
    stages: int, slots: Sequence[Sequence[Op]], fwd: Sequence[float], bwd: Sequence[float]
) -> tuple[float, float]:
    """(makespan, busy) of fixed per-slot orders: each step starts when its slot is free and its inputs are
    there. Raises if the orders wait on each other (a plan that would deadlock)."""
    finish: dict[tuple[int, str, int, int], float] = {}
    clock, pos = [0.0] * stages, [0] * stages
    busy, total = 0.0, sum(len(s) for s in slots)
    while len(finish) < total:
        moved = False
        for d in range(stages):
            while pos[d] < len(slots[d]):
                op = slots[d][pos[d]]
                needs = [(op.job, "F", op.mb, op.stage - 1)] if op.kind == "F" and op.stage > 0 else []
                if op.kind == "B":
                    needs.append((op.job, "F", op.mb, op.stage))
                    if op.stage < stages - 1:
                        needs.append((op.job, "B", op.mb, op.stage + 1))
                if not all(n in finish for n in needs):
                    break
                cost = fwd[op.job] if op.kind == "F" else bwd[op.job]
                clock[d] = max([clock[d], *(finish[n] for n in needs)]) + cost
                finish[(op.job, op.kind, op.mb, op.stage)] = clock[d]
                busy += cost
                pos[d] += 1
                moved = True
        if not moved:
            raise RuntimeError("the slots' step orders wait on each other (a plan that would deadlock)")
    return max(finish.values(), default=0.0), busy


@dataclass
class PipelineJob:
    """One model's part of a pipeline step: its engine (this rank's stage), micro-batches, and the loss step
    megatron's schedules take (`loss_step(mb, output)` on the last stage: (loss, token count, record) when
    training, (ignored, record) forward-only)."""

    engine: Any
    micro_batches: list[Batch]
    loss_step: Callable[[Batch, torch.Tensor], tuple]
    forward_only: bool = False
    records: list[Any] = field(default_factory=list)
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int))
    """Token count of the last stage's loss steps (megatron's per-token loss), for `finalize_grads`."""


@dataclass
class RunTiming:
    """This rank's wall time over the plan and the part of it spent waiting for a peer's activation or gradient."""

    wall_s: float = 0.0
    wait_s: float = 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s else 0.0


_TAG_SPAN = 1_000_000


def _tag(job: int, kind: str, mb: int) -> int:
    return (job * 2 + (kind == "B")) * _TAG_SPAN + mb


def run_plan(jobs: Sequence[PipelineJob], plan: PipelinePlan) -> RunTiming:
    """Run this rank's list of `plan` with megatron's own forward and backward steps; records of the last stage's
    loss steps land in each job's `records`. Gradients accumulate as in megatron's schedules; finalising them
    (data-parallel reduction, token scaling) and the optimizer step are the caller's."""
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

    if len(jobs) != len(plan.reverse):
        raise ValueError(f"the plan is for {len(plan.reverse)} models, got {len(jobs)} jobs")
    slot = None
    for j, job in enumerate(jobs):
        g = job.engine.groups
        if g.pp != plan.stages:
            raise ValueError(f"model {j} has {g.pp} pipeline stages; the plan has {plan.stages}")
        if g.reversed_stages != plan.reverse[j]:
            raise ValueError(
                f"model {j}'s stages run {'down' if g.reversed_stages else 'up'} its ranks; the plan "
                f"runs them {'down' if plan.reverse[j] else 'up'}: build its groups with "
                f"reverse_stages={plan.reverse[j]}"
            )
        mine = plan.slot_of(j, g.pp_rank)
        if slot is not None and mine != slot:
            raise ValueError(
                f"model {j}'s stage {g.pp_rank} is not on the slot of model 0's stage {slot}: the "
                f"models must share one rank per slot"
            )
        slot = mine
        if len(job.micro_batches) != sum(op.job == j and op.kind == "F" for op in plan.slots[slot]):
            raise ValueError(
                f"model {j} has {len(job.micro_batches)} micro-batches; the plan was made for a different count"
            )
        if len(job.micro_batches) >= _TAG_SPAN:
            raise ValueError(
                f"model {j} has {len(job.micro_batches)} micro-batches in one step; at most "
                f"{_TAG_SPAN - 1} (raise micro_batch_tokens)"
            )
    saved: dict[tuple[int, int], tuple[Any, Any]] = {}
    sends: list[Any] = []
    timing = RunTiming()
    start = time.perf_counter()

    def shape(job: PipelineJob, mb: Batch) -> tuple[int, int, int]:
        ids = mb["input_ids"]  # megatron's activations between stages: [sequence, batch, hidden]
        return int(ids.shape[1]), int(ids.shape[0]), int(job.engine.geometry.hidden_size)

    def channel(job: PipelineJob, kind: str) -> Any:
        """Activations on the model's PP group, gradients on its model-parallel group (the same pipeline ranks and
        its TP peers): one direction of one model per channel."""
        groups = job.engine.groups.collection
        return groups.pp if kind == "F" else groups.mp

    def receive(job: PipelineJob, j: int, kind: str, i: int, src: int) -> torch.Tensor:
        e = job.engine
        buf = torch.empty(shape(job, job.micro_batches[i]), dtype=e.config.pipeline_dtype, device=e.device)
        t = time.perf_counter()
        dist.recv(buf, src=src, group=channel(job, kind), tag=_tag(j, kind, i))
        timing.wait_s += time.perf_counter() - t
        return buf

    def send(job: PipelineJob, j: int, kind: str, i: int, tensor: torch.Tensor, dst: int) -> None:
        out = tensor.contiguous()
        sends.append((dist.isend(out, dst=dst, group=channel(job, kind), tag=_tag(j, kind, i)), out))
        sends[:] = [(w, t) for w, t in sends if not w.is_completed()]  # a sent tensor is freed once delivered

    for op in plan.slots[slot]:
        job = jobs[op.job]
        e, g = job.engine, job.engine.groups
        config = e.config
        if op.kind == "F":
            x = None
            if not e.first_stage:
                x = receive(job, op.job, "F", op.mb, g.pp_ranks[g.pp_rank - 1])
                x.requires_grad_(not job.forward_only)
            mb = job.micro_batches[op.mb]

            def forward_step_func(_data, model, mb=mb, job=job):
                return job.engine._run_model(model, mb), (lambda out, mb=mb: job.loss_step(mb, out))

            with torch.no_grad() if job.forward_only else torch.enable_grad():
                y, count = forward_step(
                    forward_step_func,
                    iter(()),
                    e.model,
                    len(job.micro_batches),
                    x,
                    job.records,
                    config,
                    cp_group_size=1,
                    is_last_stage=e.last_stage,
                )
            job.tokens = job.tokens + count  # on the device: no host sync per micro-batch
            if not e.last_stage:
                send(job, op.job, "F", op.mb, y.detach(), g.pp_ranks[g.pp_rank + 1])
            if not job.forward_only:
                saved[(op.job, op.mb)] = (x, y)
        else:
            x, y = saved.pop((op.job, op.mb))
            grad = None if e.last_stage else receive(job, op.job, "B", op.mb, g.pp_ranks[g.pp_rank + 1])
            dx = backward_step(x, y, grad, None, config)
            if not e.first_stage:
                send(job, op.job, "B", op.mb, dx, g.pp_ranks[g.pp_rank - 1])
    for work, _ in sends:
        t = time.perf_counter()
        work.wait()
        timing.wait_s += time.perf_counter() - t
    timing.wall_s = time.perf_counter() - start
    return timing


def finalize_grads(job: PipelineJob) -> None:
    """What megatron's schedules do after the last backward, for a job `run_plan` ran: reduce gradients over data
    parallel (megatron's `finalize_model_grads`), then divide them by the step's token count, taken from the last
    stage (megatron reads the last stage off the PP group's rank order, which a reversed pipeline does not follow)."""
    from megatron.core.distributed import finalize_model_grads

    e, g = job.engine, job.engine.groups
    finalize_model_grads([e.model], None, pg_collection=g.collection)
    tokens = job.tokens.to(e.device).clone()
    if g.pp > 1:
        dist.broadcast(tokens, src=g.last_stage_rank(), group=g.collection.pp)
    if g.dp > 1:
        dist.all_reduce(tokens, group=g.collection.dp_cp)
    if tokens > 0:
        e.model.scale_gradients(1.0 / tokens)


def fused_update(
    models: Sequence[tuple[Any, list[Batch], Callable, Callable]],
    *,
    forward_cost: Sequence[float] | None = None,
    backward_cost: Sequence[float] | None = None,
    slot_budget: int | None = None,
) -> tuple[list[dict[str, float]], list[RunTiming]]:
    """Train pipeline-parallel models on the same slots in one fused pipeline per mini-batch (RLHFuse's
    intra-stage fusion; two models, an actor and a critic, in the paper).

    `models`: (engine, mini-batches, loss_fn, outputs_fn) per model, as `MegatronEngine.update` takes them; every
    model has as many mini-batches and the same stage count; each model's stages run up its ranks or down them
    (groups built with `reverse_stages`: the fused schedule gains most when the directions differ). Returns each
    model's metrics, as its own `update` would, and this rank's timing per mini-batch. Costs and `slot_budget` as
    `plan_pipelines` takes them."""
    engines = [m[0] for m in models]
    counts = {len(m[1]) for m in models}
    if len(counts) != 1:
        raise ValueError(f"fused models need as many mini-batches each, got {[len(m[1]) for m in models]}")
    reverse = [e.groups.reversed_stages for e in engines]
    runs = [e.begin_update() for e in engines]
    timings = []
    for k in range(counts.pop()):
        jobs = []
        for e, (_, minis, loss_fn, outputs_fn) in zip(engines, models):
            e.zero_grads()
            jobs.append(PipelineJob(e, e.micro_batches(minis[k]), e.train_loss_step(loss_fn, outputs_fn)))
        plan = plan_pipelines(
            engines[0].pp,
            [len(j.micro_batches) for j in jobs],
            reverse=reverse,
            forward_cost=forward_cost,
            backward_cost=backward_cost,
            slot_budget=slot_budget,
        )
        timings.append(run_plan(jobs, plan))
        for e, job, run in zip(engines, jobs, runs):
            finalize_grads(job)
            e.optimizer_step(run, job.records)
    return [e.end_update(run) for e, run in zip(engines, runs)], timings
