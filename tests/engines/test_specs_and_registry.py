"""Typed call settings (UpdateSpec, GenerationSpec) and engines chosen by name (engines.registry), without a cluster:
the protocols are pure functions and the refusals happen on the controller (`process_groups`) or in configs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from engines import GenerationEngine, GenerationSpec, ModelConfig, TrainingEngine, UpdateSpec
from engines.protocols import MINIBATCH, plan_minibatches
from engines.registry import (
    check_training_layout,
    generation_engine,
    register_training_engine,
    training_engine,
    training_engine_names,
)
from engines.roles import ActorWorker, CriticWorker
from engines.rollout.hf import HFGenerationEngine
from engines.training.megatron.groups import megatron_subgroups
from engines.training.torch_native import TrainEngine
from flowactors import MESH, Batch, Layout


def _batch(n: int = 8) -> Batch:
    return Batch({"x": torch.arange(n)})


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(mini_batch_samples=0), "UpdateSpec.mini_batch_samples"),
        (dict(mini_batch_samples=4, epochs=0), "UpdateSpec.epochs"),
        (dict(mini_batch_samples=4, lr=0.0), "UpdateSpec.lr"),
    ],
)
def test_update_spec_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        UpdateSpec(**kwargs)


def test_specs_are_frozen_values_with_one_default_each():
    assert UpdateSpec(4) == UpdateSpec(mini_batch_samples=4, epochs=1, shuffle_seed=None, lr=None)
    assert GenerationSpec() == GenerationSpec(greedy=False, seed=0)
    with pytest.raises(AttributeError):
        UpdateSpec(4).epochs = 2  # type: ignore[misc]


def test_minibatch_protocol_takes_the_spec_from_the_call():
    batch, spec, layout = _batch(), UpdateSpec(4, 2, 5), Layout(dp=2, tp=2)
    positional = MINIBATCH.split((batch, "loss", spec), {}, layout)
    keyword = MINIBATCH.split((batch, "loss"), {"spec": spec}, layout)
    plan = plan_minibatches(batch, 2, spec)
    for parts in (positional, keyword):
        for rank, (args, kwargs) in enumerate(parts):
            shares = args[0]
            assert [s["x"].tolist() for s in shares] == [s["x"].tolist() for s in plan[layout.coords(rank)[1]]]
            assert args[1] == "loss" and (args[2:] + tuple(kwargs.values())) == (spec,)  # the spec rides along
    assert len(plan[0]) == 2  # one local batch per epoch
    assert plan[0][0]["x"].tolist() != plan[0][1]["x"].tolist()  # a seeded shuffle per epoch
    assert plan_minibatches(batch, 1, UpdateSpec(8))[0][0]["x"].tolist() == list(range(8))  # no seed: batch order


def test_minibatch_protocol_refuses_a_missing_or_wrong_spec_and_an_indivisible_batch():
    with pytest.raises(TypeError, match=re.escape("UpdateSpec(mini_batch_samples=")):
        MINIBATCH.split((_batch(), "loss"), {}, Layout())
    with pytest.raises(TypeError, match="must be an UpdateSpec, got dict"):
        MINIBATCH.split((_batch(), "loss", {"mini_batch_samples": 4}), {}, Layout())
    with pytest.raises(ValueError, match="does not divide the batch of 8 samples; choose a mini-batch size"):
        plan_minibatches(_batch(), 1, UpdateSpec(3))
    with pytest.raises(ValueError, match="make it a multiple of 4"):
        plan_minibatches(_batch(), 4, UpdateSpec(2))


def test_mesh_protocol_hands_every_rank_the_generation_spec_unchanged():
    spec = GenerationSpec(greedy=True, seed=7)
    for args, kwargs in MESH.split((_batch(), spec), {}, Layout(pp=2, dp=2, tp=2)):
        assert args[1] is spec and len(args[0]) == 4
    for args, kwargs in MESH.split((_batch(), 3), {"spec": spec}, Layout(dp=2)):
        assert kwargs["spec"] is spec and args[1] == 3


def test_engines_read_no_settings_from_batch_meta():
    """Settings travel as typed arguments; engines/ only carries meta along (Batch(..., meta) copies)."""
    root = Path(__file__).resolve().parents[2] / "engines"
    offenders = [
        f"{p.relative_to(root.parent)}:{i}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bmeta\s*(\.get\(|\[)|with_meta\(", line)
    ]
    assert offenders == []


def test_engines_implement_the_interfaces():
    model = torch.nn.Linear(2, 2)
    assert isinstance(TrainEngine(model, None, trainable=False), TrainingEngine)
    assert isinstance(HFGenerationEngine(eos_token_id=1, pad_token_id=0), GenerationEngine)
    from engines.training.megatron.engine import MegatronEngine

    methods = [
        name for name in dir(TrainingEngine) if not name.startswith("_") and callable(getattr(TrainingEngine, name))
    ]
    assert {"log_probs", "update", "checkpoint_state"} <= set(methods)
    assert all(callable(getattr(MegatronEngine, name, None)) for name in methods)


def test_the_registry_names_the_known_training_engines():
    assert {"torch", "megatron"} <= set(training_engine_names())
    known = r"unknown training engine 'jax'; known: \[.*'megatron'.*'torch'.*\] or 'package.module:name'"
    with pytest.raises(ValueError, match=known):
        training_engine("jax")


def test_a_registered_training_engine_is_selectable_by_config():
    from engines import registry

    def build(setup):
        raise AssertionError

    register_training_engine("toy", build, pipeline_parallel=True)
    try:
        assert ModelConfig(engine="toy").engine == "toy"
        assert training_engine("toy").build is build
        check_training_layout("toy", 4)
        with pytest.raises(ValueError, match="already registered"):
            register_training_engine("toy", lambda setup: None)
    finally:
        registry._TRAINING.pop("toy")


def test_generation_engines_by_name():
    assert generation_engine("hf") is not None
    if importlib.util.find_spec("vllm") is None:  # the default environment: refused on the controller, with the fix
        with pytest.raises(ImportError, match="rollout_engine='vllm' needs vllm.*vllm_cpu_check.sh"):
            generation_engine("vllm")
    else:
        assert generation_engine("vllm") is not None
    with pytest.raises(ValueError, match=r"unknown generation engine rollout_engine='sglang'; known: \['hf', 'vllm'\]"):
        generation_engine("sglang")


def test_roles_refuse_what_their_engines_cannot_run_on_the_controller():
    """process_groups runs on the controller before any rank starts."""
    with pytest.raises(ValueError, match="'torch' training engine has no pipeline parallelism.*pp=2"):
        CriticWorker.process_groups(Layout(pp=2), ModelConfig())
    with pytest.raises(ValueError, match="no pipeline parallelism"):
        ActorWorker.process_groups(Layout(pp=2), model=ModelConfig())
    # megatron asks for its own groups (model parallel, embedding, each rank alone) with the group
    assert CriticWorker.process_groups(Layout(pp=2), ModelConfig(engine="megatron")) == megatron_subgroups(2, 1, 1)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="rollout_engine='vllm' needs vllm"):
            ActorWorker.process_groups(Layout(dp=2), ModelConfig(), None, None, None, "vllm")
    else:  # vLLM's world is one generation replica: each rank alone at t_g = 1, the generation TP groups above
        assert ActorWorker.process_groups(Layout(dp=2), ModelConfig(), None, None, None, "vllm") == [(0,), (1,)]
    with pytest.raises(ValueError, match="unknown generation engine"):
        ActorWorker.process_groups(Layout(dp=2), ModelConfig(), rollout_engine="nope")
    assert ActorWorker.process_groups(Layout(dp=2), ModelConfig(), rollout_engine="hf") == []
