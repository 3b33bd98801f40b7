"""ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline, no critic.

PPO minus the critic plus one extra generation: each prompt is also decoded greedily, and r(x, ŷ_greedy) is
subtracted from r(x, y) as a variance-reducing baseline; the KL penalty to the reference is subtracted from the
return. Default task: `digit_sum` (reward only).
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import remax_step_advantages
from algorithms.rollout.asynchronous import generate_greedy
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import ReMaxConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import summarize, update_metrics
from flowactors import Batch, Controller


def remax_tiny_cpu() -> ReMaxConfig:
    return ReMaxConfig()


class ReMax(Algorithm):
    name = "remax"
    key_metrics = ("reward_mean", "baseline_rewards", "kl", "entropy", "response_length_mean")
    greedy_baseline = True

    def __init__(self, cfg: ReMaxConfig) -> None:
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
        greedy = generate_greedy(actor, prompts)  # the baseline, unfused
        batch = ctl.apply(
            remax_step_advantages,
            *scored.parts,
            greedy_rewards=self.reward.compute_reward(greedy),
            kl_coef=cfg.kl.coef,
            kl_estimator=cfg.kl.estimator,
        )
        update = actor.update_actor(batch, self.policy_loss, self.update_spec(i))
        metrics = ctl.apply(summarize, batch, ("baseline_rewards",))
        self.stage("generate", *scored.generated, greedy), self.stage("score", batch), self.stage("update", update)
        return {**metrics.result(), **update_metrics({"actor": update})}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(ReMax, remax_tiny_cpu, argv, "ReMax on a Dask cluster")


if __name__ == "__main__":
    main()
