"""DAPO (Yu et al. 2025, Decoupled Clip and Dynamic sAmpling Policy Optimization): GRPO's groups with four changes.

- **Clip-higher**: the ratio is clipped to [1 − 0.2, 1 + 0.28]; the higher ceiling lets unlikely tokens gain
  probability, which keeps entropy from collapsing.
- **Dynamic sampling**: a group whose rewards are all equal has zero advantage and adds nothing but noise to the
  loss's denominator; such groups are dropped and more prompts generated until the step's batch is full again
  (at most `max_gen_rounds` rounds, after which the run stops and says why).
- **Token-level loss**: every token of the mini-batch weighs the same (this project's aggregation for all
  programs).
- **Overlong reward shaping** (`overlong_buffer`): responses past max_new_tokens − buffer lose reward linearly.
No KL by default. Default task: `reverse`, as GRPO's.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.grpo import GRPO
from algorithms.objectives.advantages import fill_groups, grpo_step_advantages, join, varied_groups
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import ConfigError, DAPOConfig
from algorithms.run.loop import run_program
from algorithms.run.metrics import summarize, update_metrics
from engines.fields import REWARDS
from flowactors import Batch, Controller


def dapo_tiny_cpu() -> DAPOConfig:
    return DAPOConfig()


def _rows(batch: Batch) -> int:
    return len(batch)


def _reward_mean(*parts: Batch) -> float:
    return float(join(*parts)[REWARDS].float().mean())


class DAPO(GRPO):
    name = "dapo"
    key_metrics = ("reward_mean", "dapo/kept_groups_frac", "entropy", "response_length_mean")

    def __init__(self, cfg: DAPOConfig) -> None:
        super().__init__(cfg)
        self.policy_loss = cfg.policy_loss.build(
            kl_coef=cfg.kl.coef,
            kl_estimator=cfg.kl.estimator,
            **cfg.loss_terms(),
        )

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        super().setup(ctl, roles, data)
        self.data = data

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        cfg, ctl, actor = self.cfg, self.ctl, self.actor
        need, per_group = cfg.prompts_per_step, cfg.samples_per_prompt
        shaping = {
            "max_len": cfg.rollout.max_new_tokens,
            "buffer": cfg.overlong_buffer,
            "penalty": cfg.overlong_penalty,
        }
        rounds, generated, kept, drawn = [], [], 0, 0
        while True:  # generate and score rewards; keep the groups that vary, until the step's batch is full
            scored = rollout(ctl, actor, prompts, [self.reward.compute_reward], cfg.fusion)
            generated += scored.generated
            drawn += need
            if not rounds:  # the step's reward is its own prompts' samples', as in every program (not the kept)
                sampled = ctl.apply(_reward_mean, *scored.parts)
            part = ctl.apply(varied_groups, *scored.parts, offset=kept, keep_all=not cfg.dynamic_sampling, **shaping)
            rounds.append(part)
            kept += ctl.apply(_rows, part).result() // per_group
            if kept >= need or not cfg.dynamic_sampling:
                break
            if len(rounds) == cfg.max_gen_rounds:
                raise ConfigError(
                    f"dynamic sampling kept {kept} of the {need} groups a step needs after "
                    f"{len(rounds)} generation rounds at step {i} (the others' rewards were all "
                    f"equal); raise max_gen_rounds or samples_per_prompt, or dynamic_sampling=false"
                )
            prompts = self.data.next_batch(need, per_group)
        batch = ctl.apply(fill_groups, *rounds, groups=need)
        old = [] if self.on_policy else [actor.compute_log_prob(batch)]
        batch = ctl.apply(grpo_step_advantages, batch, *old, self.ref.compute_ref_log_prob(batch))
        update = actor.update_actor(batch, self.policy_loss, self.update_spec(i))
        metrics = ctl.apply(summarize, batch)
        self.stage("generate", *generated), self.stage("score", batch), self.stage("update", update)
        m, u = metrics.result(), update.result()
        if self.on_policy:
            m.setdefault("entropy", u["entropy"])
        m["kept_reward_mean"], m["reward_mean"] = m["reward_mean"], sampled.result()
        return {
            **m,
            **update_metrics({"actor": u}),
            "dapo/kept_groups_frac": kept / drawn,
            "dapo/gen_rounds": float(len(rounds)),
        }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(DAPO, dapo_tiny_cpu, argv, "DAPO on a Dask cluster")


if __name__ == "__main__":
    main()
