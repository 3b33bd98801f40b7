"""An elastic rollout fleet: a GRPO run whose replicas change under it, measured.

    python benchmarks/fleet.py [--json] [--steps 90] [--grow-at 5] [--kill-after 15] [--max-new-tokens 32]

A cluster of 2 trainer slots and one pool worker (`rollout` resource, algorithms/rollout/fleet.py) runs GRPO with
`async_replicas=1:3`. After `--grow-at` steps an operator thread adds a pool worker (Dask's own scale, as a
jobqueue's adapt would), which joins as a replica with a peer's weights; `--kill-after` steps after it joined, the
operator SIGKILLs the other replica's worker (its nanny restarts it, and the new worker joins again). Reported:

- `startup_s`: the first replica's time from its worker's arrival to its first finished group, at the run's start
  (weights from the trainer), and `startup_asked_s` from the run asking the cluster for it (the worker process's
  own start and preload included, where the run starts it); `join_s`: a worker that joined mid-run, from its
  arrival to its first finished group (weights from a peer); the target is join <= 2x start-up. The first group's
  time is the replica's own (from its first call), not when the controller collects it, which a running pipeline
  does once per step;
- `join_trainer_bytes` / `join_peer_bytes`: what each join fetched from the trainer's workers and from peers;
- `requeued_per_loss`: prompt groups requeued per lost replica, and the samples that is (x samples_per_prompt);
- `tokens_per_s` by fleet size: (prompt + response) tokens / wall time of the steps trained with that many
  replicas (the steps right after a change are left out); a step's batch is the same size whatever the fleet.

Caveat: this machine has 2 cores for the trainer's 2 processes and every replica, so more replicas share the same
cores; the figure shows that a fleet change costs the trainer no stop, not how throughput scales with devices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def run(steps: int, grow_at: int, kill_after: int, max_new_tokens: int) -> dict:
    from distributed import Client, LocalCluster

    from algorithms.grpo import main as grpo
    from algorithms.rollout.fleet import PRELOAD, RESOURCE
    from flowactors.cluster import resize_pool

    metrics = Path(tempfile.mkdtemp()) / "m.jsonl"
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
        resources={"slot": 1},
    )  # fmt: skip
    client = Client(cluster, set_as_default=False)
    events: dict[str, int] = {}
    over = threading.Event()

    def operator() -> None:
        resize_pool(cluster, RESOURCE, 1, PRELOAD)
        while not over.is_set():
            done = _rows(metrics)
            if "grown" not in events and len(done) >= grow_at:
                resize_pool(cluster, RESOURCE, 2, PRELOAD)
                events["grown"] = len(done)
            joined = next((r["step"] for r in done if r.get("fleet/joined", 0) >= 1), None)
            if joined is not None and "killed" not in events and len(done) >= joined + kill_after:
                pool = [
                    a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if RESOURCE in w["resources"]
                ]
                names = {a: str(cluster.scheduler_info["workers"][a]["name"]) for a in pool}
                victim = min(pool, key=lambda a: names[a])  # the first replica: the new one stays
                os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
                events["killed"] = len(done)
            time.sleep(0.05)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the program's summary: stdout is the table's (or JSON's)
            history = grpo(
                ["--steps", str(steps), "dashboard=none", "sft_steps=10", "prompts_per_step=8", "async_staleness=1"]
                + ["partial_rollout=true", "async_replicas=1:3", f"rollout.max_new_tokens={max_new_tokens}"]
                + ["--address", cluster.scheduler_address, f"metrics_file={metrics}"]
            )
    finally:
        over.set()
        thread.join()
        client.close()
        cluster.close()
    joins = [r["fleet/join_s"] for r in history if "fleet/join_s" in r]
    builds = [r["fleet/join_build_s"] for r in history if "fleet/join_build_s" in r]
    by_size: dict[int, list[dict]] = {}
    for prev, r in zip(history, history[1:]):
        if prev["fleet/replicas"] == r["fleet/replicas"]:  # not a step right after a change
            by_size.setdefault(int(r["fleet/replicas"]), []).append(r)
    last = history[-1]
    lost = last["fleet/left"]
    startup = next(r["fleet/startup_s"] for r in history if "fleet/startup_s" in r)
    return {
        "steps": len(history),
        "startup_asked_s": startup,
        "join_over_startup_asked": [j / startup for j in joins[1:]],
        "events": events,
        "startup_s": joins[0] if joins else None,
        "join_s": joins[1:],
        "build_s": builds,
        "join_over_startup": [j / joins[0] for j in joins[1:]] if joins else [],
        "join_trainer_bytes": [r["fleet/join_trainer_bytes"] for r in history if "fleet/join_trainer_bytes" in r],
        "join_peer_bytes": [r["fleet/join_peer_bytes"] for r in history if "fleet/join_peer_bytes" in r],
        "sync_bytes": history[0]["async/sync_bytes"],
        "lost": lost,
        "requeued_per_loss": last["fleet/requeued"] / lost if lost else None,
        "samples_per_prompt": 4,
        "exact": all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in history)
        and all(r["async/trained_groups"] == 8 for r in history),
        "tokens_per_s": {
            n: sum(r["tokens_per_s"] * r["step_s"] for r in rs) / sum(r["step_s"] for r in rs)
            for n, rs in by_size.items()
        },
        "step_s_median": {n: statistics.median(r["step_s"] for r in rs) for n, rs in by_size.items()},
        "steps_by_size": {n: len(rs) for n, rs in by_size.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--grow-at", type=int, default=5)
    ap.add_argument("--kill-after", type=int, default=15)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    out = run(args.steps, args.grow_at, args.kill_after, args.max_new_tokens)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"events (steps done when it happened): {out['events']}; every step full and exact: {out['exact']}")
    print(
        f"start-up of the first replica (weights from the trainer): {out['startup_s']:.2f} s from its worker's "
        f"arrival, {out['startup_asked_s']:.2f} s from the run asking for it (the worker's own start included)"
    )
    print(f"of each start-up and join, building the replica (its model on the worker): {out['build_s']}")
    for j, ratio, asked in zip(out["join_s"], out["join_over_startup"], out["join_over_startup_asked"]):
        print(
            f"a join mid-run (weights from a peer), arrival to its first finished group: {j:.2f} s = {ratio:.2f}x / {asked:.2f}x start-up"
        )
    print(f"bytes a join fetched: from the trainer {out['join_trainer_bytes']}, from peers {out['join_peer_bytes']}")
    if out["requeued_per_loss"] is not None:
        print(f"requeued per lost replica: {out['requeued_per_loss']:.0f} groups = "
              f"{out['requeued_per_loss'] * out['samples_per_prompt']:.0f} samples")  # fmt: skip
    print("| replicas | steps | tokens/s | median step s |\n| --- | --- | --- | --- |")
    for n in sorted(out["tokens_per_s"]):
        print(f"| {n} | {out['steps_by_size'][n]} | {out['tokens_per_s'][n]:.0f} | {out['step_s_median'][n]:.3f} |")


if __name__ == "__main__":
    main()
