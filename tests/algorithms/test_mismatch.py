"""The rollout engine against the trainer (algorithms.objectives.losses: MismatchConfig, mismatch_metrics,
rollout_correction_weight): the monitor against a direct computation, ~0 when the rollout is the trainer's own
computation and larger with bfloat16 rollouts; each correction mode against hand-computed weights; and a GRPO run
with bfloat16 rollouts and a correction learns."""

from __future__ import annotations

import json
import math

import pytest
import torch

from algorithms.objectives.losses import PolicyLoss, mismatch_metrics, policy_loss, rollout_correction_weight
from engines import HFGenerationEngine, ModelConfig, SamplingConfig, build_model, build_tokenizer
from flowactors import Batch

TRAINER = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.2, -1.5, -0.7, 0.0]])
ROLLOUT = torch.tensor([[-1.2, -0.5, -1.0, -9.9], [-0.2, -0.1, -0.9, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])


@pytest.mark.fast
def test_the_monitor_is_a_direct_computation():
    m = mismatch_metrics(TRAINER, ROLLOUT, MASK, band=2.0)
    d = [0.2, 0.0, -1.0, 0.0, -1.4, 0.2]  # trainer - rollout on the six response tokens
    assert m["mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 6)
    assert m["mismatch_abs_diff"] == pytest.approx(sum(abs(x) for x in d) / 6)
    assert m["mismatch_max_diff"] == pytest.approx(1.4)
    assert m["mismatch_frac_beyond"] == pytest.approx(2 / 6)  # |d| > log 2: -1.0 and -1.4
    seq = torch.tensor([math.exp(0.2 + 0.0 - 1.0), math.exp(0.0 - 1.4 + 0.2)])
    assert m["mismatch_seq_ratio_std"] == pytest.approx(float(seq.std()))
    assert mismatch_metrics(TRAINER, TRAINER, MASK, 2.0)["mismatch_kl"] == 0.0


@pytest.mark.fast
def test_each_correction_mode_weighs_as_computed_by_hand():
    e = math.exp
    w, keep = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "tis", "token", cap=1.1, band=2.0)
    assert w[0, :3].tolist() == pytest.approx([1.1, 1.0, e(-1.0)]) and w[1, :3].tolist() == pytest.approx(
        [1.0, e(-1.4), 1.1]
    )
    assert bool((keep == 1).all())
    w, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "tis", "sequence", cap=2.0, band=2.0)
    assert w[0].tolist() == pytest.approx([e(-0.8)] * 4) and w[1].tolist() == pytest.approx([e(-1.2)] * 4)
    w, keep = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "mis", "token", cap=2.0, band=2.0)
    assert w[:, :3].tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]] and torch.equal(w, keep)
    w, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "mis", "sequence", cap=2.0, band=2.5)
    assert w[0].tolist() == [1.0] * 4 and w[1].tolist() == [0.0] * 4  # e^-0.8 = 0.45 in [0.4, 2.5], e^-1.2 not
    w, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "mis", "sequence", cap=2.0, band=3.5)
    assert w[:, 0].tolist() == [1.0, 1.0]
    w, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "mis", "sequence", cap=2.0, band=1.5)
    assert w[:, 0].tolist() == [0.0, 0.0]  # both sequences' ratios leave [2/3, 1.5]


@pytest.mark.fast
def test_the_policy_loss_applies_the_correction_once():
    new = TRAINER.clone().requires_grad_(True)
    adv = torch.ones_like(TRAINER)
    mb = Batch({"response_mask": MASK, "old_log_probs": TRAINER, "rollout_log_probs": ROLLOUT, "advantages": adv})
    out = {"log_probs": new, "entropy": torch.zeros_like(new)}
    plain, _ = policy_loss(new, TRAINER, adv, 0.2, None)
    weight, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "tis", "token", 2.0, 2.0)
    loss, _, m = PolicyLoss(0.2, None, correction="tis")(out, mb)
    assert torch.allclose(loss, plain * weight) and m["correction_weight_mean"] == pytest.approx(
        float((weight * MASK).sum() / MASK.sum())
    )
    # asynchronous runs: the same ratio (behaviour over proximal); tis replaces the staleness weight, not doubles it
    loss_async, _, _ = PolicyLoss(0.2, None, tis_cap=2.0, correction="tis")(out, mb)
    assert torch.allclose(loss_async, loss)
    keep, _ = rollout_correction_weight(TRAINER, ROLLOUT, MASK, "mis", "token", 2.0, 2.0)
    staleness = torch.exp((TRAINER - ROLLOUT).clamp(max=math.log(2.0)))
    loss_mis, _, _ = PolicyLoss(0.2, None, tis_cap=2.0, correction="mis")(out, mb)
    assert torch.allclose(loss_mis, plain * keep * staleness)
    assert PolicyLoss(0.2, None)(out, mb)[2]["mismatch_kl"] == pytest.approx(
        mismatch_metrics(TRAINER, ROLLOUT, MASK, 2)["mismatch_kl"]
    )


@pytest.mark.fast
def test_the_monitor_is_zero_for_the_trainer_s_own_computation_and_grows_with_bf16_rollouts():
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)
    tok = build_tokenizer(cfg)
    model = build_model(cfg, "lm", tok).eval()
    enc = tok([f"sum {i}:" for i in range(8)], padding=True, return_tensors="pt")
    prompts = Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "seed": torch.arange(8)})
    figures = {}
    for dtype in (None, torch.bfloat16):
        eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id, compute_dtype=dtype)
        out = eng.generate(model, prompts, SamplingConfig(max_new_tokens=12))
        with torch.no_grad():  # the trainer: one float32 forward over the whole sequences
            logits = model(
                input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
            ).logits
        lp = torch.log_softmax(logits[:, -13:-1].float(), -1).gather(-1, out["responses"][:, :, None])[:, :, 0]
        figures[dtype] = mismatch_metrics(lp, out["rollout_log_probs"], out["response_mask"], 2.0)
    same, bf16 = figures[None], figures[torch.bfloat16]
    assert same["mismatch_kl"] < 1e-9 and same["mismatch_max_diff"] < 1e-4, same
    assert bf16["mismatch_kl"] > 100 * max(same["mismatch_kl"], 1e-12) and bf16["mismatch_max_diff"] > 1e-3, bf16


@pytest.mark.slow  # a learning run; the correction's weights are checked exactly above (-m slow runs it)
def test_grpo_learns_with_bf16_rollouts_and_a_correction(tmp_path):
    from algorithms.grpo import main

    path = tmp_path / "m.jsonl"
    main(
        [
            "dashboard=none",
            "--steps",
            "40",
            "rollout_dtype=bfloat16",
            "rollout_correction=tis",
            "--metrics-file",
            str(path),
        ]
    )
    h = [json.loads(x) for x in path.read_text().splitlines()]
    first, last = (sum(r["reward_mean"] for r in w) / len(w) for w in (h[:10], h[-10:]))
    assert last > first + 0.05, (first, last)
    assert all(r["actor/mismatch_kl"] > 0 for r in h)  # the bf16 rollouts differ from the float32 trainer
    assert all(0 < r["actor/correction_weight_mean"] <= 2.0 for r in h)
