"""The advantage stage of each algorithm, run as one Dask task next to the data.

Each takes the results of the scoring calls about the same samples (generated batch, log-probs, values, rewards,
...), joins them, and returns the batch with `advantages` (and `returns` for critics), so the update calls take
the result directly (how they walk it travels beside it, as an `UpdateSpec`). Joining inside the same task saves
one scheduling hop per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from algorithms.objectives.losses import (
    gae,
    grpo_advantages,
    kl_penalty,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    token_rewards,
)
from engines.fields import (
    ADVANTAGES,
    COST_VALUES,
    COSTS,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    REWARD_VALUES,
    REWARDS,
    TEACHER_LOG_PROBS,
    ValueFields,
)
from flowactors import Batch

__all__ = [
    "join",
    "ppo_advantages",
    "safe_rlhf_advantages",
    "grpo_step_advantages",
    "remax_step_advantages",
    "rloo_step_advantages",
    "reinforce_pp_step_advantages",
    "distill_step_advantages",
    "varied_groups",
    "fill_groups",
]


def _gae_fields(
    batch: Batch, scores: torch.Tensor, critic: ValueFields, kl_coef: float, kl_estimator: str, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch[RESPONSE_MASK]
    kl = kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], kl_estimator) if kl_coef else None
    rewards = token_rewards(scores, mask, kl, kl_coef)
    return gae(rewards, batch[critic.values], mask, gamma, lam)


def _scaled(scores: torch.Tensor, whiten: bool) -> torch.Tensor:
    """`scores` over their standard deviation across the batch (not shifted), when asked and defined."""
    if not whiten or scores.numel() < 2:
        return scores
    return scores / scores.float().std().clamp_min(1e-8)


def join(*batches: Batch) -> Batch:
    """Fields of several results about the same samples side by side."""
    return batches[0].union(*batches[1:])


def ppo_advantages(
    *parts: Batch,
    gamma: float,
    lam: float,
    kl_coef: float,
    kl_estimator: str,
    whiten: bool,
    whiten_rewards: bool = False,
) -> Batch:
    batch = join(*parts)
    adv, ret = _gae_fields(
        batch, _scaled(batch[REWARDS], whiten_rewards), REWARD_VALUES, kl_coef, kl_estimator, gamma, lam
    )
    if whiten:
        adv = masked_whiten(adv, batch[RESPONSE_MASK])
    return batch.union(Batch({ADVANTAGES: adv, REWARD_VALUES.returns: ret}))


def safe_rlhf_advantages(
    *parts: Batch,
    lagrange_lambda: float | Sequence[float],
    gamma: float,
    lam: float,
    kl_coef: float,
    kl_estimator: str,
    whiten_rewards: bool = False,
) -> Batch:
    """Reward advantages (KL penalty in the reward) and cost advantages, combined as (A_r − λ·A_c) / (1 + λ).

    Several constraints (costs (B, K), the cost critic's values (B, T, K), one λ each): a cost advantage per
    constraint, combined as (A_r − Σ_k λ_k·A_c,k) / (1 + Σ_k λ_k); the cost returns come back (B, T, K)."""
    batch = join(*parts)
    mask = batch[RESPONSE_MASK]
    adv_r, ret_r = _gae_fields(
        batch, _scaled(batch[REWARDS], whiten_rewards), REWARD_VALUES, kl_coef, kl_estimator, gamma, lam
    )
    lambdas = [lagrange_lambda] if isinstance(lagrange_lambda, (int, float)) else list(lagrange_lambda)
    costs, values = batch[COSTS], batch[COST_VALUES.values]
    several = costs.dim() == 2
    if not several:
        costs, values = costs[:, None], values[..., None]
    if costs.shape[1] != len(lambdas) or values.shape[-1] != len(lambdas):
        raise ValueError(
            f"{len(lambdas)} multipliers for costs of shape {tuple(batch[COSTS].shape)} and cost values of shape "
            f"{tuple(batch[COST_VALUES.values].shape)}: one multiplier, cost and critic head per constraint"
        )
    advs, rets = [], []
    for k in range(len(lambdas)):
        a, r = gae(
            token_rewards(_scaled(costs[:, k], whiten_rewards), mask, None, 0.0), values[..., k], mask, gamma, lam
        )
        advs.append(a)
        rets.append(r)
    penalty = sum(lam_k * a for lam_k, a in zip(lambdas, advs))
    # whiten the combination, not each part: a cost that no sample incurs has no variance to normalise
    adv = masked_whiten((adv_r - penalty) / (1 + sum(lambdas)), mask)
    ret_c = torch.stack(rets, -1) if several else rets[0]
    return batch.union(Batch({ADVANTAGES: adv, REWARD_VALUES.returns: ret_r, COST_VALUES.returns: ret_c}))


def grpo_step_advantages(*parts: Batch) -> Batch:
    batch = join(*parts)
    adv = grpo_advantages(batch[REWARDS], batch["group"], batch[RESPONSE_MASK])
    return batch.union(Batch({ADVANTAGES: adv}))


def remax_step_advantages(*parts: Batch, greedy_rewards: Batch, kl_coef: float, kl_estimator: str = "k1") -> Batch:
    """ReMax: the greedy response's reward is the baseline; the KL penalty is subtracted from the return."""
    batch = join(*parts)
    mask = batch[RESPONSE_MASK]
    adv = remax_advantages(batch[REWARDS], greedy_rewards[REWARDS], mask)
    if kl_coef:
        kl = kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], kl_estimator) * mask
        adv = adv - kl_coef * kl.sum(-1, keepdim=True) * mask
    return batch.union(Batch({ADVANTAGES: adv, "baseline_rewards": greedy_rewards[REWARDS]}))


def rloo_step_advantages(*parts: Batch, kl_coef: float, kl_estimator: str = "k1") -> Batch:
    """RLOO: the KL-penalised reward (summed over the response) minus the mean of the prompt's other samples'."""
    batch = join(*parts)
    mask = batch[RESPONSE_MASK]
    scores = batch[REWARDS].float()
    if kl_coef:
        scores = scores - kl_coef * (kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], kl_estimator) * mask).sum(
            -1
        )
    return batch.union(Batch({ADVANTAGES: rloo_advantages(scores, batch["group"], mask)}))


def reinforce_pp_step_advantages(*parts: Batch, kl_coef: float, kl_estimator: str = "k1") -> Batch:
    """REINFORCE++: token-level KL in the reward, returns-to-go, normalised over the whole batch."""
    batch = join(*parts)
    mask = batch[RESPONSE_MASK]
    kl = kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], kl_estimator) if kl_coef else None
    return batch.union(Batch({ADVANTAGES: reinforce_pp_advantages(batch[REWARDS], mask, kl, kl_coef)}))


def distill_step_advantages(*parts: Batch, sampled: bool = True, reward_coef: float = 0.0) -> Batch:
    """On-policy distillation's advantages. `sampled`: each sampled token's log pi_teacher - log pi_student, the
    negative per-token reverse KL (discount 0: a token answers for its own divergence, as in Thinking Machines'
    on-policy distillation), whitened over the step's tokens (a constant baseline and scale: the same gradient in
    expectation, far less variance); else none (the top-k loss, DistillLoss, carries the teacher). With
    `reward_coef`, plus that times the GRPO advantage of the task's reward."""
    batch = join(*parts)
    mask = batch[RESPONSE_MASK].to(torch.float32)
    adv = torch.zeros_like(mask)
    if sampled:
        adv = masked_whiten(batch[TEACHER_LOG_PROBS].float() - batch[OLD_LOG_PROBS].float(), mask)
    if reward_coef:
        adv = adv + reward_coef * grpo_advantages(batch[REWARDS], batch["group"], mask)
    return batch.union(Batch({ADVANTAGES: adv}))


def varied_groups(
    *parts: Batch, offset: int, max_len: int = 0, buffer: int = 0, penalty: float = 0.0, keep_all: bool = False
) -> Batch:
    """DAPO: the samples of the groups whose rewards are not all equal (the others give no advantage; `keep_all`
    keeps every group), their groups renumbered from `offset` so rounds can be merged. With `buffer`, rewards first
    get the overlong shaping: a response longer than max_len − buffer loses up to `penalty`, linearly over the
    buffer."""
    batch = join(*parts)
    if buffer:
        length = batch[RESPONSE_MASK].sum(-1).float()
        shaped = batch[REWARDS].float() - penalty * ((length - (max_len - buffer)) / buffer).clamp(0, 1)
        batch = Batch({**batch.tensors, REWARDS: shaped}, batch.rows, batch.meta)
    groups, rewards = batch["group"], batch[REWARDS].float()
    kept = [
        g for g in groups.unique().tolist() if keep_all or bool((rewards[groups == g] != rewards[groups == g][0]).any())
    ]
    rows = torch.cat([torch.nonzero(groups == g).flatten() for g in kept]) if kept else torch.zeros(0, dtype=torch.long)
    out = batch.take(rows)
    renumber = {g: offset + j for j, g in enumerate(kept)}
    renumbered = torch.tensor([renumber[int(g)] for g in out["group"]], dtype=groups.dtype)
    return Batch({**out.tensors, "group": renumbered}, out.rows, out.meta)


def fill_groups(*rounds: Batch, groups: int) -> Batch:
    """The first `groups` groups of the rounds' kept samples, as one batch (a step's exact size)."""
    batch = Batch.concat([r for r in rounds if len(r)])
    return batch.take(torch.nonzero(batch["group"] < groups).flatten())
