"""On-policy distillation (algorithms/distill.py): the loss and advantages against hand computations, and, end to end
on a real LocalCluster, a student that moves toward a teacher trained further on the task than itself."""

from __future__ import annotations

import json

import pytest
import torch

from algorithms.objectives.advantages import distill_step_advantages
from algorithms.objectives.losses import DistillLoss, masked_whiten
from engines.fields import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    REWARDS,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_LOG_PROBS,
)
from flowactors import Batch


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    s, t = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    return (s.exp() * (s - t)).sum(-1)


def test_the_top_k_loss_is_the_reverse_kl_when_k_covers_the_vocabulary_and_a_lower_bound_below():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 5, 11, generator=g), 3 * torch.randn(3, 5, 11, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    full = _kl(student, teacher)
    for k in (11, 4, 1):
        top, ids = teacher.log_softmax(-1).topk(k, -1)
        out = {"support_log_probs": student.log_softmax(-1).gather(-1, ids)}
        loss, got_mask, metrics = DistillLoss()(out, Batch({TEACHER_TOP_LOG_PROBS: top, RESPONSE_MASK: mask}))
        assert torch.equal(got_mask, mask)
        if k == 11:
            torch.testing.assert_close(loss, full, atol=1e-5, rtol=1e-5)
        else:  # grouping the rest into one bucket: never above the full KL, and by hand for k = 1
            assert (loss <= full + 1e-6).all()
        if k == 1:
            ps, pt = student.softmax(-1).gather(-1, ids)[..., 0], top.exp()[..., 0]
            by_hand = ps * (ps / pt).log() + (1 - ps) * ((1 - ps) / (1 - pt)).log()
            torch.testing.assert_close(loss, by_hand, atol=1e-5, rtol=1e-5)
        assert metrics["distill_kl"] == pytest.approx(float((loss * mask).sum() / mask.sum()), rel=1e-6)


def test_the_top_k_loss_moves_the_student_toward_the_teacher():
    g = torch.Generator().manual_seed(1)
    teacher = 4 * torch.randn(6, 9, generator=g)
    top, ids = teacher.log_softmax(-1).topk(3, -1)
    logits = torch.zeros(6, 9, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    before = float(_kl(logits, teacher).mean())
    for _ in range(200):
        out = {"support_log_probs": logits.log_softmax(-1).gather(-1, ids)[:, None]}
        loss, mask, _ = DistillLoss()(
            out, Batch({TEACHER_TOP_LOG_PROBS: top[:, None], RESPONSE_MASK: torch.ones(6, 1)})
        )
        opt.zero_grad()
        (loss * mask).mean().backward()
        opt.step()
    assert float(_kl(logits, teacher).mean()) < 0.2 * before


def test_sampled_advantages_are_the_whitened_negative_reverse_kl_plus_the_reward_term():
    g = torch.Generator().manual_seed(2)
    old, teacher = -torch.rand(4, 3, generator=g), -2 * torch.rand(4, 3, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    rewards, group = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    batch = Batch(
        {OLD_LOG_PROBS: old, TEACHER_LOG_PROBS: teacher, RESPONSE_MASK: mask, REWARDS: rewards, "group": group}
    )
    adv = distill_step_advantages(batch)[ADVANTAGES]
    torch.testing.assert_close(adv, masked_whiten(teacher - old, mask.float()))
    # group 0: rewards 1, 0 -> ±0.5 / std 0.7071; group 1: equal rewards -> 0
    mixed = distill_step_advantages(batch, reward_coef=0.5)[ADVANTAGES]
    expected = adv + 0.5 * torch.tensor([0.5 / 0.70710678, -0.5 / 0.70710678, 0.0, 0.0])[:, None] * mask
    torch.testing.assert_close(mixed, expected, atol=1e-4, rtol=1e-4)
    only_reward = distill_step_advantages(batch, sampled=False, reward_coef=0.5)[ADVANTAGES]
    torch.testing.assert_close(only_reward, expected - adv, atol=1e-4, rtol=1e-4)


def _run(main, tmp_path, name, *overrides):
    metrics = tmp_path / f"{name}.jsonl"
    main(["dashboard=none", "--metrics-file", str(metrics), *overrides])
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _mean(history, key, start, stop):
    vals = [r[key] for r in history[start:stop]]
    return sum(vals) / len(vals)


@pytest.mark.e2e  # whole programs' runs: CI's second tier (.ci/run)
def test_the_student_moves_toward_a_teacher_trained_further(tmp_path):
    from algorithms.distill import main as distill
    from algorithms.grpo import main as grpo

    # the teacher: 300 warm-start steps and some GRPO on the task (the student's default run warms up for 100)
    teacher = tmp_path / "teacher"
    t = _run(grpo, tmp_path, "teacher", "task=digit_sum", "sft_steps=300", "--steps", "5", f"export_dir={teacher}")
    teacher_success = _mean(t, "success_mean", 0, None)
    # a student that is the teacher: the teacher's log-probs equal its own on every token, in both estimators
    same = _run(
        distill, tmp_path, "same", f"teacher.path={teacher}", f"model.path={teacher}", "sft_steps=0", "--steps", "1"
    )
    assert abs(same[0]["distill/reverse_kl"]) < 1e-5 and abs(same[0]["actor/distill_kl"]) < 1e-5
    # the default run
    h = _run(distill, tmp_path, "student", f"teacher.path={teacher}")
    first, last = _mean(h, "distill/reverse_kl", 0, 10), _mean(h, "distill/reverse_kl", -10, None)
    assert last <= 0.5 * first, (first, last)
    before, after = _mean(h, "success_mean", 0, 10), _mean(h, "success_mean", -10, None)
    assert after > before + 0.03 and abs(teacher_success - after) < abs(teacher_success - before), (
        before,
        after,
        teacher_success,
    )


def _plan(tmp_path, name, placement) -> str:
    path = tmp_path / f"{name}.json"
    roles = [r for pool in placement for r in pool]
    path.write_text(json.dumps({"placement": placement, "gpus": dict.fromkeys(roles, 1)}))
    return str(path)


def test_a_teacher_on_a_pool_of_its_own_scores_as_a_colocated_one(tmp_path):
    """A placement plan puts the teacher (and the reward) on a second slot: the same run, step for step, as with
    every role on the first."""
    from algorithms.distill import main as distill
    from engines import ModelConfig, build_model, char_tokenizer, save_pretrained

    tok = char_tokenizer()
    teacher = save_pretrained(build_model(ModelConfig(seed=7), "lm", tok), tok, tmp_path / "teacher")
    common = [f"teacher.path={teacher}", "sft_steps=5", "--steps", "2", "prompts_per_step=8", "mini_batch_samples=16"]
    own = _run(
        distill, tmp_path, "own", *common, "--plan", _plan(tmp_path, "own", [["actor", "ref"], ["teacher", "reward"]])
    )
    one = _run(
        distill, tmp_path, "one", *common, "--plan", _plan(tmp_path, "one", [["actor", "ref", "teacher", "reward"]])
    )
    for a, b in zip(own, one, strict=True):
        for key in ("distill/reverse_kl", "actor/distill_kl", "reward_mean", "entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert own[0]["distill/reverse_kl"] > 0.1  # a teacher of other weights: something to distill
