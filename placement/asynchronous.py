"""What asynchronous RL (algorithms/rollout/asynchronous.py) would gain at cluster scale, estimated with the simulator.

The CPU benchmark (`benchmarks/async.py`) measures the overlap on two slots; this asks the same of a GPU cluster
with the simulator's costs (placement/simulator.py) for one GRPO-shaped iteration (actor, reference, reward; no
critic) on `gpus` devices with long-tailed response lengths:

- **synchronous, colocated** (today's default): every model on every device; generation (the 3D-HybridEngine
  transition, prefill, then decoding until the slowest replica's last token, continuous batching:
  placement.fusion.decode_timeline), then scoring, then training, one after the other;
- **asynchronous, split**: `rollout` devices hold generation replicas only, the other `gpus - rollout` train and
  score; each side works on a different step (staleness >= 1), so an iteration takes the longer of the two, the
  rollout side also paying the weight sync (the bf16 weights broadcast from the trainer over one node's network
  link, pipelined across the replicas).

Deviations: one fixed split per estimate (the best over multiples of the generation replica size is reported); the
trainer's layout on fewer devices keeps the colocated (p, t) and shrinks d; a staleness of K > 1 is not costed
apart (it absorbs variance between steps, which a mean-cost model has none of).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from placement.fusion import decode_timeline
from placement.models import LlamaSpec
from placement.simulator import ROLES, Parallel, Simulator

__all__ = ["AsyncEstimate", "estimate_async"]


@dataclass(frozen=True)
class AsyncEstimate:
    """Seconds of one iteration, synchronous colocated against asynchronous split."""

    generate_s: float
    """Colocated: transition + prefill + decoding on every device."""
    score_s: float
    train_s: float
    rollout_gpus: int
    async_generate_s: float
    """Split: generation on the rollout devices, with the weight sync."""
    async_train_s: float
    """Split: scoring and training on the others."""
    sync_s: float

    @property
    def sync_iteration_s(self) -> float:
        return self.generate_s + self.score_s + self.train_s

    @property
    def async_iteration_s(self) -> float:
        return max(self.async_generate_s, self.async_train_s)

    @property
    def speedup(self) -> float:
        return self.sync_iteration_s / self.async_iteration_s


def _generate(sim: Simulator, spec: LlamaSpec, cfg: Parallel, lengths: Sequence[int]) -> float:
    replicas = cfg.devices // (cfg.t_g * cfg.p_g)
    return sim.prefill_s(spec, cfg, -(-len(lengths) // replicas)) + sum(decode_timeline(sim, spec, cfg, lengths))


def _score_and_train(sim: Simulator, spec: LlamaSpec, cfg: Parallel) -> tuple[float, float]:
    score = sum(sim.inference_s(spec, ROLES[r], cfg) for r in ("actor", "ref", "reward"))
    return score, sim.train_s(spec, ROLES["actor"], cfg)


def estimate_async(
    sim: Simulator, spec: LlamaSpec, lengths: Sequence[int], *, gpus: int = 64, t: int = 4, t_g: int = 2
) -> AsyncEstimate:
    """The colocated synchronous iteration and the best asynchronous split of `gpus` devices (training
    tensor-parallel `t`, generation replicas of `t_g` devices); `lengths`: one response length per generated
    sequence."""
    if gpus % t or gpus % t_g or t % t_g:
        raise ValueError(f"gpus={gpus} must be a multiple of t={t} and t_g={t_g}, and t_g must divide t")
    colocated = Parallel(1, t, gpus // t, 1, t_g)
    generate = sim.transition_s(spec, colocated) + _generate(sim, spec, colocated, lengths)
    score, train = _score_and_train(sim, spec, colocated)
    sync = 2 * spec.params() / sim.hw.network_busbw  # the bf16 weights into every replica, pipelined
    best = None
    for rollout in range(t, gpus, t):  # whole training TP groups go to the rollout side
        g = _generate(sim, spec, Parallel(1, t_g, rollout // t_g, 1, t_g), lengths) + sync
        s, u = _score_and_train(sim, spec, Parallel(1, t, (gpus - rollout) // t))
        candidate = AsyncEstimate(generate, score, train, rollout, g, s + u, sync)
        if best is None or candidate.async_iteration_s < best.async_iteration_s:
            best = candidate
    assert best is not None
    return best
