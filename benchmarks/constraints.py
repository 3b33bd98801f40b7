"""Constraint satisfaction of Safe-RLHF's multipliers: dual ascent against the PID Lagrangian, over seeds.

    python benchmarks/constraints.py [--json] [--seeds 0,1,2] [--tasks digit_sum,digit_sum_two,tool_arith_safe]
                                     [--updates dual,pid] [--set pid_ki=0.2 ...]

Each task with its own settings (the default run's, `digit_sum_two`'s two budgets, `tool_arith_safe`'s warm start,
λ step and PID integral), `lambda_update=dual` and `lambda_update=pid` (the default gains), the same seeds. Per run and
constraint, over the last 40 steps: the reward and the cost, the violation (how far the mean cost is above its
threshold, 0 when under), and the oscillation (the standard deviation of the 10-step cost means over the second
half of the run), beside its floor: the standard deviation those means would have from sampling alone (the
steps' per-sample cost spread, `cost_std`, over the samples of 10 steps), and the excess above it,
sqrt(oscillation² − floor²), what the multiplier adds. Targets (the constrained-RL issue): PID's violation <= 0.02 on every task and seed, its oscillation
<= 0.5x dual ascent's, its final reward >= dual ascent's at equal or lower violation. Each finished run is also
appended as a JSON line to `--out` (so a long sweep keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THRESHOLDS = {"digit_sum": [0.3], "digit_sum_two": [0.3, 0.4], "tool_arith_safe": [0.3]}


def samples_per_step(task: str, extra: list[str]) -> int:
    """The samples a step's mean cost is taken over: the config's, the task's setting, or what `extra` sets."""
    from algorithms.data.tasks import get_task
    from algorithms.run.config import SafeRLHFConfig

    cfg, given = SafeRLHFConfig(), {**dict(get_task(task).settings), **dict(x.split("=", 1) for x in extra)}
    return int(given.get("prompts_per_step", cfg.prompts_per_step)) * int(
        given.get("samples_per_prompt", cfg.samples_per_prompt)
    )


def run(task: str, update: str, seed: int, extra: list[str] = ()) -> dict:
    from algorithms.safe_rlhf import main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.jsonl"
        argv = ["dashboard=none", f"task={task}", f"lambda_update={update}", f"seed={seed}", *extra]
        main([*argv, "--metrics-file", str(path)])
        h = [json.loads(x) for x in path.read_text().splitlines()]
    last, second = h[-40:], h[len(h) // 2 :]
    out = {"task": task, "update": update, "seed": seed, "steps": len(h)}
    out["reward_last40"] = statistics.mean(r["reward_mean"] for r in last)
    samples = samples_per_step(task, extra)
    for k, threshold in enumerate(THRESHOLDS[task]):
        key = f"cost_mean_{k}" if k else "cost_mean"
        cost = statistics.mean(r[key] for r in last)
        windows = [statistics.mean(r[key] for r in second[i : i + 10]) for i in range(0, len(second) - 9, 10)]
        out[f"cost_last40_{k}"] = cost
        out[f"violation_{k}"] = max(0.0, cost - threshold)
        out[f"oscillation_{k}"] = statistics.pstdev(windows) if len(windows) > 1 else 0.0
        spread = [r[f"cost_std_{k}" if k else "cost_std"] for r in second]
        out[f"noise_{k}"] = math.sqrt(statistics.mean(x * x for x in spread) / samples / 10)
        out[f"excess_{k}"] = math.sqrt(max(0.0, out[f"oscillation_{k}"] ** 2 - out[f"noise_{k}"] ** 2))
    constraints = range(len(THRESHOLDS[task]))
    out["violation"] = max(out[f"violation_{k}"] for k in constraints)
    worst = max(constraints, key=lambda k: out[f"oscillation_{k}"])
    for key in ("oscillation", "noise", "excess"):  # the row's three figures, of the same constraint
        out[key] = out[f"{key}_{worst}"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line per run first")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tasks", default=",".join(THRESHOLDS))
    p.add_argument("--out", default=None, help="append each run's JSON line to this file as it finishes")
    p.add_argument("--updates", default="dual,pid", help="which multiplier updates to run")
    p.add_argument("--set", nargs="*", default=[], help="settings for every run (e.g. pid_ki=0.3)")
    args = p.parse_args(argv)
    rows = []
    for task in args.tasks.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for update in args.updates.split(","):
                t0 = time.perf_counter()
                rows.append(run(task, update, seed, args.set))
                print(f"  {task} seed {seed} {update}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(
        f"\n{'task':<16} {'seed':>4} {'update':<5} {'reward':>7} {'cost(s)':>13} {'violation':>9} {'oscillation':>11} "
        f"{'floor':>6} {'excess':>6}"
    )
    for r in rows:
        costs = "/".join(f"{r[f'cost_last40_{k}']:.3f}" for k in range(len(THRESHOLDS[r["task"]])))
        print(
            f"{r['task']:<16} {r['seed']:>4} {r['update']:<5} {r['reward_last40']:>7.3f} {costs:>13} "
            f"{r['violation']:>9.3f} {r['oscillation']:>11.3f} {r['noise']:>6.3f} {r['excess']:>6.3f}"
        )
    print("\nPID against dual ascent per task (means over seeds):")
    for task in dict.fromkeys(r["task"] for r in rows):
        by = {u: [r for r in rows if r["task"] == task and r["update"] == u] for u in ("dual", "pid")}
        if not by["dual"] or not by["pid"]:
            continue
        m = {
            u: {k: statistics.mean(r[k] for r in rs) for k in ("reward_last40", "violation", "oscillation", "excess")}
            for u, rs in by.items()
        }
        worst = max(r["violation"] for r in by["pid"])

        def ratio(key: str) -> float:
            return m["pid"][key] / m["dual"][key] if m["dual"][key] else float("inf")

        print(
            f"  {task}: PID's worst violation {worst:.3f} (target <= 0.02); oscillation {ratio('oscillation'):.2f}x "
            f"dual's (target <= 0.5x), above the sampling floor {ratio('excess'):.2f}x; reward "
            f"{m['pid']['reward_last40']:.3f} vs {m['dual']['reward_last40']:.3f} at violation "
            f"{m['pid']['violation']:.3f} vs {m['dual']['violation']:.3f}"
        )


if __name__ == "__main__":
    main()
