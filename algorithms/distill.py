"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines' "On-Policy Distillation", 2025): the student
samples, a frozen teacher scores every sampled token, and each token's advantage is log pi_teacher - log pi_student,
the negative of the per-token reverse KL, so the student moves toward the teacher on its own samples (where it errs),
not on the teacher's. `python algorithms/distill.py teacher.path=DIR`.

The teacher is any Hugging Face causal LM with the student's tokenizer (its log-probs are of the student's token
ids), a role of its own placed as the scorers are (colocated, the split's scorer side, or its own pool in a
placement plan). The task's reward is still computed and reported (`reward_mean`, `success_mean`); `reward_coef`
mixes its GRPO advantage into every token's. The update is the clipped surrogate (one optimizer step per step by
default: ratio 1), so asynchronous rollouts (with their off-policy correction) and tool episodes (the loss sees
only the model's own tokens) work as in the other programs. `kl_coef` adds GRPO's KL to the reference in the loss;
0 by default (the teacher anchors the student). Default task: `digit_sum`.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import distill_step_advantages
from algorithms.objectives.losses import DistillLoss, PolicyLoss
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import DistillConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import summarize, update_metrics
from flowactors import Batch, Controller

__all__ = ["Distill", "distill_tiny_cpu", "main"]


def distill_tiny_cpu() -> DistillConfig:
    return DistillConfig()


class Distill(Algorithm):
    name = "distill"
    key_metrics = ("distill/reverse_kl", "reward_mean", "entropy", "response_length_mean")

    def __init__(self, cfg: DistillConfig) -> None:
        super().__init__(cfg)
        policy = cfg.policy_loss.build(kl_coef=cfg.kl.coef, kl_estimator=cfg.kl.estimator, **cfg.loss_terms())
        self.sampled = cfg.estimator == "sampled"
        if self.sampled:
            self.loss: PolicyLoss | DistillLoss = policy
        else:  # the surrogate only where it has something to add: the task reward's advantage or the KL
            self.loss = DistillLoss(policy if cfg.reward_coef or cfg.kl.coef else None)

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        if roles.teacher is None:
            raise ValueError("on-policy distillation needs a teacher role: set teacher.path=DIR")
        self.ctl, self.actor, self.ref, self.teacher, self.reward = (
            ctl,
            roles.actor,
            roles.ref,
            roles.teacher,
            roles.reward,
        )

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        cfg, ctl, actor = self.cfg, self.ctl, self.actor
        scorers = [actor.compute_log_prob, self.teacher.compute_teacher_log_prob, self.reward.compute_reward]
        if cfg.kl.coef:
            scorers.append(self.ref.compute_ref_log_prob)
        scored = rollout(ctl, actor, prompts, scorers, cfg.fusion)
        batch = ctl.apply(distill_step_advantages, *scored.parts, sampled=self.sampled, reward_coef=cfg.reward_coef)
        update = actor.update_actor(batch, self.loss, self.update_spec(i))
        metrics = ctl.apply(summarize, batch)
        self.stage("generate", *scored.generated), self.stage("score", batch), self.stage("update", update)
        return {**metrics.result(), **update_metrics({"actor": update})}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(Distill, distill_tiny_cpu, argv, "On-policy distillation on a Dask cluster")


if __name__ == "__main__":
    main()
