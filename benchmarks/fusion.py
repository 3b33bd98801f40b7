"""Stage fusion (RLHFuse): PPO steps on a long-tailed workload, fused against unfused, in one run.

    python benchmarks/fusion.py [--json] [--steps 6] [--evict] [--reward-layers 4]
    python benchmarks/fusion.py --cluster      # the cluster-scale estimate from the placement simulator

Workload. Response lengths are drawn per step from a Pareto distribution (seeded, so both modes draw the same):
most responses are a few tokens, about one in ten runs to `max_new_tokens`. Each row's length is forced
(`stop_at` with `ignore_eos`), so token counts do not depend on an untrained model's EOS.

Placement. Split, two slots: the actor alone on slot 0; reference, critic and a model-based reward on slot 1. The
reference is moved from the actor's pool (where `placement=split` puts it) to the scorers': on slot 0 it would wait
for generation like the actor's own log-probs, and only critic and reward could overlap.

Models. Actor, reference and critic are the same Llama (256 wide, 4 layers); the reward model is twice as deep
(reward models are often larger than the policy they judge). Why not all four the same: PPO's update stage cannot
overlap anything, and after generation the actor's own log-probs must still run on slot 0, so with scorers as
heavy as one actor forward F each (3F on slot 1), updates of about 3F and generation G >= 3F, the best fused step
is (G + F + 3F) against (G + 3F + 3F): at most 9/7 = 1.29x even with perfect overlap. `--reward-layers 4` measures
that case.

Generation. By default the engine keeps finished rows in its batch (its default), so every decode step costs the
same until the longest response ends: the cost profile of a GPU, where a memory-bound decode step costs about as
much for 4 rows as for 64, which is what makes the long tail expensive there. `--evict` drops finished rows
(`SamplingConfig.evict_finished`, continuous batching's shrinking half): on a CPU, compute then shrinks with the
batch, the tail is nearly free, generation is much shorter than scoring and there is little to overlap.

Measurement. Each mode has its own 2-slot cluster with the same seeds (the critic's dropout draws from its worker
process's RNG, so two modes sharing processes would diverge); both stay up and the steps alternate between them,
the order alternating too, so load from outside the benchmark affects both modes alike. One warm-up step, then
`--steps` measured steps each. Tokens per second = (prompt + response tokens) / step time, median over the
measured steps; the paired per-step ratio is printed too. `samples_digest` hashes every measured step's generated
token ids: equal digests mean both modes sampled the same responses from actors that received the same updates.
The stage timeline shows each mode's last measured step per slot, from the Dask task stream: G generation,
S scoring, U update, a tasks run next to the data (merging chunks, advantages), '.' idle.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import flowactors as fa  # noqa: E402
from algorithms.data.prompts import PromptData  # noqa: E402
from algorithms.data.tasks import get_task  # noqa: E402
from algorithms.ppo import PPO  # noqa: E402
from algorithms.rollout.fusion import FusionConfig  # noqa: E402
from algorithms.run.build import Roles  # noqa: E402
from algorithms.run.config import PPOConfig  # noqa: E402
from benchmarks.stages import stage_of  # noqa: E402
from engines import (  # noqa: E402
    ActorWorker,
    CriticWorker,
    ModelConfig,
    OptimConfig,
    RefWorker,
    RewardModelWorker,
    SamplingConfig,
    build_tokenizer,
)
from flowactors import Batch, Layout  # noqa: E402


@dataclass
class Workload:
    prompts: int = 64
    """Prompts per step, 16 tokens each (the `digits` task), one sample each."""
    max_new_tokens: int = 128
    """144-token sequences: a multiple of 8, which keeps the value and score heads' results bit-identical across
    chunkings on this CPU (algorithms/rollout/fusion.py), so the two modes' updates, and then samples, stay identical."""
    pareto_alpha: float = 0.6
    """Tail index of the response lengths (smaller: heavier tail)."""
    min_tokens: int = 4
    """Scale of the Pareto distribution: the shortest responses."""
    chunk_samples: int = 16
    evict_finished: bool = False
    hidden_size: int = 256
    num_layers: int = 4
    """Actor, reference and critic."""
    reward_layers: int = 8
    """The reward model's depth (same width)."""
    migrate: bool = False
    """Long-tail migration placement (`placement=fused`): actor and reference data-parallel over both slots,
    critic and reward on slot 1."""
    migrate_below: float = 0.25

    @property
    def model(self) -> ModelConfig:
        return self._model(self.num_layers)

    @property
    def reward_model(self) -> ModelConfig:
        return self._model(self.reward_layers)

    def _model(self, layers: int) -> ModelConfig:
        return ModelConfig(
            hidden_size=self.hidden_size,
            num_layers=layers,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=3 * self.hidden_size,
            max_position_embeddings=512,
        )

    def lengths(self, step: int) -> torch.Tensor:
        u = torch.rand(self.prompts, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)
        return (self.min_tokens * (1 - u) ** (-1 / self.pareto_alpha)).long().clamp(1, self.max_new_tokens)


_PLACEMENT = {
    False: "Slot 0: actor | slot 1: ref, critic, reward.",
    True: "Slots 0-1: actor, ref (dp=2) | slot 1: critic, reward.",
}


def build(ctl: fa.Controller, w: Workload) -> Roles:
    actor_slot, scorer_slot = (ctl.slots[:2] if w.migrate else ctl.slots[:1]), ctl.slots[1:2]
    optim = OptimConfig(lr=1e-5, micro_batch_tokens=4096)
    sampling = SamplingConfig(max_new_tokens=w.max_new_tokens, ignore_eos=True, evict_finished=w.evict_finished)

    def group(role: str, cls: type, slots: list[str], *args) -> fa.ActorGroup:
        return fa.ActorGroup(ctl, cls, name=role, slots=slots, layout=Layout(dp=len(slots)), args=args)

    return Roles(
        actor=group("actor", ActorWorker, actor_slot, w.model, optim, sampling),
        ref=group("ref", RefWorker, actor_slot if w.migrate else scorer_slot, w.model),
        critic=group("critic", CriticWorker, scorer_slot, w.model, optim),
        reward=group("reward", RewardModelWorker, scorer_slot, w.reward_model),
    )


class _Mode:
    """One mode's own 2-slot cluster, groups and PPO program."""

    def __init__(self, fuse: bool, w: Workload, migrate: bool = False) -> None:
        self.w = w
        self.name = "migrated" if migrate else "fused" if fuse else "unfused"
        self.ctl = fa.Controller.local(2, dashboard=None)
        cfg = PPOConfig(
            prompts_per_step=w.prompts,
            mini_batch_samples=w.prompts,
            dashboard="none",
            fusion=FusionConfig(fuse, chunk_samples=w.chunk_samples, migrate=migrate, migrate_below=w.migrate_below),
        )
        self.algo = PPO(cfg)
        self.data = PromptData(get_task("digits"), build_tokenizer(w.model), 256, seed=0)
        self.algo.setup(self.ctl, build(self.ctl, w), self.data)
        self.step_s: list[float] = []
        self.tokens: list[float] = []
        self.digest = hashlib.sha256()
        self.timeline: list[dict] = []

    def step(self, i: int, measured: bool) -> None:
        from distributed import get_task_stream
        from distributed.metrics import time as metrics_time

        p = self.data.next_batch(self.w.prompts, 1)
        prompts = Batch({**p.tensors, "stop_at": self.w.lengths(i)}, p.rows, p.meta)
        with get_task_stream(client=self.ctl.client) as ts:
            wall0, t0 = metrics_time(), time.perf_counter()
            m = self.algo.step(prompts, i)
            dt = time.perf_counter() - t0
        if measured:
            self.step_s.append(dt)
            self.tokens.append(m["prompt_tokens"] + m["response_tokens"])
            self.digest.update(self.algo.last_batch.result()["responses"].numpy().tobytes())
            ran = ts.data + self.ctl.call_records(wall0, metrics_time())  # tasks, and calls on the direct path
            self.timeline = _timeline(ran, self.ctl.slots, wall0, dt)

    def row(self) -> dict:
        step_s = statistics.median(self.step_s)
        return {
            "mode": self.name,
            "tokens_per_s": round(statistics.median(self.tokens) / step_s, 1),
            "step_s": round(step_s, 4),
            "samples_digest": self.digest.hexdigest()[:16],
        }


def measure(w: Workload, steps: int, warmup: int) -> tuple[list[dict], dict[str, list[dict]], list[float]]:
    """The modes side by side, steps alternating between them (see the module docstring)."""
    modes = [_Mode(False, w), _Mode(True, w)] + ([_Mode(True, w, migrate=True)] if w.migrate else [])
    try:
        for i in range(warmup + steps):
            for m in modes if i % 2 == 0 else modes[::-1]:
                m.step(i, measured=i >= warmup)
    finally:
        for m in modes:
            m.ctl.close()
    paired = [u / f for u, f in zip(modes[0].step_s, modes[-1].step_s)]  # the last mode against unfused
    return [m.row() for m in modes], {m.name: m.timeline for m in modes}, paired


_KIND = {
    "generate_sequences": "G",
    "start_generation": "G",
    "next_generated_chunk": "G",
    "hand_over_tail": "G",
    "finish_tail": "G",
    "update_actor": "U",
    "update_critic": "U",
}


def _kind(key: str) -> str:
    return stage_of(key, _KIND)


def _timeline(tasks: list[dict], slots: list[str], t0: float, dt: float) -> list[dict]:
    spans = []
    for t in tasks:
        for s in t.get("startstops", ()):
            if s.get("action") == "compute" and t.get("worker") in slots:
                spans.append(
                    {
                        "slot": slots.index(t["worker"]),
                        "kind": _kind(t["key"]),
                        "start": s["start"] - t0,
                        "stop": s["stop"] - t0,
                        "step_s": dt,
                    }
                )
    return spans


def _bars(spans: list[dict], width: int = 72) -> list[str]:
    dt = spans[0]["step_s"] if spans else 1.0
    lines = []
    for slot in sorted({s["slot"] for s in spans}):
        bar = ["."] * width
        for s in sorted((s for s in spans if s["slot"] == slot), key=lambda s: s["start"]):
            a, b = int(max(0.0, s["start"]) / dt * width), int(min(dt, s["stop"]) / dt * width)
            for c in range(a, min(width, max(a + 1, b))):
                bar[c] = s["kind"]
        busy = {k: sum(s["stop"] - s["start"] for s in spans if s["slot"] == slot and s["kind"] == k) for k in "GSUa"}
        lines.append(f"  slot {slot} |{''.join(bar)}|  " + "  ".join(f"{k} {v:.2f}s" for k, v in busy.items() if v))
    return lines


def _planned_pipeline(stages: int, micro_batches, step_s) -> float:
    """The fused update's length as engines.training.megatron.pipeline_fusion plans it (a step's time split 1 : 2
    forward : backward)."""
    from engines.training.megatron.pipeline_fusion import plan_pipelines

    plan = plan_pipelines(
        stages, list(micro_batches), forward_cost=[s / 3 for s in step_s], backward_cost=[2 * s / 3 for s in step_s]
    )
    return plan.makespan


def cluster_estimate() -> None:
    """What inter-stage fusion with long-tail migration and a fused actor/critic pipeline would save on 64 A100s
    (placement/fusion.py, the placement simulator's costs), next to RLHFuse's reported gain."""
    from placement.fusion import estimate_fusion
    from placement.hardware import a100_80gb
    from placement.models import llama_13b, llama_70b
    from placement.simulator import Parallel, Simulator
    from placement.simulator import Workload as SimWorkload

    print(
        "cluster estimate, PPO, every model colocated on 64 A100-80GB; response lengths Pareto(alpha=1, "
        "min=max/16) capped at max (seeded)"
    )
    print(
        f"{'model':<6} {'max resp':>8} {'migrate':>8} {'gen s':>7} {'score s':>8} {'fused g+s':>10} "
        f"{'train s':>8} {'fused train':>12} {'iteration':>10} {'fused':>8} {'speed-up':>9}"
    )
    for resp, mini in ((1024, 4), (4096, 8)):
        wl = SimWorkload(prompt_tokens=512, response_tokens=resp, mini_batches_per_step=mini)
        sim = Simulator(a100_80gb(), wl)
        u = torch.rand(wl.generated_sequences, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        lengths = ((resp // 16) * (1 - u) ** -1.0).long().clamp(1, resp).tolist()
        for name, spec, (p, t, d, t_g) in (("13B", llama_13b(), (2, 4, 8, 4)), ("70B", llama_70b(), (4, 8, 2, 8))):
            cfgs = {
                r: Parallel(p, t, d, *((1, t_g) if r == "actor" else ())) for r in ("actor", "critic", "ref", "reward")
            }
            for below in (0.1, 0.25):
                e = estimate_fusion(
                    sim, dict.fromkeys(cfgs, spec), cfgs, lengths, migrate_below=below, fused_pipeline=_planned_pipeline
                )
                print(
                    f"{name:<6} {resp:>8} {below:>8.2f} {e.generate_s:>7.1f} {e.inference_s:>8.1f} "
                    f"{e.fused_generate_inference_s:>10.1f} {e.train_s:>8.1f} {e.fused_train_s:>12.1f} "
                    f"{e.unfused_s:>10.1f} {e.fused_s:>8.1f} {e.speedup:>8.2f}x"
                )
    print("RLHFuse (arXiv 2409.13221) reports up to 3.7x training throughput over existing RLHF systems.")


def main(argv: list[str] | None = None) -> None:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line per mode first")
    p.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--alpha", type=float, default=d.pareto_alpha, help="Pareto tail index of the lengths")
    p.add_argument("--chunk-samples", type=int, default=d.chunk_samples)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="actor, reference and critic")
    p.add_argument("--reward-layers", type=int, default=d.reward_layers)
    p.add_argument("--evict", action="store_true", help="drop finished rows from the decode batch")
    p.add_argument(
        "--migrate",
        action="store_true",
        help="actor and ref on both slots (dp=2), critic and reward on "
        "slot 1; adds a third mode: fused with long-tail migration to actor rank 0",
    )
    p.add_argument(
        "--migrate-below",
        type=float,
        default=d.migrate_below,
        help="fraction of a rank's rows still running at which they migrate",
    )
    p.add_argument("--cluster", action="store_true", help="print only the cluster-scale estimate (no run)")
    args = p.parse_args(argv)
    if args.cluster:
        cluster_estimate()
        return
    w = Workload(
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        pareto_alpha=args.alpha,
        chunk_samples=args.chunk_samples,
        evict_finished=args.evict,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        reward_layers=args.reward_layers,
        migrate=args.migrate,
        migrate_below=args.migrate_below,
    )
    rows, timelines, paired = measure(w, args.steps, args.warmup)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    lengths = torch.cat([w.lengths(i) for i in range(args.warmup, args.warmup + args.steps)]).float()
    print(
        f"\n{w.prompts} prompts/step of 16 tokens; response lengths Pareto(alpha={w.pareto_alpha}, "
        f"min={w.min_tokens}) capped at {w.max_new_tokens}: median {lengths.median():.0f}, mean "
        f"{lengths.mean():.1f}, {(lengths >= w.max_new_tokens).float().mean():.0%} at the cap. Llama "
        f"{w.hidden_size} wide: actor, ref, critic {w.num_layers} layers, reward model {w.reward_layers}. "
        f"{_PLACEMENT[w.migrate]} "
        f"Chunks of {w.chunk_samples} samples"
        f"{f', migration below {w.migrate_below:.0%} of a rank' if w.migrate else ''}; "
        f"evict_finished={w.evict_finished}; {args.steps} measured steps per mode."
    )
    base = next(r for r in rows if r["mode"] == "unfused")
    print(f"\n{'mode':<9} {'tokens/s':>9} {'step s':>8} {'samples digest':>18} {'vs unfused':>11}")
    for r in rows:
        print(
            f"{r['mode']:<9} {r['tokens_per_s']:>9.1f} {r['step_s']:>8.3f} {r['samples_digest']:>18} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}x"
        )
    print(
        f"paired per-step speed-up of {rows[-1]['mode']}: median {statistics.median(paired):.2f}x, "
        f"range {min(paired):.2f}-{max(paired):.2f}x"
    )
    print(
        "\nstage timeline, last measured step of each mode (G generation, S scoring, U update, a merging chunks "
        "and advantages, . idle):"
    )
    for r in rows:
        spans = timelines[r["mode"]]
        print(f" {r['mode']} ({spans[0]['step_s'] if spans else 0:.2f} s)")
        print("\n".join(_bars(spans)))
    unfused = timelines["unfused"]
    if unfused:
        busy, n = sum(s["stop"] - s["start"] for s in unfused), len({s["slot"] for s in unfused})
        print(
            f"overlap bound: the unfused step's slots were busy {busy:.2f} s in all; spread perfectly over the "
            f"{n} slots, that work takes {busy / n:.2f} s, so overlapping stages alone cannot beat "
            f"{unfused[0]['step_s'] / (busy / n):.2f}x on this workload (removing work can: a migrated tail no "
            f"longer decodes finished rows)."
        )


if __name__ == "__main__":
    main()
