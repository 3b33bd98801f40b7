"""Asynchronous RL: GRPO steps on a long-tailed workload, synchronous against asynchronous, in one run.

    python benchmarks/async.py [--json] [--steps 8] [--rounds 2]
    python benchmarks/async.py --cluster     # the placement simulator's estimate for a 7B actor on 64 GPUs

Modes, each on its own 2-slot embedded cluster with the same seeds and workload:

- `sync_colocated`: today's default, every model on both slots (data-parallel 2), generate -> score -> update;
- `sync_split`: `--placement split`, actor and reference on slot 0, the reward on slot 1, synchronous;
- `async_split`: `async_staleness=K` (K = 1 and 2), the rollout replica on slot 1, actor, reference and reward on
  slot 0; rollouts run K versions ahead of the trainer (algorithms/rollout/asynchronous.py). Also K = 1 with
  `async_correction=none` (no proximal log-prob pass).
- `async_partial`: `async_split` at K = 1 with `partial_rollout=true`: the replica holds a step's surplus of prompt
  groups, decodes in segments of max_new_tokens / 4 and hands each step the first groups to finish; the long ones
  continue under the next version (engines/rollout/partial.py). Deterministic: versions change where the schedule
  says, so two runs are equal.
- `async_stream`: `async_partial` streaming (`async_rl.deterministic=false`, algorithms/rollout/streaming.py): the
  replica decodes without pause in a thread of its own, a version lands between two segments as soon as the trainer
  sends it, and each step takes the first groups to finish. `async_partial / async_stream` is the cost of
  determinism. (The replica's decoding runs outside the worker's calls, so its busy time is not in the slot
  figures, only in tokens/s.)

Workload. Response lengths per step from a Pareto distribution (seeded by step, the same in every mode): most are
a few tokens, about one in eight runs to `max_new_tokens`; each row's length is forced (`stop_at`, `ignore_eos`).
The engine keeps finished rows in its decode batch (a GPU's cost profile: a decode step costs about the same for 4
rows as for 64), so the tail sets generation time, and a data-parallel split of the batch cannot shorten it.

Measurement. Every mode runs `--warmup` steps, then `--steps` measured ones, in `--rounds` rounds (the order of the
modes reversed each round, so drift on the machine affects them alike). tokens_per_s = the measured steps' (prompt
+ response) tokens / their wall time (the controller's step times back to back: with rollouts in flight, a step's
time is its share of the pipeline). Each slot's busy time is what its worker computed in that window (direct-call
records and Dask tasks), idle the rest. The staleness histogram is the fraction of trained tokens k versions old.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import flowactors as fa  # noqa: E402
from algorithms.grpo import GRPO  # noqa: E402
from algorithms.rollout.asynchronous import AsyncConfig  # noqa: E402
from algorithms.run.build import prompt_data  # noqa: E402
from algorithms.run.config import GRPOConfig, RolloutConfig  # noqa: E402
from algorithms.run.loop import Runner  # noqa: E402
from benchmarks.stages import stage_of  # noqa: E402
from engines import ModelConfig, OptimConfig  # noqa: E402
from engines.rollout.stream import STOP_AT  # noqa: E402
from flowactors import Batch  # noqa: E402


@dataclass
class Workload:
    prompts: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 224
    pareto_alpha: float = 0.7
    min_tokens: int = 4
    hidden_size: int = 128
    num_layers: int = 4
    pack: bool = True
    """Packed micro-batches (model.pack_sequences) in every mode: scoring and training cost what the samples hold,
    not the padded max_new_tokens width, as in a production run."""

    def lengths(self, draw: int, rows: int) -> torch.Tensor:
        u = torch.rand(rows, generator=torch.Generator().manual_seed(1000 + draw), dtype=torch.float64)
        return (self.min_tokens * (1 - u) ** (-1 / self.pareto_alpha)).long().clamp(1, self.max_new_tokens)


class LongTailed:
    """The run's prompts with a forced, long-tailed response length per row (drawn per batch, in draw order)."""

    def __init__(self, inner, w: Workload) -> None:
        self.inner, self.w, self.draws = inner, w, 0

    def next_batch(self, prompts: int, samples_per_prompt: int) -> Batch:
        b = self.inner.next_batch(prompts, samples_per_prompt)
        self.draws += 1
        return Batch({**b.tensors, STOP_AT: self.w.lengths(self.draws, len(b))}, b.rows, b.meta)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


MODES = {
    "sync_colocated": ("colocated", 0, "tis", False),
    "sync_split": ("split", 0, "tis", False),
    "async_split": ("split", 1, "tis", False),
    "async_split_k2": ("split", 2, "tis", False),
    "async_split_none": ("split", 1, "none", False),
    "async_partial": ("split", 1, "tis", "deterministic"),
    "async_stream": ("split", 1, "tis", "streaming"),
}


def config(w: Workload, placement: str, staleness: int, correction: str, steps: int, partial: bool | str) -> GRPOConfig:
    model = ModelConfig(
        hidden_size=w.hidden_size,
        num_layers=w.num_layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=3 * w.hidden_size,
        max_position_embeddings=512,
        pack_sequences=w.pack,
    )
    samples = w.prompts * w.samples_per_prompt
    return GRPOConfig(
        steps=steps,
        prompts_per_step=w.prompts,
        samples_per_prompt=w.samples_per_prompt,
        mini_batch_samples=samples,
        actor=OptimConfig(lr=GRPOConfig().actor.lr, micro_batch_tokens=samples * 128),
        rollout=RolloutConfig(max_new_tokens=w.max_new_tokens, ignore_eos=True),
        sft_steps=0,
        model=model,
        placement=placement,
        dashboard="none",
        async_rl=AsyncConfig(
            staleness=staleness,
            correction=correction,
            partial_rollout=bool(partial),
            deterministic=partial != "streaming",
        ),
    )


def run_mode(name: str, w: Workload, steps: int, warmup: int) -> dict:
    from distributed import get_task_stream
    from distributed.metrics import time as metrics_time

    placement, staleness, correction, partial = MODES[name]
    cfg = config(w, placement, staleness, correction, warmup + steps, partial)
    ctl = fa.Controller.local(2, dashboard=None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = LongTailed(prompt_data(cfg)[0], w)
            runner = Runner(GRPO(cfg), ctl, Path(tmp), data)  # type: ignore[arg-type]
            runner.build(resuming=False)
            runner.start_pipeline(0)
            records = [runner.one_step(i) for i in range(warmup)]
            with get_task_stream(client=ctl.client) as ts:
                wall0 = metrics_time()
                measured = [runner.one_step(i) for i in range(warmup, warmup + steps)]
                wall1 = metrics_time()
            records += measured
            spans = ts.data + ctl.call_records(wall0, wall1)
            if runner.pipeline is not None:
                runner.pipeline.drain()
            slots = list(ctl.slots[:2])
    finally:
        ctl.close()
    wall = sum(r["step_s"] for r in measured)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in measured)
    busy = _busy(spans, slots, wall0, wall1)
    kinds = [
        {k: round(_busy([t for t in spans if _kind(t["key"]) == k], [slot], wall0, wall1)[0], 2) for k in "GSUWa"}
        for slot in slots
    ]
    hist = {
        k.rsplit("_", 1)[-1]: round(statistics.mean(r[k] for r in measured), 3)
        for k in measured[0]
        if k.startswith("async/staleness_frac_")
    }
    return {
        "mode": name,
        "staleness": staleness,
        "partial_rollout": bool(partial),
        "deterministic": partial != "streaming",
        "correction": correction if staleness else None,
        "tokens_per_s": round(tokens / wall, 1),
        "step_s": round(wall / len(measured), 4),
        "slot_busy_s": [round(b, 3) for b in busy],
        "slot_idle_s": [round(wall1 - wall0 - b, 3) for b in busy],
        "window_s": round(wall1 - wall0, 3),
        "slot_busy_by_stage_s": kinds,
        "staleness_hist": hist or {"0": 1.0},
        "reward_mean_last": round(statistics.mean(r["reward_mean"] for r in measured), 4),
        # what the measured steps trained: a mode that trains shorter responses is not faster for it
        "response_length_mean": round(statistics.mean(r["response_length_mean"] for r in measured), 2),
    }


_KIND = {
    "generate_sequences": "G",
    "generate_partial": "G",
    "stream_partial": "G",
    "update_actor": "U",
    "update_critic": "U",
    "policy_weights": "W",
    "load_policy": "W",
    "send_policy": "W",
    "receive_policy": "W",
}


def _kind(key: str) -> str:
    """G generation, S scoring, U update, W weight sync, a tasks next to the data (advantages, metrics)."""
    return stage_of(key, _KIND)


def _busy(tasks: list[dict], slots: list[str], t0: float, t1: float) -> list[float]:
    """Seconds each slot's worker computed inside [t0, t1] (overlapping spans on a slot counted once)."""
    out = []
    for slot in slots:
        spans = sorted(
            (max(t0, s["start"]), min(t1, s["stop"]))
            for t in tasks
            if t.get("worker") == slot
            for s in t.get("startstops", ())
            if s.get("action") == "compute"
        )
        total, end = 0.0, t0
        for a, b in spans:
            a = max(a, end)
            if b > a:
                total, end = total + b - a, b
        out.append(total)
    return out


def measure(w: Workload, modes: list[str], steps: int, warmup: int, rounds: int) -> list[dict]:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            t0 = time.perf_counter()
            runs[m].append(run_mode(m, w, steps, warmup))
            print(
                f"  round {r + 1}: {m} {runs[m][-1]['tokens_per_s']:.0f} tokens/s ({time.perf_counter() - t0:.0f} s "
                f"with start-up)",
                file=sys.stderr,
            )
    rows = []
    for m, rs in runs.items():
        row = dict(rs[0])
        row["tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in rs), 1)
        row["step_s"] = round(statistics.median(x["step_s"] for x in rs), 4)
        row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in rs]
        for k in ("slot_busy_s", "slot_idle_s"):
            row[k] = [round(statistics.mean(x[k][i] for x in rs), 3) for i in range(2)]
        row["slot_busy_by_stage_s"] = [
            {k: round(statistics.mean(x["slot_busy_by_stage_s"][i][k] for x in rs), 2) for k in "GSUWa"}
            for i in range(2)
        ]
        rows.append(row)
    return rows


def cluster_estimate() -> None:
    """The placement simulator's estimate for GRPO with a 7B actor on 64 GPUs, long-tailed lengths
    (placement/asynchronous.py), beside what verl and NeMo-RL report."""
    from placement.asynchronous import estimate_async
    from placement.hardware import h100
    from placement.models import llama_7b
    from placement.simulator import Simulator
    from placement.simulator import Workload as SimWorkload

    print(
        "cluster estimate: GRPO, Llama-7B actor (reference and reward the same size), 64 H100; 128 prompts of "
        "512 tokens x 8 samples; response lengths Pareto(alpha=1, min=max/32) capped at max (seeded)"
    )
    print(
        f"{'max resp':>8} {'gen s':>7} {'score s':>8} {'train s':>8} {'sync it s':>10} {'rollout gpus':>13} "
        f"{'async gen s':>12} {'async train s':>14} {'weight sync s':>14} {'async it s':>11} {'speed-up':>9}"
    )
    for resp in (2048, 8192, 28672):
        wl = SimWorkload(prompts_per_step=128, prompt_tokens=512, response_tokens=resp, samples_per_prompt=8)
        sim = Simulator(h100(), wl)
        u = torch.rand(wl.generated_sequences, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        lengths = ((resp // 32) * (1 - u) ** -1.0).long().clamp(1, resp).tolist()
        e = estimate_async(sim, llama_7b(), lengths)
        print(
            f"{resp:>8} {e.generate_s:>7.1f} {e.score_s:>8.1f} {e.train_s:>8.1f} {e.sync_iteration_s:>10.1f} "
            f"{e.rollout_gpus:>13} {e.async_generate_s:>12.1f} {e.async_train_s:>14.1f} {e.sync_s:>14.2f} "
            f"{e.async_iteration_s:>11.1f} {e.speedup:>8.2f}x"
        )
    print(
        "Reported: verl fully-async 2.35-2.67x over colocated synchronous training (Qwen2.5-7B, 128 H20, 28K-token "
        "responses); NeMo-RL 1.28x with one step off-policy (Qwen3-30B-A3B GRPO, 32 H100).\n"
        "Why they differ (our reading, not measured): the overlap alone is bounded by (generate + score + "
        "train) / max(generate, score + train) on split devices, 2x when the two sides balance, less as either "
        "dominates. verl's figure includes partial rollouts (the tail no longer holds a step back, which the "
        "overlap alone cannot give) and H20s, whose low compute makes training slow next to bandwidth-bound "
        "decoding, so the sides balance; an MoE model as NeMo-RL's trains cheaply per token, so generation "
        "dominates and the overlap hides less. "
        "This estimate has no partial rollouts, so it is an overlap-only bound."
    )


def main(argv: list[str] | None = None) -> None:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line per mode first")
    p.add_argument("--steps", type=int, default=6, help="measured steps per mode and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--alpha", type=float, default=d.pareto_alpha)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--no-pack", action="store_true", help="padded micro-batches (the table before 2026-12-05)")
    p.add_argument("--cluster", action="store_true", help="print only the cluster-scale estimate (no run)")
    args = p.parse_args(argv)
    if args.cluster:
        cluster_estimate()
        return
    w = Workload(
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        pareto_alpha=args.alpha,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        pack=not args.no_pack,
    )
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    rows = measure(w, modes, args.steps, args.warmup, args.rounds)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    lengths = torch.cat([w.lengths(i, w.prompts * w.samples_per_prompt) for i in range(1, 20)]).float()
    print(
        f"\nGRPO, {w.prompts} prompts x {w.samples_per_prompt} samples per step; response lengths Pareto(alpha="
        f"{w.pareto_alpha}, min={w.min_tokens}) capped at {w.max_new_tokens}: median {lengths.median():.0f}, mean "
        f"{lengths.mean():.1f}, {(lengths >= w.max_new_tokens).float().mean():.0%} at the cap. Llama "
        f"{w.hidden_size} wide, {w.num_layers} layers{', packed micro-batches' if w.pack else ''}; 2 slots; "
        f"{args.steps} measured steps x {args.rounds} rounds."
    )
    by = {r["mode"]: r for r in rows}
    print(
        f"\n{'mode':<17} {'K':>2} {'tokens/s':>9} {'step s':>7} {'busy s (slot 0, 1)':>20} "
        f"{'idle s (slot 0, 1)':>20} {'staleness (frac at k)':>24}"
    )
    for r in rows:
        hist = " ".join(f"{k}:{v:.2f}" for k, v in r["staleness_hist"].items())
        print(
            f"{r['mode']:<17} {r['staleness']:>2} {r['tokens_per_s']:>9.1f} {r['step_s']:>7.3f} "
            f"{r['slot_busy_s'][0]:>9.2f} {r['slot_busy_s'][1]:>9.2f}  {r['slot_idle_s'][0]:>9.2f} "
            f"{r['slot_idle_s'][1]:>9.2f}  {hist:>24}"
        )
    print("\nbusy seconds by stage (G generation, S scoring, U update, W weight sync, a advantages and metrics):")
    for r in rows:
        print(
            f"  {r['mode']:<17} "
            + " | ".join(
                f"slot {i}: " + " ".join(f"{k} {v:.2f}" for k, v in d.items() if v)
                for i, d in enumerate(r["slot_busy_by_stage_s"])
            )
        )
    best = max((r for r in rows if r["staleness"]), key=lambda r: r["tokens_per_s"], default=None)
    if "async_split" in by and "sync_split" in by:
        print(
            f"\nasync_split (K=1) / sync_split: {by['async_split']['tokens_per_s'] / by['sync_split']['tokens_per_s']:.2f}x"
            f" (target >= 1.6x)"
        )
    if "async_partial" in by and "async_split" in by:
        print(
            f"async_partial / async_split (K=1): "
            f"{by['async_partial']['tokens_per_s'] / by['async_split']['tokens_per_s']:.2f}x (target >= 1.25x)"
        )
    if "async_partial" in by and "async_stream" in by:
        print(
            f"async_stream / async_partial (K=1): "
            f"{by['async_stream']['tokens_per_s'] / by['async_partial']['tokens_per_s']:.2f}x (the cost of determinism)"
        )
    if best is not None and "sync_colocated" in by:
        print(
            f"best asynchronous ({best['mode']}) / sync_colocated: "
            f"{best['tokens_per_s'] / by['sync_colocated']['tokens_per_s']:.2f}x (target >= 1.15x)"
        )


if __name__ == "__main__":
    main()
