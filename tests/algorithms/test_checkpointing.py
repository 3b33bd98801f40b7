"""Exact resume (mid-epoch and at an epoch boundary), resharded loading, and recovery from a killed worker."""

import re

import pytest

from algorithms.ppo import main as ppo
from tests.algorithms.kill import worker_killed_when

# 64 prompts, 32 per step: an epoch ends every 2 steps
COMMON = ["dashboard=none", "sft_steps=10", "dataset_prompts=64", "prompts_per_step=32", "mini_batch_samples=16"]
KEYS = ("reward_mean", "kl", "entropy", "response_length_mean", "actor/pg_loss", "critic/vf_loss")


def same(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in KEYS:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return ppo(["--steps", "4", *COMMON, "--checkpoint-dir", str(d), "--save-every", "1"])


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
@pytest.mark.parametrize("stop", [2, 3], ids=["epoch-boundary", "mid-epoch"])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, reference, stop):
    ck = str(tmp_path / "ck")
    ppo(
        [
            "--steps",
            str(stop),
            *COMMON,
            "--checkpoint-dir",
            ck,
            "--save-every",
            "1",
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ]
    )
    resumed = ppo(
        [
            "--steps",
            "4",
            *COMMON,
            "--checkpoint-dir",
            ck,
            "--save-every",
            "1",
            "--resume",
            "auto",
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ]
    )
    assert [r["step"] for r in resumed] == list(range(stop, 4))
    same(reference[stop:], resumed)
    import json

    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]  # one line per step across both runs


def test_lora_run_resumes_exactly_from_adapter_checkpoints(tmp_path):
    """GRPO with lora_rank=8: the actor's checkpoints hold only adapters (its base is the reference's, the warm
    start's export, which the resumed run does not redo), and the resumed run equals the uninterrupted one."""
    from torch.distributed.checkpoint import FileSystemReader

    from algorithms.grpo import main as grpo

    common = [
        "dashboard=none",
        "lora_rank=8",
        "sft_steps=10",
        "dataset_prompts=64",
        "prompts_per_step=16",
        "mini_batch_samples=16",
    ]
    reference = grpo(["--steps", "4", *common])
    ck = tmp_path / "ck"
    grpo(["--steps", "2", *common, "--checkpoint-dir", str(ck), "--save-every", "1"])
    keys = FileSystemReader(str(ck / "step_000002" / "actor")).read_metadata().state_dict_metadata
    assert all(k.endswith((".lora_A", ".lora_B")) for k in keys if k.startswith("model."))
    resumed = grpo(["--steps", "4", *common, "--checkpoint-dir", str(ck), "--resume", "auto"])
    assert [r["step"] for r in resumed] == [2, 3]
    for x, y in zip(reference[2:], resumed):
        for k in ("reward_mean", "kl", "entropy", "response_length_mean"):
            assert x[k] == y[k], (x["step"], k)


def test_checkpoint_loads_under_a_different_data_parallel_size(tmp_path, reference):
    ck = str(tmp_path / "ck")
    ppo(["--steps", "2", *COMMON, "--checkpoint-dir", ck, "--save-every", "2"])
    resumed = ppo(["--steps", "4", *COMMON, "n_slots=1", "--checkpoint-dir", ck, "--resume", "auto"])
    for x, y in zip(reference[2:], resumed):  # dp=1 instead of 2: same samples, same updates up to rounding
        for k in ("reward_mean", "kl", "entropy"):
            assert x[k] == pytest.approx(y[k], abs=2e-3), (x["step"], k)


def test_killed_worker_mid_run_recovers_and_finishes_with_equal_metrics(tmp_path, reference, capsys):
    """SIGKILL one worker process once the step-2 checkpoint exists (steps 2 and 3 still to run): the run must see
    that worker die, recover from the checkpoint, and end with the metrics of the uninterrupted run."""
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
    # the run saw that very worker die and recovered once (`Runner.recover` in algorithms/run/loop.py says so)
    assert f"worker {victim} died" in err and re.search(r"recovering \(1/\d+\)", err), err[-3000:]
    assert not re.search(r"recovering \(2/", err), err[-3000:]
    same(reference, history)


def test_a_worker_lost_before_the_first_checkpoint_restarts_from_step_0(tmp_path, reference, capsys):
    """No checkpoint yet (none configured): the lost worker costs the steps so far, and the run, restarted from
    step 0 with the warm start, ends with the metrics of the uninterrupted run."""
    metrics = tmp_path / "m.jsonl"
    with worker_killed_when(lambda: metrics.exists() and bool(metrics.read_text().strip())) as (
        address,
        victim,
        killed,
    ):
        history = ppo(
            ["--steps", "4", *COMMON, "--address", address, "--metrics-file", str(metrics), "recovery_wait_s=60"]
        )
    err = capsys.readouterr().err
    assert killed.is_set()
    assert f"worker {victim} died" in err and "restarting from step 0 (no checkpoint yet)" in err, err[-3000:]
    same(reference, history)
    import json

    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1, 2, 3]


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
def test_resume_applies_changed_settings_and_refuses_ones_fixed_at_the_start(tmp_path, capsys):
    ck = tmp_path / "ck"
    ppo(["--steps", "2", *COMMON, "--checkpoint-dir", str(ck), "--save-every", "2"])
    assert not list(ck.glob(".sft-*"))  # the SFT export lived in the run's directory and went with the run
    (ck / ".sft-left-by-a-killed-run").mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        ppo(["--steps", "3", *COMMON, "--checkpoint-dir", str(ck), "seed=1"])
    assert exit_.value.code == 2
    assert "fixed at a run's start, so a resumed run cannot change them: seed 0 -> 1" in capsys.readouterr().err
    resumed = ppo(["--steps", "3", *COMMON, "--checkpoint-dir", str(ck), "actor_lr=1e-4", "kl_coef=0.05"])
    err = capsys.readouterr().err
    assert "applied: steps 2 -> 3; actor_lr 0.0002 -> 0.0001; kl_coef 0.02 -> 0.05" in err
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["kl_coef"] == 0.05  # not the checkpoint's 0.02
    assert resumed[0]["actor/lr"] == pytest.approx(1e-4)  # not the checkpoint's schedule at 2e-4
    assert not (ck / ".sft-left-by-a-killed-run").exists()


def test_finished_steps_reach_the_metrics_file_when_a_run_fails(tmp_path):
    from algorithms.ppo import PPO, ppo_tiny_cpu
    from algorithms.run.loop import run_program

    class FailsAtStep2(PPO):
        def step(self, prompts, i):
            if i == 2:
                raise RuntimeError("the step-2 failure")
            return super().step(prompts, i)

    metrics = tmp_path / "m.jsonl"
    with pytest.raises(RuntimeError, match="the step-2 failure"):
        run_program(FailsAtStep2, ppo_tiny_cpu, ["--steps", "4", *COMMON, "--metrics-file", str(metrics)], "test")
    import json

    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1]


def test_the_trained_policy_is_exported_as_a_hugging_face_folder(tmp_path):
    """export_dir: the actor at the end of the run, as a folder transformers loads. A run that resumes the last
    checkpoint with no steps left exports the same weights, bit for bit: the export is the trained state."""
    import torch
    import transformers

    ck = str(tmp_path / "ck")
    ppo(["--steps", "2", *COMMON, "--checkpoint-dir", ck, "--save-every", "2", "export_dir=" + str(tmp_path / "a")])
    ppo(["--steps", "2", *COMMON, "--checkpoint-dir", ck, "export_dir=" + str(tmp_path / "b")])
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "a")("sum 12:").input_ids
