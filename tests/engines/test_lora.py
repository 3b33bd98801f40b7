"""LoRA: adapters start as the base model, train alone, merge into a plain model that scores the same, shard under
FSDP2 as on one process, checkpoint as adapters only; impossible combinations are refused."""

import copy

import pytest
import torch

import flowactors as fa
from engines import ActorWorker, CriticWorker, ModelConfig, OptimConfig, RefWorker, UpdateSpec, build_model
from engines.training.lora import LoraConfig, apply_lora, merged_state_dict
from engines.training.torch_native import TrainEngine
from flowactors import Layout
from tests.engines.probes import pg_loss, squared_value_loss
from tests.engines.test_packing import long_tailed

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=7)
LORA = OptimConfig(lr=1e-2, lora_rank=4, lora_alpha=8.0, grad_clip=0.0)


def adapted(head: str = "lm", optim: OptimConfig = LORA) -> tuple[torch.nn.Module, TrainEngine]:
    model = build_model(CFG, head)
    base = copy.deepcopy(model)
    apply_lora(model, optim.lora, trainable_heads=() if head == "lm" else ("score",))
    return base, TrainEngine(model, optim, lora_scale=optim.lora.scale)


def test_adapters_start_as_the_base_model_and_only_they_train():
    base, engine = adapted()
    b = long_tailed()
    before = TrainEngine(base, None, trainable=False).log_probs(b)["log_probs"]
    torch.testing.assert_close(engine.log_probs(b)["log_probs"], before, atol=0, rtol=0)  # B = 0
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * 7 * CFG.num_layers  # q, k, v, o, gate, up, down in each layer
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    for _ in range(3):
        engine.update([b], pg_loss, lambda mb: engine.policy_outputs(mb, 1.0, False))
    assert all(torch.equal(p, frozen[n]) for n, p in engine.model.named_parameters() if n in frozen)
    assert (engine.log_probs(b)["log_probs"] - before).abs().max() > 1e-2  # the adapters moved the policy
    n_adapter = sum(p.numel() for n, p in engine.model.named_parameters() if p.requires_grad)
    # Adam's two float32 moments and a step count per tensor, of the adapters alone
    assert engine.optimizer_state_bytes() == 2 * 4 * n_adapter + 4 * len(trainable)


def test_merged_weights_score_as_the_adapted_model():
    """What generation copies, exports and rollout replicas load: a plain model with W + (alpha/r) B A."""
    _, engine = adapted()
    b = long_tailed(seed=2)
    for _ in range(3):
        engine.update([b], pg_loss, lambda mb: engine.policy_outputs(mb, 1.0, False))
    merged = engine.full_state_dict()
    assert not any("lora" in k for k in merged)
    plain = build_model(CFG, "lm")
    plain.load_state_dict(merged)  # strict: exactly a plain model's keys
    expected = engine.log_probs(b)["log_probs"]
    torch.testing.assert_close(
        TrainEngine(plain, None, trainable=False).log_probs(b)["log_probs"], expected, atol=1e-5, rtol=1e-5
    )
    # the merge is W + scale * B @ A, per adapted layer
    state = {k: v.detach() for k, v in engine.model.state_dict().items()}
    q = "model.layers.0.self_attn.q_proj."
    torch.testing.assert_close(
        merged_state_dict(state, 2.0)[q + "weight"],
        state[q + "weight"] + 2.0 * state[q + "lora_B"] @ state[q + "lora_A"],
    )


def test_a_critic_trains_its_head_and_adapters():
    _, engine = adapted("value")
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable and all(n.startswith("score.") or "lora" in n for n in trainable)
    b = long_tailed()
    first = engine.update([b], squared_value_loss, engine.value_outputs)["vf_loss"]
    for _ in range(5):
        last = engine.update([b], squared_value_loss, engine.value_outputs)["vf_loss"]
    assert last < first


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_fsdp2_and_zero1_adapters_train_as_on_one_process(controller4, tmp_path, zero_stage):
    """dp=2, sharded (FSDP2) or as replicas (ZeRO-1): the same updates and the same merged weights as dp=1."""
    b = long_tailed(n=16, seed=3)
    spec = UpdateSpec(mini_batch_samples=8, epochs=2, shuffle_seed=1)
    optim = OptimConfig(lr=1e-2, lora_rank=4, lora_alpha=8.0, zero_stage=zero_stage)
    merged, stats = {}, {}
    for dp in (1, 2):
        g = fa.ActorGroup(
            controller4,
            ActorWorker,
            name=f"lora_dp{dp}_z{zero_stage}",
            slots=controller4.slots[:dp],
            layout=Layout(dp=dp),
            args=(CFG, optim),
        )
        try:
            g.update_actor(b, pg_loss, spec).result()
            stats[dp] = g.memory_stats().result()
            path = g.export_hf(str(tmp_path / f"dp{dp}")).result()
            merged[dp] = build_model(ModelConfig(path=path), "lm").state_dict()
        finally:
            g.close()
    base = build_model(CFG, "lm").state_dict()
    assert any(not torch.allclose(merged[1][k], base[k]) for k in base)  # the export carries the adapters' change
    for k in merged[1]:
        torch.testing.assert_close(merged[2][k], merged[1][k], atol=2e-6, rtol=1e-5, msg=k)
    # memory_stats: FSDP2 splits the parameters over the ranks, ZeRO-1 keeps them whole; both split Adam's state
    one, two = stats[1][0], stats[2]
    assert one["optimizer_bytes"] > 0 and one["device_peak_bytes"] == 0  # no CUDA here
    assert sum(r["optimizer_bytes"] for r in two) == pytest.approx(one["optimizer_bytes"], rel=0.05)
    shard = sum(r["param_bytes"] for r in two) if zero_stage == 3 else two[0]["param_bytes"]
    assert shard == pytest.approx(one["param_bytes"], rel=0.02)


def test_the_export_carries_adapters_peft_loads_onto_the_base_as_the_merged_model(controller4, tmp_path):
    """An FSDP2 actor trained with LoRA exports its merged model and, in `adapter/`, its adapters in PEFT's format:
    `peft.PeftModel.from_pretrained(base, adapter)` gives the merged model's logits, and the folder holds the
    adapters only."""
    peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")
    import json

    from safetensors.torch import load_file

    optim = OptimConfig(lr=1e-2, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, zero_stage=3)
    g = fa.ActorGroup(
        controller4, ActorWorker, name="lora_peft", slots=controller4.slots[:2], layout=Layout(dp=2), args=(CFG, optim)
    )
    try:
        g.update_actor(long_tailed(n=16, seed=5), pg_loss, UpdateSpec(mini_batch_samples=8, epochs=2)).result()
        path = g.export_hf(str(tmp_path / "export")).result()
    finally:
        g.close()
    adapter = tmp_path / "export" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    reference = build_model(CFG, "lm")
    apply_lora(reference, optim.lora)
    want = {n for n, _ in reference.named_parameters() if "lora_" in n}
    assert len(tensors) == len(want) and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in tensors)
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained, not the zero init

    merged = build_model(ModelConfig(path=path), "lm").eval()
    loaded = peft.PeftModel.from_pretrained(build_model(CFG, "lm"), str(adapter)).eval()  # the same base
    ids = long_tailed(n=4, seed=6)["input_ids"]
    with torch.no_grad():
        base_logits = build_model(CFG, "lm").eval()(ids).logits
        want_logits, got_logits = merged(ids).logits, loaded(ids).logits
    assert (want_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)


def test_checkpoint_holds_the_adapters_and_resumes_exactly_on_the_reference_base(controller4, tmp_path):
    """A LoRA actor adapted from a fine-tuned model (here: one the reference loads): its checkpoint holds only the
    adapters and their optimizer state; a fresh actor built from the *untrained* config loads its base from the
    reference's checkpoint and its adapters from its own, and then trains exactly as the uninterrupted one."""
    from torch.distributed.checkpoint import FileSystemReader

    from engines import build_tokenizer, save_pretrained

    tuned = build_model(CFG, "lm")
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the fine-tuned base differs from the config's initial model
    save_pretrained(tuned, build_tokenizer(CFG), tmp_path / "sft")
    sft = ModelConfig(path=str(tmp_path / "sft"))
    b, spec = long_tailed(n=8, seed=4), UpdateSpec(mini_batch_samples=8, epochs=1, shuffle_seed=0)
    slots = controller4.slots[:2]
    ref = fa.ActorGroup(controller4, RefWorker, name="lora_ref", slots=slots, layout=Layout(dp=2), args=(sft,))
    actor = fa.ActorGroup(
        controller4, ActorWorker, name="lora_actor", slots=slots, layout=Layout(dp=2), args=(sft, LORA)
    )
    try:
        actor.update_actor(b, pg_loss, spec).result()
        actor.save_checkpoint(str(tmp_path / "ck" / "actor")).result()
        ref.save_checkpoint(str(tmp_path / "ck" / "ref")).result()
        actor.update_actor(b, pg_loss, spec).result()
        expected = actor.compute_log_prob(b).result()["old_log_probs"]
    finally:
        actor.close()
    keys = FileSystemReader(str(tmp_path / "ck" / "actor")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(k.endswith((".lora_A", ".lora_B")) for k in weights)
    assert any(k.startswith("optim.state.") and "lora" in k for k in keys)
    fresh = fa.ActorGroup(
        controller4, ActorWorker, name="lora_fresh", slots=slots, layout=Layout(dp=2), args=(CFG, LORA)
    )  # the config's random base, until the reference's is loaded
    try:
        fresh.load_checkpoint(str(tmp_path / "ck" / "actor"), str(tmp_path / "ck" / "ref")).result()
        fresh.update_actor(b, pg_loss, spec).result()
        torch.testing.assert_close(fresh.compute_log_prob(b).result()["old_log_probs"], expected, atol=0, rtol=0)
    finally:
        fresh.close()
        ref.close()


def test_impossible_lora_combinations_are_refused():
    from algorithms.run.config import ConfigError, PPOConfig, RLConfig, apply_overrides
    from algorithms.run.plan import check_settings

    def settings(cls, *overrides):
        return check_settings(apply_overrides(cls(), list(overrides)))

    with pytest.raises(ConfigError, match="lora_rank=8 runs on the torch engine"):
        settings(RLConfig, "lora_rank=8", "model.engine=megatron")
    with pytest.raises(ConfigError, match="3D-HybridEngine .*rollout_tp=2.* is not built"):
        settings(RLConfig, "lora_rank=8", "rollout_tp=2")
    with pytest.raises(ConfigError, match="critic: .*lora_rank=8 .*trainable_layers=1 cannot go with it"):
        settings(PPOConfig, "lora_rank=8", "critic_trainable_layers=1")
    with pytest.raises(ConfigError, match="actor: .*lora_dropout in"):
        settings(RLConfig, "lora_rank=8", "lora_dropout=1.5")
    with pytest.raises(ValueError, match="matches no linear layer.*its linear layers: .*q_proj"):
        apply_lora(build_model(CFG, "lm"), LoraConfig(rank=2, target_modules=("c_attn",)))


def test_lora_on_tensor_parallel_ranks_is_refused_before_the_model_trains(controller4):
    with pytest.raises(fa.RemoteError, match="lora_rank=4 runs on tp = 1"):
        g = fa.ActorGroup(
            controller4,
            CriticWorker,
            name="lora_tp",
            slots=controller4.slots[:2],
            layout=Layout(tp=2),
            args=(CFG, LORA),
        )
        g.close()
