"""ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline, no critic.

PPO minus the critic plus one extra generation: each prompt is also decoded greedily, and r(x, ŷ_greedy) is
subtracted from r(x, y) as a variance-reducing baseline; the KL penalty to the reference is subtracted from the
return. Default task: `digit_sum` (reward only).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from algorithms.advantages import remax_step_advantages
from algorithms.config import ReMaxConfig
from algorithms.core import PolicyLoss
from algorithms.runner import Trainer, build_common, join, open_controller, parse_args, summarize, workdir
from flowactors import Batch

KEY_METRICS = ("reward_mean", "baseline_rewards", "kl", "entropy", "response_length_mean")


def remax_tiny_cpu() -> ReMaxConfig:
    return ReMaxConfig()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    cfg: ReMaxConfig = parse_args(argv, remax_tiny_cpu, "ReMax on a Dask cluster")
    with open_controller(cfg) as ctl, workdir(cfg) as tmp:
        if ctl.dashboard_link:
            print(f"[remax] Dask dashboard: {ctl.dashboard_link}", file=sys.stderr)
        g = build_common(ctl, cfg, Path(tmp))
        actor, ref, reward = g["actor"], g["ref"], g["reward"]
        policy_loss = PolicyLoss(cfg.clip_ratio, None)
        trainer = Trainer(cfg, ctl, g["data"], "remax")
        trainer.print_sizes(actor.layout.dp)

        def step(prompts: Batch, i: int) -> dict[str, float]:
            batch = actor.generate_sequences(prompts)
            greedy = actor.generate_sequences(prompts.with_meta(greedy=True))
            trainer.stage("generate", batch, greedy)
            batch = ctl.apply(join, batch, actor.compute_log_prob(batch), ref.compute_ref_log_prob(batch),
                              reward.compute_reward(batch))
            batch = ctl.apply(remax_step_advantages, batch, reward.compute_reward(greedy), kl_coef=cfg.kl_coef,
                              mini_batch_samples=cfg.mini_batch_samples, epochs=cfg.ppo_epochs, seed=cfg.seed + i)
            trainer.stage("score", batch)
            update = actor.update_actor(batch, policy_loss)
            metrics = ctl.apply(summarize, batch, ("baseline_rewards",))
            trainer.stage("update", update)
            m = metrics.result()
            m.update({f"actor/{k}": v for k, v in update.result().items()})
            return m

        return trainer.run(step, KEY_METRICS)


if __name__ == "__main__":
    main()
