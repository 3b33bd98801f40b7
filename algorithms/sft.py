"""Supervised fine-tuning: the step before RL, on the same engines, placement and runtime.

`python algorithms/sft.py model.path=BASE train_files=sft.jsonl eval_files=held_out.jsonl out=sft_model` trains the
policy on prompt/response pairs (a `prompt` column, or chat `messages` rendered with the tokenizer's chat template,
and a `response` column or a final assistant message) with the response tokens' negative log-likelihood, and
writes a Hugging Face folder the RL programs start from (`model.path=sft_model`). Held-out evaluation: the mean
NLL per response token (`eval/nll`). A prompt's tokens carry no loss, as in TRL's and OpenRLHF's SFT trainers.

The optimizer defaults are the RL programs' (AdamW betas 0.9/0.95, gradient clipping at 1), tuned for fine-tuning
a pretrained policy. Training a small model from scratch (a judge whose one response token is a verdict) crosses
from the base rate much later with them: the reverse task's 4-layer judge, trained 3,000 steps in the loop of
tests/algorithms/test_judge_learning.py, reached 0.872 held-out accuracy with betas 0.9/0.95 alone, 0.887 with
clipping alone, 0.979 with neither (docs/algorithms.md, a judge as the reward). For such a model set
`optim.betas=0.9,0.999 optim.grad_clip=0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flowactors as fa
from algorithms.data.datasets import load_examples
from algorithms.data.prompts import PromptData
from algorithms.objectives.losses import SFTLoss
from algorithms.run.config import ConfigError
from algorithms.run.stage import Stage, StageConfig, pad_rows, run_stage
from engines import ActorWorker, OptimConfig, SamplingConfig, UpdateSpec, build_tokenizer

__all__ = ["SFT", "sft_tiny_cpu", "main"]


def sft_tiny_cpu() -> StageConfig:
    return StageConfig(optim=OptimConfig(lr=1e-3), samples_per_step=16, max_response_tokens=16)


class SFT(Stage):
    name = "sft"
    key_metrics = ("sft_loss", "eval/nll")

    def load(self) -> None:
        tokenizer = build_tokenizer(self.cfg.model)
        for setting in ("train_files", "eval_files"):
            files = getattr(self.cfg, setting)
            examples = load_examples(files, tokenizer, setting) if files else []
            missing = next((e for e in examples if e[1] is None), None)
            if missing is not None:
                raise ConfigError(
                    f"{setting}: every row needs a response (a `response` column or a final assistant "
                    f"message); the prompt {missing[0][:60]!r} has none"
                )
            setattr(self, "examples" if setting == "train_files" else "eval_examples", examples)
        self.data = PromptData(None, tokenizer, 0, self.cfg.seed, examples=self.examples)
        self.eval_data = (
            PromptData(None, tokenizer, 0, self.cfg.seed, examples=self.eval_examples) if self.eval_examples else None
        )

    def build(self, ctl: fa.Controller, optim: OptimConfig) -> fa.ActorGroup:
        slots, layout = self.place(ctl)
        return fa.ActorGroup(
            ctl,
            ActorWorker,
            name="actor",
            slots=slots,
            layout=layout,
            args=(self.cfg.model, optim, SamplingConfig(max_new_tokens=self.cfg.max_response_tokens)),
        )

    def update(self, group: fa.ActorGroup, examples: list[Any]) -> fa.CallFuture:
        batch = self.data.demonstrations(examples, self.cfg.max_response_tokens)
        return group.update_actor(batch, SFTLoss(), UpdateSpec(len(batch), shuffle_seed=None))

    def evaluate(self, group: fa.ActorGroup, examples: list[Any]) -> dict[str, float]:
        assert self.eval_data is not None
        batch = self.eval_data.demonstrations(pad_rows(examples, self.dp), self.cfg.max_response_tokens)
        n = len(examples)
        lp = group.compute_log_prob(batch).result()["old_log_probs"][:n]
        mask = batch["response_mask"][:n].float()
        return {"eval/nll": float(-(lp * mask).sum() / mask.sum())}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_stage(SFT, sft_tiny_cpu, argv, "Supervised fine-tuning on prompt/response pairs")


if __name__ == "__main__":
    main()
