"""The shared algebra against values computed by hand."""

import math

import pytest
import torch

from algorithms.objectives.losses import (
    AdaptiveKL,
    LagrangeMultiplier,
    PolicyLoss,
    ValueLoss,
    gae,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_ratio,
    token_rewards,
    value_loss,
)
from flowactors import Batch


def test_masked_mean_and_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(x, m).item() == pytest.approx(2.5)
    w = masked_whiten(x, m)
    # mean 2.5, unbiased var of [1,2,3,4] = 5/3
    assert w[0, 0].item() == pytest.approx((1 - 2.5) / math.sqrt(5 / 3), rel=1e-5)
    assert w[0, 2].item() == 0.0


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = 0.5
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    with pytest.raises(ValueError, match="use k1, k2 or k3"):
        kl_penalty(lp, ref, "k4")


def test_token_rewards_put_score_on_last_token_and_kl_everywhere():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    kl = torch.full((2, 4), 0.5)
    r = token_rewards(torch.tensor([2.0, -1.0]), mask, kl, kl_coef=0.1)
    assert r.flatten().tolist() == pytest.approx([-0.05, -0.05, 1.95, 0.0, -1.05, 0.0, 0.0, 0.0])


def test_gae_by_hand():
    # one sequence of 3 tokens, gamma=0.9, lam=0.8
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7])
    # masked tail contributes nothing and gets nothing
    adv2, _ = gae(torch.tensor([[0.0, 1.0, 5.0]]), v, torch.tensor([[1, 1, 0]]), 1.0, 1.0)
    assert adv2[0, 2].item() == 0 and adv2[0, 1].item() == pytest.approx(1.0 - 0.6)


def test_policy_loss_clip_and_dual_clip():
    lp_old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.5, 0.5, 1.5, 10.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = policy_loss(lp, lp_old, adv, clip_ratio=0.2, dual_clip=3.0)
    # A>0, ratio 1.5 -> clipped to 1.2: -1.2 ; A>0 ratio .5 -> -0.5 (unclipped is larger)
    # A<0 ratio 1.5 -> max(1.5, 1.2) = 1.5 ; A<0 ratio 10 -> max(10, 1.2)=10, dual clip caps at 3
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.5, 3.0])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(lp, lp_old, adv, dual_clip=0.5)


def test_value_loss_clip():
    v, old, ret = torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0])
    # unclipped (1-2)^2 = 1 ; clipped value 0.2 -> (0.2-2)^2 = 3.24 -> max -> 0.5*3.24
    assert value_loss(v, old, ret, 0.2).item() == pytest.approx(1.62)
    assert value_loss(v, old, ret, None).item() == pytest.approx(0.5)


def test_grpo_and_remax_advantages():
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    adv = grpo_advantages(scores, groups, mask, eps=1e-6)
    s = math.sqrt(2.0)  # unbiased std of [1, 3]; the tied group has no signal
    assert adv[:, 0].tolist() == pytest.approx([-1 / s, 1 / s, 0.0, 0.0], rel=1e-5)
    ra = remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.5]), torch.tensor([[1, 1], [1, 0]]))
    assert ra.tolist() == [[0.75, 0.75], [-0.5, 0.0]]


def test_loss_objects_read_batch_fields():
    mb = Batch(
        {
            "response_mask": torch.tensor([[1, 1], [1, 0]]),
            "old_log_probs": torch.zeros(2, 2),
            "advantages": torch.ones(2, 2),
            "ref_log_probs": torch.zeros(2, 2),
            "values": torch.zeros(2, 2),
            "returns": torch.ones(2, 2),
        }
    )
    out = {"log_probs": torch.zeros(2, 2), "entropy": torch.full((2, 2), 2.0)}
    loss, w, metrics = PolicyLoss(entropy_coef=0.1, kl_coef=0.5)(out, mb)
    assert loss.flatten().tolist() == pytest.approx([-1.2] * 4)  # -A·1 - 0.1·2 + 0.5·0
    assert metrics["entropy"] == pytest.approx(2.0) and w.sum() == 3
    vloss, _, vm = ValueLoss(None)({"values": torch.zeros(2, 2)}, mb)
    assert vm["vf_loss"] == pytest.approx(0.5)


def test_controllers():
    kl = AdaptiveKL(0.1, target=1.0, horizon=100)
    kl.update(2.0, 10)  # error clipped to 0.2 -> 0.1 * (1 + 0.02)
    assert kl.value == pytest.approx(0.102)
    lag = LagrangeMultiplier(threshold=1.0, lr=0.5, init=1.0, max_lambda=10)
    lag.update(3.0)  # log λ += 0.5 · 1 · (3 − 1) = 1
    assert lag.value == pytest.approx(math.e)
    lag.update(0.0)  # violated no more: λ falls
    assert lag.value < math.e
    for _ in range(50):
        lag.update(100.0)
    assert lag.value == pytest.approx(10.0)
    state = lag.state_dict()
    other = LagrangeMultiplier(threshold=1.0)
    other.load_state_dict(state)
    assert other.value == lag.value
    with pytest.raises(ValueError, match="log-parameterised"):
        LagrangeMultiplier(threshold=1.0, init=0.0)


def _scored_batch(reward_scale: float, cost_scale: float) -> Batch:
    g = torch.Generator().manual_seed(0)
    b, r = 6, 4
    mask = torch.ones(b, r)
    mask[0, 3:] = 0
    return Batch(
        {
            "response_mask": mask,
            "old_log_probs": -torch.rand(b, r, generator=g),
            "ref_log_probs": -torch.rand(b, r, generator=g),
            "values": torch.randn(b, r, generator=g),
            "cost_values": torch.randn(b, r, generator=g),
            "rewards": reward_scale * torch.randn(b, generator=g),
            "costs": cost_scale * torch.randn(b, generator=g),
        }
    )


def test_whiten_rewards_divides_the_scores_by_their_batch_std_without_shifting():
    from algorithms.objectives.advantages import ppo_advantages, safe_rlhf_advantages

    kw = dict(gamma=1.0, lam=0.95, kl_coef=0.1, kl_estimator="k1")
    small = _scored_batch(0.05, 0.02)
    # the reference: the same call on scores divided by hand (unbiased std over the batch's samples)
    by_hand = Batch(
        {
            **small.tensors,
            "rewards": small["rewards"] / small["rewards"].std(),
            "costs": small["costs"] / small["costs"].std(),
        }
    )
    for fn, extra in ((ppo_advantages, {"whiten": True}), (safe_rlhf_advantages, {"lagrange_lambda": 0.7})):
        out = fn(small, whiten_rewards=True, **kw, **extra)
        ref = fn(by_hand, **kw, **extra)
        torch.testing.assert_close(out["advantages"], ref["advantages"])
        torch.testing.assert_close(out["returns"], ref["returns"])
        assert torch.equal(out["rewards"], small["rewards"])  # the batch (and so the metrics) keeps raw scores
        # scale-free: a reward model scoring ten times larger gives the same advantages; unwhitened it does not
        large = _scored_batch(0.5, 0.2)
        torch.testing.assert_close(fn(large, whiten_rewards=True, **kw, **extra)["advantages"], out["advantages"])
        assert not torch.allclose(fn(large, **kw, **extra)["advantages"], fn(small, **kw, **extra)["advantages"])


def test_off_policy_corrections_of_the_policy_loss():
    """Stale samples (asynchronous RL): `tis` weights each token's surrogate, clipped against the proximal
    log-probs, by min(pi_prox / pi_behaviour, cap); `behaviour_old` clips against the behaviour log-probs."""
    from algorithms.objectives.losses import policy_loss, truncated_importance_weight
    from algorithms.run.metrics import staleness_metrics

    new = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.1, -0.7, -2.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -1.0]])  # token 1: ratio e^1.3 > 2 is truncated; token 2: e^-1
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    mb = Batch(
        {"response_mask": torch.ones(1, 3), "old_log_probs": prox, "rollout_log_probs": behaviour, "advantages": adv}
    )
    weight, truncated = truncated_importance_weight(prox, behaviour, 2.0)
    assert weight.tolist()[0] == pytest.approx([math.exp(-0.1), 2.0, math.exp(-1.0)])
    assert truncated.tolist() == [[0.0, 1.0, 0.0]]
    out = {"log_probs": new, "entropy": torch.zeros(1, 3)}
    loss, _, m = PolicyLoss(0.2, None, tis_cap=2.0)(out, mb)
    plain, _ = policy_loss(new, prox, adv, 0.2, None)
    assert torch.allclose(loss, plain * weight)
    assert m["tis_weight_mean"] == pytest.approx(float(weight.mean()))
    assert m["tis_truncated_frac"] == pytest.approx(1 / 3)
    loss_b, _, _ = PolicyLoss(0.2, None, behaviour_old=True)(out, mb)
    assert torch.allclose(loss_b, policy_loss(new, behaviour, adv, 0.2, None)[0])
    # the synchronous loss is untouched by the new fields
    assert torch.equal(PolicyLoss(0.2, None)(out, mb)[0], plain)

    versions = torch.tensor([[3, 3, 0], [1, 1, 1]])  # row 0's last token is padding
    samples = Batch({"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), "policy_versions": versions})
    hist = staleness_metrics(samples, version=3, max_staleness=2)
    assert (hist["async/staleness_frac_0"], hist["async/staleness_frac_2"]) == pytest.approx((0.4, 0.6))
    assert hist["async/staleness_mean"] == pytest.approx(1.2)
    assert (hist["async/staleness_max"], hist["async/too_stale"]) == (2.0, 0.0)
    assert staleness_metrics(samples, version=4, max_staleness=2)["async/too_stale"] == 3.0
    assert hist["async/requeued"] == 0.0  # each row's tokens are of one version (padding does not count)
    spans = Batch(
        {"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), "policy_versions": torch.tensor([[2, 3, 0], [1, 1, 1]])}
    )
    assert staleness_metrics(spans, version=3, max_staleness=2)["async/requeued"] == 1.0

    # partial rollouts: a token older than the batch's bound stays as context but leaves the policy loss
    stale = Batch(
        {**mb.tensors, "policy_versions": torch.tensor([[5, 2, 4]])}, meta={"trainer_version": 6, "max_staleness": 2}
    )
    loss_m, mask_m, _ = PolicyLoss(0.2, None, tis_cap=2.0, mask_stale=True)(out, stale)
    assert mask_m.tolist() == [[1.0, 0.0, 1.0]] and torch.allclose(loss_m, loss)
    assert PolicyLoss(0.2, None, tis_cap=2.0)(out, stale)[1].tolist() == [[1.0, 1.0, 1.0]]  # only when asked


def test_rloo_baseline_is_the_mean_of_the_other_samples_of_the_prompt():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 4.0])
    groups = torch.tensor([7, 7, 7, 7, 9, 9])
    mask = torch.tensor([[1, 1, 0]] * 6)
    adv = rloo_advantages(scores, groups, mask)
    # by hand: 1 - (2+3+6)/3, 2 - (1+3+6)/3, 3 - (1+2+6)/3, 6 - (1+2+3)/3; 0 - 4, 4 - 0
    expected = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0, -4.0, 4.0])
    assert torch.allclose(adv[:, 0], expected) and torch.allclose(adv[:, 1], expected)
    assert adv[:, 2].abs().sum() == 0  # padding gets nothing
    with pytest.raises(ValueError, match="at least 2 samples per prompt; group 3 has 1"):
        rloo_advantages(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1, 1, 3]), torch.ones(3, 2))


def test_reinforce_pp_returns_to_go_with_token_kl_whitened_over_the_batch():
    scores = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.5, 0.0, 1.0], [2.0, 1.0, 9.0]])
    beta = 0.1
    # per token: -beta * kl, plus the score at the last response token; then the sum from each token on
    raw = [
        [1 - beta * (0.5 + 0.0 + 1.0), 1 - beta * (0.0 + 1.0), 1 - beta * 1.0],
        [-1 - beta * (2.0 + 1.0), -1 - beta * 1.0],
    ]
    flat = torch.tensor([v for row in raw for v in row])
    whitened = (flat - flat.mean()) / flat.std(unbiased=True)
    adv = reinforce_pp_advantages(scores, mask, kl, beta)
    assert torch.allclose(adv[mask.bool()], whitened, atol=1e-5)
    assert adv[1, 2] == 0
    plain = reinforce_pp_advantages(scores, mask)  # no KL: every token of a response carries its score
    assert torch.allclose(plain[0, :3], plain[0, 0].expand(3)) and plain[0, 0] > 0 > plain[1, 0]


def test_gspo_sequence_ratio_is_the_length_normalised_one_with_per_token_gradients():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    new = torch.tensor([[-0.8, -2.2, -0.2], [-1.3, -0.9, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ratio = sequence_ratio(new, old, mask)
    # by hand: exp(mean of the log-ratio over each response): (0.2 − 0.2 + 0.3) / 3 and (−0.3 + 0.1) / 2
    seq = torch.tensor([math.exp(0.3 / 3), math.exp(-0.2 / 2)])
    assert torch.allclose(ratio.detach(), seq[:, None].expand(2, 3))
    (ratio * mask).sum().backward()
    # d/d new_t of the GSPO-token ratio: the sequence's ratio (value), per masked token
    assert torch.allclose(new.grad, seq[:, None] * mask)


def test_clip_higher_and_sequence_level_clipping():
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    old = torch.zeros(2, 2)
    new = torch.full((2, 2), 0.1)  # every ratio exp(0.1) = 1.105
    loss, clipped = policy_loss(new, old, adv, clip_ratio=0.05, dual_clip=None, clip_ratio_high=0.2)
    assert torch.allclose(loss[0], -adv[0] * math.exp(0.1)) and clipped[0].sum() == 0  # inside 1 + 0.2
    loss, clipped = policy_loss(new, old, adv, clip_ratio=0.05, dual_clip=None)  # symmetric: clipped at 1.05
    assert torch.allclose(loss[0], torch.full((2,), -1.05)) and clipped[0].sum() == 2
    loss, clipped = policy_loss(new, old, adv, 3e-4, None, 4e-4, mask)  # GSPO's range: the sequence is clipped
    assert torch.allclose(loss[0], torch.full((2,), -(1 + 4e-4))) and clipped[0].sum() == 2


def test_dapo_keeps_the_groups_whose_rewards_vary_and_shapes_overlong_responses():
    from algorithms.objectives.advantages import fill_groups, varied_groups

    lengths = [10, 6, 8, 10, 3, 3]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    batch = Batch(
        {
            "group": torch.tensor([0, 0, 1, 1, 2, 2]),
            "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]),
            "response_mask": mask,
            "x": torch.arange(6),
        }
    )
    kept = varied_groups(batch, offset=5)
    assert kept["x"].tolist() == [2, 3] and kept["group"].tolist() == [5, 5]
    assert len(varied_groups(batch, offset=0, keep_all=True)) == 6
    # overlong shaping over the last 4 of 10 tokens, penalty 1: length 10 loses 1, 8 loses 0.5, 6 and less nothing
    shaped = varied_groups(batch, offset=0, max_len=10, buffer=4, penalty=1.0)
    assert shaped["x"].tolist() == [0, 1, 2, 3]  # group 0 now varies: 1 − 1 = 0 against 1
    assert shaped["rewards"].tolist() == [0.0, 1.0, -0.5, 0.0]
    two = fill_groups(kept, varied_groups(batch, offset=6, keep_all=True), groups=7)
    assert two["group"].tolist() == [5, 5, 6, 6] and two["x"].tolist() == [2, 3, 0, 1]


def test_pid_lagrangian_against_hand_computed_values():
    """Stooke et al.'s PID Lagrangian: e = smoothed cost − d; I += k_i·e (≥ 0); λ = k_p·e + I + k_d·rise."""
    from algorithms.objectives.losses import PIDLagrangian

    pid = PIDLagrangian(0.3, kp=1.0, ki=0.1, kd=0.5, init=0.5, window=2)
    assert pid.value == 0.5
    want = [0.72, 0.90, 0.66, 0.285]  # by hand: see the arithmetic in the class docstring's formula
    got = [pid.update(c) for c in (0.5, 0.7, 0.1, 0.0)]
    assert got == pytest.approx(want, abs=1e-12)
    state = pid.state_dict()
    resumed = PIDLagrangian(0.3, kp=1.0, ki=0.1, kd=0.5, init=0.5, window=2)
    resumed.load_state_dict(state)
    assert [resumed.update(c) for c in (0.0, 0.9)] == [pid.update(c) for c in (0.0, 0.9)]  # exact resume
    for _ in range(50):  # a constraint met with room to spare: λ falls to 0 and stays there (no negative λ)
        pid.update(0.0)
    assert pid.value == 0.0 and pid.integral == 0.0
    capped = PIDLagrangian(0.3, kp=1.0, ki=0.1, kd=0.5, init=0.5, window=2, max_lambda=0.8)
    assert [capped.update(c) for c in (0.5, 0.7)] == pytest.approx([0.72, 0.8])
    with pytest.raises(ValueError, match="window >= 1"):
        PIDLagrangian(0.3, window=0)


@pytest.mark.parametrize("update", ["dual", "pid"])
def test_a_multiplier_in_units_of_the_cost_spread_gives_one_lambda_for_a_cost_of_any_scale(update):
    """Costs, their spread and the threshold multiplied by 7 (another cost model's scale): in units of the spread
    the same λ at every step, in the cost's own units another. The unit is the mean of the spreads seen so far
    (updates whose samples all cost the same skipped), kept in the multiplier's state."""
    from algorithms.objectives.losses import PIDLagrangian

    def make(threshold: float, by_spread: bool):
        if update == "pid":
            return PIDLagrangian(threshold, kp=1.0, ki=0.1, kd=0.5, init=0.5, window=2, by_spread=by_spread)
        return LagrangeMultiplier(threshold, lr=0.1, init=0.5, max_lambda=100.0, by_spread=by_spread)

    steps = [(0.5, 0.2), (0.45, 0.0), (0.4, 0.3), (0.2, 0.1), (0.25, 0.2), (0.35, 0.25)]  # (mean cost, spread)

    def run(m, a: float, upto: int = len(steps)) -> list[float]:
        return [m.update(a * c, a * s) for c, s in steps[:upto]]

    spread = run(make(0.3, True), 1.0)
    assert run(make(2.1, True), 7.0) == pytest.approx(spread, rel=1e-9)
    assert run(make(2.1, False), 7.0) != pytest.approx(run(make(0.3, False), 1.0), rel=1e-3)
    m, units = make(0.3, True), []
    for c, s in steps:
        m.update(c, s)
        units.append(m.unit.total / m.unit.count)
    assert units == pytest.approx([0.2, 0.2, 0.25, 0.2, 0.2, 0.21])  # the second's samples all cost the same
    if update == "dual":  # log λ += lr·(J − d)/unit
        assert spread[1] == pytest.approx(0.5 * math.exp(0.1 * 0.2 / 0.2 + 0.1 * 0.15 / 0.2))
        assert make(0.3, True).update(0.5, 0.0) == pytest.approx(0.5 * math.exp(0.1 * 0.2))  # no spread yet: unit 1
    half = make(0.3, True)
    run(half, 1.0, 3)
    resumed = make(0.3, True)
    resumed.load_state_dict(half.state_dict())
    assert [resumed.update(c, s) for c, s in steps[3:]] == pytest.approx(spread[3:], rel=1e-12)
    before = make(0.3, False)  # a checkpoint from before the unit was kept: read in the cost's units, as it was made
    before.load_state_dict({k: v for k, v in make(0.3, False).state_dict().items() if k != "unit"})
    assert before.update(0.5, 0.2) == make(0.3, False).update(0.5, 0.2)
    with pytest.raises(ValueError, match="spread"):
        make(0.3, True).update(0.4)
