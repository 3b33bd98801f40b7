"""The 3D-HybridEngine inside the actor: real 4-rank actor groups (gloo) against an unsharded reference model."""

from __future__ import annotations

import pytest
import torch

import flowactors as fa
from engines.hybrid import ModelGeometry
from engines.models.config import ModelConfig, build_model, build_tokenizer
from engines.roles import ActorWorker
from engines.rollout.hf import HFGenerationEngine
from engines.rollout.stream import SamplingConfig
from engines.specs import GenerationSpec, UpdateSpec
from engines.training.common import OptimConfig
from tests.engines.probes import HybridActorProbe, pg_loss

# 4 query and 4 key/value heads so TP 4 splits them; the vocabulary padded to a multiple of 4 for the
# vocab-parallel embedding and output head.
CFG = ModelConfig(num_heads=4, num_kv_heads=4, pad_vocab_to=4, seed=5)
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0)
# Adam's eps well above float noise: a first Adam step moves a weight by ~lr·g/(|g| + eps), so with the default 1e-8
# a gradient element of ~1e-9 (float noise of a different reduction order under TP) would move by up to lr.
OPTIM = OptimConfig(lr=5e-3, eps=1e-4, grad_clip=0.0, micro_batch_tokens=64)
# (dp, tp, t_g): micro-DP 2 with t_g = 1; micro-DP 2 with t_g = 2; t_g = t (no exchange at all)
LAYOUTS = [(2, 2, 1), (1, 4, 2), (2, 2, 2)]
SAMPLED, GREEDY = GenerationSpec(seed=11), GenerationSpec(greedy=True, seed=11)


def _prompts(tok, seeded: bool) -> fa.Batch:
    """8 prompts; `seeded` gives each row its own seed (samples independent of the DP split), otherwise rows draw
    from the batch seed and their index (the micro-DP split must then pass its row offset)."""
    enc = tok([f"sum {i * 7 + 3}:" for i in range(6)] + ["1", "22+3="], padding=True, return_tensors="pt")
    tensors = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}
    if seeded:
        tensors["seed"] = torch.arange(8) * 13 + 100
    return fa.Batch(tensors)


def _reference(tok, prompts: fa.Batch, spec: GenerationSpec, state: dict | None = None) -> fa.Batch:
    model = build_model(CFG, "lm", tok)
    if state is not None:
        model.load_state_dict(state)
    engine = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id)
    return engine.generate(model, prompts, SAMPLING, greedy=spec.greedy, seed=spec.seed)


def _group(controller, name: str, dp: int, tp: int, t_g: int) -> fa.ActorGroup:
    return fa.ActorGroup(
        controller,
        HybridActorProbe,
        name=name,
        slots=controller.slots[: dp * tp],
        layout=fa.Layout(dp=dp, tp=tp),
        args=(CFG, OPTIM, SAMPLING),
        kwargs={"rollout_tp": t_g},
    )


@pytest.mark.parametrize("dp,tp,t_g", LAYOUTS)
def test_generation_shards_bytes_and_memory(controller4, dp, tp, t_g):
    actor = _group(controller4, f"hy_report_{dp}{tp}{t_g}", dp, tp, t_g)
    try:
        reports = actor.reshard_report().result()
    finally:
        actor.close()
    tok = build_tokenizer(CFG)
    geometry = ModelGeometry.from_hf_config(build_model(CFG, "lm", tok).config)
    sharded_bytes = 4 * (geometry.numel - geometry.replicated_numel)
    for rank, rep in enumerate(reports):
        assert rep["names_match"] and rep["max_err"] == 0.0, rep
        # HybridFlow Table 2, micro-DP row, p = p_g = 1: (t − t_g)/(t_g·t) of the sharded model
        assert rep["received"] == rep["expected_received"] == sharded_bytes * (tp - t_g) // (t_g * tp), rep
        assert rep["redundant"] == 0
        assert rep["gen_param_bytes"] == sharded_bytes // t_g + 4 * geometry.replicated_numel
        assert rep["training_params_in_buffer"]
        assert rep["bound_to_training_memory"] > 0  # norms, and every tensor when t_g = t, are training memory
        # the generation model computes on the pieces where they lie: beyond training memory it holds exactly the
        # bytes it received, no merged copy
        assert rep["extra_generation_bytes"] == rep["received"]
    assert len({rep["gen_coord"] for rep in reports}) == dp * tp  # every rank its own generation coordinate


@pytest.mark.parametrize("dp,tp,t_g", LAYOUTS[:2])
def test_train_generate_cycle_serves_updated_weights(controller4, dp, tp, t_g):
    """Sampled and greedy rows equal the unsharded model's; after an update the hybrid weights equal an unsharded
    actor's after the same update, and the next generation samples from them."""
    tok = build_tokenizer(CFG)
    hybrid = _group(controller4, f"hy_cycle_{dp}{tp}{t_g}", dp, tp, t_g)
    plain = fa.ActorGroup(
        controller4,
        HybridActorProbe,
        name=f"hy_plain_{dp}{tp}{t_g}",
        slots=controller4.slots[:1],
        args=(CFG, OPTIM, SAMPLING),
    )  # no rollout_tp: unsharded
    try:
        sampled = _prompts(tok, seeded=dp > 1)
        first = hybrid.generate_sequences(sampled, SAMPLED).result()
        ref = _reference(tok, sampled, SAMPLED)
        assert torch.equal(first["responses"], ref["responses"])
        torch.testing.assert_close(first["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)

        g = torch.Generator().manual_seed(0)
        batch = fa.Batch({**first.tensors, "advantages": torch.randn(first["responses"].shape, generator=g)})
        m_h = hybrid.update_actor(batch, pg_loss, UpdateSpec(mini_batch_samples=4)).result()
        m_p = plain.update_actor(batch, pg_loss, UpdateSpec(mini_batch_samples=4)).result()
        assert m_h["grad_norm"] == pytest.approx(m_p["grad_norm"], rel=1e-4)
        w_h, w_p = hybrid.full_weights().result()[0], plain.full_weights().result()[0]
        moved = max(float((w_p[k] - v).abs().max()) for k, v in ActorWorker_initial(tok).items())
        assert moved > 1e-3  # the update changed the weights, so the comparison below means something
        for k in w_p:
            torch.testing.assert_close(w_h[k], w_p[k], atol=2e-5, rtol=0, msg=k)

        greedy = _prompts(tok, seeded=dp > 1)
        second = hybrid.generate_sequences(greedy, GREEDY).result()
        assert torch.equal(second["responses"], _reference(tok, greedy, GREEDY, w_h)["responses"])
        old = _reference(tok, greedy, GREEDY)
        assert not torch.equal(second["responses"], old["responses"])  # not the old weights
        after = hybrid.reshard_report().result()
        assert all(rep["max_err"] == 0.0 for rep in after)
    finally:
        hybrid.close()
        plain.close()


def ActorWorker_initial(tok) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in build_model(CFG, "lm", tok).state_dict().items()}


def test_bad_rollout_tp_fails_before_any_collective(controller4):
    # an impossible generation layout is refused on the controller, before any rank starts
    with pytest.raises(ValueError, match="gen_tp=3 must divide train_tp=2"):
        _group(controller4, "hy_bad_tp", 2, 2, 3)
    assert "hy_bad_tp" not in controller4.groups
    # a model the layout cannot cut is refused by every rank before its first collective
    odd_vocab = ModelConfig(num_heads=4, num_kv_heads=4)  # 51 characters: not divisible by tp 2
    with pytest.raises(fa.RemoteError, match="pad the vocabulary"):
        fa.ActorGroup(
            controller4,
            ActorWorker,
            name="hy_bad_vocab",
            slots=controller4.slots[:2],
            layout=fa.Layout(dp=1, tp=2),
            args=(odd_vocab,),
            kwargs={"rollout_tp": 1},
        )
    # the slots are still usable: a valid group forms on them afterwards
    ok = _group(controller4, "hy_after_bad", 1, 2, 1)
    ok.close()


def test_hybrid_actor_checkpoint_round_trip_and_reshard_on_load(controller4, tmp_path):
    """DCP save of a hybrid TP=2×DP=2 actor, an update, then load: the saved weights come back into the flat
    buffer (parameters still its views, generation serves them); the same checkpoint loads into an unsharded actor."""
    tok = build_tokenizer(CFG)
    hybrid = _group(controller4, "hy_ckpt", 2, 2, 1)
    plain = fa.ActorGroup(
        controller4, HybridActorProbe, name="hy_ckpt_plain", slots=controller4.slots[:1], args=(CFG, OPTIM, SAMPLING)
    )
    try:
        greedy = _prompts(tok, seeded=True)
        first = hybrid.generate_sequences(greedy, GREEDY).result()
        saved = hybrid.full_weights().result()[0]
        hybrid.save_checkpoint(str(tmp_path / "ckpt")).result()
        g = torch.Generator().manual_seed(2)
        batch = fa.Batch({**first.tensors, "advantages": torch.randn(first["responses"].shape, generator=g)})
        hybrid.update_actor(batch, pg_loss, UpdateSpec(mini_batch_samples=8)).result()
        assert any(not torch.equal(v, saved[k]) for k, v in hybrid.full_weights().result()[0].items())
        hybrid.load_checkpoint(str(tmp_path / "ckpt")).result()
        for k, v in hybrid.full_weights().result()[0].items():
            assert torch.equal(v, saved[k]), k
        assert all(
            rep["training_params_in_buffer"] and rep["max_err"] == 0.0 for rep in hybrid.reshard_report().result()
        )
        assert torch.equal(hybrid.generate_sequences(greedy, GREEDY).result()["responses"], first["responses"])
        plain.load_checkpoint(str(tmp_path / "ckpt")).result()
        for k, v in plain.full_weights().result()[0].items():
            assert torch.equal(v, saved[k]), k
    finally:
        hybrid.close()
        plain.close()


def _pg_batch(rows: fa.Batch, seed: int) -> fa.Batch:
    g = torch.Generator().manual_seed(seed)
    return fa.Batch({**rows.tensors, "advantages": torch.randn(rows["responses"].shape, generator=g)})


def test_zero1_optimizer_state_sharded_over_dp_and_checkpoints_load_under_any_dp(controller4, tmp_path):
    """The hybrid actor's DP replicas split the Adam state (ZeRO-1): each of a TP=2×DP=2 actor's ranks holds about
    half of its replica's, the two halves add up to it, and the updates stay the unsharded actor's. Its checkpoint
    is in the unsharded optimizer's format: an unsharded actor resumes from it, and a DP=2 actor resumes from the
    unsharded actor's, with the same next update as the uninterrupted run."""
    tok = build_tokenizer(CFG)
    hybrid = _group(controller4, "hy_zero", 2, 2, 1)
    plain = fa.ActorGroup(
        controller4, HybridActorProbe, name="hy_zero_plain", slots=controller4.slots[:1], args=(CFG, OPTIM, SAMPLING)
    )
    resumed = _group(controller4, "hy_zero_resumed", 2, 2, 1)
    spec = UpdateSpec(mini_batch_samples=4)
    try:
        rows = hybrid.generate_sequences(_prompts(tok, seeded=True), SAMPLED).result()
        first, second = _pg_batch(rows, 3), _pg_batch(rows, 4)
        m_h = hybrid.update_actor(first, pg_loss, spec).result()
        m_p = plain.update_actor(first, pg_loss, spec).result()
        assert m_h["grad_norm"] == pytest.approx(m_p["grad_norm"], rel=1e-4)  # the norm summed over the owners

        reports = hybrid.optimizer_report().result()
        whole = plain.optimizer_report().result()[0]
        assert whole["state_bytes"] == whole["replica_bytes"] and whole["owners"] is None
        for tp_rank in range(2):  # ranks of one TP coordinate across DP: rank = dp·2 + tp
            halves = [reports[d * 2 + tp_rank] for d in range(2)]
            assert sum(r["state_bytes"] for r in halves) == halves[0]["replica_bytes"]
            for r in halves:
                assert 0 < r["state_bytes"] <= 0.6 * r["replica_bytes"], r
        assert {reports[0]["owners"][n] for n in reports[0]["owners"]} == {0, 1}

        hybrid.save_checkpoint(str(tmp_path / "zero")).result()
        hybrid.update_actor(second, pg_loss, spec).result()
        want = hybrid.full_weights().result()[0]

        plain.load_checkpoint(str(tmp_path / "zero")).result()  # DP=2 ZeRO-1 → one unsharded replica
        plain.save_checkpoint(str(tmp_path / "whole")).result()
        plain.update_actor(second, pg_loss, spec).result()
        for k, v in plain.full_weights().result()[0].items():
            torch.testing.assert_close(v, want[k], atol=2e-5, rtol=0, msg=k)

        resumed.load_checkpoint(str(tmp_path / "whole")).result()  # unsharded → DP=2 ZeRO-1
        resumed.update_actor(second, pg_loss, spec).result()
        moved = 0.0
        for k, v in resumed.full_weights().result()[0].items():
            assert torch.equal(v, want[k]), k  # the same state on the same layout: bit-exact
        for k, v in ActorWorker_initial(tok).items():
            moved = max(moved, float((want[k] - v).abs().max()))
        assert moved > 1e-3
    finally:
        for g in (hybrid, plain, resumed):
            g.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_zero_stage_1_actor_keeps_replicas_without_the_hybrid_engine(controller4, tmp_path, tp):
    """OptimConfig(zero_stage=1) without rollout_tp: a DP=2 actor keeps a whole replica (its TP shard when tp = 2)
    on each rank, samples what the unsharded model samples, updates as the unsharded actor does with the Adam state
    split over DP, and its checkpoint resumes an unsharded actor to the same next update."""
    from dataclasses import replace

    tok = build_tokenizer(CFG)
    zero1 = fa.ActorGroup(
        controller4,
        HybridActorProbe,
        name=f"z1_actor_{tp}",
        slots=controller4.slots[: 2 * tp],
        layout=fa.Layout(dp=2, tp=tp),
        args=(CFG, replace(OPTIM, zero_stage=1), SAMPLING),
    )
    plain = fa.ActorGroup(
        controller4, HybridActorProbe, name=f"z1_plain_{tp}", slots=controller4.slots[:1], args=(CFG, OPTIM, SAMPLING)
    )
    spec = UpdateSpec(mini_batch_samples=4)
    try:
        prompts = _prompts(tok, seeded=True)
        rows = zero1.generate_sequences(prompts, SAMPLED).result()
        assert torch.equal(rows["responses"], _reference(tok, prompts, SAMPLED)["responses"])
        first, second = _pg_batch(rows, 3), _pg_batch(rows, 4)
        m_z = zero1.update_actor(first, pg_loss, spec).result()
        m_p = plain.update_actor(first, pg_loss, spec).result()
        assert m_z["grad_norm"] == pytest.approx(m_p["grad_norm"], rel=1e-4)
        reports = zero1.optimizer_report().result()
        for tp_rank in range(tp):  # the two DP ranks of a TP coordinate split its Adam state
            halves = [reports[d * tp + tp_rank] for d in range(2)]
            assert sum(r["state_bytes"] for r in halves) == halves[0]["replica_bytes"]
            assert all(0 < r["state_bytes"] < r["replica_bytes"] for r in halves)
        w_z, w_p = zero1.full_weights().result()[0], plain.full_weights().result()[0]
        for k, v in ActorWorker_initial(tok).items():
            assert float((w_p[k] - v).abs().max()) > 0 or k.endswith("norm.weight"), k  # it moved
            torch.testing.assert_close(w_z[k], w_p[k], atol=2e-5, rtol=0, msg=k)

        zero1.save_checkpoint(str(tmp_path / "z1")).result()
        zero1.update_actor(second, pg_loss, spec).result()
        want = zero1.full_weights().result()[0]
        plain.load_checkpoint(str(tmp_path / "z1")).result()
        plain.update_actor(second, pg_loss, spec).result()
        for k, v in plain.full_weights().result()[0].items():
            torch.testing.assert_close(v, want[k], atol=2e-5, rtol=0, msg=k)
    finally:
        zero1.close()
        plain.close()


def test_qwen2_biases_through_the_generation_pieces(controller4, tmp_path):
    """Qwen2's q/k/v biases are column-split with their weights: greedy tokens and rollout log-probs of a TP=4
    actor generating at t_g=2 equal the unsharded Qwen2 model's (biases made non-zero, loaded from a folder)."""
    from engines.models.config import save_pretrained

    built = ModelConfig(arch="qwen2", num_heads=4, num_kv_heads=4, pad_vocab_to=4, seed=9)
    tok = build_tokenizer(built)
    model = build_model(built, "lm", tok)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    save_pretrained(model, tok, tmp_path / "qwen2")
    cfg = ModelConfig(path=str(tmp_path / "qwen2"))
    actor = fa.ActorGroup(
        controller4,
        HybridActorProbe,
        name="hy_qwen2",
        slots=controller4.slots[:4],
        layout=fa.Layout(tp=4),
        args=(cfg, OPTIM, SAMPLING),
        kwargs={"rollout_tp": 2},
    )
    try:
        prompts = _prompts(tok, seeded=False)
        out = actor.generate_sequences(prompts, GREEDY).result()
    finally:
        actor.close()
    ref = HFGenerationEngine(tok.eos_token_id, tok.pad_token_id).generate(
        model, prompts, SAMPLING, greedy=GREEDY.greedy, seed=GREEDY.seed
    )
    assert torch.equal(out["responses"], ref["responses"])
    torch.testing.assert_close(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-5, rtol=0)
