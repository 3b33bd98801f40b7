"""A judge model as the only reward (engines.judge, `judge.path=`), end to end: a tiny judge, fine-tuned here to say
whether a reversal is right, replaces the task's rule in GRPO, and the rule-measured success rises.

What makes such a judge usable, found here: it must verify, not guess from the surface. A 2-layer judge fine-tuned
from the warm-started policy (accuracy 0.84 on held-out rows, 80% of them wrong) is hacked by GRPO (its reward rises
while the rule's success stays or falls); the 4-layer judge below, trained from scratch on the rule's verdicts over
right answers, near misses (a letter changed, two swapped, one short or long) and random strings, reaches 0.98 and
GRPO on it gains success on every seed tried (docs/algorithms.md has the table).
"""

from __future__ import annotations

import random

import pytest
import torch

from algorithms.data.tasks import get_task
from engines import ModelConfig, build_model, build_tokenizer, save_pretrained
from engines.judge import judge_prompts
from tests.algorithms.test_learning import run, window

TEMPLATE = "{prompt} {response}?"
VERDICTS = ("y", "n")
LETTERS = "abcdefgh"  # the reverse task's alphabet


def _candidates(rng: random.Random, target: str) -> list[str]:
    """The right answer and four wrong ones, mostly near misses (what a policy's mistakes look like)."""
    out = [target]
    for _ in range(4):
        k, i = rng.random(), rng.randrange(len(target))
        if k < 0.3:  # one letter changed
            out.append(target[:i] + rng.choice(LETTERS.replace(target[i], "")) + target[i + 1 :])
        elif k < 0.45:  # two neighbours swapped (the words have >= 2 letters)
            i = min(i, len(target) - 2)
            out.append(target[:i] + target[i + 1] + target[i] + target[i + 2 :])
        elif k < 0.6:
            out.append(target[:-1])
        elif k < 0.7:
            out.append(target + rng.choice(LETTERS))
        else:
            out.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 5))))
    return out


def _verdicts(rng: random.Random, n: int) -> list[tuple[str, str, bool]]:
    """(prompt, response, the rule's verdict) rows of the reverse task."""
    task, rows = get_task("reverse"), []
    while len(rows) < n:
        prompt, _, row = task.make_example(rng)
        rows += [(prompt, r, task.success(prompt, r, row)) for r in _candidates(rng, row["target"])]
    return rows[:n]


class _Judge:
    """The judge's verdict logits exactly as engines.judge reads them: left-padded, positions from each row's start."""

    def __init__(self, seed: int) -> None:
        self.tokenizer = build_tokenizer(ModelConfig())
        self.tokenizer.padding_side = "left"
        self.model = build_model(ModelConfig(hidden_size=64, num_layers=4, seed=seed), "lm", self.tokenizer)
        self.ids = [self.tokenizer(v, add_special_tokens=False).input_ids[0] for v in VERDICTS]

    def logits(self, rows: list[tuple[str, str, bool]]) -> torch.Tensor:
        tok = self.tokenizer
        texts = judge_prompts(TEMPLATE, [p for p, _, _ in rows], [r for _, r, _ in rows])
        enc = tok(texts, padding=True, return_tensors="pt")
        positions = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=positions)
        return out.logits[:, -1, self.ids]


def _train_judge(path, steps: int = 3000, seed: int = 0) -> tuple[float, float]:
    """Fine-tunes a tiny judge on the rule's verdicts (cross-entropy on its verdict token), writes it to `path` as a
    Hugging Face folder and returns its accuracy on held-out rows and its AUC there (the chance that it says yes
    more surely to a right answer than to a wrong one: GRPO ranks samples within a group, not against 0.5)."""
    torch.manual_seed(seed)
    rng, judge = random.Random(seed), _Judge(seed)
    opt = torch.optim.AdamW(judge.model.parameters(), lr=5e-4)
    for _ in range(steps):
        rows = _verdicts(rng, 64)
        labels = torch.tensor([0 if good else 1 for _, _, good in rows])
        loss = torch.nn.functional.cross_entropy(judge.logits(rows), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = _verdicts(random.Random(seed + 1000), 2000)
    with torch.no_grad():
        yes = torch.softmax(judge.logits(held), -1)[:, 0]
    save_pretrained(judge.model.eval(), judge.tokenizer, path)
    good = torch.tensor([g for _, _, g in held])
    auc = (yes[good][:, None] > yes[~good][None, :]).float().mean().item()
    return ((yes > 0.5) == good).float().mean().item(), auc


@pytest.mark.e2e  # whole programs' runs: CI's second tier (.ci/run)
def test_grpo_with_a_judge_as_its_only_reward_raises_the_rule_measured_success(tmp_path):
    from algorithms.grpo import main as grpo

    judge = tmp_path / "judge"
    accuracy, auc = _train_judge(judge)
    print(f"judge: held-out accuracy {accuracy:.3f} (80% of the rows are wrong answers), AUC {auc:.3f}")
    assert auc >= 0.85, (accuracy, auc)
    h = run(
        grpo,
        tmp_path,
        "task=reverse",
        f"judge.path={judge}",
        f"judge.template={TEMPLATE}",
        f"judge.yes={VERDICTS[0]}",
        f"judge.no={VERDICTS[1]}",
        "--steps",
        "150",
        "prompts_per_step=16",
        "mini_batch_samples=64",
    )
    before, after = window(h, "success_mean", 0, 15), window(h, "success_mean", -30, None)
    print(f"rule-measured success, first 15 steps -> last 30: {before:.3f} -> {after:.3f}")
    assert after >= before + 0.05, (before, after)
