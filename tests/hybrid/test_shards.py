"""Shard specs, training shards, generation-shard assembly, validation and accounting, without processes."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.hybrid import (
    GenerationEngineLimits,
    HybridLayout,
    ModelGeometry,
    Resharder,
    ReshardGroups,
    build_train_shard,
    check_model_fits,
    expected_gen_param_bytes,
    expected_generation_state_dict,
    expected_received_bytes,
    generation_tensors,
    merge_generation_shards,
    model_rules,
    table2,
    transformers_engine_limits,
    vllm_engine_limits,
)

SMALL = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    intermediate_size=96,
    num_hidden_layers=4,
    vocab_size=64,
)
MODELS = {
    "llama": (LlamaConfig(**SMALL), LlamaForCausalLM),
    "llama-biases": (LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True), LlamaForCausalLM),
    "qwen2": (Qwen2Config(**SMALL), Qwen2ForCausalLM),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    config, cls = MODELS[request.param]
    torch.manual_seed(0)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in cls(config).state_dict().items()}  # no all-equal norms
    return ModelGeometry.from_hf_config(config), state


# Training DP replicas hold identical shards, so d = 1 covers the cutting; one d = 2 layout checks the ranks' map.
LAYOUTS = [
    HybridLayout(p, t, 1, pg, tg)
    for p, t in itertools.product((1, 2, 4), (1, 2, 4))
    for pg in (1, 2, 4)
    if p % pg == 0
    for tg in (1, 2, 4)
    if t % tg == 0
] + [HybridLayout(1, 4, 2, 1, 2), HybridLayout(2, 2, 2, 1, 1)]


def test_rules_cover_exactly_the_hf_state_dict(model):
    geometry, state = model
    names = [hf for rule in model_rules(geometry) for hf, _ in rule.parts]
    assert sorted(names) == sorted(state)
    assert geometry.numel == sum(v.numel() for v in state.values())


def _fused_expected(state, geometry, layout, rank):
    """The "fused" generation format from the HF slices: parts re-concatenated per tensor."""
    hf = expected_generation_state_dict(state, geometry, layout, rank)
    out = {}
    for rule in model_rules(geometry):
        parts = [hf[name] for name, _ in rule.parts if name in hf]
        if parts:
            out[rule.name] = parts[0] if rule.split_dim is None else torch.cat(parts, dim=rule.split_dim)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_generation_shard_from_member_training_shards_equals_full_weight_slice(model, layout):
    """What the micro-DP all-gather assembles, fed here the members' buffers directly."""
    geometry, state = model
    train = [build_train_shard(state, geometry, layout, r) for r in range(layout.world_size)]
    for rank in range(layout.world_size):
        g = layout.gen_coord(rank)
        members = [layout.train_coord(m) for m in layout.micro_dp_group(rank)]
        sharded = {(c.pp, c.tp): train[layout.rank_of(*c)].sharded for c in members}
        replicated = {c.pp: train[layout.rank_of(*c)].replicated for c in members}
        for fmt, want in (
            ("hf", expected_generation_state_dict(state, geometry, layout, rank)),
            ("fused", _fused_expected(state, geometry, layout, rank)),
        ):
            got = dict(generation_tensors(geometry, layout, g.pp, g.tp, sharded, replicated, fmt))
            assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got), (rank, fmt)
        if layout.tp_ratio == 1:  # no TP merge: every tensor is a view of a gathered piece, nothing copied
            pieces = {p.untyped_storage().data_ptr() for p in [*sharded.values(), *replicated.values()]}
            got = generation_tensors(geometry, layout, g.pp, g.tp, sharded, replicated, "hf")
            assert all(t.untyped_storage().data_ptr() in pieces for _, t in got)


@pytest.mark.parametrize(
    "layout", [HybridLayout(2, 4, 1), HybridLayout(4, 2, 1), HybridLayout(1, 4, 1)], ids=lambda lay: lay.describe()
)
def test_training_shards_reassemble_to_the_full_model(model, layout):
    geometry, state = model
    train = {
        layout.train_coord(r)[::2]: build_train_shard(state, geometry, layout, r) for r in range(layout.world_size)
    }
    sharded = {key: shard.sharded for key, shard in train.items()}
    replicated = {pp: shard.replicated for (pp, _), shard in train.items()}
    full = dict(generation_tensors(geometry, layout, 0, 0, sharded, replicated, "hf", gen_pp=1, gen_tp=1))
    assert full.keys() == state.keys() and all(torch.equal(full[k], state[k]) for k in state)
    for shard in train.values():
        shard.check_views()
        assert shard.sharded.numel() + shard.replicated.numel() == shard.flat.numel()


def test_merge_generation_shards_rebuilds_the_full_state_dict(model):
    geometry, state = model
    layout = HybridLayout(2, 4, 1, gen_pp=2, gen_tp=2)
    shards = {}
    for rank in range(layout.world_size):
        g = layout.gen_coord(rank)
        shards[(g.pp, g.tp)] = expected_generation_state_dict(state, geometry, layout, rank)
    merged = merge_generation_shards(geometry, shards, layout.gen_tp)
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)


def test_tied_embeddings_give_the_last_stage_its_own_lm_head():
    config = LlamaConfig(**SMALL, tie_word_embeddings=True)
    geometry = ModelGeometry.from_hf_config(config)
    state = LlamaForCausalLM(config).state_dict()
    state.pop("lm_head.weight", None)
    layout = HybridLayout(2, 1, 1)
    last = build_train_shard(state, geometry, layout, 1)
    assert torch.equal(last.tensors["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("overrides", "layout", "message"),
    [
        (dict(num_key_value_heads=2), HybridLayout(1, 4, 1), "num_key_value_heads=2 cannot be split over train_tp=4"),
        (dict(vocab_size=66), HybridLayout(1, 4, 1), "vocab_size=66 cannot be split over train_tp=4; choose"),
        (dict(num_hidden_layers=3), HybridLayout(2, 1, 1), "num_hidden_layers=3 cannot be split evenly over"),
    ],
)
def test_models_the_layout_cannot_cut_are_rejected(overrides, layout, message):
    geometry = ModelGeometry.from_hf_config(LlamaConfig(**{**SMALL, **overrides}))
    with pytest.raises(ValueError, match=message):
        check_model_fits(geometry, layout)


@pytest.mark.parametrize(
    ("engine", "layout", "overrides", "message"),
    [
        (GenerationEngineLimits("unpiped"), HybridLayout(2, 2, 1, 2, 1), {}, "does not generate over pipeline stages"),
        (vllm_engine_limits(), HybridLayout(1, 2, 1, 1, 2), {}, "needs head_dim >= 32"),
        (GenerationEngineLimits("tiny", max_tp=1), HybridLayout(1, 2, 1, 1, 2), {}, "at most tensor parallel 1"),
    ],
)
def test_engine_that_cannot_take_the_layout_fails_before_any_collective(engine, layout, overrides, message):
    geometry = ModelGeometry.from_hf_config(LlamaConfig(**{**SMALL, **overrides}))
    groups = ReshardGroups(layout=layout, rank=0, methods=("micro-dp",))  # no process group exists at all
    with pytest.raises(ValueError, match=message):
        Resharder(geometry, layout, groups, engine=engine)


def test_transformers_engine_takes_pipeline_stages_and_vllm_inside_the_actor_does_not():
    geometry = ModelGeometry.from_hf_config(LlamaConfig(**SMALL))
    layout = HybridLayout(2, 2, 1, 2, 1)
    assert transformers_engine_limits().supports_pipeline
    transformers_engine_limits().check(geometry, layout)  # the hybrid engine's _PipelineStage runs it
    with pytest.raises(ValueError, match="does not generate over pipeline stages"):
        GenerationEngineLimits("unpiped").check(geometry, layout)


def test_unknown_model_type_is_rejected():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type 'gpt2' is not one this resharder knows"):
        ModelGeometry.from_hf_config(GPT2Config())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_expected_bytes_are_what_each_rank_lacks(model, layout):
    geometry, state = model
    for rank in range(layout.world_size):
        train_bytes = 4 * build_train_shard(state, geometry, layout, rank).flat.numel()
        micro = expected_received_bytes(geometry, layout, rank, "micro-dp", 4)
        assert micro + train_bytes == expected_gen_param_bytes(geometry, layout, rank, "micro-dp", 4)
        assert expected_received_bytes(geometry, layout, rank, "tp-pp", 4) + train_bytes == 4 * geometry.numel


def test_table2_for_the_paper_example():
    layout, m = HybridLayout(1, 4, 2, 1, 2), 8000
    assert table2("all", layout, m).comm_bytes == 7000 and table2("all", layout, m).redundant_bytes == 1000
    assert table2("tp-pp", layout, m).comm_bytes == 6000 and table2("tp-pp", layout, m).peak_param_bytes == m
    micro = table2("micro-dp", layout, m)
    assert (micro.comm_bytes, micro.peak_param_bytes, micro.redundant_bytes) == (2000, 4000, 0)


def test_the_package_imports_only_torch_and_itself():
    """engines.hybrid's resharding core sits below the runtime: no flowactors, no dask, no transformers. Only its
    binding to the actor (actor.py) uses the runtime, and importing the package does not load it."""
    allowed = {
        "torch",
        "engines",
        "__future__",
        "collections",
        "dataclasses",
        "datetime",
        "fractions",
        "functools",
        "time",
        "typing",
    }
    package = Path(__file__).parents[2] / "engines" / "hybrid"
    assert "engines.hybrid.actor" not in (package / "__init__.py").read_text()
    for path in package.glob("*.py"):
        if path.name == "actor.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("engines"):
                    assert name.startswith("engines.hybrid"), f"{path.name} imports {name}"
