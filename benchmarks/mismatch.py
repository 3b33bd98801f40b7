"""The rollout engine against the trainer: low-precision rollouts, the mismatch they make, and what correcting it does.

    python benchmarks/mismatch.py [--json] [--steps 40] [--seeds 0,1]

The default GRPO and PPO tasks (tiny Llama, float32 training, 2 local slots), each run with float32 rollouts (the
reference: the rollout is the trainer's own computation), then bfloat16 and float16 rollouts (`rollout_dtype`, the
hf engine decoding under autocast) without a correction, with `rollout_correction=tis` and with `mis`, all token
level, same seeds. Per run: the mean mismatch figures over the run (algorithms.objectives.losses.mismatch_metrics:
KL(rollout || trainer) on the sampled tokens, mean and largest |log-prob difference|, fraction of tokens whose ratio
leaves [1/2, 2]), the mean reward of the first and last 10 steps, and the last-10 gap to the float32 run of the same
seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = [
    ("float32", "", "none"),
    ("bfloat16", "bfloat16", "none"),
    ("bfloat16+tis", "bfloat16", "tis"),
    ("bfloat16+mis", "bfloat16", "mis"),
    ("float16", "float16", "none"),
]
KEYS = ("mismatch_kl", "mismatch_abs_diff", "mismatch_max_diff", "mismatch_frac_beyond")


def run(program: str, dtype: str, correction: str, steps: int, seed: int) -> dict:
    import importlib

    main = importlib.import_module(f"algorithms.{program}").main
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.jsonl"
        argv = ["dashboard=none", "--steps", str(steps), f"seed={seed}", f"rollout_correction={correction}"]
        main([*argv, *([f"rollout_dtype={dtype}"] if dtype else []), "--metrics-file", str(path)])
        h = [json.loads(x) for x in path.read_text().splitlines()]
    mean = lambda key, w: statistics.mean(r[key] for r in w)  # noqa: E731
    return {
        **{k: mean(f"actor/{k}", h) for k in KEYS},
        "reward_first10": mean("reward_mean", h[:10]),
        "reward_last10": mean("reward_mean", h[-10:]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line per run first")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0,1", help="comma-separated")
    p.add_argument("--programs", default="grpo,ppo")
    args = p.parse_args(argv)
    rows = []
    for program in args.programs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            reference = None
            for name, dtype, correction in RUNS:
                t0 = time.perf_counter()
                r = {"program": program, "seed": seed, "run": name, **run(program, dtype, correction, args.steps, seed)}
                reference = r["reward_last10"] if reference is None else reference
                r["gap_to_float32"] = r["reward_last10"] - reference
                rows.append(r)
                print(f"  {program} seed {seed} {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(
        f"\nrollout precision against float32 training; {args.steps} steps, default tasks, seeds {args.seeds}\n"
        f"{'program':<8} {'seed':>4} {'run':<14} {'KL':>9} {'mean|d|':>8} {'max|d|':>7} {'beyond':>7} "
        f"{'reward 0-10':>11} {'last 10':>8} {'gap':>7}"
    )
    for r in rows:
        print(
            f"{r['program']:<8} {r['seed']:>4} {r['run']:<14} {r['mismatch_kl']:>9.2e} {r['mismatch_abs_diff']:>8.4f} "
            f"{r['mismatch_max_diff']:>7.3f} {r['mismatch_frac_beyond']:>7.4f} {r['reward_first10']:>11.3f} "
            f"{r['reward_last10']:>8.3f} {r['gap_to_float32']:>+7.3f}"
        )


if __name__ == "__main__":
    main()
