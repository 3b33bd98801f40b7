"""Several constraints in Safe-RLHF (algorithms/safe_rlhf.py with `cost_thresholds`): each constraint has its own
threshold and λ and a head of the shared cost critic; the task digit_sum_two has two costs (9s and 8s) at different
budgets. Checked: the advantages combine the constraints as computed by hand, a mismatch of thresholds and costs is
refused before start, both constraints are held on their task, and every λ resumes exactly from a checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch

from algorithms.objectives.advantages import safe_rlhf_advantages
from algorithms.objectives.losses import gae, masked_whiten, token_rewards
from flowactors import Batch


@pytest.mark.fast
def test_several_constraints_combine_as_the_one_constraint_formula_extended():
    g = torch.Generator().manual_seed(0)
    b, t = 6, 4
    mask = torch.ones(b, t)
    mask[0, 3] = 0
    base = {
        "response_mask": mask,
        "rewards": torch.randn(b, generator=g),
        "values": torch.randn(b, t, generator=g),
        "old_log_probs": torch.zeros(b, t),
        "ref_log_probs": torch.zeros(b, t),
    }
    costs, cost_values = torch.rand(b, 2, generator=g), torch.randn(b, t, 2, generator=g)
    out = safe_rlhf_advantages(
        Batch({**base, "costs": costs, "cost_values": cost_values}),
        lagrange_lambda=[0.5, 2.0],
        gamma=1.0,
        lam=0.95,
        kl_coef=0.0,
        kl_estimator="k1",
    )
    adv_r, _ = gae(token_rewards(base["rewards"], mask, None, 0.0), base["values"], mask, 1.0, 0.95)
    parts = [gae(token_rewards(costs[:, k], mask, None, 0.0), cost_values[..., k], mask, 1.0, 0.95) for k in (0, 1)]
    expected = masked_whiten((adv_r - 0.5 * parts[0][0] - 2.0 * parts[1][0]) / 3.5, mask)
    assert torch.allclose(out["advantages"], expected, atol=1e-6)
    assert out["cost_returns"].shape == (b, t, 2)
    assert torch.allclose(out["cost_returns"][..., 1], parts[1][1])
    # one constraint given as a list of one is the scalar case, bit for bit
    one = dict(base, costs=costs[:, 0], cost_values=cost_values[..., 0])
    kw = dict(gamma=1.0, lam=0.95, kl_coef=0.0, kl_estimator="k1")
    a = safe_rlhf_advantages(Batch(one), lagrange_lambda=0.5, **kw)
    c = safe_rlhf_advantages(
        Batch({**one, "costs": costs[:, :1], "cost_values": cost_values[..., :1]}), lagrange_lambda=[0.5], **kw
    )
    assert torch.equal(a["advantages"], c["advantages"])
    with pytest.raises(ValueError, match="one multiplier, cost and critic head per constraint"):
        safe_rlhf_advantages(Batch({**base, "costs": costs, "cost_values": cost_values}), lagrange_lambda=[1.0], **kw)


def test_each_constraints_mean_and_spread_are_reported_from_its_own_column():
    from algorithms.run.metrics import summarize

    rows = 4
    base = {
        "rewards": torch.zeros(rows),
        "response_mask": torch.ones(rows, 2),
        "attention_mask": torch.ones(rows, 3),
        "prompts": torch.zeros(rows, 1),
    }
    two = summarize(Batch({**base, "costs": torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 3.0], [3.0, 3.0]])}))
    assert (two["cost_mean"], two["cost_mean_1"]) == (1.0, 2.0)
    assert two["cost_std"] == pytest.approx(torch.tensor([0.0, 1, 0, 3]).std(correction=0).item())
    assert two["cost_std_1"] == pytest.approx(1.0)  # the population spread of 1, 1, 3, 3
    one = summarize(Batch({**base, "costs": torch.tensor([0.0, 0.0, 2.0, 2.0])}))
    assert (one["cost_mean"], one["cost_std"]) == (1.0, 1.0) and "cost_mean_1" not in one


def test_thresholds_that_do_not_match_the_costs_are_one_line_before_start(capsys, no_cluster):
    from algorithms.safe_rlhf import main

    for argv, message in [
        (
            ["task=digit_sum_two", "cost_thresholds=0.3"],
            r"task 'digit_sum_two' has 2 cost constraints but "
            r"cost_thresholds gives 1 threshold; set cost_thresholds=0.3,0.3",
        ),
        (["cost_thresholds=0.3,0.2"], r"task 'digit_sum' has 1 cost constraint but cost_thresholds gives 2"),
        (["task=digit_sum_two", "cost_thresholds=a,b"], r"cost_thresholds must be numbers"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert re.search(message, err.splitlines()[0]), err


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_two_constraints_are_each_held_on_their_task(tmp_path):
    """digit_sum_two: 9s under 0.3 a sample and 8s under 0.4 (the task's budgets), the PID multiplier. The warm start
    violates the first; by the end both costs are at their budgets (within the Lagrangian's oscillation) while the
    reward rises, and the satisfied constraint's λ has fallen."""
    from algorithms.safe_rlhf import main

    main(["dashboard=none", "task=digit_sum_two", "lambda_update=pid", "--metrics-file", str(tmp_path / "m.jsonl")])
    h = _lines(tmp_path / "m.jsonl")
    mean = lambda key, w: sum(r[key] for r in w) / len(w)  # noqa: E731
    assert mean("cost_mean", h[:10]) > 0.3  # the warm start uses 9s beyond the budget
    assert mean("cost_mean", h[-20:]) <= 0.3 + 0.06
    assert mean("cost_mean_1", h[-20:]) <= 0.4 + 0.06
    assert mean("reward_mean", h[-20:]) > mean("reward_mean", h[:20]) + 0.1
    assert h[-1]["lagrange_lambda_1"] < h[0]["lagrange_lambda_1"]


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
@pytest.mark.parametrize("update", [["lambda_update=dual"], ["lambda_update=pid", "lambda_unit=spread"]])
def test_every_multiplier_resumes_exactly(tmp_path, update):
    from algorithms.safe_rlhf import main

    common = ["dashboard=none", "task=digit_sum_two", "sft_steps=10", "prompts_per_step=16", "mini_batch_samples=16"]
    common += update
    ck = tmp_path / "ck"
    ref = main([*common, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ref"), "--save-every", "2"])
    main([*common, "--steps", "2", "--checkpoint-dir", str(ck), "--save-every", "2"])
    resumed = main([*common, "--steps", "4", "--checkpoint-dir", str(ck), "--resume", "auto"])
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(ref[2:], resumed):
        for k in ("lagrange_lambda", "lagrange_lambda_1", "cost_mean", "cost_mean_1", "reward_mean", "critic/vf_loss"):
            assert a[k] == b[k], (a["step"], k)
    assert ref[3]["lagrange_lambda_1"] != ref[0]["lagrange_lambda_1"]  # the second λ moved: its state matters
    if "lambda_unit=spread" in update:  # each λ as a multiplier in the spread's units makes it from the logged costs
        from algorithms.objectives.losses import PIDLagrangian

        for k, (threshold, suffix) in enumerate(((0.3, ""), (0.4, "_1"))):
            pid = PIDLagrangian(threshold, init=0.5, max_lambda=5.0, by_spread=True)
            for r in ref:
                assert r[f"lagrange_lambda{suffix}"] == pytest.approx(pid.value, rel=1e-9), (r["step"], k)
                pid.update(r[f"cost_mean{suffix}"], r[f"cost_std{suffix}"])
            assert pid.unit.count > 0
