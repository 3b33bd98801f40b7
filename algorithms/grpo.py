"""GRPO (Shao et al. 2024): n samples per prompt, group-normalised advantages, no critic, KL in the loss.

PPO minus the critic: the advantage of a sample is its reward standardised within its prompt's group, applied to
every token; the KL to the reference (k3 estimator) is a loss term instead of a reward penalty. Losses are
token-mean over the mini-batch (the DAPO / Dr. GRPO aggregation), not the original per-sequence mean.
Default task: `reverse`.

When a step's samples are trained on in one optimizer step (`ppo_epochs=1`, `mini_batch_samples` = the step's
samples), the policy that computes the loss is the one that sampled: the old log-probs equal the current ones, so
their forward pass is skipped (as TRL does) and the step's entropy and KL come from the update's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import grpo_step_advantages
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import GRPOConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import summarize, update_metrics
from flowactors import Batch, Controller


def grpo_tiny_cpu() -> GRPOConfig:
    return GRPOConfig()


class GRPO(Algorithm):
    name = "grpo"

    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__(cfg)
        self.policy_loss = cfg.policy_loss.build(kl_coef=cfg.kl.coef, kl_estimator=cfg.kl.estimator, **cfg.loss_terms())

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        self.ctl, self.actor, self.ref, self.reward = ctl, roles.actor, roles.ref, roles.reward

    @property
    def on_policy(self) -> bool:
        """One optimizer step over exactly the step's samples: the old log-probs need no pass of their own. With
        asynchronous rollouts too: the proximal policy of decoupled PPO (`async_correction=tis`) is the trainer's
        policy before the update, which is the one the update's own forward runs."""
        cfg = self.cfg
        return cfg.ppo_epochs == 1 and cfg.mini_batch_samples == cfg.prompts_per_step * cfg.samples_per_prompt

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        ctl, actor = self.ctl, self.actor
        old = [] if self.on_policy else [actor.compute_log_prob]
        scored = rollout(
            ctl, actor, prompts, [*old, self.ref.compute_ref_log_prob, self.reward.compute_reward], self.cfg.fusion
        )
        batch = ctl.apply(grpo_step_advantages, *scored.parts)
        update = actor.update_actor(batch, self.policy_loss, self.update_spec(i))
        metrics = ctl.apply(summarize, batch)
        self.stage("generate", *scored.generated), self.stage("score", batch), self.stage("update", update)
        m, u = metrics.result(), update.result()
        if self.on_policy:  # the update's forward ran the sampling policy: its entropy and KL are the step's
            m.update({k: u[k] for k in ("entropy", "kl") if k in u and k not in m})  # no KL without kl_coef
        return {**m, **update_metrics({"actor": u})}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(GRPO, grpo_tiny_cpu, argv, "GRPO on a Dask cluster")


if __name__ == "__main__":
    main()
