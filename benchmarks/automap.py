"""Auto device mapping: the paper's placement experiments (`--table`) and search time against cluster size
(HybridFlow §8.4-8.5; the paper reports up to 30 minutes, growing linearly, for its largest search).

    python benchmarks/automap.py --table                 # PPO 7B/13B/34B/70B and 13B actor+ref / 70B critic+reward
                                                         # on 8-128 A100s: chosen plan next to the runner-up
    python benchmarks/automap.py                         # search time: PPO, four 7B models, 8 -> 1024 GPUs
    python benchmarks/automap.py --algorithm safe-rlhf   # six models, 203 placements
    python benchmarks/automap.py --json                  # only the JSON lines
    python benchmarks/automap.py --stages                # 13B/70B: stage seconds of colocation and the splits
                                                         # at 64, 96, 128 A100s (why colocation stays ahead)

`--table` prints, per case and cluster size, the placement chosen (pools and their GPUs), each model's (p,t,d) and
the actor's generation (p_g,t_g), the engine the plan needs, the estimated iteration time, and the runner-up
placement with its own best allocation and time. Search-time mode prints one JSON line per cluster size as it is
measured, then a table with the growth from one size to the next and the log-log slope over the whole range (1 =
linear in the number of GPUs). Every search starts fresh (no cache); the fastest of `--repeat` is reported, as the
machine may be busy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement import ALGORITHMS, AutoMapper, Workload, get_hardware, iteration_cost, parse_model
from placement.search import SearchResult, set_partitions

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
TABLE_SIZES = (8, 16, 32, 64, 96, 128)
TABLE_CASES = {  # the paper's PPO workloads (§8.1) and its heterogeneous placement experiment (§8.4)
    "ppo 7b": {r: "7b" for r in ALGORITHMS["ppo"]},
    "ppo 13b": {r: "13b" for r in ALGORITHMS["ppo"]},
    "ppo 34b": {r: "34b" for r in ALGORITHMS["ppo"]},
    "ppo 70b": {r: "70b" for r in ALGORITHMS["ppo"]},
    "ppo 13b/70b": {"actor": "13b", "critic": "70b", "ref": "13b", "reward": "70b"},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="store_true", help="the placement table of the paper's experiments")
    ap.add_argument("--algorithm", default="ppo", choices=sorted(ALGORITHMS))
    ap.add_argument("--size", default="7b", help="model size for every role")
    ap.add_argument("--gpu", default="a100-80gb")
    ap.add_argument("--gpus", type=int, nargs="+", help=f"cluster sizes (default {SIZES}, {TABLE_SIZES} with --table)")
    ap.add_argument("--repeat", type=int, default=3, help="searches per size; the fastest is reported")
    ap.add_argument("--json", action="store_true", help="print only the JSON lines")
    ap.add_argument(
        "--stages",
        action="store_true",
        help="stage seconds of the 13B/70B case's colocated and split plans (default 64, 96 and 128 GPUs)",
    )
    args = ap.parse_args(argv)
    hardware = get_hardware(args.gpu)
    if args.stages:
        print(stage_breakdown(hardware, args.gpus or STAGE_SIZES))
        return 0
    if args.table:
        print(placement_table(hardware, args.gpus or TABLE_SIZES))
        print()
        print(paper_placements(hardware, [g for g in args.gpus or TABLE_SIZES if g >= 32]))
        return 0
    workload = Workload(baseline_samples_per_prompt=1 if args.algorithm == "remax" else 0)
    rows = []
    for gpus in args.gpus or SIZES:
        models = {role: parse_model(args.size) for role in ALGORITHMS[args.algorithm]}
        row = {"algorithm": args.algorithm, "size": args.size, "gpu": hardware.name, "gpus": gpus}
        try:
            result = min(
                (AutoMapper(models, hardware, workload).search(gpus) for _ in range(args.repeat)),
                key=lambda r: r.search_s,
            )
        except ValueError as e:
            row["error"] = str(e)
        else:
            row.update(
                search_s=round(result.search_s, 4),
                repeats=args.repeat,
                placements=result.placements,
                allocations_evaluated=result.allocations_evaluated,
                estimated_iteration_s=round(result.estimated_iteration_s, 2),
                placement=[list(s) for s in result.plan.placement],
                pools=result.plan.pools(),
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.json:
        print()
        print(_table(rows))
    return 0


def placement_table(hardware, sizes) -> str:
    """The chosen plan and the runner-up for every case of `TABLE_CASES` on every cluster size."""
    lines = [
        f"PPO, 1024 prompts x (1024 + 1024) tokens, {hardware.name}, {hardware.gpus_per_node} per node. "
        "p,t,d per model (actor: /gen p_g,t_g); pools are colocated sets.",
        "",
    ]
    header = [
        "case",
        "gpus",
        "chosen placement (gpus)",
        "p,t,d per model",
        "engine",
        "iter s",
        "runner-up placement (gpus)",
        "iter s",
        "x",
    ]
    rows = []
    start = time.perf_counter()
    for case, sizes_by_role in TABLE_CASES.items():
        models = {role: parse_model(size) for role, size in sizes_by_role.items()}
        mapper = AutoMapper(models, hardware)  # one mapper per case: its caches carry across cluster sizes
        for gpus in sizes:
            try:
                result = mapper.search(gpus)
            except ValueError:
                rows.append([case, str(gpus), "does not fit (memory)", "", "", "", "", "", ""])
                continue
            up = result.runner_up
            up_cost = f"{up[1]:.1f}" if up else "-"
            ratio = f"{up[1] / result.estimated_iteration_s:.2f}" if up else "-"
            rows.append(
                [
                    case,
                    str(gpus),
                    _pools(result),
                    _sizes(result),
                    result.engine,
                    f"{result.estimated_iteration_s:.1f}",
                    _runner_up(result),
                    up_cost,
                    ratio,
                ]
            )
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    right = {1, 5, 7, 8}
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                f"{cell:{'>' if c in right else '<'}{w}}" for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
    lines += ["", f"x: runner-up time / chosen time. {len(rows)} searches in {time.perf_counter() - start:.1f} s."]
    return "\n".join(lines)


PAPER = {  # HybridFlow §8.4, 13B actor and reference with 70B critic and reward (the Korean summary in the seeds)
    32: "colocate ahead (up to 64 GPUs)",
    64: "colocate ahead (44.8% more throughput on average up to 64)",
    96: "split ahead",
    128: "split ahead; best: [actor+ref+reward]=64 [critic]=64",
}


def paper_placements(hardware, sizes) -> str:
    """The heterogeneous case's named placements, each at its best allocation, against what the paper measured."""
    case = TABLE_CASES["ppo 13b/70b"]
    mapper = AutoMapper({role: parse_model(size) for role, size in case.items()}, hardware)
    named = {
        "colocate": [("actor", "critic", "ref", "reward")],
        "split [actor+ref][critic+reward]": [("actor", "ref"), ("critic", "reward")],
        "[actor+ref+reward][critic]": [("actor", "ref", "reward"), ("critic",)],
    }
    header = ["gpus", *named, "[a+ref+rw]=N/2 [critic]=N/2", "paper (measured)"]
    rows = []
    for gpus in sizes:
        row = [str(gpus)]
        for placement in named.values():
            found = mapper.cost_placement(placement, gpus)
            row.append("does not fit" if found is None else f"{found[0]:.1f} ({'+'.join(map(str, found[1]))})")
        halves = [mapper.solve_set(s, gpus // 2) for s in named["[actor+ref+reward][critic]"]]
        row.append("does not fit" if None in halves else f"{iteration_cost([h.stages for h in halves]):.1f}")
        rows.append(row + [PAPER.get(gpus, "")])
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = [
        "13B actor+ref / 70B critic+reward: the paper's placements, iteration s at each one's best allocation "
        "(devices per pool)",
        "",
    ]
    lines += [
        "  ".join(
            f"{cell:{'<' if c == len(header) - 1 else '>'}{w}}" for c, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


STAGE_SIZES = (64, 96, 128)


def stage_breakdown(hardware, sizes) -> str:
    """Why the 13B/70B case stays colocated (docs/placement.md): per cluster size, the stage seconds of colocation,
    of the best plan with actor and critic apart, and of the paper's 128-GPU plan on halves, each pool's and each
    model's; then the speedup colocation would have to be held to for the best split to tie."""
    case = TABLE_CASES["ppo 13b/70b"]
    mapper = AutoMapper({role: parse_model(size) for role, size in case.items()}, hardware)
    every = tuple(mapper.models)
    apart = [
        p
        for p in set_partitions(list(every))
        if len(p) > 1 and next(s for s in p if "actor" in s) != next(s for s in p if "critic" in s)
    ]
    lines = [
        "13B actor+ref / 70B critic+reward, PPO: seconds per stage (gen = the actor's transition and generation, "
        "inf = every scoring pass, train = the updates). Models in a pool add up; pools take the max per stage.",
        "",
    ]
    base = None
    for gpus in sizes:
        plans = [("colocate", [every], None)]
        best = None
        for placement in apart:
            found = mapper.cost_placement(placement, gpus)
            if found and (best is None or found[0] < best[0]):
                best = (found[0], placement, found[1])
        if best:
            plans.append(("best split (actor, critic apart)", best[1], best[2]))
        halves = [("actor", "ref", "reward"), ("critic",)]
        plans.append(("paper's 128-GPU plan on halves", halves, (gpus // 2, gpus - gpus // 2)))
        lines.append(f"== {gpus} x {hardware.name}")
        costs = {}
        for name, placement, alloc in plans:
            if alloc is None:
                found = mapper.cost_placement(placement, gpus)
                alloc = found[1] if found else None
            sets = (
                None
                if alloc is None
                else [mapper.solve_set(tuple(r for r in every if r in s), c) for s, c in zip(placement, alloc)]
            )
            if sets is None or None in sets:
                lines.append(f"  {name}: does not fit")
                continue
            stage_max = [max(s.stages[i] for s in sets) for i in range(3)]
            costs[name] = sum(stage_max)
            lines.append(
                f"  {name}: {sum(stage_max):.1f} s = gen {stage_max[0]:.1f} + inf {stage_max[1]:.1f} "
                f"+ train {stage_max[2]:.1f}"
            )
            for s in sets:
                lines.append(
                    f"    [{'+'.join(s.roles)}]={s.gpus}: gen {s.stages[0]:.1f}  inf {s.stages[1]:.1f}  "
                    f"train {s.stages[2]:.1f}  (peak {s.peak_bytes / 2**30:.1f} GiB)"
                )
                for m in s.models:
                    gen = f"/{m.parallel.p_g},{m.parallel.t_g}" if m.parallel.generate else ""
                    batch = f" batch {m.generation_batch}" if m.generation_batch else ""
                    lines.append(
                        f"      {m.role:7s} {','.join(map(str, m.parallel.train)) + gen:11s} "
                        f"gen {m.generate_s + m.transition_s:6.1f}  inf {m.inference_s:6.1f}  "
                        f"train {m.train_s:6.1f}{batch}"
                    )
        if base is None and "colocate" in costs:
            base = (gpus, costs["colocate"])
        elif base and "colocate" in costs and "best split (actor, critic apart)" in costs:
            g0, c0 = base
            need = c0 / costs["best split (actor, critic apart)"]
            lines.append(
                f"  colocation {g0} -> {gpus} GPUs: ideal speedup {gpus / g0:.2f}x, modelled "
                f"{c0 / costs['colocate']:.2f}x; the best split ties only if it is at most {need:.2f}x"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def _pools(result: SearchResult) -> str:
    return " ".join(f"[{'+'.join(s.roles)}]={s.gpus}" for s in result.sets)


def _sizes(result: SearchResult) -> str:
    out = []
    for s in result.sets:
        for m in s.models:
            gen = f"/{m.parallel.p_g},{m.parallel.t_g}" if m.parallel.generate else ""
            out.append(f"{m.role} {','.join(map(str, m.parallel.train))}{gen}")
    return "; ".join(out)


def _runner_up(result: SearchResult) -> str:
    pools = result.runner_up_pools
    return " ".join(f"[{name}]={n}" for name, n in pools.items()) if pools else "-"


def _table(rows: list[dict]) -> str:
    lines = [f"{'gpus':>5} {'search s':>9} {'x prev':>7} {'allocs':>7} {'iter s':>8}  placement (gpus per pool)"]
    prev = None
    for r in rows:
        if "error" in r:
            lines.append(f"{r['gpus']:>5}  {r['error']}")
            continue
        growth = f"{r['search_s'] / prev:.2f}" if prev else "-"
        pools = " ".join(f"[{p}]={n}" for p, n in r["pools"].items())
        lines.append(
            f"{r['gpus']:>5} {r['search_s']:>9.3f} {growth:>7} {r['allocations_evaluated']:>7} "
            f"{r['estimated_iteration_s']:>8.1f}  {pools}"
        )
        prev = r["search_s"]
    ok = [r for r in rows if "error" not in r]
    if len(ok) >= 2 and ok[0]["search_s"] > 0:
        slope = math.log(ok[-1]["search_s"] / ok[0]["search_s"]) / math.log(ok[-1]["gpus"] / ok[0]["gpus"])
        lines.append(
            f"search time grows as gpus^{slope:.2f} from {ok[0]['gpus']} to {ok[-1]['gpus']} GPUs "
            f"({ok[0]['algorithm']}, {len(ALGORITHMS[ok[0]['algorithm']])} models of "
            f"{ok[0]['size']}, {ok[0]['gpu']})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
