"""The shared algebra of the RLHF algorithms: advantages, losses, KL penalties and controllers, λ updates.

Everything here is a pure function of tensors (or a small picklable callable object), so it runs wherever the data
is: advantage estimation runs as a Dask task next to the batch, losses run inside the actor and critic ranks
during `update_*`. Conventions: per-token tensors are (B, R) over the response, masked by `response_mask`;
sequence scores (rewards, costs) are (B,). References: PPO for RLHF (Ouyang et al. 2022; Ziegler et al. 2019 for
the adaptive KL controller), GAE (Schulman et al. 2016), dual-clip PPO (Ye et al. 2020), ReMax (Li et al.
2023), GRPO (Shao et al. 2024), Safe-RLHF / PPO-Lagrangian (Dai et al. 2023), KL estimators k1/k2/k3
(Schulman, "Approximating KL divergence", 2020); for stale samples (asynchronous RL) decoupled PPO (Hilton et al.
2022, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025) with a truncated importance weight
(Espeholt et al. 2018's truncation; verl's and NeMo-RL's TIS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from algorithms.rollout.asynchronous import MAX_STALENESS, TRAINER_VERSION
from algorithms.run.errors import ConfigError
from engines.fields import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    POLICY_VERSIONS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    REWARD_VALUES,
    ROLLOUT_LOG_PROBS,
    TEACHER_TOP_LOG_PROBS,
    ValueFields,
)
from flowactors import Batch

__all__ = [
    "CostUnit",
    "PIDLagrangian",
    "PolicyLossConfig",
    "KLConfig",
    "MismatchConfig",
    "mismatch_metrics",
    "rollout_correction_weight",
    "masked_mean",
    "masked_whiten",
    "kl_penalty",
    "token_rewards",
    "gae",
    "grpo_advantages",
    "remax_advantages",
    "policy_loss",
    "truncated_importance_weight",
    "value_loss",
    "PolicyLoss",
    "ValueLoss",
    "SFTLoss",
    "DistillLoss",
    "FixedKL",
    "AdaptiveKL",
    "LagrangeMultiplier",
    "PairwiseLoss",
    "SafetyCostLoss",
]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance); masked-out entries come back as 0."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π: k1 = log r, k2 = ½ (log r)², k3 = r⁻¹ − 1 + log r
    with log r = log π − log π_ref (k3 is unbiased and non-negative)."""
    d = log_probs - ref_log_probs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def token_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Sequence score at the last response token (the model's last, in a multi-turn episode), minus kl_coef · KL at
    every token (KL-in-reward PPO)."""
    mask = response_mask.to(torch.float32)
    last = (mask * torch.arange(1, mask.shape[-1] + 1)).argmax(-1)  # last 1 (0 for an empty row)
    r = torch.zeros_like(mask)
    r[torch.arange(len(r)), last] = scores.to(torch.float32)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl * mask
    return r * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response; returns (advantages, returns), both masked.

    Over the model's own tokens: in a multi-turn episode the masked-out tool outputs between turns are skipped (a
    token's next value is the next model token's, and the advantage carries across the gap), as if the episode's
    model tokens were one sequence; with a contiguous mask this is ordinary GAE."""
    mask = mask.to(torch.float32)
    values = values * mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0])
    next_v = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        here = delta + gamma * lam * last
        adv[:, t] = here * m
        last = torch.where(m > 0, here, last)  # a masked position carries the later advantage through
        next_v = torch.where(m > 0, values[:, t], next_v)
    return adv * mask, (adv + values) * mask


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """(r − mean of its group) / (std of its group + eps), broadcast over the response tokens."""
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in group_ids.unique():
        sel = group_ids == g
        r = scores[sel].float()
        centred = r - r.mean()
        adv[sel] = centred / (r.std(unbiased=True) + eps) if scale and sel.sum() > 1 else centred
    return adv[:, None] * mask.to(torch.float32)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i − the mean reward of the other samples of its prompt, broadcast over the response tokens. Each
    group needs at least two samples (the config refuses fewer before start)."""
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in group_ids.unique():
        sel = group_ids == g
        r = scores[sel].float()
        k = r.numel()
        if k < 2:
            raise ValueError(f"RLOO needs at least 2 samples per prompt; group {int(g)} has {k}")
        adv[sel] = r - (r.sum() - r) / (k - 1)
    return adv[:, None] * mask.to(torch.float32)


def reinforce_pp_advantages(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """REINFORCE++: the per-token reward (the score at the last response token, − kl_coef · KL at every token),
    summed to a return-to-go (γ = 1, no critic), then whitened over every response token of the global batch."""
    rewards = token_rewards(scores, mask, kl, kl_coef)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask.to(torch.float32)
    return masked_whiten(returns, mask)


def remax_advantages(scores: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax: the return r(x, y) − r(x, ŷ_greedy) at every response token."""
    return (scores.float() - baseline_scores.float())[:, None] * mask.to(torch.float32)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float = 0.2,
    dual_clip: float | None = 3.0,
    clip_ratio_high: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (with dual clip for negative advantages); returns (loss, clipped mask).
    The ratio is clipped to [1 − clip_ratio, 1 + clip_ratio_high] (clip_ratio_high None: clip_ratio). With the
    response `mask`, the ratio is GSPO's sequence-level one instead (`sequence_ratio`)."""
    ratio = torch.exp(log_probs - old_log_probs) if mask is None else sequence_ratio(log_probs, old_log_probs, mask)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1 - clip_ratio, 1 + high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1).float()
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (it bounds the loss at -c·A for A < 0), got {dual_clip}")
        bound = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, clipped


def sequence_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's importance ratio at every response token (its "GSPO-token" form): the value is the sequence's
    length-normalised ratio exp(mean over its tokens of log π − log π_old), the same at each of its tokens; the
    gradient at a token is that value times the token's own ∇log π."""
    mask = mask.to(log_probs.dtype)
    seq = ((log_probs - old_log_probs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    return torch.exp(seq.detach() + log_probs - log_probs.detach())


def truncated_importance_weight(
    proximal: torch.Tensor, behaviour: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(pi_prox / pi_behaviour, cap), detached, and where the cap bit (as 0/1 floats). The ratio is
    formed in log space and capped there, so a token the behaviour policy found unlikely cannot overflow."""
    log_ratio = (proximal - behaviour).detach()
    truncated = (log_ratio > math.log(cap)).float()
    return torch.exp(log_ratio.clamp(max=math.log(cap))), truncated


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
    """Per-token clipped value loss ½·max((v − R)², (clip(v) − R)²)."""
    l1 = (values - returns).pow(2)
    if clip is None:
        return 0.5 * l1
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(l1, (v_clip - returns).pow(2))


@dataclass
class PolicyLossConfig:
    """The actor's clipped surrogate, the `policy_loss.` section of every RL program (short forms: `clip_ratio=`,
    `clip_ratio_high=`, `dual_clip=`, `entropy_coef=`)."""

    ranges: ClassVar[dict[str, str]] = {
        "clip_ratio": "(0, inf)",
        "clip_ratio_high": "(0, inf)",
        "dual_clip": "(1, inf)",
        "entropy_coef": "[0, inf)",
    }
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio, 1 ± clip_ratio (GSPO: of the sequence's length-normalised ratio,
    whose range is far narrower than a token's)."""
    clip_ratio_high: float | None = None
    """The upper clip 1 + clip_ratio_high where it differs from the lower (DAPO's clip-higher, ε_high > ε_low: room
    for unlikely tokens to grow; GSPO's ε_right); none: clip_ratio."""
    dual_clip: float | None = None
    """Dual-clip bound on negative advantages (Ye et al. 2020), > 1; none: off."""
    entropy_coef: float = 0.0
    """Entropy bonus in the policy loss (0: none)."""

    def build(self, **terms: Any) -> PolicyLoss:
        """The loss these settings give, with a program's own terms (KL in the loss, sequence level, the
        asynchronous correction's)."""
        return PolicyLoss(
            self.clip_ratio, self.dual_clip, self.entropy_coef, clip_ratio_high=self.clip_ratio_high, **terms
        )


@dataclass
class MismatchConfig:
    """The rollout engine against the trainer, the `mismatch.` section of every RL program (short forms:
    `rollout_correction=`, `rollout_correction_level=`, `rollout_correction_cap=`, `rollout_correction_band=`,
    `mismatch_warn_kl=`). Every step measures, on the sampled tokens, how far the rollout engine's log-probs
    (`rollout_log_probs`) are from the trainer's before the update (`mismatch_metrics`); `correction` corrects the
    loss for it (`rollout_correction_weight`). docs/algorithms.md#rollout-trainer-mismatch."""

    ranges: ClassVar[dict[str, str]] = {"cap": "[1, inf)", "band": "(1, inf)", "warn_kl": "[0, inf)"}
    correction: str = "none"
    """none; tis: truncated importance sampling, each token's (or sequence's) loss weighted by min(ratio, cap);
    mis: masked importance sampling, the tokens (or whole sequences) whose ratio leaves [1/band, band] leave the
    loss. The ratio is the trainer's pre-update probability over the rollout engine's."""
    level: str = "token"
    """token: each token's own ratio; sequence: the product of the sequence's token ratios, for all its tokens."""
    cap: float = 2.0
    """tis's truncation."""
    band: float = 2.0
    """mis's band [1/band, band], also the bound of the monitor's `mismatch_frac_beyond`."""
    warn_kl: float = 0.01
    """A warning line, once per run, when a step's mismatch KL passes this."""

    def __post_init__(self) -> None:
        if self.correction not in ("none", "tis", "mis"):
            raise ConfigError(f"rollout_correction must be none, tis or mis, got {self.correction!r}")
        if self.level not in ("token", "sequence"):
            raise ConfigError(f"rollout_correction_level must be token or sequence, got {self.level!r}")

    def loss_terms(self) -> dict[str, Any]:
        """The policy loss's terms for the correction (the monitor is always on)."""
        out: dict[str, Any] = {"mismatch_band": self.band}
        if self.correction != "none":
            out.update(correction=self.correction, correction_level=self.level, correction_cap=self.cap)
        return out


def mismatch_metrics(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, band: float) -> dict[str, float]:
    """The rollout engine against the trainer on the sampled tokens (log-probs, (B, T), `mask` the response): the
    KL(rollout || trainer) by the k3 estimator (unbiased and >= 0 per token for samples from the rollout
    engine: r - 1 - log r with r = p_trainer / p_rollout), the mean and largest |log-prob difference|, the fraction
    of tokens whose ratio leaves [1/band, band], and the spread (std) of the sequences' ratios (the product of
    their tokens')."""
    m = mask.float()
    log_r = (trainer - rollout) * m
    k3 = torch.expm1(log_r) - log_r
    diff = log_r.abs()
    n = m.sum().clamp(min=1)
    seq = torch.exp(log_r.sum(-1).clamp(-20, 20))[m.sum(-1) > 0]
    return {
        "mismatch_kl": float((k3 * m).sum() / n),
        "mismatch_abs_diff": float(diff.sum() / n),
        "mismatch_max_diff": float(diff.max()) if diff.numel() else 0.0,
        "mismatch_frac_beyond": float(((diff > math.log(band)) * m).sum() / n),
        "mismatch_seq_ratio_std": float(seq.std()) if seq.numel() > 1 else 0.0,
    }


def rollout_correction_weight(
    trainer: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    level: str,
    cap: float,
    band: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights correcting for the rollout engine (detached), and the kept-token mask: `tis`
    weights min(r, cap), `mis` keeps (weight 1) the tokens with r in [1/band, band] and drops the others (weight
    0); r is each token's p_trainer / p_rollout, or, at `level=sequence`, the product over the sequence's tokens
    (the same weight for all of them)."""
    trainer, rollout = trainer * mask, rollout * mask
    if level == "sequence":
        trainer, rollout = (x.sum(-1, keepdim=True).expand_as(mask) for x in (trainer, rollout))
    if mode == "tis":
        weight, _ = truncated_importance_weight(trainer, rollout, cap)
        return weight, torch.ones_like(weight)
    keep = ((trainer - rollout).detach().abs() <= math.log(band)).float()
    return keep, keep


@dataclass
class KLConfig:
    """The KL to the reference policy, the `kl.` section of every RL program (short forms: `kl_coef=`,
    `kl_estimator=`). Where it acts is the program's: in the reward per token (PPO, Safe-RLHF, REINFORCE++),
    summed over the response and subtracted from its return (ReMax, RLOO), or in the loss (GRPO, DAPO, GSPO)."""

    ranges: ClassVar[dict[str, str]] = {"coef": "[0, inf)"}
    coef: float = 0.0
    """The KL's weight (0: none)."""
    estimator: str = "k1"
    """k1 (log-ratio), k2 (squared) or k3 (Schulman's unbiased, positive)."""

    def __post_init__(self) -> None:
        if self.estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"kl_estimator must be k1, k2 or k3, got {self.estimator!r}")


def fresh_tokens(versions: torch.Tensor, trainer_version: int, bound: int) -> torch.Tensor:
    """1.0 where a token's policy version is at most `bound` versions behind the trainer's, else 0.0."""
    return ((trainer_version - versions) <= bound).float()


@dataclass
class PolicyLoss:
    """The actor's loss for `update_actor`: clipped surrogate − entropy bonus (+ KL to the reference, GRPO)."""

    clip_ratio: float = 0.2
    dual_clip: float | None = 3.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """KL-in-loss coefficient (GRPO); 0 when the KL is in the reward (PPO)."""
    kl_estimator: str = "k3"
    clip_ratio_high: float | None = None
    """The upper clip 1 + clip_ratio_high (DAPO's clip-higher, GSPO's asymmetric range); None: clip_ratio."""
    sequence_level: bool = False
    """GSPO: the importance ratio (and its clipping) is the sequence's, length-normalised (`sequence_ratio`)."""
    behaviour_old: bool = False
    """Clip against the behaviour log-probs recorded at generation (ROLLOUT_LOG_PROBS) instead of OLD_LOG_PROBS:
    stale samples without a proximal pass (async_correction=none)."""
    tis_cap: float | None = None
    """Decoupled PPO for stale samples (async_correction=tis): each token's clipped surrogate, taken against the
    trainer's own pre-update log-probs (OLD_LOG_PROBS, the proximal policy; without them, the update's own
    detached log-probs, which are the pre-update policy's in GRPO's one-optimizer-step case), is weighted by
    min(exp(old - behaviour), tis_cap), correcting for the older policy that sampled it. None: off."""
    mask_stale: bool = False
    """Partial rollouts: tokens older than the batch's staleness bound (its meta's MAX_STALENESS versions behind
    TRAINER_VERSION, by their POLICY_VERSIONS) stay as context but leave the policy loss."""
    mismatch_band: float = 2.0
    """The monitor's ratio band (MismatchConfig.band): with rollout log-probs in the batch, every update reports
    `mismatch_metrics` against the trainer's pre-update log-probs."""
    correction: str = "none"
    """The rollout-trainer mismatch correction (MismatchConfig): none, tis or mis, at `correction_level`. With
    `tis_cap` (asynchronous) the ratio is the same one (behaviour over proximal): `tis` here replaces that weight,
    `mis` masks on top of it."""
    correction_level: str = "token"
    correction_cap: float = 2.0

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb[RESPONSE_MASK].float()
        if self.mask_stale and POLICY_VERSIONS in mb and TRAINER_VERSION in mb.meta:
            mask = mask * fresh_tokens(mb[POLICY_VERSIONS], mb.meta[TRAINER_VERSION], mb.meta[MAX_STALENESS])
        if self.behaviour_old:
            old = mb[ROLLOUT_LOG_PROBS]
        else:
            # Without old log-probs the batch is trained on by the policy that sampled it, in one optimizer step
            # (GRPO's on-policy case): the ratio is exactly 1, so the current log-probs, detached, are the old ones.
            old = mb[OLD_LOG_PROBS] if OLD_LOG_PROBS in mb else out["log_probs"].detach()
        loss, clipped = policy_loss(
            out["log_probs"],
            old,
            mb[ADVANTAGES],
            self.clip_ratio,
            self.dual_clip,
            self.clip_ratio_high,
            mask if self.sequence_level else None,
        )
        metrics = {"pg_loss": float(masked_mean(loss.detach(), mask)), "pg_clipfrac": float(masked_mean(clipped, mask))}
        if ROLLOUT_LOG_PROBS in mb:  # the trainer's pre-update log-probs against the rollout engine's
            trainer = mb[OLD_LOG_PROBS] if OLD_LOG_PROBS in mb else out["log_probs"].detach()
            metrics.update(mismatch_metrics(trainer, mb[ROLLOUT_LOG_PROBS], mask, self.mismatch_band))
            if self.correction != "none":
                weight, keep = rollout_correction_weight(
                    trainer,
                    mb[ROLLOUT_LOG_PROBS],
                    mask,
                    self.correction,
                    self.correction_level,
                    self.correction_cap,
                    self.mismatch_band,
                )
                loss = loss * weight
                metrics["correction_weight_mean"] = float(masked_mean(weight, mask))
                metrics["correction_kept_frac"] = float(masked_mean(keep, mask))
        if self.tis_cap is not None and self.correction != "tis":
            weight, truncated = truncated_importance_weight(old, mb[ROLLOUT_LOG_PROBS], self.tis_cap)
            loss = loss * weight
            metrics["tis_weight_mean"] = float(masked_mean(weight, mask))
            metrics["tis_truncated_frac"] = float(masked_mean(truncated, mask))
        if self.entropy_coef:
            loss = loss - self.entropy_coef * out["entropy"]
        if self.kl_coef:
            kl = kl_penalty(out["log_probs"], mb[REF_LOG_PROBS], self.kl_estimator)
            loss = loss + self.kl_coef * kl
            metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
            metrics["kl"] = float(masked_mean(out["log_probs"].detach() - mb[REF_LOG_PROBS], mask))  # k1
        metrics["entropy"] = float(masked_mean(out["entropy"].detach(), mask))
        return loss, mask, metrics


@dataclass
class ValueLoss:
    """The critic's loss for `update_critic`; `fields` says which critic's values and returns it reads."""

    clip: float | None = 0.2
    fields: ValueFields = REWARD_VALUES

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb[RESPONSE_MASK].float()
        loss = value_loss(out["values"], mb[self.fields.values], mb[self.fields.returns], self.clip)
        if loss.dim() == 3:  # a shared critic with a head per constraint: the heads' mean per token
            loss = loss.mean(-1)
        return loss, mask, {"vf_loss": float(masked_mean(loss.detach(), mask))}


@dataclass
class SFTLoss:
    """Negative log-likelihood of the response tokens: supervised warm start through the same update path
    (and Safe-RLHF's pretraining loss, scaled by `coef`)."""

    coef: float = 1.0

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb[RESPONSE_MASK].float()
        nll = -out["log_probs"]
        return self.coef * nll, mask, {"sft_loss": float(masked_mean(nll.detach(), mask))}


@dataclass
class DistillLoss:
    """On-policy distillation over the teacher's top-k (GKD's reverse KL, Agarwal et al. 2024): at each response
    token the student's sample reached, KL(student || teacher) over the teacher's k most likely tokens plus one
    bucket for the rest of the vocabulary. Grouping tokens never raises a KL, so this is a lower bound on the full
    reverse KL, equal to it once k covers the vocabulary; its gradient needs no sampled token, so it has none of the
    sampled estimator's variance. `policy`: the clipped surrogate on the task reward's advantages, added
    (reward_coef > 0)."""

    policy: PolicyLoss | None = None
    floor: float = 1e-6
    """The smallest mass a rest bucket is given (its log is taken)."""

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        student, teacher = out["support_log_probs"], mb[TEACHER_TOP_LOG_PROBS].float()
        p = student.exp()
        rest_s = (1 - p.sum(-1)).clamp(min=self.floor)
        rest_t = (1 - teacher.exp().sum(-1)).clamp(min=self.floor)
        kl = (p * (student - teacher)).sum(-1) + rest_s * (rest_s.log() - rest_t.log())
        mask = mb[RESPONSE_MASK].float()
        metrics = {"distill_kl": float(masked_mean(kl.detach(), mask))}
        if self.policy is None:
            return kl, mask, metrics
        pg, mask, policy_metrics = self.policy(out, mb)  # its mask: stale tokens (partial rollouts) are out of both
        return kl + pg, mask, {**policy_metrics, **metrics}


@dataclass
class PairwiseLoss:
    """Bradley-Terry loss of a reward model on preference pairs: −log σ(r(chosen) − r(rejected)), per pair (the
    update's `response_mask` is one column of ones, so it averages over pairs)."""

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        margin = out["chosen"] - out["rejected"]
        loss = -torch.nn.functional.logsigmoid(margin)
        return (
            loss[:, None],
            mb[RESPONSE_MASK].float(),
            {"rm_loss": float(loss.detach().mean()), "pair_accuracy": float((margin.detach() > 0).float().mean())},
        )


@dataclass
class SafetyCostLoss:
    """Safe-RLHF's cost-model loss (Dai et al. 2023, eq. 6): the more harmful response of a pair costs more,
    −log σ(c(rejected) − c(chosen)), and each response's sign matches its safety label, −log σ(s·c(y)) with
    s = +1 for an unsafe response and −1 for a safe one, so that cost > 0 means unsafe (the threshold the policy keeps
    to is then meaningful). Rows carry `chosen_safe` and `rejected_safe` (1 safe, 0 unsafe)."""

    def __call__(self, out: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        chosen, rejected = out["chosen"], out["rejected"]
        sign_c, sign_r = 1 - 2 * mb["chosen_safe"].float(), 1 - 2 * mb["rejected_safe"].float()
        f = torch.nn.functional.logsigmoid
        loss = -f(rejected - chosen) - f(sign_c * chosen) - f(sign_r * rejected)
        sign_ok = torch.cat([(sign_c * chosen > 0), (sign_r * rejected > 0)]).float()
        return (
            loss[:, None],
            mb[RESPONSE_MASK].float(),
            {
                "cm_loss": float(loss.detach().mean()),
                "pair_accuracy": float((rejected > chosen).float().mean()),
                "sign_accuracy": float(sign_ok.mean()),
            },
        )


@dataclass
class FixedKL:
    value: float

    def update(self, kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKL:
    """Ziegler et al.'s proportional controller: move the coefficient so the observed KL tracks `target`."""

    value: float
    target: float = 6.0
    horizon: int = 10000

    def update(self, kl: float, n_steps: int) -> float:
        error = max(-0.2, min(0.2, kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon
        return self.value


@dataclass
class CostUnit:
    """The unit a multiplier reads the constraint's violation in: the cost's own (`by_spread` False), or the cost's
    sampling spread, the mean over the updates so far of each one's std of the samples' costs. A learned cost
    model's scale is arbitrary (calibration slopes 2.0 and 5.1 on one task here), so gains in its units make λ
    sluggish on one model and noisy on another; in units of the spread, costs and threshold multiplied by any a > 0
    give the same λ, and one set of gains carries over. Updates whose samples all cost the same add nothing to the
    mean; before the first with a spread the unit is the cost's own."""

    by_spread: bool = False
    total: float = 0.0
    count: int = 0

    def observe(self, spread: float | None) -> float:
        """Take one update's spread (ignored in the cost's own units) and return the unit it is read in."""
        if not self.by_spread:
            return 1.0
        if spread is None:
            raise ValueError("a multiplier in units of the cost's spread needs each update's spread (cost_std)")
        if math.isfinite(spread) and spread > 0:
            self.total, self.count = self.total + float(spread), self.count + 1
        return self.total / self.count if self.count else 1.0

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict | None) -> None:
        """(A checkpoint from before the unit was kept holds none: nothing seen yet.)"""
        self.total, self.count = (float(state["total"]), int(state["count"])) if state else (0.0, 0)


@dataclass
class LagrangeMultiplier:
    """λ ≥ 0 of PPO-Lagrangian, kept positive as exp(log λ) and raised by dual ascent while cost > threshold.

    log λ += lr · (J_c − d) / u, u the violation's unit (`CostUnit`: 1, or with `by_spread` the cost's spread): the
    direction of the gradient of λ·(J_c − d) with respect to log λ, without its λ factor, which is the scale-free
    step the Safe-RLHF code takes with Adam (a plain gradient step would barely move a small λ). Clamped to
    `max_lambda` so one bad batch cannot make the reward irrelevant.
    """

    threshold: float
    lr: float = 0.1
    init: float = 1.0
    max_lambda: float = 100.0
    by_spread: bool = False

    def __post_init__(self) -> None:
        if self.init <= 0:
            raise ValueError(f"LagrangeMultiplier.init must be > 0 (λ is log-parameterised), got {self.init}")
        self.log_lambda = math.log(self.init)
        self.unit = CostUnit(self.by_spread)

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda)

    def update(self, mean_cost: float, spread: float | None = None) -> float:
        """One step from the update's mean cost (and its samples' cost std, read with `by_spread`)."""
        unit = self.unit.observe(spread)
        self.log_lambda += self.lr * (mean_cost - self.threshold) / unit
        self.log_lambda = min(self.log_lambda, math.log(self.max_lambda))
        return self.value

    def state_dict(self) -> dict:
        return {"log_lambda": self.log_lambda, "unit": self.unit.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.log_lambda = float(state["log_lambda"])
        self.unit.load_state_dict(state.get("unit"))


@dataclass
class PIDLagrangian:
    """λ ≥ 0 set by a PID controller on the constraint violation (Stooke, Achiam & Abbeel 2020, "Responsive Safety in
    Reinforcement Learning by PID Lagrangian Methods"): dual ascent is the integral term alone, which over-shoots
    and oscillates; the proportional term reacts to the violation now, the derivative term to a cost that rises.

    With e = (J̄_c − d) / u, J̄_c the mean cost of the last `window` updates and u the violation's unit (`CostUnit`:
    1, or with `by_spread` the cost's spread): I ← max(0, I + k_i·e); λ = clamp(k_p·e + I + k_d·max(0, J̄_c − J̄_c
    before) / u, 0, max_lambda). I starts at `init`, so λ starts there.
    """

    threshold: float
    kp: float = 1.0
    ki: float = 0.1
    kd: float = 0.0
    init: float = 0.5
    max_lambda: float = 100.0
    window: int = 1
    by_spread: bool = False

    def __post_init__(self) -> None:
        if self.init < 0 or self.window < 1 or min(self.kp, self.ki, self.kd) < 0:
            raise ValueError(
                f"PIDLagrangian: init and the gains must be >= 0 and window >= 1, got init={self.init}, "
                f"kp={self.kp}, ki={self.ki}, kd={self.kd}, window={self.window}"
            )
        self.integral, self.costs, self.smoothed, self.lam = self.init, [], None, self.init
        self.unit = CostUnit(self.by_spread)

    @property
    def value(self) -> float:
        return self.lam

    def update(self, mean_cost: float, spread: float | None = None) -> float:
        """One step from the update's mean cost (and its samples' cost std, read with `by_spread`)."""
        unit = self.unit.observe(spread)
        self.costs = [*self.costs, float(mean_cost)][-self.window :]
        smoothed = sum(self.costs) / len(self.costs)
        error = (smoothed - self.threshold) / unit
        self.integral = max(0.0, self.integral + self.ki * error)
        rise = max(0.0, smoothed - self.smoothed) / unit if self.smoothed is not None else 0.0
        self.smoothed = smoothed
        self.lam = min(self.max_lambda, max(0.0, self.kp * error + self.integral + self.kd * rise))
        return self.lam

    def state_dict(self) -> dict:
        state = {"integral": self.integral, "costs": list(self.costs), "smoothed": self.smoothed, "lambda": self.lam}
        return state | {"unit": self.unit.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.integral, self.costs = float(state["integral"]), [float(c) for c in state["costs"]]
        self.smoothed = None if state["smoothed"] is None else float(state["smoothed"])
        self.lam = float(state["lambda"])
        self.unit.load_state_dict(state.get("unit"))
