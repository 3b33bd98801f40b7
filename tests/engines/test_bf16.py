"""bf16 paths against fp32 references: scoring, one update, generation, tensor parallel.

One tiny random model (tests/engines/bf16_probes.py) in fp32 and in bf16 with the same weights cast
(`ModelConfig(dtype="bfloat16")`, the path a bf16 run takes).

Why these tolerances. bf16 keeps 8 significant bits: one rounding is off by up to 2^-9 relative, so a logit of
magnitude ~4 already carries ~0.008 of error from its last rounding alone, and the two layers before it add a few
more such roundings. Measured on this model (log-probs from -2 to -8): bf16 vs fp32 log-probs differ by at most
0.039 (mean 0.008); the KV-cache decode vs one full forward, both in bf16, by 0.027; logits (std ~1) of bf16 vs
fp32 by 0.053, of TP=2 vs TP=1 (both bf16) by 0.041. So `LOGP_ATOL = 0.1` (about 2.5x the worst measured) for
log-probs, and a mean bound of 0.02. Each test also checks that the error is not ~0 where it must not be (a model
that silently ran in fp32 would pass the closeness checks otherwise).
"""

from __future__ import annotations

import copy

import pytest
import torch

import flowactors as fa
from engines import HFGenerationEngine, ModelConfig, OptimConfig, SamplingConfig, TrainEngine, build_tokenizer
from flowactors import Batch, Layout
from tests.engines.bf16_probes import Bf16LogitsProbe, random_lm
from tests.engines.probes import fixed_batch

LOGP_ATOL = 0.1
LOGP_MEAN_ATOL = 0.02


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return random_lm("float32"), random_lm("bfloat16")


def scoring_batch() -> Batch:
    return fixed_batch(n=6, width=16, resp=8, seed=0)  # one left-padded row, one response ending early


def pg_loss(outputs: dict[str, torch.Tensor], mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """A policy-gradient loss that also reports metrics (the engine averages them token-weighted)."""
    lp, m = outputs["log_probs"], mb["response_mask"].float()
    loss = -(lp * mb["advantages"])
    return (
        loss,
        m,
        {
            "pg_loss": float((loss.detach() * m).sum() / m.sum()),
            "log_prob_mean": float((lp.detach() * m).sum() / m.sum()),
        },
    )


def one_update(
    model: torch.nn.Module, lr: float
) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(metrics, weights before, weights after) of one AdamW step on a copy of `model`."""
    model = copy.deepcopy(model).requires_grad_(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = TrainEngine(
        model, OptimConfig(lr=lr, micro_batch_tokens=48)
    )  # 2 micro-batches (bf16 compute, fp32 master weights and grads)
    metrics = eng.update([scoring_batch()], pg_loss, lambda mb: eng.policy_outputs(mb, 1.0, False))
    return metrics, before, model.state_dict()


def test_bf16_log_probs_are_close_to_fp32(models):
    f32, b16 = models
    assert next(b16.parameters()).dtype == torch.bfloat16
    batch = scoring_batch()
    ref = TrainEngine(f32, None, trainable=False).log_probs(batch, with_entropy=True)
    got = TrainEngine(b16, None, trainable=False).log_probs(batch, with_entropy=True)
    assert got["log_probs"].dtype == torch.float32  # log-softmax runs in fp32 on bf16 logits
    err = (got["log_probs"] - ref["log_probs"]).abs()
    assert 1e-3 < float(err.max()) <= LOGP_ATOL, float(err.max())
    assert float(err.mean()) <= LOGP_MEAN_ATOL
    assert torch.allclose(got["entropy"], ref["entropy"], atol=LOGP_ATOL)


def test_bf16_update_step_matches_the_fp32_step(models):
    f32, b16 = models
    m32, w32_before, w32 = one_update(f32, lr=1e-3)
    m16, w16_before, w16 = one_update(b16, lr=1e-3)
    for k in ("pg_loss", "log_prob_mean", "grad_norm"):
        assert torch.isfinite(torch.tensor(m16[k])), k
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=2e-2)  # measured 0.4 %
    assert m16["pg_loss"] == pytest.approx(m32["pg_loss"], abs=LOGP_MEAN_ATOL)
    assert m16["log_prob_mean"] == pytest.approx(m32["log_prob_mean"], abs=LOGP_MEAN_ATOL)
    changed = sum(int((w16[k] != w16_before[k]).sum()) for k in w16) / sum(v.numel() for v in w16.values())
    assert changed > 0.9, changed  # lr 1e-3 is above half a bf16 ulp of almost every weight
    # The bf16 step lands where the fp32 step lands up to two bf16 roundings (casting the weights, storing the
    # result: 2^-8 relative each) plus the step difference: AdamW's first step is lr * g / (|g| + eps), at most lr
    # per element, and the two steps agree wherever the grads' signs do (measured: 99.4 % of elements).
    total = agree = 0
    for k in w32:
        diff = (w16[k].float() - w32[k]).abs()
        rounding = 2.0**-7 * torch.maximum(w32_before[k].abs(), w32[k].abs())
        assert bool((diff <= rounding + 2 * 1e-3 * 1.01).all()), k
        agree += int((diff <= rounding + 1e-5).sum())
        total += diff.numel()
    assert agree / total > 0.98, agree / total


def test_bf16_update_at_a_fine_tuning_learning_rate_moves_the_weights(models):
    """TrainEngine trains a bf16 model on float32 master weights (bf16 compute), so steps below half a bf16 ulp
    (lr 1e-5 on weights ~0.1-1) are not rounded away."""
    _, b16 = models
    _, before, after = one_update(b16, lr=1e-5)  # RL fine-tuning rates are 1e-6..1e-5
    changed = sum(int((after[k] != before[k]).sum()) for k in after) / sum(v.numel() for v in after.values())
    assert changed > 0.9, f"only {changed:.1%} of the bf16 weights moved (fp32: 98.6 %)"


def test_bf16_greedy_generation_log_probs_match_the_training_forward(models):
    f32, b16 = models
    tok = build_tokenizer(ModelConfig())
    enc = tok(["sum 17:", "ab", "hello world", "q"], padding=True, return_tensors="pt")
    prompts = Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    eng = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    out = eng.generate(b16, prompts, SamplingConfig(max_new_tokens=12), greedy=True)
    ref = eng.generate(f32, prompts, SamplingConfig(max_new_tokens=12), greedy=True)
    assert out["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(out["responses"], ref["responses"])  # this model's greedy margins exceed bf16 rounding
    mask = out["response_mask"]
    forward = TrainEngine(b16, None, trainable=False).log_probs(out)["log_probs"] * mask
    err = (forward - out["rollout_log_probs"]).abs()
    # KV-cache decode and one full forward are the same bf16 function with different matmul shapes: equal up to
    # bf16 rounding (measured 0.027), not bitwise as in fp32 (1e-6)
    assert float(err.max()) <= LOGP_ATOL, float(err.max())
    assert float(err.sum() / mask.sum()) <= LOGP_MEAN_ATOL


def test_tensor_parallel_bf16_logits_match_tp1(controller4, models):
    f32, b16 = models
    batch = scoring_batch()
    with torch.no_grad():  # TP=1 references in this process: the same weights as the workers build
        ref, exact = (
            m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() for m in (b16, f32)
        )
    bf16_err = float((ref - exact).abs().max())
    assert 1e-3 < bf16_err <= 0.2, bf16_err
    two = fa.ActorGroup(controller4, Bf16LogitsProbe, name="bf16_tp2", slots=controller4.slots[:2], layout=Layout(tp=2))
    try:
        for logits in two.logits(batch).result():
            tp_err, tp_vs_fp32 = float((logits - ref).abs().max()), float((logits - exact).abs().max())
            # TP splits each matmul's reduction and all-reduces the bf16 partial sums: another rounding of the same
            # computation, so TP=2 is as close to fp32 as TP=1 is (measured 0.050 vs 0.053), and so within twice
            # that of TP=1 (triangle inequality; measured 0.041). A wrong split would be off by O(1).
            assert tp_vs_fp32 <= 1.5 * bf16_err, (tp_vs_fp32, bf16_err)
            assert tp_err <= 2 * bf16_err, (tp_err, bf16_err)
            assert float((logits - ref).abs().mean()) <= LOGP_MEAN_ATOL
    finally:
        two.close()
