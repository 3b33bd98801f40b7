"""Roles as groups on a real cluster: their outputs equal the same models run directly in this process."""

import pytest
import torch

import flowactors as fa
from engines import (
    ActorWorker,
    CriticWorker,
    ModelConfig,
    RewardModelWorker,
    RuleRewardWorker,
    SamplingConfig,
    build_model,
    build_tokenizer,
    save_pretrained,
)
from engines.rollout.hf import HFGenerationEngine
from engines.training.common import OptimConfig
from engines.training.torch_native import TrainEngine
from flowactors import Batch
from tests.engines.probes import squared_value_loss

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)


def _prompts(tok, n=8):
    enc = tok([f"sum {i + 3}:" for i in range(n)], padding=True, return_tensors="pt")
    return Batch(
        {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "seed": torch.arange(n) + 100},
        {"target": [i + 3 for i in range(n)]},
    )


def _length_reward(prompt: str, response: str, row: dict) -> float:
    return float(len(response)) + 0.01 * row["target"]


@pytest.fixture(scope="module")
def samples(controller4):
    tok = build_tokenizer(CFG)
    actor = fa.ActorGroup(
        controller4,
        ActorWorker,
        name="roles_actor",
        slots=controller4.slots[:2],
        args=(CFG, None, SamplingConfig(max_new_tokens=6)),
    )
    try:
        out = actor.generate_sequences(_prompts(tok)).result()
        lp = actor.compute_log_prob(out).result()
    finally:
        actor.close()
    return tok, out, lp


def test_actor_group_samples_and_scores_like_the_local_model(samples):
    tok, out, lp = samples
    model = build_model(CFG, "lm", tok)
    local = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id).generate(
        model, _prompts(tok), SamplingConfig(max_new_tokens=6)
    )
    assert torch.equal(out["responses"], local["responses"])  # dp=2 split, same per-row seeds
    ref = TrainEngine(model, None, trainable=False).log_probs(local, with_entropy=True)
    assert torch.allclose(lp["old_log_probs"], ref["log_probs"], atol=1e-5)


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_critic_and_reward_model_groups_match_direct_forward(controller4, samples, tmp_path, zero_stage):
    """Over 2 DP ranks, sharded (FSDP2) or as whole replicas (zero_stage=1): the unsharded model's values and
    scores."""
    tok, out, _ = samples
    save_pretrained(build_model(CFG, "score", tok), tok, tmp_path / "sft")  # a trained-looking, non-zero head
    sft = ModelConfig(path=str(tmp_path / "sft"))
    critic = fa.ActorGroup(
        controller4,
        CriticWorker,
        name=f"roles_critic{zero_stage}",
        slots=controller4.slots[:2],
        args=(sft, OptimConfig(zero_stage=zero_stage)),
    )
    rm = fa.ActorGroup(
        controller4,
        RewardModelWorker,
        name=f"roles_rm{zero_stage}",
        slots=controller4.slots[2:],
        args=(sft, None, None, zero_stage),
    )
    rule = fa.ActorGroup(
        controller4,
        RuleRewardWorker,
        name=f"roles_rule{zero_stage}",
        slots=controller4.slots[:2],
        args=(_length_reward, CFG),
    )
    try:
        values = critic.compute_values(out).result()["values"]
        scores = rm.compute_reward(out).result()["rewards"]
        rules = rule.compute_reward(out).result()["rewards"]
    finally:
        for g in (critic, rm, rule):
            g.close()
    v_model, s_model = build_model(sft, "value"), build_model(sft, "score")
    assert values.abs().sum() > 0 and scores.abs().sum() > 0
    assert torch.allclose(values, TrainEngine(v_model, None, trainable=False).values(out), atol=1e-6)
    assert torch.allclose(scores, TrainEngine(s_model, None, trainable=False).scores(out), atol=1e-6)
    texts = tok.batch_decode(out["responses"], skip_special_tokens=True)
    assert rules.tolist() == pytest.approx([len(t) + 0.01 * (i + 3) for i, t in enumerate(texts)])


def test_critic_with_trainable_layers_moves_only_its_top_layer_and_head(controller4, samples, tmp_path):
    """A critic trained with trainable_layers=1 (what RL's critic_trainable_layers gives it), 2 DP replicas: its
    embeddings and lower layer stay the pretrained ones bit for bit, its top layer and value head move, and its
    loss on the batch falls."""
    from engines import UpdateSpec

    tok, out, _ = samples
    save_pretrained(build_model(CFG, "score", tok), tok, tmp_path / "sft")
    sft = ModelConfig(path=str(tmp_path / "sft"))
    batch = out.union(Batch({"returns": torch.ones(out["responses"].shape)}))
    critic = fa.ActorGroup(
        controller4,
        CriticWorker,
        name="roles_critic_top",
        slots=controller4.slots[:2],
        args=(sft, OptimConfig(lr=1e-2, trainable_layers=1, zero_stage=1)),
    )
    try:
        losses = [
            critic.update_critic(batch, squared_value_loss, UpdateSpec(len(batch))).result()["vf_loss"]
            for _ in range(3)
        ]
        critic.export_hf(str(tmp_path / "trained")).result()
    finally:
        critic.close()
    assert losses[-1] < losses[0]
    base = build_model(sft, "value").state_dict()
    trained = build_model(ModelConfig(path=str(tmp_path / "trained")), "value").state_dict()
    frozen = [n for n in base if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    head = [n for n in base if not n.startswith("model.")]
    moved = [n for n in base if n.startswith("model.layers.1.") and not n.endswith("norm.weight")] + head
    assert frozen and head and moved
    assert all(torch.equal(base[n], trained[n]) for n in frozen)
    assert all(not torch.equal(base[n], trained[n]) for n in moved)
