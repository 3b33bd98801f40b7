"""The command line of the algorithm programs: --help from the config dataclasses, and what a mistake looks like.

User errors must fail before any worker starts: the `no_cluster` fixture (conftest.py) makes starting a cluster fail
the test, so a check that ran too late shows up as that failure, not as a slow pass.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from algorithms.run.config import (
    ConfigError,
    DAPOConfig,
    GRPOConfig,
    GSPOConfig,
    PPOConfig,
    ReinforcePPConfig,
    ReMaxConfig,
    RLConfig,
    RLOOConfig,
    SafeRLHFConfig,
    apply_overrides,
    describe_settings,
)
from algorithms.run.metrics import MetricsFile, print_summary
from algorithms.run.plan import check_settings
from algorithms.safe_rlhf import SafeRLHF
from algorithms.safe_rlhf import main as safe_rlhf
from flowactors import Layout

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "cls",
    [
        RLConfig,
        PPOConfig,
        SafeRLHFConfig,
        GRPOConfig,
        ReMaxConfig,
        RLOOConfig,
        ReinforcePPConfig,
        GSPOConfig,
        DAPOConfig,
    ],
)
def test_every_setting_is_documented_where_it_is_declared(cls):
    undocumented = [key for key, _, doc in describe_settings(cls()) if not doc]
    assert undocumented == []


def test_help_lists_every_setting_with_its_default_and_doc(capsys):
    with pytest.raises(SystemExit) as exit_:
        safe_rlhf(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the wrapping
    rows = describe_settings(SafeRLHFConfig())
    assert {k for k, _, _ in rows} >= {"steps", "cost_threshold", "model.hidden_size", "slurm.partition"}
    for key, value, doc in rows:
        assert f"{key}={value}" in out
        assert " ".join(doc.split()[:6]) in out, key


def _error(capsys, argv, program: str = "safe_rlhf") -> str:
    main = importlib.import_module(f"algorithms.{program}").main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith(f"{program}: error: ") and len(lines) == 2, err
    return lines[0]


@pytest.fixture(scope="module")
def other_tokenizer_lm(tmp_path_factory) -> str:
    """A causal LM folder whose tokenizer has one token more than the tiny default's."""
    from engines import ModelConfig, build_model, char_tokenizer, save_pretrained

    tok = char_tokenizer()
    tok.add_tokens(["<extra>"])
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return str(save_pretrained(build_model(cfg, "lm", tok), tok, tmp_path_factory.mktemp("other")))


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], r"distillation needs a teacher: teacher.path=DIR, a Hugging Face causal LM folder"),
        (["teacher.path=/no/such/teacher"], r"teacher.path: model folder /no/such/teacher does not exist"),
        (["teacher.path=/tmp", "estimator=kl"], r"distill estimator must be topk or sampled, got 'kl'"),
        (["teacher.path=/tmp", "top_k=0"], r"top_k must be >= 1 with estimator=topk, got 0"),
        (["teacher.path={other}"], r"has another tokenizer than the student .*both need the same vocabulary"),
        (["teacher.path={other}", "model.engine=megatron"], r"estimator=topk gathers the student's log-probs at"),
    ],
)
def test_distillation_refuses_a_bad_teacher_before_the_cluster_starts(
    capsys, no_cluster, other_tokenizer_lm, argv, message
):
    import re

    argv = [a.format(other=other_tokenizer_lm) for a in argv]
    assert re.search(message, _error(capsys, argv, "distill"))


def _plan(tmp_path, actor_train) -> str:
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "placement": [["actor", "ref", "critic", "reward"]],
                "gpus": {"actor": 2, "ref": 2, "critic": 2, "reward": 2},
                "parallel": {"actor": {"train": actor_train}},
            }
        )
    )
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dashboard=localhost"], r"dashboard=localhost is not an address HOST:PORT \(or :PORT\); none turns"),
        (["prompt_per_step=8"], r"unknown setting 'prompt_per_step'; did you mean prompts_per_step\?"),
        (["model.hidden_sise=8"], r"did you mean model.hidden_size\?"),
        (["steps=ten"], r"bad value for steps: invalid literal for int\(\) with base 10: 'ten'"),
        (["fuse=maybe"], r"bad value for fuse: expected a boolean, got 'maybe'"),
        (["fuse_migrate=true"], r"fuse_migrate moves the long tail of a fused rollout; set fuse=true with it"),
        (["fuse=true", "fuse_migrate_below=1.5"], r"fuse_migrate_below is a fraction .* must be in \(0, 1\), got 1.5"),
        (["--placement", "fused", "n_slots=1"], r"placement=fused needs n_slots >= 2"),
        (
            ["--placement", "fused", "fuse=true", "fuse_migrate=true", "fuse_migrate_to=2"],
            r"placement=fused keeps the scorers off the first fuse_migrate_to=2 slots, so it needs n_slots > 2",
        ),
        (["fuse=true", "fuse_migrate=true", "fuse_migrate_to=0"], r"fuse_migrate_to is how many actor ranks"),
        (
            ["--placement", "split", "fuse=true", "fuse_migrate=true"],
            r"fuse_migrate: long-tail migration .* needs an actor of dp >= 2 .* --placement fused puts the actor on every",
        ),
        (["fuse=true", "fuse_migrate=true", "rollout_tp=1"], r"fuse_migrate moves decoding rows between actor ranks"),
        (
            ["fuse_train=true"],
            r"fuse_train fuses the actor's and the critic's pipeline-parallel training; give a --plan",
        ),
        (["n_slots=3"], r"actor: mini_batch_samples=32 cannot be split over data-parallel size 3; use a multiple of 3"),
        (["judge.path=/nonexistent/judge"], r"judge.path: model folder /nonexistent/judge does not exist"),
        (["judge.path=/tmp", "judge.template=no slot"], r"judge.template must contain \{response\}"),
        (
            ["--placement", "split", "n_slots=6"],
            r"actor: mini_batch_samples=32 cannot be split over data-parallel size 3",
        ),
        (["model.num_heads=3"], r"ModelConfig.hidden_size \(64\) must be divisible by num_heads \(3\)"),
        (["model.path=/no/such/model"], r"model.path: model folder /no/such/model does not exist"),
        (["--plan", "/no/such/plan.json"], r"plan file /no/such/plan.json does not exist"),
        (["--metrics-file", "/no/such/dir/m.jsonl"], r"the directory /no/such/dir does not exist"),
        (["--resume", "/no/such/ckpt"], r"resume=/no/such/ckpt is not a checkpoint directory"),
        (["log_level=loud"], r"log_level must be debug, info, warning or error"),
        (["model=5"], r"model is a group of settings, not one"),
        (["model.hidden_size=-4"], r"ModelConfig.hidden_size must be a positive integer, got -4"),
        (["model.hidden_size=12"], r"head size hidden_size / num_heads = 12 / 4 = 3 must be even"),
        (["call_timeout_s=0"], r"call_timeout_s must be > 0 seconds"),
        (["actor_lr=nan"], r"actor_lr=nan is not a finite number; give one in \(0, inf\)$"),
        (["actor_lr=-1"], r"actor_lr=-1.0 is outside \(0, inf\); give a number in \(0, inf\)$"),
        (["critic_lr=0"], r"critic_lr=0.0 is outside \(0, inf\)"),
        (["cost_threshold=nan"], r"cost_threshold=nan is not a finite number; give one$"),
        (["cost_threshold=inf"], r"cost_threshold=inf is not a finite number"),
        (["cost_threshold=-inf"], r"cost_threshold=-inf is not a finite number"),
        (["lambda_lr=inf"], r"lambda_lr=inf is not a finite number; give one in \[0, inf\)$"),
        (["gamma=1.5"], r"gamma=1.5 is outside \[0, 1\]"),
        (["temperature=0"], r"temperature=0.0 is outside \(0, inf\)"),
        (["dual_clip=1"], r"dual_clip=1.0 is outside \(1, inf\)"),
        (["kl_coef=-0.1"], r"kl_coef=-0.1 is outside \[0, inf\)"),
        (["recovery_wait_s=nan"], r"recovery_wait_s=nan is not a finite number"),
        (["slurm.startup_timeout_s=-5"], r"slurm.startup_timeout_s=-5.0 is outside \(0, inf\)"),
        (["rollout_engine=sglang"], r"rollout_engine must be hf or vllm"),
        (["model.engine=jax"], r"model.engine=jax: unknown training engine .jax.; known: \[.*megatron.*torch"),
        (["max_turns=2"], r"max_turns=2 applies to multi-turn tasks .*; task 'digit_sum' samples one response"),
        (["tool_workers=0"], r"rollout.agent: max_turns and tool_workers must be >= 1 .*; got None, 0, 0$"),
        (["task=tool_arith", "max_turns=0"], r"max_turns and tool_workers must be >= 1 .*; got 0, 8, 0$"),
        (["task=nosuchtask"], r"unknown task 'nosuchtask'; available: add, digit_sum, "),
        (["lambda_update=pi"], r"lambda_update must be dual or pid, got 'pi'"),
        (["lambda_unit=std"], r"lambda_unit must be cost or spread, got 'std'"),
        (["pid_ki=-1"], r"pid_ki=-1.0 is outside \[0, inf\)"),
        (
            ["lora_rank=4", "lora_target_modules=nosuch"],
            r"lora_target_modules=nosuch matches no linear layer of model llama; its linear layers: .*q_proj",
        ),
        *(
            [
                (
                    ["rollout_engine=vllm"],
                    r"rollout_engine: vLLM's CPU attention needs head_dim >= 32, the model has 16 "
                    r".*or rollout_engine='hf' \(the tiny default with model.hidden_size=128 "
                    r"model.intermediate_size=256\)$",
                )
            ]
            if not torch.cuda.is_available()
            else []
        ),
        *(
            [
                (
                    ["rollout_engine=vllm", "model.hidden_size=128", "model.intermediate_size=256"],
                    r"rollout_engine: rollout_engine='vllm' needs vllm, which is not installed here: .*scripts/vllm_cpu_check.sh",
                )
            ]
            if importlib.util.find_spec("vllm") is None
            else []
        ),
    ],
)
def test_a_user_error_is_one_line_and_status_2_before_the_cluster_starts(capsys, no_cluster, argv, message):
    import re

    assert re.search(message, _error(capsys, argv))


def test_a_plan_with_pipeline_stages_on_the_torch_engine_fails_before_any_worker(capsys, no_cluster, tmp_path):
    line = _error(capsys, ["--plan", _plan(tmp_path, [2, 1, 1])])
    assert "pipeline stages to actor (p=2)" in line and "torch engine has no pipeline parallelism" in line


def test_a_plan_whose_data_parallel_size_does_not_divide_fails_before_any_worker(capsys, no_cluster, tmp_path):
    line = _error(capsys, ["--plan", _plan(tmp_path, [1, 1, 2]), "prompts_per_step=5", "mini_batch_samples=5"])
    assert "mini_batch_samples=5 cannot be split over data-parallel size 2" in line


def test_migration_on_a_plan_with_a_tensor_parallel_actor_fails_before_any_worker(capsys, no_cluster, tmp_path):
    line = _error(capsys, ["--plan", _plan(tmp_path, [1, 2, 1]), "fuse=true", "fuse_migrate=true"])
    assert "fuse_migrate: long-tail migration" in line and "tp = pp = 1" in line


@pytest.mark.parametrize(
    "actor_train, message",
    [
        (
            [2, 1, 1],
            r"same train sizes and p >= 2; the plan has actor \(2, 1, 1\) in actor\+ref\+critic\+reward, critic "
            r"\(1, 1, 2\)",
        ),
        ([1, 1, 2], r"same train sizes and p >= 2; the plan has actor \(1, 1, 2\)"),
    ],
)
def test_fused_training_on_a_plan_that_cannot_fuse_fails_before_any_worker(
    capsys, no_cluster, tmp_path, actor_train, message
):
    import re

    line = _error(capsys, ["--plan", _plan(tmp_path, actor_train), "model.engine=megatron", "fuse_train=true"])
    assert re.search(message, line), line


def test_reverse_stages_puts_stage_0_on_the_last_stage_s_slots():
    from algorithms.run.plan import reverse_stages

    slots = [f"w{i}" for i in range(8)]  # (pp, dp, tp) = (2, 2, 2): group rank (p·2 + d)·2 + t
    assert reverse_stages(slots, Layout(pp=2, dp=2, tp=2)) == ["w4", "w5", "w6", "w7", "w0", "w1", "w2", "w3"]
    assert reverse_stages(slots, Layout(pp=4, dp=2, tp=1)) == ["w6", "w7", "w4", "w5", "w2", "w3", "w0", "w1"]
    assert reverse_stages(slots, Layout(pp=1, dp=8, tp=1)) == slots


def test_debug_shows_the_traceback(no_cluster):
    with pytest.raises(ConfigError, match="did you mean prompts_per_step"):
        safe_rlhf(["prompt_per_step=8", "--debug"])
    with pytest.raises(ConfigError, match="did you mean prompts_per_step"):
        safe_rlhf(["prompt_per_step=8", "log_level=debug"])


def _listener(accept: bool) -> tuple[socket.socket, str]:
    """A TCP port on 127.0.0.1: accepting connections and never answering (not a Dask scheduler), or closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if not accept:
        sock.close()
        return sock, f"tcp://127.0.0.1:{port}"
    sock.listen(8)
    held = []

    def serve():
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "accept, message",
    [(False, "Connection refused"), (True, "accepts connections but did not answer as a Dask scheduler")],
)
def test_a_dead_address_fails_within_5_s_saying_why(capsys, accept, message):
    sock, address = _listener(accept)
    try:
        t0 = time.perf_counter()
        line = _error(capsys, ["--address", address])
        elapsed = time.perf_counter() - t0
    finally:
        sock.close()
    assert message in line and "dask scheduler" in line
    assert elapsed < 5.0


def test_the_program_itself_exits_2_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "algorithms/safe_rlhf.py", "prompt_per_step=8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("safe_rlhf: error: unknown setting 'prompt_per_step'")


@pytest.mark.parametrize("sig", [pytest.param("SIGINT", marks=pytest.mark.slow), "SIGTERM"])  # one handler
def test_ctrl_c_and_sigterm_end_with_one_line_saying_what_was_saved(tmp_path, sig):
    """The signal goes to the whole process group, as a terminal's Ctrl-C or a `kill -TERM -PGID` does: no process
    prints a traceback, the run says where it stopped, what was saved and where the metrics are, and leaves its
    checkpoint directory unlocked with every worker process gone."""
    import os
    import signal

    import psutil

    from flowactors.checkpoint import CheckpointStore

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "algorithms/safe_rlhf.py",
            "--steps",
            "400",
            "dashboard=none",
            "sft_steps=2",
            "--checkpoint-dir",
            str(ckpt),
            "save_every=2",
            "--metrics-file",
            str(metrics),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "%|" not in x and "roles (" not in x]
    assert lines and "Traceback" not in err and len(lines) == 1, err[-3000:]
    steps = len(metrics.read_text().splitlines())
    saved = CheckpointStore(ckpt).steps()
    how = "Ctrl-C" if sig == "SIGINT" else "SIGTERM"
    assert lines[0] == (
        f"safe_rlhf: interrupted ({how}) after {steps} of 400 steps; the checkpoint of step "
        f"{saved[-1]} is in {ckpt} (--resume auto --checkpoint-dir {ckpt} continues from it); "
        f"metrics of {steps} steps in {metrics}"
    )
    assert saved[-1] in (steps, steps - 1)
    CheckpointStore(ckpt).acquire()  # the run's lock was released
    _, alive = psutil.wait_procs(children, timeout=15)  # a worker may take a moment to end on a loaded machine
    assert not [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_dapo_refuses_what_dynamic_sampling_cannot_do(capsys, no_cluster):
    from algorithms.dapo import main as dapo

    with pytest.raises(SystemExit):
        dapo(["samples_per_prompt=1", "mini_batch_samples=8"])
    assert (
        "dynamic_sampling keeps the groups whose rewards vary, which needs samples_per_prompt >= 2"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        dapo(["overlong_buffer=8"])
    assert "overlong_buffer=8 needs max_new_tokens > it" in capsys.readouterr().err


def test_dapo_that_cannot_fill_its_batch_stops_with_the_reason(capsys):
    """Near-greedy sampling makes every group's samples, and so its rewards, equal: no group can be kept."""
    from algorithms.dapo import main as dapo

    with pytest.raises(SystemExit) as exit_:
        dapo(["--steps", "2", "dashboard=none", "sft_steps=0", "temperature=1e-6", "max_gen_rounds=2"])
    assert exit_.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert lines == [
        "dapo: error: dynamic sampling kept 0 of the 8 groups a step needs after 2 generation rounds "
        "at step 0 (the others' rewards were all equal); raise max_gen_rounds or samples_per_prompt, "
        "or dynamic_sampling=false"
    ]


def test_a_worker_process_that_dies_while_the_cluster_starts_is_one_line(tmp_path):
    """The process the workers come from exits at once (a sitecustomize on its path, as a broken environment
    would): the server they fork from (flowactors.cluster.fork_from_server), or a spawned worker. The run ends
    with one line naming what failed, not Dask's "Nanny failed to start" traceback."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--multiprocessing-fork' in sys.argv or 'multiprocessing.forkserver' in ' '.join(sys.orig_argv):\n"
        "    os._exit(3)\n"
    )
    import os

    proc = subprocess.run(
        [sys.executable, "algorithms/safe_rlhf.py", "--steps", "2", "dashboard=none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(
        "safe_rlhf: error: the embedded cluster of 2 worker process(es) did not start: a worker process ended or "
        "failed while starting (RuntimeError: Nanny failed to start"
    ), proc.stderr


def test_safe_rlhf_summary_shows_the_threshold_and_whether_the_constraint_holds(capsys):
    algo = SafeRLHF(SafeRLHFConfig(cost_threshold=0.3))
    steps = [{"step": i, "cost_mean": c, "tokens_per_s": 1.0} for i, c in enumerate([0.9, 0.8, 0.5, 0.2])]
    assert algo.summary_notes(steps) == {"cost_mean": "(threshold 0.3: constraint holds at the end)"}
    steps[-1]["cost_mean"] = 0.4
    notes = algo.summary_notes(steps)
    assert notes == {"cost_mean": "(threshold 0.3: constraint violated at the end)"}
    print_summary("safe_rlhf", steps, ("cost_mean",), notes)
    line = next(x for x in capsys.readouterr().err.splitlines() if "cost_mean" in x)
    assert line.split()[:4] == ["cost_mean", "0.900", "->", "0.400"] and line.endswith(notes["cost_mean"])


def test_metrics_file_keeps_earlier_steps_and_replaces_redone_ones(tmp_path):
    path = tmp_path / "m.jsonl"
    f = MetricsFile(path)
    f.restart_at(0)
    for i in range(4):
        f.append({"step": i, "reward_mean": float(i)})
    f.restart_at(2)  # a resume from the checkpoint of step 2 redoes steps 2 and 3
    f.append({"step": 2, "reward_mean": 20.0})
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"step": 0, "reward_mean": 0.0}, {"step": 1, "reward_mean": 1.0}, {"step": 2, "reward_mean": 20.0}]


def test_the_demo_prints_no_warnings_and_no_per_model_loading_bars(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "algorithms/safe_rlhf.py",
            "--steps",
            "2",
            "sft_steps=2",
            "prompts_per_step=8",
            "mini_batch_samples=8",
            "dashboard=none",
            "--metrics-file",
            str(metrics),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    noise = [
        x
        for x in proc.stderr.splitlines()
        if "Warning" in x or "Loading weights" in x or "Writing model shards" in x or "still alive" in x
    ]
    assert noise == []
    assert "roles (actor, ref, reward, critic, cost_critic, cost) ready" in proc.stderr
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1]


def test_nested_settings_validate_after_override():
    with pytest.raises(ConfigError, match="ModelConfig.arch must be one of"):
        apply_overrides(SafeRLHFConfig(), ["model.arch=gpt2"])


def test_an_unreadable_plan_or_a_checkpoint_dir_under_a_file_fails_before_any_worker(capsys, no_cluster, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("not json{")
    assert f"plan file {bad} is not a valid plan (JSONDecodeError" in _error(capsys, ["--plan", str(bad)])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _error(capsys, ["--checkpoint-dir", str(blocker / "ckpt")])
    assert f"checkpoint_dir={blocker / 'ckpt'} cannot be a directory: Not a directory" in line


def test_resume_from_a_path_saves_on_into_its_directory():
    cfg = apply_overrides(SafeRLHFConfig(), ["resume=/runs/a/step_00000010"])
    assert cfg.checkpoint.dir == "/runs/a"


def test_fusion_is_a_section_of_every_rl_program_with_its_short_forms(capsys):
    short = apply_overrides(
        GRPOConfig(),
        ["fuse=true", "fuse_chunk_samples=4", "fuse_migrate=true", "fuse_migrate_below=0.5", "fuse_migrate_to=1"],
    )
    dotted = apply_overrides(
        GRPOConfig(),
        [
            "fusion.enabled=true",
            "fusion.chunk_samples=4",
            "fusion.migrate=true",
            "fusion.migrate_below=0.5",
            "fusion.migrate_to=1",
        ],
    )
    assert short.fusion == dotted.fusion and (short.fusion.enabled, short.fusion.chunk_samples) == (True, 4)
    assert GRPOConfig().fusion.enabled is False  # the preset untouched
    for cls in (GRPOConfig, ReMaxConfig):  # no critic to fuse with: refused with the reason
        with pytest.raises(
            ConfigError,
            match=f"fuse_train fuses the actor's and the critic's training; {cls.__name__} trains no critic",
        ):
            check_settings(apply_overrides(cls(), ["fuse_train=true"]))
    with pytest.raises(SystemExit):
        safe_rlhf(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "fusion.enabled=False (short form: fuse=) Score finished samples" in out
