"""Asynchronous RL (algorithms/rollout/asynchronous.py) on real clusters: the schedule, the weight sync, exactly-once
resume and recovery with rollouts in flight, learning under staleness; and the settings it refuses before start."""

from __future__ import annotations

import json
import re

import pytest

from algorithms.grpo import main as grpo
from algorithms.ppo import main as ppo
from tests.algorithms.kill import worker_killed_when

SPLIT = ["dashboard=none", "--placement", "split"]
# 64 prompts, 32 per step: an epoch ends every 2 steps
COMMON = [
    *SPLIT,
    "sft_steps=10",
    "dataset_prompts=64",
    "prompts_per_step=32",
    "mini_batch_samples=16",
    "async_staleness=1",
]
KEYS = (
    "reward_mean",
    "kl",
    "entropy",
    "response_length_mean",
    "actor/pg_loss",
    "actor/tis_weight_mean",
    "critic/vf_loss",
    "async/staleness_mean",
    "async/sync_bytes",
)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def same(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in KEYS:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


# -- refused before the cluster starts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["async_staleness=-1"], r"async_staleness is how many policy versions rollouts may run ahead, >= 0"),
        (
            ["partial_rollout=true"],
            r"partial_rollout interrupts rollouts that run ahead of training; set "
            r"async_staleness >= 1",
        ),
        (["async_staleness=1", "partial_rollout=true", "partial_segment=-2"], r"async_rl.partial_segment must be >= 0"),
        (
            [
                "async_staleness=1",
                "partial_rollout=true",
                "--placement",
                "split",
                "prompts_per_step=3",
                "n_slots=4",
                "mini_batch_samples=12",
            ],
            r"partial rollouts share prompt groups among the 2 rollout replicas: prompts_per_step=3 is not a multiple",
        ),
        (["async_staleness=1"], r"async_staleness=1 runs the rollouts on slots of their own .* add --placement split"),
        (["async_staleness=1", "--placement", "split", "n_slots=1"], r"placement=split needs n_slots >= 2"),
        (
            ["async_staleness=1", "--placement", "split", "async_rollout_slots=2"],
            r"needs slots for the rollout replicas and slots for training: n_slots=2 with async_rollout_slots=2",
        ),
        (["async_staleness=2", "--placement", "split", "fuse=true"], r"async_staleness=2 with fuse=true is not built"),
        (
            [*SPLIT, "n_slots=4", "async_staleness=1", "partial_rollout=true", "rollout_tp=2", "model.pad_vocab_to=2"],
            r"rollout_tp=2: a replica's 2 TP ranks decode in lockstep, which streaming partial rollouts .* add "
            r"async_deterministic=true",
        ),
        (
            ["async_staleness=1", "--placement", "split", "partial_rollout=true", "rollout_tp=1"],
            r"rollout_tp=1 makes each replica a 3D-HybridEngine of one rank, which streaming partial rollouts do not "
            r"run .* set rollout_tp=0",
        ),
        (
            ["async_staleness=1", "--placement", "split", "n_slots=4", "rollout_tp=2"],
            r"rollout_tp=2 splits each replica's vocabulary over 2 ranks: set model.pad_vocab_to=2",
        ),
        (
            ["async_staleness=1", "--placement", "split", "n_slots=6", "async_rollout_slots=3", "rollout_tp=2"]
            + ["model.pad_vocab_to=2"],
            r"async_rollout_slots=3 cannot hold rollout replicas of rollout_tp=2 ranks each",
        ),
        (
            ["async_staleness=1", "--placement", "split", "n_slots=4", "rollout_tp=2", "model.pad_vocab_to=2"]
            + ["async_sync=rank0"],
            r"rollout_tp=2 gives each rollout replica 2 ranks, which take their shards by the sharded sync",
        ),
        (["async_correction=ratio"], r"async_correction must be tis or none, got 'ratio'"),
        (["async_tis_cap=0.5"], r"async_tis_cap truncates an importance weight and must be >= 1, got 0.5"),
        (["async_sync=nccl"], r"async_sync must be sharded or rank0, got 'nccl'"),
        (["async_sync_bucket_mb=0"], r"async_sync_bucket_mb must be > 0"),
    ],
)
def test_bad_asynchronous_settings_are_one_line_before_the_cluster_starts(capsys, no_cluster, argv, message):
    with pytest.raises(SystemExit) as exit_:
        grpo(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("grpo: error: ") and re.search(message, lines[0]), lines[0]


ASYNC_PLAN = {
    "placement": [["actor", "ref", "reward"], ["rollout"]],
    "gpus": {"actor": 2, "ref": 2, "reward": 2, "rollout": 2},
    "parallel": {"rollout": {"train": [1, 2, 1]}},
}


@pytest.mark.parametrize(
    "plan, argv, message",
    [
        (
            {**ASYNC_PLAN, "placement": [["actor", "ref", "reward"]], "gpus": {"actor": 2, "ref": 2, "reward": 2}}
            | {"parallel": {}},
            ["async_staleness=1"],
            r"async_staleness=1 with a placement plan needs the rollout replicas in it: add a set \[\"rollout\"\]",
        ),
        (ASYNC_PLAN, [], r"the placement plan has a rollout pool, for asynchronous RL's replicas; set async_staleness"),
        (
            {**ASYNC_PLAN, "placement": [["actor", "ref"], ["reward", "rollout"]]},
            ["async_staleness=1"],
            r"the rollout replicas generate while the others train, so they need a pool of their own; the plan "
            r"puts them with reward, rollout",
        ),
        (
            {**ASYNC_PLAN, "parallel": {**ASYNC_PLAN["parallel"], "actor": {"train": [1, 1, 2], "generate": [1, 1]}}},
            ["async_staleness=1"],
            r"under async_staleness=1 the actor trains and the replicas generate: move the actor's 'generate'",
        ),
        (ASYNC_PLAN, ["async_staleness=1"], r"rollout_tp=2 splits each replica's vocabulary over 2 ranks"),
        (
            ASYNC_PLAN,
            ["async_staleness=1", "model.pad_vocab_to=2", "partial_rollout=true"],
            r"rollout_tp=2: a replica's 2 TP ranks decode in lockstep",
        ),
    ],
)
def test_a_plan_places_the_replicas_only_under_asynchronous_rl(capsys, no_cluster, tmp_path, plan, argv, message):
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit) as exit_:
        grpo(["dashboard=none", "n_slots=4", "--plan", str(tmp_path / "plan.json"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err


def test_the_staleness_is_fixed_at_a_run_s_start_and_older_checkpoints_resume_unchanged():
    import dataclasses

    from algorithms.run.config import ConfigError, GRPOConfig, apply_overrides
    from algorithms.run.resume import check_resumable, setting_changes

    saved = dataclasses.asdict(GRPOConfig())
    del saved["async_rl"]  # a checkpoint from before the section existed ran synchronously
    assert setting_changes(saved, GRPOConfig()) == []
    cfg = apply_overrides(GRPOConfig(), ["async_staleness=1", "placement=split"])
    with pytest.raises(ConfigError, match=r"async_staleness (None|0) -> 1"):
        check_resumable(saved, cfg)


def test_a_partial_rollout_checkpoint_from_before_streaming_resumes_only_deterministic():
    """Partial rollouts ran on the fixed schedule before `async_rl.deterministic` existed: such a checkpoint holds
    a deterministic pipeline's state, so resuming it under streaming (the new default) is refused with the fix,
    and `async_deterministic=true` resumes it; a run without partial rollouts is unaffected."""
    import dataclasses

    from algorithms.run.config import ConfigError, GRPOConfig, apply_overrides
    from algorithms.run.resume import check_resumable

    partial = ["async_staleness=1", "placement=split", "partial_rollout=true"]
    saved = dataclasses.asdict(apply_overrides(GRPOConfig(), partial))
    del saved["async_rl"]["deterministic"]
    with pytest.raises(ConfigError, match=r"async_deterministic True -> False"):
        check_resumable(saved, apply_overrides(GRPOConfig(), partial))
    assert check_resumable(saved, apply_overrides(GRPOConfig(), [*partial, "async_deterministic=true"])) == []
    whole = dataclasses.asdict(apply_overrides(GRPOConfig(), partial[:2]))
    del whole["async_rl"]["deterministic"]
    assert check_resumable(whole, apply_overrides(GRPOConfig(), partial[:2])) == []


# -- on a cluster ---------------------------------------------------------------------------------------------------


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_rollouts_run_k_versions_ahead_on_the_weights_the_trainer_sent(tmp_path):
    """K = 2: step j trains on samples of version max(0, j - 2), every token records it; the first step's samples
    come from the warm-started policy the trainer sent, so they equal the synchronous run's (same seeds)."""
    common = [*SPLIT, "--steps", "5", "sft_steps=20", "prompts_per_step=16", "mini_batch_samples=16"]
    grpo([*common, "async_staleness=2", "--metrics-file", str(tmp_path / "a.jsonl")])
    grpo([*common, "--metrics-file", str(tmp_path / "s.jsonl")])
    a, s = _lines(tmp_path / "a.jsonl"), _lines(tmp_path / "s.jsonl")
    assert [r["async/staleness_mean"] for r in a] == [0, 1, 2, 2, 2]
    assert [r["async/staleness_frac_2"] for r in a] == [0, 0, 1, 1, 1]
    assert all(r["async/too_stale"] == 0 for r in a)
    params = 322304  # the tiny default's float32 bytes (hidden 64, 2 layers, tied embeddings)
    assert all(r["async/sync_bytes"] == params for r in a), [r["async/sync_bytes"] for r in a]
    for k in ("reward_mean", "response_length_mean"):
        assert a[0][k] == s[0][k], k  # version 0 is the warm start, sampled with the same seeds
    assert a[0]["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # behaviour == proximal at version 0
    assert a[3]["actor/tis_weight_mean"] != pytest.approx(1.0, abs=1e-7)  # stale: a real correction
    assert "sync_bytes" not in json.dumps(s[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return ppo(["--steps", "4", *COMMON, "--checkpoint-dir", str(d), "--save-every", "1"])


def test_resume_with_rollouts_in_flight_reproduces_an_uninterrupted_run(tmp_path, reference):
    """The step-2 checkpoint holds step 2's and step 3's rollouts (generated by versions 1 and 2): the resumed run
    trains each exactly once, at its step, and ends with the uninterrupted run's metrics."""
    ck = tmp_path / "ck"
    ppo(["--steps", "2", *COMMON, "--checkpoint-dir", str(ck), "--save-every", "1"])
    from flowactors.checkpoint import CheckpointStore

    state = CheckpointStore(str(ck)).latest_complete().controller_state()
    # a run that checkpoints keeps its pipeline full past its last step, so a longer resumed run goes on exactly
    assert [(g["step"], g["version"]) for g in state["async"]["in_flight"]] == [(2, 1), (3, 2)]
    resumed = ppo(
        [
            "--steps",
            "4",
            *COMMON,
            "--checkpoint-dir",
            str(ck),
            "--save-every",
            "1",
            "--resume",
            "auto",
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ]
    )
    assert [r["step"] for r in resumed] == [2, 3]
    same(reference[2:], resumed)


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_a_checkpoint_mid_run_holds_the_rollouts_in_flight(tmp_path, reference):
    ck = tmp_path / "ck"
    history = ppo(["--steps", "4", *COMMON, "--checkpoint-dir", str(ck), "--save-every", "2"])
    same(reference, history)
    from flowactors.checkpoint import CheckpointStore

    store = CheckpointStore(str(ck))
    mid = store.load(ck / "step_000002").controller_state()
    assert [(g["step"], g["version"]) for g in mid["async"]["in_flight"]] == [(2, 1), (3, 2)]
    assert mid["data"]["index"] == 0 and mid["data"]["epoch"] == 2  # four batches of 32 drawn from 64 prompts
    resumed = ppo(["--steps", "4", *COMMON, "--checkpoint-dir", str(ck), "--resume", str(ck / "step_000002")])
    same(reference[2:], resumed)


def test_a_worker_killed_with_rollouts_in_flight_recovers_to_the_uninterrupted_metrics(tmp_path, reference, capsys):
    ck = tmp_path / "ck"
    with worker_killed_when(lambda: (ck / "step_000002").exists()) as (address, victim, killed):
        history = ppo(
            [
                "--steps",
                "4",
                *COMMON,
                "--address",
                address,
                "--checkpoint-dir",
                str(ck),
                "--save-every",
                "2",
                "recovery_wait_s=60",
            ]
        )
    err = capsys.readouterr().err
    assert killed.is_set(), "the run ended before the worker was killed: the test proved nothing"
    assert f"worker {victim} died" in err and re.search(r"recovering \(1/\d+\)", err), err[-3000:]
    same(reference, history)


@pytest.mark.parametrize(
    "algo, staleness, partial",
    [
        # (each program once in the default run; the others with -m slow, for CI's time)
        pytest.param("grpo", 1, False, marks=pytest.mark.slow),
        ("grpo", 2, True),  # (streaming: async_rl.deterministic=false, the default)
        ("ppo", 1, False),
        pytest.param("ppo", 2, False, marks=pytest.mark.slow),
        pytest.param("remax", 1, False, marks=pytest.mark.slow),
        ("remax", 1, True),
    ],
)
def test_each_algorithm_learns_its_task_under_staleness(tmp_path, algo, staleness, partial):
    import importlib

    main = importlib.import_module(f"algorithms.{algo}").main
    argv = [*SPLIT, "--steps", "40", f"async_staleness={staleness}", "--metrics-file", str(tmp_path / "m.jsonl")]
    main([*argv, f"partial_rollout={str(partial).lower()}"])
    h = _lines(tmp_path / "m.jsonl")
    first, last = (sum(r["reward_mean"] for r in w) / len(w) for w in (h[:10], h[-10:]))
    assert last > first + 0.05, (first, last)
    if not partial:
        assert h[-1]["async/staleness_mean"] == staleness
        return
    # partial rollouts: samples continue across versions, each group is trained once, none is lost; streaming
    # (the default) lands each version when the trainer sends it, so tokens are off-policy by timing, not by K
    if algo != "remax":  # ReMax's answers are ~3 tokens: they finish long before a version lands (by timing, a
        # few span one in some runs, none in others: this failed 1 run in 3 on a loaded machine)
        assert sum(r["async/requeued"] for r in h) > 0
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in h)
    assert len({r["async/trained_groups"] for r in h}) == 1 and h[0]["async/trained_groups"] > 0  # every batch full
    assert sum(r["async/staleness_mean"] for r in h) > 0


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
@pytest.mark.parametrize(
    "staleness, partial",
    # (whole rollouts with -m slow, for CI's time: the partial run covers Safe-RLHF's asynchronous λ)
    [pytest.param(1, "false", marks=pytest.mark.slow), (2, "true")],
)
def test_safe_rlhf_keeps_its_constraint_under_staleness(tmp_path, staleness, partial):
    from algorithms.safe_rlhf import main

    main(
        [
            *SPLIT,
            f"async_staleness={staleness}",
            f"partial_rollout={partial}",
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ]
    )
    h = _lines(tmp_path / "m.jsonl")
    mean = lambda key, w: sum(r[key] for r in w) / len(w)  # noqa: E731
    assert mean("cost_mean", h[:10]) > 0.3  # the warm start violates the constraint
    assert mean("cost_mean", h[-20:]) <= 0.3  # ... and the policy ends at or below the threshold
    assert mean("reward_mean", h[-20:]) > mean("reward_mean", h[:20]) + 0.05
    assert h[-1]["async/staleness_mean"] >= staleness  # (partial rollouts: older tokens too)


# -- partial rollouts -----------------------------------------------------------------------------------------------

PARTIAL = [*SPLIT, "sft_steps=10", "prompts_per_step=8", "async_staleness=1", "partial_rollout=true"]
DETERMINISTIC = [*PARTIAL, "async_deterministic=true"]
TIMINGS = ("_s", "tokens_per_s", "controller_share")


def same_everywhere(a: list[dict], b: list[dict]) -> None:
    """Every metric but the timings equal, step by step."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.endswith(TIMINGS)}
        assert keys == {k for k in y if not k.endswith(TIMINGS)}
        for k in sorted(keys):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


def test_partial_rollouts_resume_with_unfinished_sequences_into_the_uninterrupted_run(tmp_path):
    """The step-2 checkpoint holds the replica's unfinished sequences (tokens, versions, log-probs), its finished
    groups not yet handed out and the prompt ledger: the resumed run trains every group exactly once and equals the
    uninterrupted run on every metric but the timings."""
    from flowactors.checkpoint import CheckpointStore

    def run(steps: int, ck, *extra: str) -> list[dict]:
        return grpo(["--steps", str(steps), *DETERMINISTIC, "--checkpoint-dir", str(ck), "--save-every", "1", *extra])

    reference = run(5, tmp_path / "ref")
    assert sum(r["async/requeued"] for r in reference) > 0  # sequences did continue under newer weights
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in reference)
    run(2, tmp_path / "ck")
    state = CheckpointStore(str(tmp_path / "ck")).latest_complete().controller_state()["async"]
    held = [s for _, group in state["partial"][0]["groups"] for s in group]
    assert any(not s["done"] and s["tokens"] for s in held), "no unfinished sequence in the checkpoint"
    resumed = run(5, tmp_path / "ck", "--resume", "auto")
    assert [r["step"] for r in resumed] == [2, 3, 4]
    same_everywhere(reference[2:], resumed)


def test_streaming_partial_rollouts_train_every_group_once_across_a_resume(tmp_path):
    """Streaming (the default): the replica decodes in a thread of its own and versions land between segments
    whenever the trainer sends them, so runs differ; what must hold is the ledger: every group drawn is trained
    once, or waits finished, or is held by the replica, at every step, and a checkpoint keeps all three (the
    replica's snapshot between two segments, the finished groups waiting at the controller, the ledger)."""
    from flowactors.checkpoint import CheckpointStore

    def run(steps: int, *extra: str) -> list[dict]:
        ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1"]
        return grpo(["--steps", str(steps), *PARTIAL, *ck, *extra])

    first = run(3)
    state = CheckpointStore(str(tmp_path / "ck")).latest_complete().controller_state()["async"]
    assert set(state["stream"]) == {"buffer", "owed"}
    held = [s for _, group in state["partial"][0]["groups"] for s in group]
    # after a step the replica and the controller hold prompts_per_step + surplus groups of 4 samples between them
    assert held and len(held) + 4 * len(state["stream"]["buffer"]) == 4 * (8 + 8)
    resumed = run(6, "--resume", "auto")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for h in (first, resumed):
        assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in h)
        assert all(r["async/held_groups"] == 8 for r in h)  # prompts_per_step + surplus - the step's own
    assert sum(r["async/requeued"] for r in first + resumed) > 0  # sequences continued under newer weights
    assert all(r["async/too_stale"] == 0 for r in first + resumed)


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_a_streaming_replica_killed_mid_run_loses_no_group_and_trains_none_twice(tmp_path, capsys):
    """Streaming partial rollouts on a 2-worker cluster; the replica's worker (the second slot) is SIGKILLed after
    the step-2 checkpoint: the run recovers from it (the replica's snapshot, the groups waiting at the controller,
    the ledger) and every step, before and after, trains each group once and loses none."""
    ck = tmp_path / "ck"
    with worker_killed_when(lambda: (ck / "step_000002").exists()) as (address, victim, killed):
        history = grpo(
            ["--steps", "6", *PARTIAL, "--address", address, "--checkpoint-dir", str(ck), "--save-every", "2"]
            + ["recovery_wait_s=60"]
        )
    err = capsys.readouterr().err
    assert killed.is_set(), "the run ended before the worker was killed: the test proved nothing"
    assert f"worker {victim} died" in err and re.search(r"recovering \(1/\d+\)", err), err[-3000:]
    assert [r["step"] for r in history] == list(range(6))
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in history)
    assert all(r["async/held_groups"] == 8 for r in history)


@pytest.mark.e2e
def test_replicas_with_generation_tp_sample_what_whole_copies_do_from_half_the_bytes(tmp_path):
    """rollout_tp=2 under asynchronous RL: one replica of two TP ranks instead of two whole copies. Each TP rank
    receives only its shard, so a sync moves about half the bytes, and the rollouts (same prompts, same seeds)
    and so every step's metrics equal the whole copies'; with partial rollouts the ledger stays exact."""
    common = [*SPLIT, "n_slots=4", "async_staleness=1", "model.pad_vocab_to=2", "--steps", "3", "sft_steps=10"]
    common += ["prompts_per_step=16", "mini_batch_samples=16"]
    for tp in (2, 0):
        grpo([*common, f"rollout_tp={tp}", "--metrics-file", str(tmp_path / f"tp{tp}.jsonl")])
    sharded, whole = _lines(tmp_path / "tp2.jsonl"), _lines(tmp_path / "tp0.jsonl")
    for x, y in zip(sharded, whole, strict=True):
        for k in ("reward_mean", "response_length_mean", "kl", "entropy"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
        assert 0.45 < x["async/sync_bytes"] / y["async/sync_bytes"] < 0.55  # its shard, not the whole model
    assert sharded[0]["actor/mismatch_kl"] < 1e-10  # version 0 generated by TP shards = the trainer's policy
    # the same placement as a plan (rollout: one replica of 2 TP ranks) runs the same steps
    (tmp_path / "plan.json").write_text(json.dumps(ASYNC_PLAN))
    planned = [*common[3:], "--plan", str(tmp_path / "plan.json"), "--metrics-file", str(tmp_path / "plan.jsonl")]
    grpo(["dashboard=none", *planned])
    for x, y in zip(_lines(tmp_path / "plan.jsonl"), sharded, strict=True):
        for k in ("reward_mean", "response_length_mean", "kl", "entropy", "async/sync_bytes"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
    partial = ["partial_rollout=true", "async_deterministic=true"]  # (a TP replica decodes in lockstep)
    grpo([*common, "rollout_tp=2", *partial, "--metrics-file", str(tmp_path / "partial.jsonl")])
    partial = _lines(tmp_path / "partial.jsonl")
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in partial)
    assert sum(r["async/held_groups"] for r in partial) > 0  # unfinished groups carried across versions
