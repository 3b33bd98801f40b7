"""Each algorithm learns its tiny task, end to end on a real LocalCluster (smoothed windows, not single steps)."""

import json

import pytest


def window(history, key, start, stop):
    vals = [r[key] for r in history[start:stop]]
    return sum(vals) / len(vals)


def run(main, tmp_path, *overrides):
    metrics = tmp_path / "m.jsonl"
    history = main(["dashboard=none", "--metrics-file", str(metrics), *overrides])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(len(history)))
    return lines


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_safe_rlhf_cost_ends_below_threshold_while_reward_rises(tmp_path):
    from algorithms.safe_rlhf import main

    h = run(main, tmp_path)
    for key in (
        "reward_mean",
        "cost_mean",
        "lagrange_lambda",
        "kl",
        "entropy",
        "response_length_mean",
        "tokens_per_s",
        "generate_s",
        "score_s",
        "update_s",
    ):
        assert key in h[0], key
    assert window(h, "cost_mean", 0, 10) > 0.3  # the warm start violates the constraint
    assert window(h, "cost_mean", -20, None) < 0.3  # ... and the policy ends below the threshold
    assert window(h, "reward_mean", -20, None) > window(h, "reward_mean", 0, 20) + 0.05
    assert max(r["lagrange_lambda"] for r in h[:40]) > h[0]["lagrange_lambda"]  # λ rose while violated


@pytest.mark.parametrize(
    "algo, margin",
    [
        ("ppo", 0.05),
        ("grpo", 0.05),
        ("remax", 0.05),
        ("rloo", 0.05),
        ("reinforce_pp", 0.05),
        ("gspo", 0.05),
        ("dapo", 0.05),
    ],
)
@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_algorithm_learns_its_task(tmp_path, algo, margin):
    import importlib

    main = importlib.import_module(f"algorithms.{algo}").main
    h = run(main, tmp_path, "--steps", "40")
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + margin


def test_grpo_with_lora_adapters_learns(tmp_path):
    """lora_rank=8: the warm start trains every parameter, RL only rank-8 adapters on its export."""
    from algorithms.grpo import main

    h = run(main, tmp_path, "--steps", "40", "lora_rank=8")
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + 0.05


def test_two_data_parallel_ranks_match_one(tmp_path):
    from algorithms.grpo import main

    common = ["--steps", "4", "sft_steps=20", "prompts_per_step=8", "mini_batch_samples=16"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    one = run(main, tmp_path / "a", "n_slots=1", *common)
    two = run(main, tmp_path / "b", "n_slots=2", *common)
    replicas = run(main, tmp_path / "c", "n_slots=2", "zero_stage=1", *common)  # actor and reference unsharded
    for a, b, c in zip(one, two, replicas):
        for key in ("reward_mean", "kl", "entropy", "response_length_mean"):
            assert a[key] == pytest.approx(b[key], abs=2e-3), (a["step"], key)
            assert a[key] == pytest.approx(c[key], abs=2e-3), (a["step"], key)


@pytest.mark.slow  # packing's equality is tested per engine (tests/engines/test_packing.py); -m slow runs it
def test_packed_ppo_run_matches_the_padded_run(tmp_path):
    """pack_sequences=true through every role of a PPO run (actor, reference, critic; warm start included): the
    same samples and, within float tolerance, the same KL, entropy, values and losses, step by step."""
    from algorithms.ppo import main

    common = ["--steps", "3", "sft_steps=20", "prompts_per_step=8", "mini_batch_samples=8"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    padded = run(main, tmp_path / "a", *common)
    packed = run(main, tmp_path / "b", "pack_sequences=true", *common)
    for a, b in zip(padded, packed):
        assert a["response_length_mean"] == b["response_length_mean"], a["step"]
        for key in (
            "reward_mean",
            "kl",
            "entropy",
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/grad_norm",
        ):
            assert a[key] == pytest.approx(b[key], abs=2e-3), (a["step"], key)


def test_grpo_on_policy_steps_skip_the_old_log_prob_pass_and_update_alike(tmp_path, monkeypatch):
    """One optimizer step per batch (the default): no compute_log_prob call, the update's own forward gives the
    old log-probs (ratio 1). The updates equal those with the separate pass, so later steps sample the same
    sequences and report the same metrics."""
    import flowactors as fa
    from algorithms import grpo

    calls = []
    issue = fa.ActorGroup._call
    monkeypatch.setattr(
        fa.ActorGroup, "_call", lambda self, method, *a: calls.append(method) or issue(self, method, *a)
    )
    common = ["--steps", "3", "sft_steps=10"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    skipped = run(grpo.main, tmp_path / "a", *common)
    rl = calls[calls.index("generate_sequences") :]  # after the warm start
    assert "compute_log_prob" not in calls and rl.count("update_actor") == rl.count("generate_sequences") == 3
    calls.clear()
    monkeypatch.setattr(grpo.GRPO, "on_policy", property(lambda self: False))
    full = run(grpo.main, tmp_path / "b", *common)
    assert calls.count("compute_log_prob") == 3
    for a, b in zip(skipped, full):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length_mean"] == b["response_length_mean"]
        for key in ("kl", "entropy", "actor/pg_loss", "actor/kl_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), (a["step"], key)
        assert a["actor/pg_clipfrac"] == b["actor/pg_clipfrac"] == 0.0


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_plan_with_tensor_parallel_actor_matches_data_parallel(tmp_path):
    """A TP=2 actor generating through the 3D-HybridEngine at TP=1 (micro-DP 2), a TP=2 FSDP actor that gathers
    its weights, and a DP=2 actor: same metrics."""
    from algorithms.ppo import main
    from placement import ModelPlan, Plan

    runs = []
    for name, actor_train, generate in (
        ("hybrid", (1, 2, 1), (1, 1)),
        ("tp", (1, 2, 1), None),
        ("dp", (1, 1, 2), None),
    ):
        plan = Plan(
            placement=[["actor", "ref", "critic", "reward"]],
            models=[
                ModelPlan("actor", 2, actor_train, generate),
                ModelPlan("ref", 2, (1, 1, 2)),
                ModelPlan("critic", 2, (1, 2, 1)),
                ModelPlan("reward", 2, (1, 1, 2)),
            ],
        )
        (tmp_path / name).mkdir()
        plan.save(tmp_path / name / "plan.json")
        runs.append(
            run(
                main,
                tmp_path / name,
                "--plan",
                str(tmp_path / name / "plan.json"),
                "--steps",
                "3",
                "sft_steps=10",
                "model.pad_vocab_to=2",
            )
        )  # the hybrid actor's vocab splits over tp=2
    for a, b, c in zip(*runs):
        for key in ("reward_mean", "kl", "entropy", "response_length_mean"):
            assert a[key] == pytest.approx(c[key], abs=2e-3), (a["step"], key)
            assert b[key] == pytest.approx(c[key], abs=2e-3), (b["step"], key)
