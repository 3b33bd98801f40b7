"""`python -m placement.automap`: HybridFlow's auto device mapping from the command line (§6, Algorithm 1).

    python -m placement.automap --model actor=13b --model critic=70b --model ref=13b --model reward=70b \\
        --gpus 64 --json > plan.json
    python -m placement.automap --algorithm ppo --size 7b --gpus 16 --gpu h100

`--json` prints one object: the plan (placement, gpus, parallel), which `Plan.load` and the algorithm scripts
accept as it is, plus what runs it (`engine`: "megatron" when a model has p > 1, else "torch"; `engine_note`), the
estimate (`estimated_iteration_s`, `stages`, per-model `models`), the runner-up placements and `search_s`. Without
it, a table. `--engine torch` searches only plans without pipeline stages, which the torch engine runs.
docs/placement.md explains how to read either.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from placement.hardware import PROFILES, get_hardware
from placement.models import parse_model
from placement.plan import engine_note
from placement.search import RUNNER_UP_MARGIN, SearchResult, auto_map
from placement.simulator import ALGORITHMS, ROLES, Workload


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m placement.automap", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="ROLE=SIZE",
        help=f"a model: role ({', '.join(ROLES)}) = 7b|13b|34b|70b or "
        "'hidden=..,layers=..,heads=..,ffn=..[,kv_heads=..,vocab=..]'; repeat per model",
    )
    ap.add_argument(
        "--algorithm",
        type=algorithm_name,
        metavar="NAME",
        help=f"fill the algorithm's roles with --size: {_accepted_algorithms()}",
    )
    ap.add_argument("--size", default="7b", help="model size for --algorithm roles not given by --model")
    ap.add_argument("--gpus", type=int, required=True, help="devices in the cluster")
    ap.add_argument("--gpu", default="a100-80gb", choices=sorted(PROFILES), help="hardware profile")
    ap.add_argument("--gpus-per-node", type=int, help="override the profile's GPUs per node")
    ap.add_argument("--prompts-per-step", type=int, default=Workload.prompts_per_step)
    ap.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    ap.add_argument("--response-tokens", type=int, default=Workload.response_tokens)
    ap.add_argument("--samples-per-prompt", type=int, default=Workload.samples_per_prompt)
    ap.add_argument(
        "--engine",
        choices=("any", "torch"),
        default="any",
        help="torch: only plans with p = 1 (the torch engine has no pipeline parallelism); any: p > 1 "
        "too, marked as needing model.engine=megatron",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--save", metavar="PATH", help="also write the plan to PATH (.json, or .yaml with PyYAML)")
    return ap


def algorithm_name(name: str) -> str:
    """The `ALGORITHMS` key of an algorithm given by its program's name (`safe_rlhf`, as in algorithms/safe_rlhf.py)
    or by the dashed name the simulator uses (`safe-rlhf`)."""
    key = name.strip().lower().replace("_", "-")
    if key not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"unknown algorithm {name!r}; choose one of {_accepted_algorithms()}")
    return key


def _accepted_algorithms() -> str:
    return ", ".join(a if "-" not in a else f"{a.replace('-', '_')} (or {a})" for a in sorted(ALGORITHMS))


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        models = {role: parse_model(args.size) for role in ALGORITHMS.get(args.algorithm, ())}
        for item in args.model:
            role, sep, size = item.partition("=")
            if not sep:
                ap.error(f"--model {item!r}: write ROLE=SIZE, e.g. actor=13b")
            if role not in ROLES:
                ap.error(f"--model {item!r}: unknown role {role!r}; roles are {', '.join(ROLES)}")
            models[role] = parse_model(size)
        if not models:
            ap.error("give --algorithm or at least one --model ROLE=SIZE")
        hardware = get_hardware(args.gpu)
        if args.gpus_per_node:
            hardware = hardware.with_gpus_per_node(args.gpus_per_node)
        workload = Workload(
            prompts_per_step=args.prompts_per_step,
            prompt_tokens=args.prompt_tokens,
            response_tokens=args.response_tokens,
            samples_per_prompt=args.samples_per_prompt,
            baseline_samples_per_prompt=1 if args.algorithm == "remax" else 0,
        )
        result = auto_map(models, args.gpus, hardware, workload, pipeline=args.engine == "any")
    except ValueError as e:
        print(f"automap: {e}", file=sys.stderr)
        return 2
    if args.save:
        result.plan.save(args.save)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_table(result, f"{args.gpus} x {hardware.name} ({hardware.gpus_per_node} per node)"))
    return 0


# (header, alignment) of the plan table's columns; widths come from the content, so long pool names keep it aligned
_COLUMNS = (
    ("pool", "<"),
    ("gpus", ">"),
    ("model", "<"),
    ("train p,t,d", "<"),
    ("gen p,t", "<"),
    ("engine", "<"),
    ("generate s", ">"),
    ("transit s", ">"),
    ("infer s", ">"),
    ("train s", ">"),
    ("peak GiB", ">"),
)


def model_engine(train: tuple[int, int, int]) -> str:
    """What can run one model's (p, t, d): pipeline stages need the megatron engine, p = 1 runs on either."""
    return "megatron (p>1)" if train[0] > 1 else "any"


def format_table(result: SearchResult, cluster: str) -> str:
    """The plan and its estimate as a table for people."""

    def num(x: float) -> str:
        return f"{x:.2f}" if x else "-"

    rows = []
    for s in result.sets:
        for i, m in enumerate(s.models):
            first = i == 0
            rows.append(
                [
                    "+".join(s.roles) if first else "",
                    str(s.gpus) if first else "",
                    m.role,
                    ",".join(map(str, m.parallel.train)),
                    ",".join(map(str, m.parallel.generate)) if m.parallel.generate else "-",
                    model_engine(m.parallel.train),
                    num(m.generate_s),
                    num(m.transition_s),
                    num(m.inference_s),
                    num(m.train_s),
                    f"{s.peak_bytes / 2**30:.1f}" if first else "",
                ]
            )
    lines = [
        f"auto device mapping on {cluster}: {result.placements} placements searched in {result.search_s:.2f} s",
        f"engine: {result.engine} ({engine_note(result.plan)})",
        "",
        *_aligned([h for h, _ in _COLUMNS], rows, [a for _, a in _COLUMNS]),
    ]
    lines += ["", "stage       seconds (slowest pool; models in one pool add up)"]
    lines += [f"{name:<10}{t:>9.2f}" for name, t in result.stages.items()]
    lines += [
        f"{'iteration':<10}{result.estimated_iteration_s:>9.2f}",
        "",
        f"placements within {RUNNER_UP_MARGIN:.0%} of the best, and the runner-up (iteration s):",
    ]
    lines += [
        f"{cost:>9.2f} s  " + "  ".join("[" + ", ".join(s) + f"]={n}" for s, n in zip(p, gpus))
        for (p, cost), gpus in zip(result.ranking, result.ranking_gpus)
    ]
    return "\n".join(line.rstrip() for line in lines)


def _aligned(header: list[str], rows: list[list[str]], align: list[str]) -> list[str]:
    """Header and rows as lines of columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)) for row in [header, *rows]]


if __name__ == "__main__":
    sys.exit(main())
