"""Search time of the auto device mapping against cluster size (HybridFlow §8.5 reports ≤ 30 minutes, growing
linearly, for its largest search).

    python benchmarks/automap.py                       # PPO, four 7B models, A100-80GB, 8 -> 1024 GPUs
    python benchmarks/automap.py --algorithm safe-rlhf # six models, 203 placements
    python benchmarks/automap.py --json                # only the JSON lines

One JSON line per cluster size as it is measured, then a table with the growth from one size to the next and the
log-log slope over the whole range (1 = linear in the number of GPUs). Every search starts fresh (no cache); the
fastest of `--repeat` is reported, as the machine may be busy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement import ALGORITHMS, AutoMapper, Workload, get_hardware, parse_model  # noqa: E402

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", default="ppo", choices=sorted(ALGORITHMS))
    ap.add_argument("--size", default="7b", help="model size for every role")
    ap.add_argument("--gpu", default="a100-80gb")
    ap.add_argument("--gpus", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--repeat", type=int, default=3, help="searches per size; the fastest is reported")
    ap.add_argument("--json", action="store_true", help="print only the JSON lines")
    args = ap.parse_args(argv)
    hardware = get_hardware(args.gpu)
    workload = Workload(baseline_samples_per_prompt=1 if args.algorithm == "remax" else 0)
    rows = []
    for gpus in args.gpus:
        models = {role: parse_model(args.size) for role in ALGORITHMS[args.algorithm]}
        row = {"algorithm": args.algorithm, "size": args.size, "gpu": hardware.name, "gpus": gpus}
        try:
            result = min((AutoMapper(models, hardware, workload).search(gpus) for _ in range(args.repeat)),
                         key=lambda r: r.search_s)
        except ValueError as e:
            row["error"] = str(e)
        else:
            row.update(search_s=round(result.search_s, 4), repeats=args.repeat, placements=result.placements,
                       allocations_evaluated=result.allocations_evaluated,
                       estimated_iteration_s=round(result.estimated_iteration_s, 2),
                       placement=[list(s) for s in result.plan.placement], pools=result.plan.pools())
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.json:
        print()
        print(_table(rows))
    return 0


def _table(rows: list[dict]) -> str:
    lines = [f"{'gpus':>5} {'search s':>9} {'x prev':>7} {'allocs':>7} {'iter s':>8}  placement (gpus per pool)"]
    prev = None
    for r in rows:
        if "error" in r:
            lines.append(f"{r['gpus']:>5}  {r['error']}")
            continue
        growth = f"{r['search_s'] / prev:.2f}" if prev else "-"
        pools = " ".join(f"[{p}]={n}" for p, n in r["pools"].items())
        lines.append(f"{r['gpus']:>5} {r['search_s']:>9.3f} {growth:>7} {r['allocations_evaluated']:>7} "
                     f"{r['estimated_iteration_s']:>8.1f}  {pools}")
        prev = r["search_s"]
    ok = [r for r in rows if "error" not in r]
    if len(ok) >= 2 and ok[0]["search_s"] > 0:
        slope = math.log(ok[-1]["search_s"] / ok[0]["search_s"]) / math.log(ok[-1]["gpus"] / ok[0]["gpus"])
        lines.append(f"search time grows as gpus^{slope:.2f} from {ok[0]['gpus']} to {ok[-1]['gpus']} GPUs "
                     f"({ok[0]['algorithm']}, {len(ALGORITHMS[ok[0]['algorithm']])} models of "
                     f"{ok[0]['size']}, {ok[0]['gpu']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
