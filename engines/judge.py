"""A judge model as the reward (a generative reward model, as verl, OpenRLHF and NeMo-RL call it): a causal language
model is asked whether a response is good, and its verdict is read from the probability of its answer token.

Each sample is decoded with the policy's tokenizer, written into the judge's prompt template (`{prompt}` and
`{response}`), tokenized with the judge's own tokenizer (left-padded, positions counted from each row's first real
token) and run through the judge once; the reward is P(yes) / (P(yes) + P(no)) of the next token at the end of the
template, in [0, 1]: the two verdict tokens' softmax, so probability the judge puts elsewhere does not count. Why a
probability and not a parsed, generated score: one forward pass and no sampling noise, and it is smooth in the
judge's belief, so GRPO's group baseline sees differences that a thresholded "Yes" would hide.

The judge is a frozen model on the reward role's pool (its own slots under `--placement split`), sharded like the
other frozen models (`actor.zero_stage`), batched by the MESH protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engines.fields import REWARDS, SUCCESS
from engines.models.config import ModelConfig, build_tokenizer
from engines.roles import ModelWorker
from flowactors import MESH, Batch, endpoint

__all__ = ["JudgeRewardWorker", "judge_prompts", "verdict_token"]


def verdict_token(tokenizer, text: str) -> int:
    """The one token id of a verdict (" Yes", "Y", ...) in the judge's vocabulary; a verdict of several tokens is
    refused (its probability would be a product over positions the template does not end at)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if ids == [tokenizer.unk_token_id]:
        raise ValueError(f"the judge's verdict {text!r} is not in its vocabulary (it reads as the unknown token)")
    if len(ids) != 1:
        raise ValueError(
            f"the judge's verdict {text!r} is {len(ids)} tokens in its vocabulary ({ids}); choose verdicts of one "
            f"token each (judge.yes / judge.no), e.g. ' Yes' / ' No' for a BPE vocabulary or 'Y' / 'N' for characters"
        )
    return ids[0]


def judge_prompts(template: str, prompts: list[str], responses: list[str]) -> list[str]:
    """The judge's inputs: the template with each sample's prompt and response in place."""
    return [template.replace("{prompt}", p).replace("{response}", r) for p, r in zip(prompts, responses)]


class JudgeRewardWorker(ModelWorker):
    """compute_reward: P(yes) of a frozen causal LM asked, through `template`, whether each response is good."""

    head = "lm"

    def __init__(
        self,
        model: ModelConfig,
        policy: ModelConfig,
        template: str,
        verdicts: tuple[str, str] = (" Yes", " No"),
        zero_stage: int = 3,
        success: Callable[[str, str, dict[str, Any]], bool] | None = None,
    ) -> None:
        """`model`: the judge (a Hugging Face causal LM folder); `policy`: the model whose samples it judges (their
        tokens are decoded with its tokenizer); `verdicts`: the (yes, no) answer texts, one token each;
        `success`: a task's rule of whether a response solved its prompt, reported beside the judge's reward (a
        `success` field) so a run shows what the judge's reward bought."""
        self.success = success
        if model.engine != "torch":
            raise ValueError(f"the judge runs on the torch engine, not {model.engine!r}")
        self._setup(model, None, trainable=False, zero_stage=zero_stage)
        self.template = template
        self.policy_tokenizer = build_tokenizer(policy)
        self.verdicts = [verdict_token(self.tokenizer, v) for v in verdicts]
        if self.verdicts[0] == self.verdicts[1]:
            raise ValueError(f"the judge's verdicts {verdicts} are the same token; give two different ones")

    @torch.no_grad()
    def judge(self, texts: list[str]) -> torch.Tensor:
        """P(yes) / (P(yes) + P(no)) of the token after each text."""
        tok = self.tokenizer
        side, tok.padding_side = tok.padding_side, "left"
        try:
            enc = tok(texts, padding=True, return_tensors="pt")
        finally:
            tok.padding_side = side
        mask = enc.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.engine.model(input_ids=enc.input_ids, attention_mask=mask, position_ids=positions).logits
        if hasattr(logits, "full_tensor"):  # a vocabulary-parallel head's DTensor
            logits = logits.full_tensor()
        return torch.softmax(logits[:, -1, self.verdicts].float(), dim=-1)[:, 0]

    @endpoint(protocol=MESH)
    def compute_reward(self, batch: Batch) -> Batch:
        decode = self.policy_tokenizer.batch_decode
        prompts = decode(batch["prompts"], skip_special_tokens=True)
        responses = decode(batch["responses"], skip_special_tokens=True)
        out = {REWARDS: self.judge(judge_prompts(self.template, prompts, responses))}
        if self.success is not None:
            rows = [{k: v[i] for k, v in batch.rows.items()} for i in range(len(batch))]
            out[SUCCESS] = torch.tensor([float(self.success(p, r, row)) for p, r, row in zip(prompts, responses, rows)])
        return Batch(out)
