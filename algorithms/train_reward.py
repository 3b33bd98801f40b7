"""Reward and cost models from preference pairs: the other steps before RL, on the same engines and runtime.

`python algorithms/train_reward.py model.path=SFT train_files=pairs.jsonl eval_files=held_out.jsonl out=rm` trains
a score head (started from zero on the SFT model's backbone, as OpenRLHF and TRL do) with the Bradley-Terry loss
−log σ(r(chosen) − r(rejected)) and reports the held-out pairwise accuracy (`eval/pair_accuracy`).

`kind=cost` trains Safe-RLHF's cost model instead (Dai et al. 2023): rows also carry `chosen_safe` and
`rejected_safe` (true for a safe response), `chosen` is the safer response, and the loss makes the more harmful
response cost more and each cost's sign match its label (cost > 0: unsafe), so a cost threshold of 0 means "safe on
average". Held-out: `eval/pair_accuracy` (the rejected one costs more) and `eval/sign_accuracy`.

Rows: a `prompt` (text or chat messages) or `messages`, and `chosen` / `rejected` responses (text, or chats whose
final message is the response). The folder written to `out` is a …ForSequenceClassification model, what
`reward_model=` and `cost_model=` load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import flowactors as fa
from algorithms.data.datasets import load_pairs
from algorithms.data.prompts import PromptData
from algorithms.objectives.losses import PairwiseLoss, SafetyCostLoss
from algorithms.run.config import ConfigError
from algorithms.run.stage import Stage, StageConfig, pad_rows, run_stage
from engines import OptimConfig, RewardModelWorker, UpdateSpec, build_tokenizer
from flowactors import Batch

__all__ = ["RewardStageConfig", "RewardModelTraining", "reward_tiny_cpu", "main"]


@dataclass
class RewardStageConfig(StageConfig):
    kind: str = "reward"
    """reward (Bradley-Terry on chosen/rejected) or cost (Safe-RLHF's cost loss; rows need chosen_safe and
    rejected_safe)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in ("reward", "cost"):
            raise ConfigError(f"kind must be reward or cost, got {self.kind!r}")


def reward_tiny_cpu() -> RewardStageConfig:
    return RewardStageConfig(optim=OptimConfig(lr=1e-3), samples_per_step=16, max_response_tokens=16)


class RewardModelTraining(Stage):
    name = "train_reward"
    key_metrics = ("rm_loss", "cm_loss", "pair_accuracy", "eval/pair_accuracy", "eval/sign_accuracy")

    def load(self) -> None:
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.model)
        self.examples = load_pairs(cfg.train_files, self.tokenizer, "train_files")
        self.eval_examples = load_pairs(cfg.eval_files, self.tokenizer, "eval_files") if cfg.eval_files else []
        if cfg.kind == "cost":
            for prompt, _, _, values in self.examples + self.eval_examples:
                if not all(isinstance(values.get(k), (bool, int)) for k in ("chosen_safe", "rejected_safe")):
                    raise ConfigError(
                        f"kind=cost needs `chosen_safe` and `rejected_safe` (true/false) in every row; "
                        f"the pair of prompt {prompt[:60]!r} has {sorted(values)}"
                    )

    def build(self, ctl: fa.Controller, optim: OptimConfig) -> fa.ActorGroup:
        slots, layout = self.place(ctl)
        return fa.ActorGroup(
            ctl, RewardModelWorker, name=self.cfg.kind, slots=slots, layout=layout, args=(self.cfg.model, None, optim)
        )

    def _sides(self, pairs: list[Any]) -> tuple[Batch, Batch]:
        """The chosen and the rejected sequences, laid out as generated samples (prompt | response + EOS) with a
        common prompt width, which is what the RL programs' samples look like when the model scores them."""
        width_of = PromptData(None, self.tokenizer, 0, self.cfg.seed, examples=[(p, c, {}) for p, c, _, _ in pairs])
        chosen = width_of.demonstrations([(p, c, {}) for p, c, _, _ in pairs], self.cfg.max_response_tokens)
        rejected = width_of.demonstrations([(p, r, {}) for p, _, r, _ in pairs], self.cfg.max_response_tokens)
        return chosen, rejected

    def update(self, group: fa.ActorGroup, pairs: list[Any]) -> fa.CallFuture:
        chosen, rejected = self._sides(pairs)
        fields = {
            "input_ids": chosen["input_ids"],
            "attention_mask": chosen["attention_mask"],
            "rejected_input_ids": rejected["input_ids"],
            "rejected_attention_mask": rejected["attention_mask"],
            "response_mask": torch.ones(len(pairs), 1),
        }
        if self.cfg.kind == "cost":
            fields["chosen_safe"] = torch.tensor([float(v["chosen_safe"]) for *_, v in pairs])
            fields["rejected_safe"] = torch.tensor([float(v["rejected_safe"]) for *_, v in pairs])
        loss = SafetyCostLoss() if self.cfg.kind == "cost" else PairwiseLoss()
        return group.update_scorer(Batch(fields), loss, UpdateSpec(len(pairs)))

    def evaluate(self, group: fa.ActorGroup, pairs: list[Any]) -> dict[str, float]:
        n = len(pairs)
        chosen, rejected = self._sides(pad_rows(pairs, self.dp))
        s_c, s_r = (group.compute_reward(b).result()["rewards"][:n] for b in (chosen, rejected))
        if self.cfg.kind == "reward":
            return {"eval/pair_accuracy": float((s_c > s_r).float().mean())}
        safe_c = torch.tensor([bool(v["chosen_safe"]) for *_, v in pairs])
        safe_r = torch.tensor([bool(v["rejected_safe"]) for *_, v in pairs])
        signs = torch.cat([(s_c > 0) != safe_c, (s_r > 0) != safe_r]).float()
        return {"eval/pair_accuracy": float((s_r > s_c).float().mean()), "eval/sign_accuracy": float(signs.mean())}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    return run_stage(RewardModelTraining, reward_tiny_cpu, argv, "Reward or cost model on preference pairs")


if __name__ == "__main__":
    main()
