"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's groups and advantages with the importance
ratio, and its clipping, taken per sequence instead of per token.

A sequence's ratio is exp(mean over its response tokens of log π − log π_old): one number per sample, matching the
sequence-level reward it multiplies, so a few off-policy tokens cannot swing the update the way per-token ratios
do. Its range is correspondingly narrow and asymmetric (1 − 3e-4, 1 + 4e-4 by default, the paper's). Losses are
token means over the mini-batch, as everywhere here (the paper averages within each sequence first). Default task:
`reverse`, as GRPO's.
"""

from __future__ import annotations

from collections.abc import Sequence

from algorithms.grpo import GRPO
from algorithms.run.config import GSPOConfig
from algorithms.run.loop import run_program


def gspo_tiny_cpu() -> GSPOConfig:
    return GSPOConfig()


class GSPO(GRPO):
    """GRPO's step; only the loss differs."""

    name = "gspo"

    def __init__(self, cfg: GSPOConfig) -> None:
        super().__init__(cfg)
        self.policy_loss = cfg.policy_loss.build(
            kl_coef=cfg.kl.coef,
            kl_estimator=cfg.kl.estimator,
            sequence_level=True,
            **cfg.loss_terms(),
        )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(GSPO, gspo_tiny_cpu, argv, "GSPO on a Dask cluster")


if __name__ == "__main__":
    main()
