"""Placement plans with pipeline stages (p = 2) run the algorithms end to end on the megatron engine, and give the
torch engine's metrics on the same seeds with the same devices spent on data parallelism instead (p = 1, d = 2).

On CPU the megatron engine needs the test-only CUDA shim, so the runs name it as
`model.engine=tests.engines.megatron_probes:megatron_cpu` (the real engine, built after the shim is applied in
each worker). Tolerance: sampled tokens, rewards and costs equal; float metrics within 2e-3 absolute (KL, entropy,
λ) and gradient norms within 1e-4 relative — the two engines' kernels differ only in summation order.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]' pulls it)")

from placement import ModelPlan, Plan
from tests.engines.megatron_probes import MEGATRON_CPU

EXACT = ("reward_mean", "cost_mean", "response_length_mean")
CLOSE = ("kl", "entropy", "lagrange_lambda")


def _run(main, workdir, plan: Plan, *overrides: str) -> list[dict]:
    workdir.mkdir()
    plan.save(workdir / "plan.json")
    metrics = workdir / "m.jsonl"
    main(
        [
            "dashboard=none",
            "--plan",
            str(workdir / "plan.json"),
            "--metrics-file",
            str(metrics),
            "--steps",
            "2",
            "sft_steps=10",
            *overrides,
        ]
    )
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _plans(
    placement: list[list[str]], staged: tuple[str, ...], per_pool: int, generate: tuple[int, int] | None = None
) -> tuple[Plan, Plan]:
    """The plan with `staged` models on (p, t, d) = (2, 1, 1) and the same plan with (1, 1, 2) instead; the actor
    generates with `generate` (p_g, t_g) where given, as automap's plans say (the p = 1 plan with p_g = 1)."""
    roles = [r for pool in placement for r in pool]
    out = []
    for train in ((2, 1, 1), (1, 1, 2)):
        gen = generate if generate is None or train[0] >= generate[0] else (1, generate[1])
        out.append(
            Plan(
                placement=placement,
                models=[
                    ModelPlan(r, per_pool, train if r in staged else (1, 1, per_pool), gen if r == "actor" else None)
                    for r in roles
                ],
            )
        )
    return out[0], out[1]


def _same_metrics(mega: list[dict], torch_: list[dict]) -> None:
    assert [r["step"] for r in mega] == [r["step"] for r in torch_] == [0, 1]
    for a, b in zip(mega, torch_):
        for key in EXACT:
            if key in b:
                assert a[key] == b[key], (a["step"], key)
        for key in CLOSE:
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=2e-3), (a["step"], key)
        for key in [k for k in b if k.endswith("vf_loss")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
        for key in [k for k in b if k.endswith("grad_norm")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)


@pytest.mark.slow  # 45-60 s with four worker processes; the colocated PPO plan below runs by default
def test_safe_rlhf_on_a_split_plan_with_pipeline_stages(tmp_path):
    """Actor + reference on two slots, critics + reward + cost on two others; actor, reference and both critics
    with two pipeline stages."""
    from algorithms.safe_rlhf import main

    staged = ("actor", "ref", "critic", "cost_critic")
    mega, torch_ = _plans([["actor", "ref"], ["critic", "cost_critic", "reward", "cost"]], staged, 2)
    m = _run(main, tmp_path / "megatron", mega, "n_slots=4", f"model.engine={MEGATRON_CPU}")
    t = _run(main, tmp_path / "torch", torch_, "n_slots=4")
    assert {"actor/grad_norm", "critic/grad_norm", "cost_critic/vf_loss", "lagrange_lambda"} <= set(t[0])
    _same_metrics(m, t)


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
@pytest.mark.parametrize("p_g", [1, 2])
def test_ppo_on_a_colocated_plan_with_pipeline_stages(tmp_path, p_g):
    """Every model on both slots; actor, reference and critic with two pipeline stages; the plan's actor generates
    at [p_g, t_g] through the 3D-HybridEngine: [1, 1] on both engines (megatron: (2, 1, 1) → (1, 1), each rank
    gathering the other stage inside its micro-DP group), or [2, 1] on megatron (each rank generating with its own
    stage, the two stages decoding in step) against the torch plan's [1, 1]."""
    from algorithms.ppo import main

    mega, torch_ = _plans([["actor", "ref", "critic", "reward"]], ("actor", "ref", "critic"), 2, generate=(p_g, 1))
    assert mega.models[0].generate == (p_g, 1)
    m = _run(main, tmp_path / "megatron", mega, "n_slots=2", f"model.engine={MEGATRON_CPU}")
    t = _run(main, tmp_path / "torch", torch_, "n_slots=2")
    assert {"actor/grad_norm", "critic/grad_norm", "critic/vf_loss"} <= set(t[0])
    _same_metrics(m, t)


def _resume_args(workdir) -> list[str]:
    plan, _ = _plans([["actor", "ref", "critic", "reward"]], ("actor", "ref", "critic"), 2)
    plan.save(workdir / "plan.json")
    return [
        "dashboard=none",
        "--plan",
        str(workdir / "plan.json"),
        "n_slots=2",
        f"model.engine={MEGATRON_CPU}",
        "sft_steps=10",
        "dataset_prompts=64",
        "prompts_per_step=32",
        "mini_batch_samples=16",
    ]


RESUME_KEYS = (
    "reward_mean",
    "kl",
    "entropy",
    "response_length_mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/grad_norm",
    "critic/grad_norm",
)


@pytest.mark.e2e  # whole program runs: CI's second tier (.ci/run)
def test_ppo_with_fused_actor_critic_training_gives_the_unfused_run(tmp_path):
    """fuse_train=true (RLHFuse's intra-stage fusion) on the colocated p = 2 plan: the critic's stages run down the
    slots and both models train in one fused pipeline; every step's metrics equal the unfused run's exactly."""
    from algorithms.ppo import main

    common = _resume_args(tmp_path)
    plain = main(["--steps", "2", *common])
    fused = main(["--steps", "2", *common, "fuse_train=true"])
    assert [r["step"] for r in fused] == [0, 1]
    for x, y in zip(plain, fused):
        for k in (*RESUME_KEYS, "critic/vf_loss", "actor/lr", "critic/lr"):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.slow  # 30 s each; the PPO test above runs the fused update by default
@pytest.mark.parametrize("staged", [("actor", "ref", "critic"), ("actor", "ref", "critic", "cost_critic")])
def test_safe_rlhf_with_fused_actor_critic_training_gives_the_unfused_run(tmp_path, staged):
    """Safe-RLHF fuses the actor with the reward critic, and with the cost critic too where the plan gives it the
    actor's train sizes (three models in one pipeline); otherwise the cost critic trains on its own."""
    from algorithms.safe_rlhf import main

    plan, _ = _plans([["actor", "ref", "critic", "cost_critic", "reward", "cost"]], staged, 2)
    plan.save(tmp_path / "plan.json")
    common = [
        "dashboard=none",
        "--plan",
        str(tmp_path / "plan.json"),
        "n_slots=2",
        f"model.engine={MEGATRON_CPU}",
        "sft_steps=10",
        "--steps",
        "2",
    ]
    plain, fused = main(common), main([*common, "fuse_train=true"])
    for x, y in zip(plain, fused, strict=True):
        for k in (
            "reward_mean",
            "cost_mean",
            "kl",
            "lagrange_lambda",
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/grad_norm",
            "cost_critic/vf_loss",
            "cost_critic/grad_norm",
        ):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.slow  # 15 s, most of it the cluster's start; the fused PPO run above places the critic this way
def test_fused_placement_reverses_the_critic_alone(tmp_path):
    """With fuse_train the critic's group runs its stages down the slots; the scorers the plan leaves out take the
    critic's pool the usual way round (they are not fused), the actor's side is untouched."""
    import flowactors as fa
    from algorithms.rollout.fusion import FusionConfig
    from algorithms.run.config import PPOConfig
    from algorithms.run.plan import place
    from engines import ModelConfig

    plan = Plan(
        placement=[["actor", "ref", "critic"]],
        models=[ModelPlan("actor", 2, (2, 1, 1)), ModelPlan("ref", 2, (2, 1, 1)), ModelPlan("critic", 2, (2, 1, 1))],
    )
    plan.save(tmp_path / "plan.json")
    ctl = fa.Controller.local(2, dashboard=None)
    try:
        cfg = PPOConfig(plan=str(tmp_path / "plan.json"), model=ModelConfig(engine="megatron"), n_slots=2)
        plain = place(ctl, cfg).roles
        fused = place(ctl, PPOConfig(**{**cfg.__dict__, "fusion": FusionConfig(train=True)})).roles
    finally:
        ctl.close()
    slots = list(ctl.slots[:2])
    assert plain["critic"][0] == fused["actor"][0] == fused["ref"][0] == slots
    assert fused["critic"][0] == slots[::-1]
    assert fused["reward"][0] == plain["reward"][0] == slots  # defaulted to the critic's pool, not its order


def test_fused_critics_are_those_with_the_actor_s_pool_and_sizes(tmp_path):
    from algorithms.rollout.fusion import FusionConfig
    from algorithms.run.config import PPOConfig, SafeRLHFConfig
    from algorithms.run.plan import resolve
    from engines import ModelConfig

    roles = [["actor", "ref", "critic", "cost_critic", "reward", "cost"]]
    for staged, want in (
        (("actor", "critic"), ("critic",)),
        (("actor", "critic", "cost_critic"), ("critic", "cost_critic")),
    ):
        plan, _ = _plans(roles, staged, 2)
        path = tmp_path / f"plan{len(want)}.json"
        plan.save(path)
        mega = ModelConfig(engine="megatron")
        fused = FusionConfig(train=True)
        assert resolve(SafeRLHFConfig(plan=str(path), model=mega, fusion=fused)).fused_critics == want
        assert resolve(SafeRLHFConfig(plan=str(path), model=mega)).fused_critics == ()
        assert resolve(PPOConfig(plan=str(path), model=mega, fusion=fused)).fused_critics[:1] == ("critic",)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four PPO steps on the megatron p = 2 plan, uninterrupted."""
    from algorithms.ppo import main

    return main(["--steps", "4", *_resume_args(tmp_path_factory.mktemp("mega_ref"))])


@pytest.mark.slow  # 40 s; the default run keeps the engine-level bit-exact load (tests/engines/test_megatron_roles.py)
def test_ppo_on_megatron_resumes_exactly(tmp_path, uninterrupted):
    """A run stopped after step 2 (checkpoints every step) and resumed reproduces the uninterrupted run's steps 2
    and 3 exactly: weights, distributed-optimizer state, LR schedule, data position and RNG all come back."""
    from algorithms.ppo import main

    common, ck = _resume_args(tmp_path), str(tmp_path / "ck")
    main(["--steps", "2", *common, "--checkpoint-dir", ck, "--save-every", "1"])
    resumed = main(["--steps", "4", *common, "--checkpoint-dir", ck, "--save-every", "1", "--resume", "auto"])
    assert [r["step"] for r in resumed] == [2, 3]
    for x, y in zip(uninterrupted[2:], resumed):
        for k in RESUME_KEYS:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.slow  # 40 s
def test_a_fused_run_resumes_unfused_exactly(tmp_path, uninterrupted):
    """Steps 0-1 with fuse_train (the critic's stages reversed over the slots), checkpointed; resumed without it,
    steps 2 and 3 equal the uninterrupted unfused run's: checkpoints are in model space, whatever the stage order."""
    from algorithms.ppo import main

    common, ck = _resume_args(tmp_path), str(tmp_path / "ck")
    main(["--steps", "2", *common, "fuse_train=true", "--checkpoint-dir", ck, "--save-every", "1"])
    resumed = main(["--steps", "4", *common, "--checkpoint-dir", ck, "--save-every", "1", "--resume", "auto"])
    assert [r["step"] for r in resumed] == [2, 3]
    for x, y in zip(uninterrupted[2:], resumed):
        for k in RESUME_KEYS:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.slow  # about a minute
def test_ppo_on_megatron_recovers_from_a_killed_worker(tmp_path, uninterrupted, capsys):
    """SIGKILL a worker once the step-2 checkpoint exists: the run rebuilds its megatron groups, loads the
    checkpoint and ends with the uninterrupted run's metrics."""
    from algorithms.ppo import main
    from tests.algorithms.kill import worker_killed_when

    common, ck = _resume_args(tmp_path), tmp_path / "ck"
    with worker_killed_when(lambda: (ck / "step_000002").exists()) as (address, victim, killed):
        history = main(
            [
                "--steps",
                "4",
                *[a for a in common if a != "n_slots=2"],
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
    assert killed.is_set() and f"worker {victim} died" in err, err[-3000:]
    for x, y in zip(uninterrupted, history):
        for k in RESUME_KEYS:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])


@pytest.mark.slow  # 30-60 s; equality with the torch engine (above) runs by default
def test_ppo_learns_on_megatron_with_pipeline_stages(tmp_path):
    """40 PPO steps on a p = 2 plan (actor, reference and critic in two stages, the actor generating through the
    3D-HybridEngine at [1, 1]): the reward of the last 10 steps beats the first 10, as on the torch engine
    (tests/algorithms/test_learning.py)."""
    from algorithms.ppo import main

    plan, _ = _plans([["actor", "ref", "critic", "reward"]], ("actor", "ref", "critic"), 2, generate=(1, 1))
    plan.save(tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    main(
        [
            "dashboard=none",
            "--plan",
            str(tmp_path / "plan.json"),
            "n_slots=2",
            f"model.engine={MEGATRON_CPU}",
            "--steps",
            "40",
            "--metrics-file",
            str(metrics),
        ]
    )
    h = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, last = (sum(r["reward_mean"] for r in rows) / len(rows) for rows in (h[:10], h[-10:]))
    assert last > first + 0.05, (first, last)
