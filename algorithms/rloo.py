"""RLOO (Ahmadian et al. 2024, "Back to Basics"): k samples per prompt, each one's baseline the mean reward of the
other k − 1, no critic.

REINFORCE with a leave-one-out baseline, an unbiased one (a sample's own reward is not in it) that costs no extra
generation or model. The KL to the reference (k1, summed over the response) is subtracted from each sample's reward
before the baseline, as in the paper; the update is PPO's clipped surrogate over the sampled responses.
Default task: `reverse`; samples_per_prompt must be >= 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import rloo_step_advantages
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import ReinforcePPConfig, RLOOConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import summarize, update_metrics
from flowactors import Batch, Controller


def rloo_tiny_cpu() -> RLOOConfig:
    return RLOOConfig()


class RLOO(Algorithm):
    """Also the shape of REINFORCE++ (algorithms/reinforce_pp.py): sample, score with old and reference log-probs
    and the reward, compute critic-free advantages (`advantages`), update with the clipped surrogate."""

    name = "rloo"
    advantages = staticmethod(rloo_step_advantages)

    def __init__(self, cfg: RLOOConfig | ReinforcePPConfig) -> None:
        super().__init__(cfg)
        self.policy_loss = cfg.policy_loss.build(**cfg.loss_terms())

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        self.ctl, self.actor, self.ref, self.reward = ctl, roles.actor, roles.ref, roles.reward

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        cfg, ctl, actor = self.cfg, self.ctl, self.actor
        scored = rollout(
            ctl,
            actor,
            prompts,
            [actor.compute_log_prob, self.ref.compute_ref_log_prob, self.reward.compute_reward],
            cfg.fusion,
        )
        batch = ctl.apply(self.advantages, *scored.parts, kl_coef=cfg.kl.coef, kl_estimator=cfg.kl.estimator)
        update = actor.update_actor(batch, self.policy_loss, self.update_spec(i))
        metrics = ctl.apply(summarize, batch)
        self.stage("generate", *scored.generated), self.stage("score", batch), self.stage("update", update)
        return {**metrics.result(), **update_metrics({"actor": update})}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(RLOO, rloo_tiny_cpu, argv, "RLOO on a Dask cluster")


if __name__ == "__main__":
    main()
