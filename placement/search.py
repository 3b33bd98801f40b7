"""Auto device mapping: HybridFlow Algorithm 1 (§6, Appendix B) over the costs of `placement.simulator`.

1. Placements: every set partition of the models (Bell numbers: 15 for PPO's four, 203 for Safe-RLHF's six).
2. Each colocated set's minimum device count from memory (`min_devices`): the analytic floor (weights, gradients,
   Adam states, one sequence of KV cache, spread perfectly), raised to the first count at which some parallel
   config of every member fits together.
3. Allocations of the N devices to the sets, each at least its floor (`allocations` lists them all;
   `_best_allocation` searches them).
4. Per set and device count, every member's parallel config (`solve_set`, cached per (set, count), and each
   model's candidate configs cached per (model, count)), the actor's generation TP size t_g among them.
5. Iteration cost: models of one set add up, concurrent sets take the maximum, stage by stage (`iteration_cost`).

Nothing here names a cluster size or a model: which placement wins is the cost model's consequence.

Plans that run: the actor generates with p_g = 1 (`generate: [1, t_g]`, what the runner accepts; HybridFlow's
Fig. 15 also lowers t_g, not p_g), and a plan that gives a model p > 1 says it needs the megatron engine
(`SearchResult.engine`, `plan.engine_note`): the torch engine has no pipeline parallelism and the runner refuses such
a plan on it before any worker starts. `pipeline=False` searches only p = 1 plans, which either engine runs.

Deviations, and why:
- Device counts are powers of two inside a node and whole nodes above it (`device_counts`), so tensor parallelism
  stays on NVLink and pools stay node-aligned; the paper enumerates every count.
- Colocated models share one memory budget, so their configs are chosen jointly (Pareto frontiers of latency,
  resident and working memory) rather than model by model; the actor's generation gets whatever KV memory its set
  leaves free. Each set minimises its own summed latency, like the paper's per-model auto_parallel.
- Allocations are searched by branch and bound (`_Bounds`: what each remaining set could do with every device
  left, their device-seconds spread over those devices, and a Lagrangian bound of the continuous relaxation). It
  returns the optimum of exhaustive enumeration (a test checks) while costing few complete allocations, and it
  stops work on a placement as soon as it can neither come within `RUNNER_UP_MARGIN` of the best so far nor beat
  the runner-up so far (so the runner-up placement is exact, however far behind).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from placement.hardware import Hardware, a100_80gb
from placement.models import LlamaSpec, divides_heads
from placement.plan import ModelPlan, Plan, engine_note, plan_engine
from placement.simulator import ROLES, STAGES, Parallel, Simulator, Workload, get_role, iteration_cost

Vec = tuple[float, float, float]  # seconds per stage, in STAGES order
_INF = float("inf")
RUNNER_UP_MARGIN = 0.1
"""Placements this close to the best (relative) are costed exactly and listed in `SearchResult.ranking`."""


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split `items` into non-empty colocated sets (each partition once, in a canonical order)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [(first,)] + partition
        for i in range(len(partition)):
            yield partition[:i] + [(first,) + partition[i]] + partition[i + 1 :]


def device_counts(total: int, gpus_per_node: int) -> list[int]:
    """Candidate sizes of one pool: powers of two below a node, then whole nodes."""
    small = [1 << i for i in range(gpus_per_node.bit_length()) if (1 << i) < gpus_per_node and (1 << i) <= total]
    return small + list(range(gpus_per_node, total + 1, gpus_per_node))


def allocations(floors: Sequence[int], total: int, counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every assignment of one count per set, each at least its floor, summing to `total` (exhaustive)."""
    if not floors:
        if total == 0:
            yield ()
        return
    rest = sum(floors[1:])
    for c in counts:
        if floors[0] <= c <= total - rest:
            for tail in allocations(floors[1:], total - c, counts):
                yield (c,) + tail


class _Option(NamedTuple):
    """One model under one config: latency per stage and per-rank memory."""

    role: str
    cfg: Parallel
    stages: Vec
    static: float
    working: float


class _Combo(NamedTuple):
    total: float
    static: float
    working: float
    stages: Vec
    options: tuple[_Option, ...]


def _pareto(items: list, key) -> list:
    """Items not dominated on all three coordinates of `key(item)` (all minimised). Visited by the first
    coordinate, an item is dominated iff some kept item has second and third coordinates no larger: `bs`/`cs` is
    the staircase of the kept items' (second, third) minima, so each check is one bisection."""
    kept, bs, cs = [], [], []
    for (_, b, c), item in sorted(((key(item), item) for item in items), key=lambda x: x[0]):
        i = bisect.bisect_right(bs, b)
        if i and cs[i - 1] <= c:
            continue
        kept.append(item)
        j = i
        while j < len(bs) and cs[j] >= c:
            j += 1
        lo = i - 1 if i and bs[i - 1] == b else i
        bs[lo:j], cs[lo:j] = [b], [c]
    return kept


@dataclass(frozen=True)
class ModelChoice:
    role: str
    parallel: Parallel
    generate_s: float
    transition_s: float
    inference_s: float
    train_s: float
    generation_batch: int = 0
    """Sequences in flight per generation replica (actor only)."""


@dataclass(frozen=True)
class SetChoice:
    roles: tuple[str, ...]
    gpus: int
    stages: Vec
    models: tuple[ModelChoice, ...]
    peak_bytes: float
    """Peak memory per device of the colocated models."""


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    estimated_iteration_s: float
    stages: dict[str, float]
    """Each stage's latency: the slowest colocated set in it."""
    sets: tuple[SetChoice, ...]
    ranking: tuple[tuple[tuple[tuple[str, ...], ...], float], ...]
    """Best iteration time of every placement within `RUNNER_UP_MARGIN` of the best, and of the runner-up however
    far behind, cheapest first."""
    search_s: float
    placements: int
    """Placements enumerated (set partitions of the models)."""
    allocations_evaluated: int
    """Complete allocations costed; branch and bound skips the others."""
    ranking_gpus: tuple[tuple[int, ...], ...] = ()
    """Devices per set of each `ranking` entry's best allocation, in the same order."""

    @property
    def runner_up(self) -> tuple[tuple[tuple[str, ...], ...], float] | None:
        """The second-best placement and its best iteration time (None when only one placement fits)."""
        return self.ranking[1] if len(self.ranking) > 1 else None

    @property
    def runner_up_pools(self) -> dict[str, int] | None:
        """Pool name -> devices of the runner-up's best allocation."""
        if self.runner_up is None:
            return None
        return {"+".join(s): c for s, c in zip(self.runner_up[0], self.ranking_gpus[1])}

    @property
    def engine(self) -> str:
        return plan_engine(self.plan)

    def to_dict(self) -> dict[str, Any]:
        models = {
            m.role: {
                "generate_s": m.generate_s,
                "transition_s": m.transition_s,
                "inference_s": m.inference_s,
                "train_s": m.train_s,
                **({"generation_batch": m.generation_batch} if m.generation_batch else {}),
            }
            for s in self.sets
            for m in s.models
        }
        pools = {
            "+".join(s.roles): {"gpus": s.gpus, "peak_gib": s.peak_bytes / 2**30, "stages": dict(zip(STAGES, s.stages))}
            for s in self.sets
        }
        return {
            **self.plan.to_dict(),
            "engine": self.engine,
            "engine_note": engine_note(self.plan),
            "estimated_iteration_s": self.estimated_iteration_s,
            "stages": self.stages,
            "search_s": self.search_s,
            "placements_searched": self.placements,
            "pools": pools,
            "models": models,
            "ranking": [
                {"placement": [list(s) for s in p], "gpus": list(g), "estimated_iteration_s": c}
                for (p, c), g in zip(self.ranking, self.ranking_gpus)
            ],
        }


class AutoMapper:
    """Searches placements, allocations and parallel sizes for `models` (role -> spec) on one hardware type."""

    def __init__(
        self,
        models: Mapping[str, LlamaSpec],
        hardware: Hardware | None = None,
        workload: Workload | None = None,
        *,
        pipeline: bool = True,
    ) -> None:
        """`pipeline=False` keeps every model at p = 1: plans the torch engine runs."""
        if not models:
            raise ValueError("give at least one model (role -> size)")
        order = list(ROLES)
        for role in models:
            get_role(role)
        self.models = dict(sorted(models.items(), key=lambda kv: order.index(kv[0])))
        self.hw = hardware or a100_80gb()
        self.sim = Simulator(self.hw, workload)
        self.pipeline = pipeline
        self._options: dict[tuple[str, int], list[_Option]] = {}
        self._sets: dict[tuple[tuple[str, ...], int], SetChoice | None] = {}

    # -- one model ---------------------------------------------------------------------------------------------
    def configs(self, role: str, n: int) -> list[Parallel]:
        """Parallel configs of `role` on n devices: t inside a node dividing the heads, p dividing the layers (only
        p = 1 with `pipeline=False`), and for the actor a generation TP size t_g dividing t, with p_g = 1: the
        runner generates without pipeline stages (`generate: [1, t_g]`)."""
        spec, gpn = self.models[role], self.hw.gpus_per_node
        out = []
        for t in _divisors(n):
            if t > gpn or not divides_heads(spec, t):
                continue
            for p in _divisors(n // t) if self.pipeline else [1]:
                if spec.layers % p:
                    continue
                d = n // (t * p)
                if not get_role(role).generates:
                    out.append(Parallel(p, t, d))
                    continue
                out += [Parallel(p, t, d, 1, t_g) for t_g in _divisors(t)]
        return out

    def options(self, role: str, n: int) -> list[_Option]:
        """Every config of a model that fits alone; for non-actors only the latency/memory Pareto frontier."""
        key = (role, n)
        if key not in self._options:
            spec, r, sim, usable = self.models[role], get_role(role), self.sim, self.hw.usable_bytes
            opts = []
            for cfg in self.configs(role, n):
                static, working = sim.static_bytes(spec, r, cfg), sim.activation_bytes(spec, r, cfg)
                if r.generates:
                    stages = (sim.transition_s(spec, cfg), sim.inference_s(spec, r, cfg), sim.train_s(spec, r, cfg))
                    working = max(working, sim.generation_extra_bytes(spec, cfg) + sim.kv_bytes_per_sequence(spec, cfg))
                else:
                    stages = (0.0, sim.inference_s(spec, r, cfg), sim.train_s(spec, r, cfg) if r.trains else 0.0)
                if static + working <= usable:
                    opts.append(_Option(role, cfg, stages, static, working))
            if not get_role(role).generates:
                opts = _pareto(opts, key=lambda o: (sum(o.stages), o.static, o.working))
            self._options[key] = opts
        return self._options[key]

    # -- one colocated set -------------------------------------------------------------------------------------
    def solve_set(self, roles: tuple[str, ...], n: int) -> SetChoice | None:
        """Cheapest joint configs of colocated `roles` on n devices, or None if they cannot fit together."""
        key = (roles, n)
        if key not in self._sets:
            self._sets[key] = self._solve_set(roles, n)
        return self._sets[key]

    def _solve_set(self, roles: tuple[str, ...], n: int) -> SetChoice | None:
        usable = self.hw.usable_bytes
        combos = [_Combo(0.0, 0.0, 0.0, (0.0, 0.0, 0.0), ())]
        for role in roles:
            if get_role(role).generates:
                continue
            combos = _pareto(
                [
                    _Combo(
                        c.total + sum(o.stages),
                        c.static + o.static,
                        max(c.working, o.working),
                        _add(c.stages, o.stages),
                        c.options + (o,),
                    )
                    for c in combos
                    for o in self.options(role, n)
                    if c.static + o.static + max(c.working, o.working) <= usable
                ],
                key=lambda c: (c.total, c.static, c.working),
            )
        actor = next((r for r in roles if get_role(r).generates), None)
        if actor is None:
            best = min(combos, key=lambda c: c.total, default=None)
            return None if best is None else self._set_choice(roles, n, best.options, {})
        return self._solve_with_actor(roles, n, actor, combos)

    def _solve_with_actor(self, roles, n, actor, combos) -> SetChoice | None:
        """The actor's generation gets the memory its set leaves free, so it is costed against each combination
        of the other members. Options are visited by a lower bound (most memory free) to stop early."""
        spec, sim, usable = self.models[actor], self.sim, self.hw.usable_bytes
        if not combos:
            return None
        least_static = min(c.static for c in combos)
        least_total = min(c.total for c in combos)
        bounded = []
        for a in self.options(actor, n):
            gen = sim.generation_s(spec, a.cfg, usable - a.static - least_static)
            if gen is not None:
                bounded.append((sum(a.stages) + gen, a))
        bounded.sort(key=lambda x: x[0])
        best, best_total = None, _INF
        for bound, a in bounded:
            if bound + least_total >= best_total:
                break
            for c in combos:
                static = c.static + a.static
                if static + max(c.working, a.working) > usable:
                    continue
                gen = sim.generation_s(spec, a.cfg, usable - static)
                if gen is None:
                    continue
                total = c.total + sum(a.stages) + gen
                if total < best_total:
                    best, best_total = (a, c, gen), total
        if best is None:
            return None
        a, c, gen = best
        return self._set_choice(roles, n, c.options + (a,), {actor: gen})

    def _set_choice(self, roles, n, options: tuple[_Option, ...], gen: dict[str, float]) -> SetChoice:
        sim, by_role = self.sim, {o.role: o for o in options}
        free = self.hw.usable_bytes - sum(o.static for o in options)
        models = []
        for role in roles:
            o = by_role[role]
            batch = sim.generation_batch(self.models[role], o.cfg, free) if role in gen else 0
            models.append(
                ModelChoice(
                    role,
                    o.cfg,
                    gen.get(role, 0.0),
                    o.stages[0] if role in gen else 0.0,
                    o.stages[1],
                    o.stages[2],
                    batch,
                )
            )
        stages = (
            sum(o.stages[0] for o in options) + sum(gen.values()),
            sum(o.stages[1] for o in options),
            sum(o.stages[2] for o in options),
        )
        peak = sim.colocated_peak_bytes([(self.models[o.role], get_role(o.role), o.cfg) for o in options])
        return SetChoice(roles, n, stages, tuple(models), peak)

    def memory_floor(self, roles: tuple[str, ...]) -> int:
        """Devices needed if the set's state were spread perfectly: 18 bytes a parameter for trained models
        (bf16 weights, fp32 gradients, fp32 Adam master, m, v), 2 for scoring ones, plus one sequence of KV cache."""
        need = 0.0
        for role in roles:
            spec, r = self.models[role], get_role(role)
            need += (18 if r.trains else 2) * spec.params(r.lm_head)
            if r.generates:
                need += spec.kv_bytes_per_token * self.sim.wl.seq_tokens
        return math.ceil(need / self.hw.usable_bytes)

    def min_devices(self, roles: tuple[str, ...], total: int) -> int | None:
        """Smallest candidate count >= the memory floor on which the colocated set fits, or None up to `total`."""
        floor = self.memory_floor(roles)
        for n in device_counts(total, self.hw.gpus_per_node):
            if n >= floor and self.solve_set(roles, n) is not None:
                return n
        return None

    # -- allocations and placements ----------------------------------------------------------------------------
    def search(self, gpus: int, runner_up_margin: float = RUNNER_UP_MARGIN) -> SearchResult:
        """Algorithm 1: the cheapest placement, allocation and parallel sizes on `gpus` devices. Placements within
        `runner_up_margin` of the best are costed exactly for the ranking; the rest are only shown to be worse."""
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        start = time.perf_counter()
        candidates, placements = [], 0
        for placement in set_partitions(list(self.models)):
            placements += 1
            tables = self._tables(placement, gpus)
            if tables is not None:
                vectors = [[(c, choice.stages) for c, choice in t] for t in tables]
                candidates.append((_lower_bound(vectors, gpus), tuple(placement), tables, vectors))
        # Fewer sets first (few allocations, quick to settle), then by bound: the incumbent then prunes the rest.
        candidates.sort(key=lambda x: (len(x[1]), x[0]))
        ranking, best, evaluated = [], None, 0
        for bound, placement, tables, vectors in candidates:
            # Prune only what can beat neither the margin nor the runner-up found so far, so the runner-up is exact.
            costs = sorted(c for _, c, _ in ranking)
            cutoff = _INF if len(costs) < 2 else max(costs[0] * (1 + runner_up_margin), costs[1])
            if bound >= cutoff:
                continue
            found, n_eval = _best_allocation(vectors, gpus, cutoff)
            evaluated += n_eval
            if found is None:
                continue
            cost, alloc = found
            ranking.append((placement, cost, alloc))
            if best is None or cost < best[0]:
                best = (cost, [dict(t)[c] for t, c in zip(tables, alloc)])
        if best is None:
            raise ValueError(
                f"no placement of {', '.join(self.models)} fits on {gpus} x {self.hw.name}; the "
                "models need more devices (or devices with more memory)"
            )
        cost, sets = best
        stages = {name: max(s.stages[i] for s in sets) for i, name in enumerate(STAGES)}
        plan = Plan(
            tuple(s.roles for s in sets),
            tuple(ModelPlan(m.role, s.gpus, m.parallel.train, m.parallel.generate) for s in sets for m in s.models),
        )
        ranking = [
            r
            for i, r in enumerate(sorted(ranking, key=lambda x: x[1]))
            if i < 2 or r[1] <= cost * (1 + runner_up_margin)
        ]
        return SearchResult(
            plan,
            cost,
            stages,
            tuple(sets),
            tuple((p, c) for p, c, _ in ranking),
            time.perf_counter() - start,
            placements,
            evaluated,
            tuple(a for _, _, a in ranking),
        )

    def _tables(self, placement: Sequence[tuple[str, ...]], gpus: int) -> list[list[tuple[int, SetChoice]]] | None:
        """Per set, (count, its choice) for every count the set can take on `gpus` devices; None if they cannot
        all fit."""
        floors = [self.min_devices(s, gpus) for s in placement]
        if None in floors or sum(floors) > gpus:
            return None
        counts = device_counts(gpus, self.hw.gpus_per_node)
        return [
            [
                (c, choice)
                for c in counts
                if f <= c <= gpus - sum(floors) + f
                if (choice := self.solve_set(s, c)) is not None
            ]
            for s, f in zip(placement, floors)
        ]

    def cost_placement(self, placement: Sequence[Sequence[str]], gpus: int) -> tuple[float, tuple[int, ...]] | None:
        """One placement's best iteration time on `gpus` devices and its devices per set (None if it does not
        fit): what `search` finds for it, for comparing named placements (the paper's colocate, split, ...)."""
        placement = [tuple(r for r in self.models if r in s) for s in placement]
        if sorted(r for s in placement for r in s) != sorted(self.models):
            raise ValueError(f"placement {placement} must hold each of {', '.join(self.models)} once")
        tables = self._tables(placement, gpus)
        if tables is None:
            return None
        found, _ = _best_allocation([[(c, choice.stages) for c, choice in t] for t in tables], gpus)
        return found


def auto_map(
    models: Mapping[str, LlamaSpec],
    gpus: int,
    hardware: Hardware | None = None,
    workload: Workload | None = None,
    *,
    pipeline: bool = True,
) -> SearchResult:
    """Cheapest plan for `models` (role -> spec) on `gpus` devices of `hardware` (default: A100-80GB)."""
    return AutoMapper(models, hardware, workload, pipeline=pipeline).search(gpus)


class _Bounds:
    """Lower bounds on the iteration cost once some sets have their devices (tables sorted by count).

    Each set's stage latency is at least its least device-seconds over its devices, w/c. Per stage, the sets left
    therefore take at least (a) what each could do alone with every device it could get, and (b) their summed
    device-seconds over the devices left. (c) is the Lagrangian bound of the continuous relaxation
    min Σ_s max(worst_s, max_j w_js/c_j) subject to Σ_j c_j = room: for weights λ_s over the candidates of each
    stage's maximum, the cost is at least Σ_s λ_s0·worst_s + Σ_j A_j/c_j with A_j = Σ_s λ_sj·w_js, whose least value
    over the devices is (Σ_j √A_j)²/room. The weights come from a few Frank-Wolfe steps (each stage's argmax at the
    allocation that is optimal for the current weights); any weights give a valid bound. (c) is what separates
    placements: concurrent sets whose stages do not overlap cannot share their devices the way (b) assumes."""

    def __init__(self, tables: list[list[tuple[int, Vec]]]) -> None:
        self.floors = [t[0][0] for t in tables]
        self.counts = [[c for c, _ in t] for t in tables]
        self.running = []  # per-stage minimum over counts <= r, as a running minimum by count
        for table in tables:
            mins, run = [], (_INF, _INF, _INF)
            for _, vec in table:
                run = tuple(map(min, run, vec))
                mins.append(run)
            self.running.append(mins)
        self.work = [tuple(min(c * vec[s] for c, vec in t) for s in range(3)) for t in tables]
        self.work_after = [tuple(sum(w[s] for w in self.work[i:]) for s in range(3)) for i in range(len(tables) + 1)]
        self.floor_after = [sum(self.floors[i:]) for i in range(len(tables) + 1)]

    def after(self, i: int, worst: tuple[float, ...], room: int, steps: int = 3, cutoff: float = _INF) -> float:
        """Least iteration cost once sets < i have stage maxima `worst` and sets >= i share `room` devices. Once
        the cheap bounds (a) and (b) reach `cutoff` the result is returned without (c): the caller only asks
        whether the bound reaches it."""
        # Unrolled over the three stages: this runs once per partial allocation.
        w0, w1, w2 = self.work_after[i]
        b0, b1, b2 = max(worst[0], w0 / room), max(worst[1], w1 / room), max(worst[2], w2 / room)  # (b)
        spare = room - self.floor_after[i]
        for j in range(i, len(self.floors)):  # (a)
            r0, r1, r2 = self.running[j][bisect.bisect_right(self.counts[j], spare + self.floors[j]) - 1]
            b0, b1, b2 = max(b0, r0), max(b1, r1), max(b2, r2)
        best = b0 + b1 + b2
        work = self.work[i:]
        if len(work) < 2 or best >= cutoff:
            return best
        share = [math.sqrt(sum(w)) for w in work]  # (c), starting from devices in proportion to √(total work)
        hits = [[0] * (len(work) + 1) for _ in range(3)]
        for step in range(1, steps + 1):
            total = sum(share)
            for s in range(3):
                x = [worst[s]] + [w[s] * total / (room * c) if c else _INF for w, c in zip(work, share)]
                hits[s][max(range(len(x)), key=x.__getitem__)] += 1
            base = sum(hits[s][0] * worst[s] for s in range(3)) / step
            share = [math.sqrt(sum(hits[s][j + 1] * w[s] for s in range(3)) / step) for j, w in enumerate(work)]
            best = max(best, base + sum(share) ** 2 / room)
            if not any(share):
                break
        return best


def _lower_bound(tables: list[list[tuple[int, Vec]]], total: int) -> float:
    """Least iteration cost any allocation of `total` devices to these sets could reach."""
    if any(not t for t in tables) or sum(t[0][0] for t in tables) > total:
        return _INF
    return _Bounds(tables).after(0, (0.0, 0.0, 0.0), total)


def _best_allocation(
    tables: list[list[tuple[int, Vec]]], total: int, cutoff: float = _INF
) -> tuple[tuple[float, tuple[int, ...]] | None, int]:
    """Branch and bound over allocations: returns ((cost, counts) or None if none beats `cutoff`, allocations
    costed). `tables[i]` lists (count, stage vector) of set i by increasing count; a partial allocation is dropped
    as soon as `_Bounds.after` shows it cannot beat the best found."""
    if not tables or _lower_bound(tables, total) >= cutoff:
        return None, 0
    k, bounds, last = len(tables), _Bounds(tables), dict(tables[-1])
    best: list[Any] = [cutoff, None]
    evaluated = 0

    def visit(i: int, left: int, worst: tuple[float, ...], chosen: tuple[int, ...]) -> None:
        nonlocal evaluated
        if i == k - 1:
            vec = last.get(left)
            if vec is not None:
                evaluated += 1
                cost = iteration_cost([worst, vec])
                if cost < best[0]:
                    best[0], best[1] = cost, chosen + (left,)
            return
        for c, vec in tables[i]:
            room = left - c
            if room < bounds.floor_after[i + 1]:
                break
            now = tuple(map(max, worst, vec))
            if bounds.after(i + 1, now, room, cutoff=best[0]) < best[0]:
                visit(i + 1, room, now, chosen + (c,))

    visit(0, total, (0.0, 0.0, 0.0), ())
    return (None if best[1] is None else (best[0], best[1])), evaluated


def _add(a: Vec, b: Vec) -> Vec:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]
