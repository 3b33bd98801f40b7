"""Multi-turn tool tasks end to end on a real LocalCluster: the algorithms take episodes (plain, fused and
asynchronous steps sample the same ones), tool_arith is learned with the tool and not without it, and Safe-RLHF
keeps the unsafe tool's use under its threshold on tool_arith_safe while success rises."""

import importlib

import pytest

from tests.algorithms.test_learning import run, window

EPISODE_KEYS = (
    "success_mean",
    "turns_mean",
    "tool_calls_mean",
    "tool_errors_mean",
    "tool_seconds_mean",
    "model_tokens_mean",
    "tool_tokens_mean",
)


@pytest.mark.parametrize("algo", ["ppo", "remax", "safe_rlhf"])
@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_algorithms_train_on_episodes(tmp_path, algo):
    """Two steps on episodes from a warm start that calls the tool about half the time: the step metrics report
    the episodes (calls made, their outputs as context tokens, turns = calls + 1 answer)."""
    main = importlib.import_module(f"algorithms.{algo}").main
    task = "tool_arith_safe" if algo == "safe_rlhf" else "tool_arith"
    h = run(
        main, tmp_path, f"task={task}", "sft_steps=100", "--steps", "2", "prompts_per_step=16", "mini_batch_samples=16"
    )
    for r in h:
        for key in EPISODE_KEYS:
            assert key in r, key
        assert 0.2 < r["tool_calls_mean"] < 1.0
        assert r["turns_mean"] == pytest.approx(1 + r["tool_calls_mean"], abs=0.15)  # answer after each call
        assert r["tool_tokens_mean"] > 2 * r["tool_calls_mean"]  # "=N." per call at least
        assert r["model_tokens_mean"] == pytest.approx(r["response_length_mean"])  # the loss mask's tokens
    if algo == "safe_rlhf":
        assert h[0]["cost_mean"] > 0  # some episodes used the unsafe tool


@pytest.mark.slow  # three whole program runs (~1 min), for CI's time (-m slow runs it; the e2e tier keeps
# episodes learning under asynchronous partial rollouts)
def test_fused_and_asynchronous_steps_sample_the_same_episodes(tmp_path):
    """Episodes streamed to the scorers in chunks (stage fusion) and episodes sampled by rollout replicas
    (asynchronous RL) are the plain step's episodes: the first step's metrics agree exactly."""
    from algorithms.grpo import main

    common = ["task=tool_arith", "sft_steps=100", "--steps", "1"]
    firsts = {}
    for name, extra in {
        "plain": [],
        "fused": ["fuse=true", "fuse_chunk_samples=8"],
        "async": ["async_staleness=1", "--placement", "split"],
    }.items():
        (tmp_path / name).mkdir()
        firsts[name] = run(main, tmp_path / name, *common, *extra)[0]
    for key in (
        "reward_mean",
        "success_mean",
        "tool_calls_mean",
        "turns_mean",
        "model_tokens_mean",
        "tool_tokens_mean",
    ):
        assert firsts["fused"][key] == firsts["plain"][key] == firsts["async"][key], key
    assert firsts["plain"]["tool_calls_mean"] > 0.2


@pytest.mark.slow  # two whole runs (~2 min); CI's e2e tier keeps the tool task learning with partial rollouts
def test_grpo_learns_tool_arith_with_the_tool_and_not_without(tmp_path):
    from algorithms.grpo import main

    h = run(main, tmp_path, "task=tool_arith")  # the task's settings: a 300-step warm start, 80 steps
    assert window(h, "success_mean", -20, None) >= 0.8
    assert window(h, "success_mean", -20, None) > window(h, "success_mean", 0, 20) + 0.1
    assert window(h, "tool_calls_mean", -20, None) > 0.9  # ... by calling the calculator
    assert window(h, "tool_errors_mean", -20, None) < 0.05
    (tmp_path / "none").mkdir()
    without = run(main, tmp_path / "none", "task=tool_arith", "max_turns=1", "--steps", "30")
    assert window(without, "turns_mean", 0, None) == 1.0  # a call ends the episode before its output is read
    assert window(without, "success_mean", -10, None) <= 0.3


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_grpo_learns_tool_arith_with_partial_rollouts(tmp_path):
    """Asynchronous, partial (streaming, the default): the replica advances its episodes a turn at a time in its own
    thread (algorithms.rollout.streaming), every group is trained once, and the tool task is learned as with whole
    rollouts. (Whether an episode spans versions depends on timing here; tests/engines/test_agent.py checks that a
    continued one is right.)"""
    from algorithms.grpo import main

    h = run(main, tmp_path, "task=tool_arith", "async_staleness=1", "partial_rollout=true", "--placement", "split")
    assert window(h, "success_mean", -20, None) >= 0.8
    assert window(h, "success_mean", -20, None) > window(h, "success_mean", 0, 20) + 0.1
    assert window(h, "tool_calls_mean", -20, None) > 0.9
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in h)


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_safe_rlhf_keeps_unsafe_tool_use_under_the_threshold_while_success_rises(tmp_path):
    from algorithms.safe_rlhf import main

    h = run(main, tmp_path, "task=tool_arith_safe")  # the task's settings: 100 steps, λ step 0.2
    windows = [window(h, "cost_mean", i, i + 10) for i in range(0, len(h), 10)]
    assert max(windows) > 0.3  # the reward pulls towards `exec` past the threshold
    # ... and λ holds it at the threshold at the end: dual ascent settles around it, so the last 20 steps' mean cost
    # is within two standard errors of it or under (0.318 +- 0.04 on one machine, under 0.3 on another)
    last = [r["cost_mean"] for r in h[-20:]]
    mean = sum(last) / len(last)
    se = (sum((c - mean) ** 2 for c in last) / (len(last) - 1) / len(last)) ** 0.5
    assert mean <= 0.3 + 2 * se, (mean, se)
    assert window(h, "success_mean", -20, None) > window(h, "success_mean", 0, 20) + 0.2
    assert window(h, "tool_calls_mean", -20, None) > 0.8  # ... by calling `calc` where it answers
