"""The batch fields of the RLHF dataflow: what the roles write and the algorithms' losses and advantages read.

One name per field, so a role, a loss and an advantage stage cannot disagree on a string. The generated samples'
layout (prompts, responses, input_ids, attention_mask, position_ids, response_mask, rollout_log_probs) is the rollout
protocol's (engines.rollout.stream); these are what scoring and the advantage stage add to it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "OLD_LOG_PROBS",
    "ENTROPY",
    "REF_LOG_PROBS",
    "TEACHER_LOG_PROBS",
    "TEACHER_TOP_LOG_PROBS",
    "TEACHER_TOP_IDS",
    "REWARDS",
    "SUCCESS",
    "COSTS",
    "ADVANTAGES",
    "RESPONSE_MASK",
    "ROLLOUT_LOG_PROBS",
    "POLICY_VERSIONS",
    "ValueFields",
    "REWARD_VALUES",
    "COST_VALUES",
    "CRITIC_FIELDS",
]

OLD_LOG_PROBS = "old_log_probs"
"""The actor's log-probs of the sampled tokens before the update (compute_log_prob)."""
ENTROPY = "entropy"
"""The actor's per-token entropy (compute_log_prob)."""
REF_LOG_PROBS = "ref_log_probs"
"""The reference policy's log-probs of the sampled tokens (compute_ref_log_prob)."""
TEACHER_LOG_PROBS = "teacher_log_probs"
"""A teacher model's log-probs of the student's sampled tokens (on-policy distillation: compute_teacher_log_prob)."""
TEACHER_TOP_LOG_PROBS, TEACHER_TOP_IDS = "teacher_top_log_probs", "teacher_top_ids"
"""(B, R, k): the teacher's k most likely tokens at each response position, their log-probs and ids (on-policy
distillation over the teacher's top-k, compute_teacher_log_prob with top_k)."""
REWARDS = "rewards"
"""One score per sample: a reward model's or a rule's (compute_reward)."""
SUCCESS = "success"
"""1.0 where a rule judged the response a solution (compute_reward, for tasks whose reward is shaped)."""
COSTS = "costs"
"""One cost per sample: Safe-RLHF's cost model or rule (compute_cost)."""
ADVANTAGES = "advantages"
"""Per-token advantages (the advantage stage), read by the policy loss."""
RESPONSE_MASK = "response_mask"
"""1 over each response's own tokens (up to and including EOS)."""
ROLLOUT_LOG_PROBS = "rollout_log_probs"
"""The behaviour policy's log-probs of the sampled tokens, recorded by the generation engine as it sampled (0
past each response's end)."""
POLICY_VERSIONS = "policy_versions"
"""(B, R) int64: the policy version (updates applied) that sampled each response token; written by rollout
replicas (ActorWorker.load_policy, asynchronous RL), absent where the actor samples its own current weights."""


@dataclass(frozen=True)
class ValueFields:
    """Where one critic's values (compute_values) and the returns it trains towards (the advantage stage) live."""

    values: str
    returns: str


REWARD_VALUES = ValueFields("values", "returns")
COST_VALUES = ValueFields("cost_values", "cost_returns")
CRITIC_FIELDS = {"critic": REWARD_VALUES, "cost_critic": COST_VALUES}
"""Each critic role's fields, by role name."""
