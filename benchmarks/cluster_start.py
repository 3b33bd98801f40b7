"""How long the embedded cluster takes to be ready: worker processes spawned (Dask's default) or forked from one
server that imported the runtime and the model code once (flowactors.cluster.fork_from_server).

    python benchmarks/cluster_start.py [--json] [--clusters 3]

Each method runs in a fresh interpreter (a process has one fork server) that opens `--clusters` embedded clusters
of 2 workers one after another, as a test suite or a notebook does, with the algorithms' preload
(`engines.preload`). Per cluster: `start` (Controller.local), `first call` (a group whose workers build a tiny
model and answer), `close`. The first cluster's start includes the server's own imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import flowactors as fa  # noqa: E402


class Tiny(fa.Worker):
    def __init__(self) -> None:
        from engines import ModelConfig, build_model, build_tokenizer

        tokenizer = build_tokenizer(ModelConfig())
        self.model = build_model(ModelConfig(hidden_size=32, num_layers=2), "lm", tokenizer)

    @fa.endpoint(protocol=fa.ONE_TO_ALL)
    def size(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _run(clusters: int) -> list[dict]:
    rows = []
    for i in range(clusters):
        t0 = time.perf_counter()
        ctl = fa.Controller.local(2, dashboard=None, preload=("engines.preload",))
        t1 = time.perf_counter()
        group = fa.ActorGroup(ctl, Tiny, name="tiny")
        group.size().result()
        t2 = time.perf_counter()
        ctl.close()
        t3 = time.perf_counter()
        rows.append({"cluster": i + 1, "start_s": t1 - t0, "first_call_s": t2 - t1, "close_s": t3 - t2})
    return rows


def measure(method: str, clusters: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if method == "spawn":  # Dask's default, chosen explicitly: flowactors keeps a chosen method
        env["DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"] = "spawn"
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(clusters)], env=env, capture_output=True, text=True, check=True
    ).stdout
    return [{"method": method, **r} for r in json.loads(out.strip().splitlines()[-1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per cluster, no table")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_run(args.child)))
        return
    rows = [r for method in ("spawn", "forkserver") for r in measure(method, args.clusters)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'method':<11} {'cluster':>7} {'start s':>8} {'first call s':>13} {'close s':>8} {'ready s':>8}")
    for r in rows:
        ready = r["start_s"] + r["first_call_s"]
        print(
            f"{r['method']:<11} {r['cluster']:>7} {r['start_s']:>8.2f} {r['first_call_s']:>13.2f} "
            f"{r['close_s']:>8.2f} {ready:>8.2f}"
        )


if __name__ == "__main__":
    main()
