"""PPO for RLHF (Ouyang et al. 2022), the HybridFlow paper's 8-line program.

Actor (hybrid: generates and trains), critic, reference, reward. KL to the reference is a per-token penalty in the
reward (fixed or adaptive coefficient, k1/k2/k3 estimator); GAE; clipped surrogate with dual clip; clipped value
loss; optional entropy bonus; several epochs over shuffled mini-batches per step. Default task: `digit_sum`
(reward only).

`fuse=true` runs generation and scoring as one fused stage (RLHFuse, `algorithms.rollout.fusion`): the scorers that do not
share the actor's slots score finished samples in chunks while the long tail is still generating; with
`fuse_migrate=true` (and `--placement fused`) the long tail moves to the first actor rank(s) and the freed slots
score too.
Same samples, scores and update as the unfused step.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import ppo_advantages
from algorithms.objectives.losses import AdaptiveKL, FixedKL, ValueLoss
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import PPOConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import AS_REPORTED, summarize, update_metrics
from algorithms.run.resume import Change
from flowactors import Batch, Controller


def ppo_tiny_cpu() -> PPOConfig:
    return PPOConfig()


class PPO(Algorithm):
    name = "ppo"
    key_metrics = ("reward_mean", "kl", "kl_coef", "entropy", "response_length_mean")
    critics = ("critic",)

    def __init__(self, cfg: PPOConfig) -> None:
        super().__init__(cfg)
        self.kl_ctl = (
            AdaptiveKL(cfg.kl.coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKL(cfg.kl.coef)
        )
        self.policy_loss = cfg.policy_loss.build(**cfg.loss_terms())

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        self.ctl, self.actor, self.ref = ctl, roles.actor, roles.ref
        self.critic, self.reward = roles.critic, roles.reward

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        cfg, ctl, actor = self.cfg, self.ctl, self.actor
        scored = rollout(
            ctl,
            actor,
            prompts,
            [
                actor.compute_log_prob,
                self.ref.compute_ref_log_prob,
                self.critic.compute_values,
                self.reward.compute_reward,
            ],
            cfg.fusion,
        )
        batch = ctl.apply(
            ppo_advantages,
            *scored.parts,
            gamma=cfg.gamma,
            lam=cfg.lam,
            kl_coef=self.kl_ctl.value,
            kl_estimator=cfg.kl.estimator,
            whiten=cfg.whiten_advantages,
            whiten_rewards=cfg.whiten_rewards,
        )
        value_loss, spec = ValueLoss(cfg.value_clip), self.update_spec(i)
        if cfg.fusion.train:  # one fused pipeline for both updates (engines.training.megatron.pipeline_fusion)
            updates = {
                AS_REPORTED: actor.update_actor_and_critics(
                    batch, self.policy_loss, spec, critics={self.critic.name: value_loss}
                )
            }
        else:
            updates = {
                "critic": self.critic.update_critic(batch, value_loss, spec),
                "actor": actor.update_actor(batch, self.policy_loss, spec),
            }
        metrics = ctl.apply(summarize, batch)
        self.last_batch = batch  # the step's scored batch, for tests and benchmarks
        self.stage("generate", *scored.generated)
        self.stage("score", batch)
        self.stage("update", *updates.values())
        m = metrics.result()
        m["kl_coef"] = self.kl_ctl.value
        self.kl_ctl.update(m["kl"], cfg.prompts_per_step * cfg.samples_per_prompt)
        return {**m, **update_metrics(updates)}

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.value = float(state["kl_coef"])

    def resumed(self, changes: list[Change]) -> None:
        if any(c.key == "kl.coef" for c in changes):  # a changed coefficient replaces the checkpoint's
            self.kl_ctl.value = self.cfg.kl.coef


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(PPO, ppo_tiny_cpu, argv, "PPO on a Dask cluster")


if __name__ == "__main__":
    main()
