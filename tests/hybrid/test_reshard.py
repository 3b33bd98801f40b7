"""The resharding collectives on real gloo ranks (spawned processes, up to 8 on 2 cores).

Three spawns in all: one world of 8 ranks runs three layouts back to back, one of 4 ranks generates with the full
model (t_g = p_g = 1), one of 2 ranks covers d_g = 1 and a rank handing over a wrong shard. For every rank the
checks are: the generation shard equals the slice of the full weights computed independently; the bytes received
equal the exact expectation and, for layouts with balanced stages, HybridFlow Table 2; the local piece is the
training memory (no redundant copy); the training shard is untouched; a train → generate → train (SGD step) →
generate cycle serves the updated weights; and greedy tokens from what generation received equal those of the
unsharded model (the shards of one generation TP×PP group merged and loaded into a transformers model).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.hybrid import (
    HybridLayout,
    ModelGeometry,
    expected_gen_param_bytes,
    expected_received_bytes,
    merge_generation_shards,
    replicated_bytes_missing,
    table2,
)
from tests.hybrid import cases
from tests.hybrid.spawn import run_ranks

METHODS = ("micro-dp", "tp-pp", "all")
ITEMSIZE = 4  # float32
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

# (model, (p, t, d, p_g, t_g), methods); grouped by world size, one spawn per world.
EIGHT = [
    ("llama", (1, 4, 2, 1, 2), METHODS),  # the example: TP 4 -> 2, d_g = 2
    ("qwen2", (2, 2, 2, 2, 1), ("micro-dp",)),  # p_g = p = 2 > 1, biases fused with q/k/v
    ("llama", (4, 2, 1, 2, 1), METHODS),  # p_g = 2 > 1 from p = 4, TP 2 -> 1: d_g = 4, stages merge
]
FOUR = [("llama", (2, 2, 1, 1, 1), METHODS)]  # generation holds the full model
TWO = [("llama", (1, 2, 1, 1, 2), ("micro-dp",))]  # d_g = 1: nothing to move
ALL_CASES = EIGHT + FOUR + TWO
CASE_IDS = [f"{m}-{'x'.join(map(str, s))}" for m, s, _ in ALL_CASES]


def tiny_config(model: str):
    config_cls, _ = MODELS[model]
    return config_cls(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=128,
        num_hidden_layers=4,
        vocab_size=128,
        tie_word_embeddings=False,
    )


def tiny_model(model: str):
    torch.manual_seed(0)
    return MODELS[model][1](tiny_config(model)).eval()


@pytest.fixture(scope="module")
def case_files(tmp_path_factory):
    files = {}
    for model in MODELS:
        path = tmp_path_factory.mktemp("hybrid") / f"{model}.pt"
        geometry = ModelGeometry.from_hf_config(tiny_config(model))
        torch.save({"state_dict": tiny_model(model).state_dict(), "geometry": dataclasses.asdict(geometry)}, path)
        files[model] = str(path)
    return files


def _run_world(world_size: int, specs, case_files, extra=()) -> list[list]:
    jobs = [(cases.reshard_case, (case_files[m], sizes, methods)) for m, sizes, methods in specs] + list(extra)
    return run_ranks(world_size, cases.run_jobs, jobs)


@pytest.fixture(scope="module")
def results(case_files):
    """{case id: [per-rank result]} for every case, plus "bad-shard"; three spawns in all."""
    out = {}
    for world, specs, extra in (
        (8, EIGHT, ()),
        (4, FOUR, ()),
        (2, TWO, [(cases.bad_shard_case, (case_files["llama"],))]),
    ):
        per_rank = _run_world(world, specs, case_files, extra)
        for i, (model, sizes, _) in enumerate(specs):
            out[f"{model}-{'x'.join(map(str, sizes))}"] = [rank_out[i] for rank_out in per_rank]
        if extra:
            out["bad-shard"] = [rank_out[len(specs)] for rank_out in per_rank]
    return out


def _case(case_id: str):
    return ALL_CASES[CASE_IDS.index(case_id)]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_generation_shards_equal_slices_of_full_weights(results, case_id):
    _, _, methods = _case(case_id)
    for rank, out in enumerate(results[case_id]):
        for method in methods:
            record = out["methods"][method]
            assert record["matches"], f"rank {rank} {method}: generation weights differ from the full-weight slice"
            assert record["released"] and record["training_untouched"], f"rank {rank} {method}"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bytes_received_equal_the_formulas(results, case_id):
    model, sizes, methods = _case(case_id)
    layout, geometry = HybridLayout(*sizes), ModelGeometry.from_hf_config(tiny_config(model))
    sharded_bytes = ITEMSIZE * (geometry.numel - geometry.replicated_numel)
    balanced = layout.train_pp <= 2  # every stage then holds the same sharded payload
    for rank, out in enumerate(results[case_id]):
        for method in methods:
            stats = out["methods"][method]["stats"]
            assert stats.received_bytes == expected_received_bytes(geometry, layout, rank, method, ITEMSIZE)
            assert stats.gen_param_bytes == expected_gen_param_bytes(geometry, layout, rank, method, ITEMSIZE)
            if balanced:
                formula = table2(method, layout, sharded_bytes)
                norms = replicated_bytes_missing(geometry, layout, rank, method, ITEMSIZE)
                assert stats.received_bytes == formula.comm_bytes + norms, (rank, method)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_no_rank_holds_a_redundant_copy(results, case_id):
    model, sizes, methods = _case(case_id)
    layout = HybridLayout(*sizes)
    geometry = ModelGeometry.from_hf_config(tiny_config(model))
    for rank, out in enumerate(results[case_id]):
        micro = out["methods"]["micro-dp"]
        stats = micro["stats"]
        assert micro["local_piece_is_training_memory"]
        assert stats.redundant_bytes == 0
        assert stats.resident_param_bytes == stats.gen_param_bytes  # peak = the generation shard alone
        if layout.gen_tp * layout.gen_pp > 1:  # less than the whole model
            assert stats.gen_param_bytes < ITEMSIZE * geometry.numel
        for method in set(methods) - {"micro-dp"}:  # the baselines keep the training shard beside a full copy
            base = out["methods"][method]["stats"]
            assert base.gen_param_bytes == ITEMSIZE * geometry.numel
            assert base.redundant_bytes == base.train_param_bytes
            assert not out["methods"][method]["local_piece_is_training_memory"]


def test_fused_format_uses_the_training_names(results):
    names = results["qwen2-2x2x2x2x1"][0]["methods"]["micro-dp"]["fused_names"]
    assert "model.layers.0.self_attn.qkv_proj.bias" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n for n in names)


def _greedy(model, state_dict=None, new_tokens=8):
    if state_dict is not None:
        model.load_state_dict(state_dict)
    prompt = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0].tolist()


def _served_model(per_rank, layout: HybridLayout, geometry, key):
    """Merge the generation shards of generation replica 0 (one TP×PP group) into the full HF state dict."""
    shards = {}
    for out in per_rank:
        g_pp, g_tp, _, g_dp = out["gen_coord"]
        if g_dp == 0:
            shards[(g_pp, g_tp)] = key(out)
    assert len(shards) == layout.gen_pp * layout.gen_tp
    return merge_generation_shards(geometry, shards, layout.gen_tp)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_generation_after_resharding_matches_unsharded_model(results, case_id):
    model_name, sizes, _ = _case(case_id)
    layout, geometry = HybridLayout(*sizes), ModelGeometry.from_hf_config(tiny_config(model_name))
    served = _served_model(results[case_id], layout, geometry, lambda out: out["methods"]["micro-dp"]["gen_state"])
    reference = _greedy(tiny_model(model_name))
    assert _greedy(tiny_model(model_name), served) == reference


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_cycle_with_optimizer_step_serves_updated_weights(results, case_id):
    model_name, sizes, _ = _case(case_id)
    layout, geometry = HybridLayout(*sizes), ModelGeometry.from_hf_config(tiny_config(model_name))
    for rank, out in enumerate(results[case_id]):
        cycle = out["cycle"]
        assert cycle["params_are_training_views"], rank
        assert cycle["first_matches"] and cycle["second_changed"] and cycle["second_matches"], rank
    served = _served_model(results[case_id], layout, geometry, lambda out: out["cycle"]["second_state"])
    updated = tiny_model(model_name)
    updated.load_state_dict(cases.sgd_reference(updated.state_dict()))
    assert _greedy(tiny_model(model_name), served) == _greedy(updated)


def test_bad_shard_on_one_rank_raises_on_every_rank_of_its_group(results):
    per_rank = results["bad-shard"]
    assert "training shard is for stage 0" in per_rank[1]["error"]
    assert "another rank of its resharding group rejected" in per_rank[0]["error"]
    assert all(out["recovered"] for out in per_rank)
