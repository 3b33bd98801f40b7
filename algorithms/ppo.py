"""PPO for RLHF (Ouyang et al. 2022), the HybridFlow paper's 8-line program.

Actor (hybrid: generates and trains), critic, reference, reward. KL to the reference is a per-token penalty in the
reward (fixed or adaptive coefficient, k1/k2/k3 estimator); GAE; clipped surrogate with dual clip; clipped value
loss; optional entropy bonus; several epochs over shuffled mini-batches per step. Default task: `digit_sum` (reward only).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from algorithms.advantages import ppo_advantages
from algorithms.config import PPOConfig
from algorithms.core import AdaptiveKL, FixedKL, PolicyLoss, ValueLoss
from algorithms.runner import Trainer, build_common, join, open_controller, parse_args, summarize, workdir
from flowactors import Batch

KEY_METRICS = ("reward_mean", "kl", "kl_coef", "entropy", "response_length_mean")


def ppo_tiny_cpu() -> PPOConfig:
    return PPOConfig()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    cfg: PPOConfig = parse_args(argv, ppo_tiny_cpu, "PPO on a Dask cluster")
    with open_controller(cfg) as ctl, workdir(cfg) as tmp:
        if ctl.dashboard_link:
            print(f"[ppo] Dask dashboard: {ctl.dashboard_link}", file=sys.stderr)
        g = build_common(ctl, cfg, Path(tmp), with_critics=("critic",))
        actor, ref, critic, reward = g["actor"], g["ref"], g["critic"], g["reward"]
        kl_ctl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKL(cfg.kl_coef)
        policy_loss = PolicyLoss(cfg.clip_ratio, cfg.dual_clip, cfg.entropy_coef)
        trainer = Trainer(cfg, ctl, g["data"], "ppo")
        trainer.print_sizes(actor.layout.dp)

        def step(prompts: Batch, i: int) -> dict[str, float]:
            batch = actor.generate_sequences(prompts)
            trainer.stage("generate", batch)
            batch = ctl.apply(join, batch, actor.compute_log_prob(batch), ref.compute_ref_log_prob(batch),
                              critic.compute_values(batch), reward.compute_reward(batch))
            batch = ctl.apply(ppo_advantages, batch, gamma=cfg.gamma, lam=cfg.lam, kl_coef=kl_ctl.value,
                              kl_estimator=cfg.kl_estimator, whiten=cfg.whiten_advantages,
                              mini_batch_samples=cfg.mini_batch_samples, epochs=cfg.ppo_epochs, seed=cfg.seed + i)
            trainer.stage("score", batch)
            updates = [critic.update_critic(batch, ValueLoss(cfg.value_clip)), actor.update_actor(batch, policy_loss)]
            metrics = ctl.apply(summarize, batch)
            trainer.stage("update", *updates)
            m = metrics.result()
            m["kl_coef"] = kl_ctl.value
            kl_ctl.update(m["kl"], cfg.prompts_per_step * cfg.samples_per_prompt)
            m.update({f"actor/{k}": v for k, v in updates[1].result().items()})
            m.update({f"critic/{k}": v for k, v in updates[0].result().items()})
            return m

        return trainer.run(step, KEY_METRICS)


if __name__ == "__main__":
    main()
