import json

import pytest

from placement import LlamaSpec, ModelPlan, Plan, PlanError, Workload, a100_80gb, llama_7b, llama_70b, validate
from placement.automap import main

PLAN = {
    "placement": [["actor", "ref"], ["critic", "reward"]],
    "gpus": {"actor": 8, "ref": 8, "critic": 8, "reward": 8},
    "parallel": {
        "actor": {"train": [1, 4, 2], "generate": [1, 2]},
        "ref": {"train": [1, 1, 8]},
        "critic": {"train": [2, 4, 1]},
        "reward": {"train": [1, 2, 4]},
    },
}


def test_json_round_trip():
    plan = Plan.from_dict(PLAN)
    assert plan.to_dict() == PLAN
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.pools() == {"actor+ref": 8, "critic+reward": 8}
    assert plan.pool_of("reward") == "critic+reward"
    assert plan.model("actor").parallel.generate == (1, 2)


def test_yaml_round_trip(tmp_path):
    pytest.importorskip("yaml")
    plan = Plan.from_dict(PLAN)
    plan.save(tmp_path / "plan.yaml")
    assert "placement:" in (tmp_path / "plan.yaml").read_text()
    assert Plan.load(tmp_path / "plan.yaml") == plan
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text()) == PLAN


def test_the_actor_entry_names_its_rollout_engine():
    data = json.loads(json.dumps(PLAN))
    data["parallel"]["actor"]["rollout_engine"] = "vllm"
    plan = Plan.from_dict(data)
    assert plan.model("actor").rollout_engine == "vllm" and plan.to_dict() == data
    assert Plan.from_dict(PLAN).model("actor").rollout_engine is None  # the run's setting decides
    data["parallel"]["critic"]["rollout_engine"] = "vllm"
    with pytest.raises(
        PlanError, match="critic: only the actor and the rollout replicas generate; drop its 'rollout_engine'"
    ):
        Plan.from_dict(data)


def test_defaults_for_hand_written_plans():
    plan = Plan.from_dict({"placement": [["actor", "ref"]], "gpus": {"actor": 4, "ref": 4}})
    assert plan.model("ref").train == (1, 1, 4)  # pure data parallelism
    assert plan.model("actor").generate is None
    assert plan.model("actor").parallel.generate == (1, 1)  # generates with its training sizes


def test_automap_output_is_a_plan(capsys, tmp_path):
    argv = ["--algorithm", "ppo", "--size", "7b", "--gpus", "16", "--json", "--save", str(tmp_path / "p.json")]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(printed)
    assert plan == Plan.load(tmp_path / "p.json")
    validate(plan, 16, models={r: llama_7b() for r in plan.roles}, hardware=a100_80gb())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"placement": [["actor", "ref"], ["ref"]]}, "names ref more than once"),
        (
            {"gpus": {"actor": 8, "ref": 4, "critic": 8, "reward": 8}, "parallel": {"ref": {"train": [1, 1, 4]}}},
            "need the same gpus",
        ),
        ({"parallel": {"actor": {"train": [1, 4, 1]}}}, r"p·t·d = 1·4·1 = 4 must equal its 8 GPUs; change d to 2"),
        ({"parallel": {"actor": {"train": [1, 4, 2], "generate": [1, 3]}}}, "must divide the training sizes"),
        ({"parallel": {"ref": {"train": [1, 1, 8], "generate": [1, 1]}}}, "only the actor generates"),
        ({"colour": "red"}, r"unknown plan keys \['colour'\]"),
        (
            {"placement": [["actor", "ref"], ["critic", "reward"], ["rollout"]], "gpus": {**PLAN["gpus"], "rollout": 4}}
            | {"parallel": {"rollout": {"train": [2, 1, 2]}}},
            r"rollout: the replicas have no pipeline stages; train must be \[1, t, d\]",
        ),
        (
            {"placement": [["actor", "ref"], ["critic", "reward"], ["rollout"]], "gpus": {**PLAN["gpus"], "rollout": 4}}
            | {"parallel": {"rollout": {"train": [1, 2, 2], "generate": [1, 1]}}},
            r"rollout: a replica generates with its own sizes; generate must be \[1, 2\] or left out",
        ),
        ({"placement": ["actor", "ref", "critic", "reward"]}, "placement must be a list of colocated sets"),
    ],
)
def test_malformed_plans_say_what_to_fix(change, message):
    data = {**PLAN, **change}
    if "parallel" in change:
        data["parallel"] = {**PLAN["parallel"], **change["parallel"]}
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_validate_against_the_cluster():
    plan = Plan.from_dict(PLAN)
    validate(plan, 16)
    with pytest.raises(PlanError, match="needs 16 device slots but the cluster has 12: start more workers"):
        validate(plan, 12)
    with pytest.raises(PlanError, match="tensor parallel size 4 exceeds the 2 GPUs of a node"):
        validate(plan, 16, gpus_per_node=2)


def test_validate_sizes_against_the_models():
    odd = LlamaSpec(hidden=4096, layers=33, heads=32, ffn=11008)
    plan = Plan.from_dict(PLAN)
    with pytest.raises(PlanError) as err:
        validate(plan, 16, models={"critic": odd})
    assert "critic: pipeline size 2 does not divide its 33 layers" in str(err.value)
    three = Plan((("ref",),), (ModelPlan("ref", 3, (1, 3, 1)),))
    with pytest.raises(PlanError, match="tensor parallel size 3 does not divide its 32 attention heads"):
        validate(three, 3, models={"ref": odd})


def test_validate_memory():
    # 70B actor and reference on one node: 16 B/param of the actor over 8 GPUs alone is 128 GiB per device.
    plan = Plan((("actor", "ref"),), (ModelPlan("actor", 8, (1, 8, 1)), ModelPlan("ref", 8, (1, 8, 1))))
    with pytest.raises(
        PlanError,
        match=r"pool actor\+ref needs \d+\.\d GiB per device but a a100-80gb has 72.0 GiB "
        "usable: give it more GPUs",
    ):
        validate(plan, 8, models={"actor": llama_70b(), "ref": llama_70b()}, hardware=a100_80gb(), workload=Workload())
    roomy = Plan((("actor", "ref"),), (ModelPlan("actor", 64, (8, 8, 1)), ModelPlan("ref", 64, (1, 8, 8))))
    validate(roomy, 64, models={"actor": llama_70b(), "ref": llama_70b()}, hardware=a100_80gb())
