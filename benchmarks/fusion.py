"""Stage fusion (RLHFuse): PPO steps on a long-tailed workload, fused against unfused, in one run.

    python benchmarks/fusion.py [--json] [--steps 4]

Workload: response lengths drawn per step from a Pareto distribution (seeded, so both modes draw the same): most
responses are a few tokens, a few run to `max_new_tokens`. Each row's length is forced (`stop_at`, `ignore_eos`),
so token counts do not depend on an untrained model's EOS. Split placement on two slots: the actor alone on slot 0;
reference, critic and a model-based reward on slot 1 (the reference is moved from the actor's pool to the scorers'
so that it is one of the models that can overlap generation; with it on slot 0 only critic and reward would). All
four models have the actor's size. The generation engine drops finished rows from its batch (`evict_finished`) in
both modes, so the long tail is decoded by a shrinking batch and the comparison measures fusion alone.

Each mode runs on a freshly started cluster with the same seeds (the critic's dropout draws from its process's RNG,
so sharing processes would make the two runs diverge), a warm-up step, then `--steps` measured steps. Tokens per
second = (prompt + response tokens) / step time, median over the measured steps. `samples_digest` hashes every
measured step's generated token ids: equal digests mean both modes sampled the same responses (from actors that
received the same updates). The stage timeline shows one measured step per mode, per slot, from the Dask task
stream: G generation, S scoring, U update, a tasks that run next to the data (joins, advantages), '.' idle.
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
from algorithms.config import PPOConfig  # noqa: E402
from algorithms.ppo import PPO  # noqa: E402
from algorithms.runner import PromptData  # noqa: E402
from algorithms.tasks import get_task  # noqa: E402
from engines import (ActorWorker, CriticWorker, ModelConfig, OptimConfig, RefWorker, RewardModelWorker,  # noqa: E402
                     SamplingConfig, build_tokenizer)
from flowactors import Batch, Layout  # noqa: E402


@dataclass
class Workload:
    prompts: int = 32
    max_new_tokens: int = 128
    """With 16-token prompts, 144-token sequences (a multiple of 8: exact scores, see algorithms/fusion.py)."""
    pareto_alpha: float = 0.6
    """Tail index of the response lengths (smaller: heavier tail)."""
    min_tokens: int = 4
    """Scale of the Pareto distribution: the shortest responses."""
    chunk_samples: int = 4
    evict_finished: bool = True
    hidden_size: int = 256
    num_layers: int = 4
    """Actor, reference and critic."""
    reward_layers: int = 4
    """The reward model's depth (same width)."""

    @property
    def model(self) -> ModelConfig:
        return self._model(self.num_layers)

    @property
    def reward_model(self) -> ModelConfig:
        return self._model(self.reward_layers)

    def _model(self, layers: int) -> ModelConfig:
        return ModelConfig(hidden_size=self.hidden_size, num_layers=layers, num_heads=8, num_kv_heads=4,
                           intermediate_size=3 * self.hidden_size, max_position_embeddings=512)

    def lengths(self, step: int) -> torch.Tensor:
        u = torch.rand(self.prompts, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.float64)
        return (self.min_tokens * (1 - u) ** (-1 / self.pareto_alpha)).long().clamp(1, self.max_new_tokens)


def build(ctl: fa.Controller, w: Workload) -> dict:
    actor_slot, scorer_slot = ctl.slots[:1], ctl.slots[1:2]
    optim = OptimConfig(lr=1e-5, micro_batch_tokens=4096)
    sampling = SamplingConfig(max_new_tokens=w.max_new_tokens, ignore_eos=True, evict_finished=w.evict_finished)

    def group(role: str, cls: type, slots: list[str], *args) -> fa.ActorGroup:
        return fa.ActorGroup(ctl, cls, name=role, slots=slots, layout=Layout(dp=1), args=args)

    return {"actor": group("actor", ActorWorker, actor_slot, w.model, optim, sampling),
            "ref": group("ref", RefWorker, scorer_slot, w.model),
            "critic": group("critic", CriticWorker, scorer_slot, w.model, optim),
            "reward": group("reward", RewardModelWorker, scorer_slot, w.reward_model)}


def run_mode(fuse: bool, w: Workload, steps: int, warmup: int) -> dict:
    """One mode on a fresh 2-slot cluster: warm-up steps, then `steps` measured ones."""
    from distributed import get_task_stream

    cfg = PPOConfig(prompts_per_step=w.prompts, mini_batch_samples=w.prompts, micro_batch_tokens=4096,
                    fuse=fuse, fuse_chunk_samples=w.chunk_samples, dashboard="none", kl_coef=0.02)
    data = PromptData(get_task("digits"), build_tokenizer(w.model), 256, seed=0)
    out: dict = {"step_s": [], "tokens": [], "responses": [], "timeline": []}
    with fa.Controller.local(2, dashboard=None) as ctl:
        algo = PPO(cfg)
        algo.setup(ctl, build(ctl, w))
        for i in range(warmup + steps):
            p = data.next_batch(w.prompts, 1)
            prompts = Batch({**p.tensors, "stop_at": w.lengths(i)}, p.rows, p.meta)
            with get_task_stream(client=ctl.client) as ts:
                wall0, t0 = time.time(), time.perf_counter()
                m = algo.step(prompts, i)
                dt = time.perf_counter() - t0
            if i < warmup:
                continue
            out["step_s"].append(dt)
            out["tokens"].append(m["prompt_tokens"] + m["response_tokens"])
            out["responses"].append(algo.last_batch.result()["responses"].numpy().tobytes())
            out["timeline"] = _timeline(ts.data, ctl.slots, wall0, dt)
    return out


def measure(w: Workload, rounds: int, steps: int, warmup: int) -> tuple[list[dict], dict[str, list[dict]]]:
    """`rounds` rounds of both modes, the order alternating (machine load drifts); each round restarts from the
    same initial models, so every round samples the same responses."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds):
        for fuse in ((False, True) if r % 2 == 0 else (True, False)):
            runs[fuse].append(run_mode(fuse, w, steps, warmup))
    rows, timelines = [], {}
    for fuse, rs in runs.items():
        mode = "fused" if fuse else "unfused"
        step_s = statistics.median(t for r in rs for t in r["step_s"])
        tokens = statistics.median(t for r in rs for t in r["tokens"])
        digest = hashlib.sha256(b"".join(rs[0]["responses"])).hexdigest()[:16]
        if any(hashlib.sha256(b"".join(r["responses"])).hexdigest()[:16] != digest for r in rs):
            digest += "!"  # rounds of one mode disagree: not reproducible
        rows.append({"mode": mode, "tokens_per_s": round(tokens / step_s, 1), "step_s": round(step_s, 4),
                     "samples_digest": digest})
        timelines[mode] = rs[-1]["timeline"]
    return rows, timelines


_KIND = {"generate_sequences": "G", "start_generation": "G", "next_generated_chunk": "G", "update_actor": "U",
         "update_critic": "U"}


def _kind(key: str) -> str:
    name = key.rsplit("-", 2)[0] if key.count("-") >= 2 else key.rsplit("-", 1)[0]
    method = name.split(".")[-1]
    return _KIND.get(method, "S" if method.startswith("compute_") else "a")


def _timeline(tasks: list[dict], slots: list[str], t0: float, dt: float) -> list[dict]:
    spans = []
    for t in tasks:
        for s in t.get("startstops", ()):
            if s.get("action") == "compute" and t.get("worker") in slots:
                spans.append({"slot": slots.index(t["worker"]), "kind": _kind(t["key"]),
                              "start": s["start"] - t0, "stop": s["stop"] - t0, "step_s": dt})
    return spans


def _bars(spans: list[dict], width: int = 72) -> list[str]:
    dt = spans[0]["step_s"] if spans else 1.0
    lines = []
    for slot in sorted({s["slot"] for s in spans}):
        bar = ["."] * width
        for s in sorted((s for s in spans if s["slot"] == slot), key=lambda s: s["start"]):
            a, b = int(max(0.0, s["start"]) / dt * width), int(min(dt, s["stop"]) / dt * width)
            for c in range(a, max(a + 1, b)):
                if c < width:
                    bar[c] = s["kind"]
        busy = {k: sum(s["stop"] - s["start"] for s in spans if s["slot"] == slot and s["kind"] == k) for k in "GSUa"}
        lines.append(f"  slot {slot} |{''.join(bar)}|  " + "  ".join(f"{k} {v:.2f}s" for k, v in busy.items() if v))
    return lines


def main(argv: list[str] | None = None) -> None:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, each on fresh clusters")
    p.add_argument("--steps", type=int, default=3, help="measured steps per mode and round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--alpha", type=float, default=d.pareto_alpha, help="Pareto tail index of the lengths")
    p.add_argument("--chunk-samples", type=int, default=d.chunk_samples)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--reward-layers", type=int, default=d.reward_layers)
    p.add_argument("--no-evict", action="store_true", help="keep finished rows in the decode batch")
    args = p.parse_args(argv)
    w = Workload(prompts=args.prompts, max_new_tokens=args.max_new_tokens, pareto_alpha=args.alpha,
                 chunk_samples=args.chunk_samples, evict_finished=not args.no_evict, hidden_size=args.hidden_size,
                 num_layers=args.num_layers, reward_layers=args.reward_layers)
    rows, timelines = measure(w, args.rounds, args.steps, args.warmup)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    lengths = torch.cat([w.lengths(i) for i in range(args.warmup, args.warmup + args.steps)]).float()
    print(f"\n{w.prompts} prompts/step of 16 tokens; response lengths Pareto(alpha={w.pareto_alpha}, "
          f"min={w.min_tokens}) capped at {w.max_new_tokens}: median {lengths.median():.0f}, mean "
          f"{lengths.mean():.1f}, {(lengths >= w.max_new_tokens).float().mean():.0%} at the cap; four Llama "
          f"{w.hidden_size}x{w.num_layers} models; slot 0: actor | slot 1: ref, critic, reward model; chunks of "
          f"{w.chunk_samples} samples; evict_finished={w.evict_finished}; {args.rounds} rounds x {args.steps} steps")
    base = next(r for r in rows if r["mode"] == "unfused")
    print(f"\n{'mode':<8} {'tokens/s':>9} {'step s':>8} {'samples digest':>18} {'vs unfused':>11}")
    for r in rows:
        print(f"{r['mode']:<8} {r['tokens_per_s']:>9.1f} {r['step_s']:>8.3f} {r['samples_digest']:>18} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}x")
    print("\nstage timeline, last measured step of each mode (G generation, S scoring, U update, a joins and "
          "advantages, . idle):")
    for r in rows:
        spans = timelines[r["mode"]]
        print(f" {r['mode']} ({spans[0]['step_s'] if spans else 0:.2f} s)")
        print("\n".join(_bars(spans)))


if __name__ == "__main__":
    main()
