"""Safe-RLHF (Dai et al. 2023): PPO-Lagrangian over a reward model and a cost model.

Maximise reward subject to E[cost] ≤ threshold. A reward critic and a cost critic give two GAE advantages; the
policy follows (A_r − λ·A_c) / (1 + λ), and λ (log-parameterised, so it stays positive) rises by dual ascent while
the constraint is violated and falls once it holds. λ is controller state, updated from the step's mean cost.
An optional pretraining loss (ptx) takes a separate scaled NLL step on demonstrations, as the paper's code does.

The embedded default: `python algorithms/safe_rlhf.py` trains a tiny model on `digit_sum` (reward: digits summing
to a target; cost: using the digit 9) on a 2-slot local cluster in a few minutes, and visibly trades reward for
cost. The rule reward and cost stand in for the reward and cost models (`RewardModelWorker` takes their place
when models are given).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from algorithms.advantages import safe_rlhf_advantages
from algorithms.config import SafeRLHFConfig
from algorithms.core import LagrangeMultiplier, PolicyLoss, SFTLoss, ValueLoss
from algorithms.runner import Trainer, build_common, join, open_controller, parse_args, summarize, workdir
from flowactors import Batch

KEY_METRICS = ("reward_mean", "cost_mean", "lagrange_lambda", "kl", "entropy", "response_length_mean")


def safe_rlhf_tiny_cpu() -> SafeRLHFConfig:
    """The embedded default: a 2-layer model on digit_sum, 2 CPU slots, a few minutes."""
    return SafeRLHFConfig()


def safe_rlhf_smollm2(model_dir: str) -> SafeRLHFConfig:
    """The opt-in larger preset: SmolLM2-135M-Instruct converted to a safetensors folder (see README)."""
    cfg = SafeRLHFConfig(actor_lr=1e-6, critic_lr=5e-6, sft_steps=20, sft_lr=1e-5, micro_batch_tokens=4096)
    cfg.model.path = model_dir
    return cfg


def main(argv: Sequence[str] | None = None) -> list[dict]:
    cfg: SafeRLHFConfig = parse_args(argv, safe_rlhf_tiny_cpu, "Safe-RLHF (PPO-Lagrangian) on a Dask cluster")
    with open_controller(cfg) as ctl, workdir(cfg) as tmp:
        from pathlib import Path

        if ctl.dashboard_link:
            print(f"[safe_rlhf] Dask dashboard: {ctl.dashboard_link}", file=sys.stderr)
        g = build_common(ctl, cfg, Path(tmp), with_critics=("critic", "cost_critic"), with_cost=True)
        actor, ref, critic, cost_critic, reward, cost = (g[k] for k in
                                                         ("actor", "ref", "critic", "cost_critic", "reward", "cost"))
        lagrange = LagrangeMultiplier(cfg.cost_threshold, cfg.lambda_lr, cfg.lambda_init, cfg.lambda_max)
        policy_loss = PolicyLoss(cfg.clip_ratio, cfg.dual_clip, cfg.entropy_coef)
        trainer = Trainer(cfg, ctl, g["data"], "safe_rlhf")
        trainer.print_sizes(actor.layout.dp)

        def step(prompts: Batch, i: int) -> dict[str, float]:
            batch = actor.generate_sequences(prompts)
            trainer.stage("generate", batch)
            batch = ctl.apply(join, batch, actor.compute_log_prob(batch), ref.compute_ref_log_prob(batch),
                              critic.compute_values(batch), cost_critic.compute_values(batch),
                              reward.compute_reward(batch), cost.compute_cost(batch))
            batch = ctl.apply(safe_rlhf_advantages, batch, lagrange_lambda=lagrange.value, gamma=cfg.gamma,
                              lam=cfg.lam, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                              mini_batch_samples=cfg.mini_batch_samples, epochs=cfg.ppo_epochs, seed=cfg.seed + i)
            trainer.stage("score", batch)
            updates = [critic.update_critic(batch, ValueLoss(cfg.value_clip)),
                       cost_critic.update_critic(batch, ValueLoss(cfg.value_clip, prefix="cost_")),
                       actor.update_actor(batch, policy_loss)]
            if cfg.ptx_coef:
                ptx = g["data"].sft_batch(cfg.mini_batch_samples, g["task"].max_new_tokens, cfg.seed + 100 + i)
                updates.append(actor.update_actor(ptx.with_meta(mini_batch_samples=len(ptx)), SFTLoss(cfg.ptx_coef)))
            metrics = ctl.apply(summarize, batch)
            trainer.stage("update", *updates)
            m = metrics.result()
            m["lagrange_lambda"] = lagrange.value  # the λ this step's advantages used
            lagrange.update(m["cost_mean"])
            m.update({f"actor/{k}": v for k, v in updates[2].result().items()})
            return m

        return trainer.run(step, KEY_METRICS)


if __name__ == "__main__":
    main()
