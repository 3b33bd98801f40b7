"""The roles on the megatron engine (TP=2, PP=2) inside a real 2-slot flowactors group, against the torch engine's
roles on one slot: the actor (same log-probs, greedy samples and weights after one update), the critic (same values
and weights after one update) and the reward model (same scores); and megatron groups of different layouts and
sizes side by side in the same processes."""

from __future__ import annotations

import pytest
import torch

import flowactors as fa
from engines.models.config import ModelConfig, build_tokenizer
from engines.roles import RewardModelWorker
from engines.rollout.stream import SamplingConfig
from engines.specs import GenerationSpec, UpdateSpec
from engines.training.common import OptimConfig
from tests.engines.probes import HybridActorProbe, pg_loss

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]' pulls it)")

from tests.engines.megatron_probes import ShimmedActor, ShimmedCritic, ShimmedRewardModel, TorchCritic
from tests.engines.probes import squared_value_loss

CFG = dict(num_heads=4, num_kv_heads=2, pad_vocab_to=2, seed=7)
SAMPLING = SamplingConfig(max_new_tokens=5)
OPTIM = OptimConfig(lr=5e-3, eps=1e-4, grad_clip=0.0, micro_batch_tokens=32)  # eps: see tests/hybrid/test_actor.py


def _prompts(tok) -> fa.Batch:
    enc = tok(["sum 12:", "7", "sum 345:", "22+3="], padding=True, return_tensors="pt")
    return fa.Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})


@pytest.mark.parametrize("layout", [fa.Layout(tp=2), fa.Layout(pp=2)], ids=["tp2", "pp2"])
def test_megatron_actor_matches_torch_actor(fresh_controller, layout):
    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    mega = fa.ActorGroup(
        ctl,
        ShimmedActor,
        name="mega",
        slots=ctl.slots,
        layout=layout,
        args=(ModelConfig(engine="megatron", **CFG), OPTIM, SAMPLING),
    )
    ref = fa.ActorGroup(
        ctl, HybridActorProbe, name="torch_ref", slots=ctl.slots[:1], args=(ModelConfig(**CFG), OPTIM, SAMPLING)
    )
    try:
        assert all(mega.implements_training_engine().result())
        prompts = _prompts(tok)
        out_m = mega.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        out_t = ref.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        assert torch.equal(out_m["responses"], out_t["responses"])

        lp_m, lp_t = mega.compute_log_prob(out_t).result(), ref.compute_log_prob(out_t).result()
        mask = out_t["response_mask"].bool()
        torch.testing.assert_close(lp_m["old_log_probs"][mask], lp_t["old_log_probs"][mask], atol=1e-5, rtol=0)

        g = torch.Generator().manual_seed(1)
        batch = fa.Batch({**out_t.tensors, "advantages": torch.randn(out_t["responses"].shape, generator=g)})
        spec = UpdateSpec(mini_batch_samples=4)
        m_m, m_t = mega.update_actor(batch, pg_loss, spec).result(), ref.update_actor(batch, pg_loss, spec).result()
        assert m_m["grad_norm"] == pytest.approx(m_t["grad_norm"], rel=1e-4)
        w_m, w_t = mega.full_weights().result()[0], ref.full_weights().result()[0]
        for k, v in w_t.items():
            torch.testing.assert_close(w_m[k], v, atol=2e-5, rtol=0, msg=k)
    finally:
        mega.close()
        ref.close()


def _scored(tok) -> fa.Batch:
    """Left-padded prompts and responses, one right-padded with pad tokens, as the actor hands them on."""
    prompts = _prompts(tok)
    g = torch.Generator().manual_seed(3)
    responses = torch.randint(3, 40, (len(prompts), 4), generator=g)
    response_mask = torch.ones_like(responses)
    response_mask[1, -2:] = 0
    responses[response_mask == 0] = tok.pad_token_id
    return fa.Batch(
        {
            "input_ids": torch.cat([prompts["input_ids"], responses], 1),
            "attention_mask": torch.cat([prompts["attention_mask"], response_mask], 1),
            "responses": responses,
            "response_mask": response_mask,
            "returns": torch.randn(responses.shape, generator=g),
        }
    )


@pytest.mark.parametrize("layout", [fa.Layout(tp=2), fa.Layout(pp=2)], ids=["tp2", "pp2"])
def test_megatron_critic_and_reward_model_match_torch(fresh_controller, layout):
    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    batch = _scored(tok)
    mask = batch["response_mask"].bool()
    groups = {
        "mega_critic": fa.ActorGroup(
            ctl,
            ShimmedCritic,
            name="mega_critic",
            slots=ctl.slots,
            layout=layout,
            args=(ModelConfig(engine="megatron", **CFG), OPTIM),
        ),
        "torch_critic": fa.ActorGroup(
            ctl, TorchCritic, name="torch_critic", slots=ctl.slots[:1], args=(ModelConfig(**CFG), OPTIM)
        ),
    }
    try:
        v_m = groups["mega_critic"].compute_values(batch).result()
        v_t = groups["torch_critic"].compute_values(batch).result()
        torch.testing.assert_close(v_m["values"][mask], v_t["values"][mask], atol=1e-5, rtol=0)
        spec = UpdateSpec(mini_batch_samples=4)
        m_m = groups["mega_critic"].update_critic(batch, squared_value_loss, spec).result()
        m_t = groups["torch_critic"].update_critic(batch, squared_value_loss, spec).result()
        assert m_m["grad_norm"] == pytest.approx(m_t["grad_norm"], rel=1e-4)
        w_m, w_t = groups["mega_critic"].full_weights().result()[0], groups["torch_critic"].full_weights().result()[0]
        assert set(w_m) == set(w_t)
        for k, v in w_t.items():
            torch.testing.assert_close(w_m[k], v, atol=2e-5, rtol=0, msg=k)
        for g in groups.values():
            g.close()
        groups = {
            "mega_rm": fa.ActorGroup(
                ctl,
                ShimmedRewardModel,
                name="mega_rm",
                slots=ctl.slots,
                layout=layout,
                args=(ModelConfig(engine="megatron", **CFG),),
            ),
            "torch_rm": fa.ActorGroup(
                ctl, RewardModelWorker, name="torch_rm", slots=ctl.slots[:1], args=(ModelConfig(**CFG),)
            ),
        }
        r_m, r_t = groups["mega_rm"].compute_reward(batch).result(), groups["torch_rm"].compute_reward(batch).result()
        torch.testing.assert_close(r_m["rewards"], r_t["rewards"], atol=1e-5, rtol=0)
    finally:
        for g in groups.values():
            g.close()


def test_megatron_groups_on_any_slots_with_different_layouts_side_by_side(fresh_controller):
    """Three megatron models in the same two worker processes, each on its own process groups (megatron's global
    parallel state is never used): an actor with pp=2 over both slots, a critic with tp=2 over both, and a reward
    model and another critic on the second slot alone. Each equals the torch engine's role on one slot, and the actor
    and critic
    still do after one update each, interleaved on the same processes."""
    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    mega_cfg = ModelConfig(engine="megatron", **CFG)
    groups = {
        "actor": fa.ActorGroup(
            ctl, ShimmedActor, name="actor", slots=ctl.slots, layout=fa.Layout(pp=2), args=(mega_cfg, OPTIM, SAMPLING)
        ),
        "critic": fa.ActorGroup(
            ctl, ShimmedCritic, name="critic", slots=ctl.slots, layout=fa.Layout(tp=2), args=(mega_cfg, OPTIM)
        ),
        "rm": fa.ActorGroup(ctl, ShimmedRewardModel, name="rm", slots=ctl.slots[1:], args=(mega_cfg,)),
        # trainable on one slot: megatron's optimizer set-up must not wait for the idle rank 0 (see
        # engines.training.megatron.engine._default_group_is)
        "critic1": fa.ActorGroup(ctl, ShimmedCritic, name="critic1", slots=ctl.slots[1:], args=(mega_cfg, OPTIM)),
        "t_actor": fa.ActorGroup(
            ctl, HybridActorProbe, name="t_actor", slots=ctl.slots[:1], args=(ModelConfig(**CFG), OPTIM, SAMPLING)
        ),
        "t_critic": fa.ActorGroup(
            ctl, TorchCritic, name="t_critic", slots=ctl.slots[:1], args=(ModelConfig(**CFG), OPTIM)
        ),
        "t_rm": fa.ActorGroup(ctl, RewardModelWorker, name="t_rm", slots=ctl.slots[:1], args=(ModelConfig(**CFG),)),
    }
    try:
        batch = _scored(tok)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(
            groups["rm"].compute_reward(batch).result()["rewards"],
            groups["t_rm"].compute_reward(batch).result()["rewards"],
            atol=1e-5,
            rtol=0,
        )
        lp_m, lp_t = (
            groups["actor"].compute_log_prob(batch).result(),
            groups["t_actor"].compute_log_prob(batch).result(),
        )
        torch.testing.assert_close(lp_m["old_log_probs"][mask], lp_t["old_log_probs"][mask], atol=1e-5, rtol=0)
        v_m, v_t = groups["critic"].compute_values(batch).result(), groups["t_critic"].compute_values(batch).result()
        torch.testing.assert_close(v_m["values"][mask], v_t["values"][mask], atol=1e-5, rtol=0)
        v_1 = groups["critic1"].compute_values(batch).result()
        torch.testing.assert_close(v_1["values"][mask], v_t["values"][mask], atol=1e-5, rtol=0)

        g = torch.Generator().manual_seed(1)
        train = fa.Batch({**batch.tensors, "advantages": torch.randn(batch["responses"].shape, generator=g)})
        spec = UpdateSpec(mini_batch_samples=4)
        updates = {
            name: groups[name].update_actor(train, pg_loss, spec)
            if "actor" in name
            else groups[name].update_critic(train, squared_value_loss, spec)
            for name in ("actor", "critic", "t_actor", "t_critic")
        }
        for mine, ref in (("actor", "t_actor"), ("critic", "t_critic")):
            assert updates[mine].result()["grad_norm"] == pytest.approx(updates[ref].result()["grad_norm"], rel=1e-4)
            w_m, w_t = groups[mine].full_weights().result()[0], groups[ref].full_weights().result()[0]
            assert set(w_m) == set(w_t)
            for k, v in w_t.items():
                torch.testing.assert_close(w_m[k], v, atol=2e-5, rtol=0, msg=f"{mine}: {k}")
    finally:
        for g in groups.values():
            g.close()


@pytest.mark.parametrize(
    "layout,p_g", [(fa.Layout(tp=2), 1), (fa.Layout(pp=2), 1), (fa.Layout(pp=2), 2)], ids=["tp2", "pp2", "pp2-gen-pp2"]
)
def test_megatron_actor_generates_through_the_3d_hybrid_engine(fresh_controller, layout, p_g):
    """(p, t, d) = (1, 2, 1) or (2, 1, 1) → (p_g, t_g) = (1, 1): each rank gathers, inside its micro-DP group of
    2, the other rank's shard (Table 2: (t − t_g)/(t_g·t) of the model for TP, the other stage for PP) and
    generates half the rows; (2, 1, 1) → (2, 1): no exchange at all, each rank generates with its own stage's
    layers, both stages decoding every row in step. Greedy samples equal the torch actor's before and after one
    update (the shards are read again after it)."""
    from engines.hybrid.accounting import expected_received_bytes
    from engines.hybrid.layout import HybridLayout
    from engines.hybrid.shards import ModelGeometry
    from engines.models.config import build_model

    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    mega = fa.ActorGroup(
        ctl,
        ShimmedActor,
        name="mega_hy",
        slots=ctl.slots,
        layout=layout,
        args=(ModelConfig(engine="megatron", **CFG), OPTIM, SAMPLING, 1, "hf", p_g),
    )
    ref = fa.ActorGroup(
        ctl, HybridActorProbe, name="torch_hy", slots=ctl.slots[:1], args=(ModelConfig(**CFG), OPTIM, SAMPLING)
    )
    try:
        prompts = _prompts(tok)
        out_m = mega.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        out_t = ref.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        assert torch.equal(out_m["responses"], out_t["responses"])
        config = build_model(ModelConfig(**CFG), "lm", tok).config
        config.tie_word_embeddings = False
        geometry = ModelGeometry.from_hf_config(config)
        hl = HybridLayout(layout.pp, layout.tp, layout.dp, p_g, 1)
        stage_bytes = {}
        for rank, stats in enumerate(mega.reshard_stats().result()):
            assert stats["received_bytes"] == expected_received_bytes(geometry, hl, rank, "micro-dp", 4)
            assert stats["redundant_bytes"] == 0
            # beyond megatron's own buffers: the received pieces plus the copy of this rank's shard
            assert stats["extra_generation_bytes"] > stats["received_bytes"]
            stage_bytes[rank] = stats["extra_generation_bytes"] - stats["received_bytes"]  # the shard's copy
            if p_g == 2:  # each rank keeps its stage: nothing received, it generates from its own half
                assert stats["received_bytes"] == 0
                assert stats["gen_param_bytes"] == stage_bytes[rank]
        if p_g == 2:
            assert sum(stage_bytes.values()) == 4 * geometry.numel

        g = torch.Generator().manual_seed(1)
        batch = fa.Batch({**out_t.tensors, "advantages": torch.randn(out_t["responses"].shape, generator=g)})
        spec = UpdateSpec(mini_batch_samples=4)
        mega.update_actor(batch, pg_loss, spec).result(), ref.update_actor(batch, pg_loss, spec).result()
        again_m = mega.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        again_t = ref.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
        assert torch.equal(again_m["responses"], again_t["responses"])
        # the sampler's own log-probs follow the updated weights (stale shards would give the first ones)
        torch.testing.assert_close(again_m["rollout_log_probs"], again_t["rollout_log_probs"], atol=1e-5, rtol=0)
        assert not torch.allclose(again_t["rollout_log_probs"], out_t["rollout_log_probs"], atol=1e-4)
        lp_m, lp_t = mega.compute_log_prob(again_t).result(), ref.compute_log_prob(again_t).result()
        mask = again_t["response_mask"].bool()
        torch.testing.assert_close(lp_m["old_log_probs"][mask], lp_t["old_log_probs"][mask], atol=1e-5, rtol=0)
    finally:
        mega.close()
        ref.close()


def test_megatron_checkpoint_restores_an_update_exactly_and_loads_under_another_layout(fresh_controller, tmp_path):
    """Save a critic (pp=2) after one update, update it again; a fresh critic loaded from the save and updated the
    same way ends with the same weights, bit for bit. A tp=2 critic loaded from it (weights and Adam moments
    resharded by DCP in model space) ends there too, up to float rounding."""
    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    batch, spec = _scored(tok), UpdateSpec(mini_batch_samples=4)
    args = (ModelConfig(engine="megatron", **CFG), OPTIM)
    first = fa.ActorGroup(ctl, ShimmedCritic, name="first", slots=ctl.slots, layout=fa.Layout(pp=2), args=args)
    try:
        first.update_critic(batch, squared_value_loss, spec).result()
        saved = first.full_weights().result()[0]
        first.save_checkpoint(str(tmp_path)).result()
        after = first.update_critic(batch, squared_value_loss, spec).result()
        want = first.full_weights().result()[0]
    finally:
        first.close()
    assert any(not torch.equal(want[k], saved[k]) for k in want)  # the second update moved the weights
    for name, layout, exact in (("second", fa.Layout(pp=2), True), ("other", fa.Layout(tp=2), False)):
        group = fa.ActorGroup(ctl, ShimmedCritic, name=name, slots=ctl.slots, layout=layout, args=args)
        try:
            group.load_checkpoint(str(tmp_path)).result()
            loaded = group.full_weights().result()[0]
            again = group.update_critic(batch, squared_value_loss, spec).result()
            got = group.full_weights().result()[0]
        finally:
            group.close()
        assert set(got) == set(want)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), name  # weights move without rounding
        if exact:
            assert again == after and all(torch.equal(got[k], want[k]) for k in want)
        else:  # Adam moments and step came along: the update matches, not just the weights
            assert again["grad_norm"] == pytest.approx(after["grad_norm"], rel=1e-4)
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=0, msg=k)
