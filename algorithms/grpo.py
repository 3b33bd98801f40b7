"""GRPO (Shao et al. 2024): n samples per prompt, group-normalised advantages, no critic, KL in the loss.

PPO minus the critic: the advantage of a sample is its reward standardised within its prompt's group, applied to
every token; the KL to the reference (k3 estimator) is a loss term instead of a reward penalty. Losses are
token-mean over the mini-batch (the DAPO / Dr. GRPO aggregation), not the original per-sequence mean.
Default task: `reverse`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from algorithms.advantages import grpo_step_advantages
from algorithms.config import GRPOConfig
from algorithms.core import PolicyLoss
from algorithms.runner import Trainer, build_common, join, open_controller, parse_args, summarize, workdir
from flowactors import Batch

KEY_METRICS = ("reward_mean", "kl", "entropy", "response_length_mean")


def grpo_tiny_cpu() -> GRPOConfig:
    return GRPOConfig()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    cfg: GRPOConfig = parse_args(argv, grpo_tiny_cpu, "GRPO on a Dask cluster")
    with open_controller(cfg) as ctl, workdir(cfg) as tmp:
        if ctl.dashboard_link:
            print(f"[grpo] Dask dashboard: {ctl.dashboard_link}", file=sys.stderr)
        g = build_common(ctl, cfg, Path(tmp))
        actor, ref, reward = g["actor"], g["ref"], g["reward"]
        policy_loss = PolicyLoss(cfg.clip_ratio, None, cfg.entropy_coef, kl_coef=cfg.kl_coef, kl_estimator="k3")
        trainer = Trainer(cfg, ctl, g["data"], "grpo")
        trainer.print_sizes(actor.layout.dp)

        def step(prompts: Batch, i: int) -> dict[str, float]:
            batch = actor.generate_sequences(prompts)
            trainer.stage("generate", batch)
            batch = ctl.apply(join, batch, actor.compute_log_prob(batch), ref.compute_ref_log_prob(batch),
                              reward.compute_reward(batch))
            batch = ctl.apply(grpo_step_advantages, batch, mini_batch_samples=cfg.mini_batch_samples,
                              epochs=cfg.ppo_epochs, seed=cfg.seed + i)
            trainer.stage("score", batch)
            update = actor.update_actor(batch, policy_loss)
            metrics = ctl.apply(summarize, batch)
            trainer.stage("update", update)
            m = metrics.result()
            m.update({f"actor/{k}": v for k, v in update.result().items()})
            return m

        return trainer.run(step, KEY_METRICS)


if __name__ == "__main__":
    main()
