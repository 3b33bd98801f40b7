"""REINFORCE++ (Hu et al. 2025): REINFORCE with PPO's clipping, a token-level KL penalty in the reward, and advantages
normalised over the whole batch, no critic and no groups.

Each response token's reward is −kl_coef · KL_t (k1 against the reference), plus the sequence's score at its last
token; its advantage is the return-to-go (γ = 1), whitened over every response token of the step's batch — a global
baseline, where GRPO's and RLOO's are per prompt, so one sample per prompt suffices. The update is PPO's clipped
surrogate. Default task: `reverse`, one sample for each of 32 prompts a step.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.objectives.advantages import reinforce_pp_step_advantages
from algorithms.rloo import RLOO
from algorithms.run.config import ReinforcePPConfig
from algorithms.run.loop import run_program


def reinforce_pp_tiny_cpu() -> ReinforcePPConfig:
    return ReinforcePPConfig()


class ReinforcePP(RLOO):
    """RLOO's step with REINFORCE++'s advantages: the same calls, a global baseline instead of a per-prompt one."""

    name = "reinforce_pp"
    advantages = staticmethod(reinforce_pp_step_advantages)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(ReinforcePP, reinforce_pp_tiny_cpu, argv, "REINFORCE++ on a Dask cluster")


if __name__ == "__main__":
    main()
