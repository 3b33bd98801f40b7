"""The actor role on the megatron engine (TP=2, PP=2) inside a real 2-slot flowactors group, against the torch
engine's actor on one slot: same log-probs, same greedy samples, same weights after one update."""

from __future__ import annotations

import pytest
import torch

import flowactors as fa
from engines.generation import SamplingConfig
from engines.models import ModelConfig, build_tokenizer
from engines.training import OptimConfig
from tests.engines.probes import HybridActorProbe, pg_loss

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]' pulls it)")

from tests.engines.megatron_probes import ShimmedActor  # noqa: E402

CFG = dict(num_heads=4, num_kv_heads=2, pad_vocab_to=2, seed=7)
SAMPLING = SamplingConfig(max_new_tokens=5)
OPTIM = OptimConfig(lr=5e-3, eps=1e-4, grad_clip=0.0, micro_batch_tokens=32)  # eps: see tests/hybrid/test_actor.py


def _prompts(tok) -> fa.Batch:
    enc = tok(["sum 12:", "7", "sum 345:", "22+3="], padding=True, return_tensors="pt")
    return fa.Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, meta={"greedy": True})


@pytest.mark.parametrize("layout", [fa.Layout(tp=2), fa.Layout(pp=2)], ids=["tp2", "pp2"])
def test_megatron_actor_matches_torch_actor(fresh_controller, layout):
    ctl = fresh_controller
    tok = build_tokenizer(ModelConfig(**CFG))
    mega = fa.ActorGroup(ctl, ShimmedActor, name="mega", slots=ctl.slots, layout=layout,
                         args=(ModelConfig(engine="megatron", **CFG), OPTIM, SAMPLING))
    ref = fa.ActorGroup(ctl, HybridActorProbe, name="torch_ref", slots=ctl.slots[:1],
                        args=(ModelConfig(**CFG), OPTIM, SAMPLING))
    try:
        prompts = _prompts(tok)
        out_m = mega.generate_sequences(prompts).result()
        out_t = ref.generate_sequences(prompts).result()
        assert torch.equal(out_m["responses"], out_t["responses"])

        lp_m, lp_t = mega.compute_log_prob(out_t).result(), ref.compute_log_prob(out_t).result()
        mask = out_t["response_mask"].bool()
        torch.testing.assert_close(lp_m["old_log_probs"][mask], lp_t["old_log_probs"][mask], atol=1e-5, rtol=0)

        g = torch.Generator().manual_seed(1)
        batch = fa.Batch({**out_t.tensors, "advantages": torch.randn(out_t["responses"].shape, generator=g)},
                         meta={"mini_batch_samples": 4})
        m_m, m_t = mega.update_actor(batch, pg_loss).result(), ref.update_actor(batch, pg_loss).result()
        assert m_m["grad_norm"] == pytest.approx(m_t["grad_norm"], rel=1e-4)
        w_m, w_t = mega.full_weights().result()[0], ref.full_weights().result()[0]
        for k, v in w_t.items():
            torch.testing.assert_close(w_m[k], v, atol=2e-5, rtol=0, msg=k)
    finally:
        mega.close()
        ref.close()


def test_megatron_engine_refuses_what_it_cannot_do(fresh_controller):
    ctl = fresh_controller
    from engines.roles import CriticWorker

    with pytest.raises(fa.RemoteError, match="causal-LM heads only"):
        fa.ActorGroup(ctl, CriticWorker, name="mega_critic", slots=ctl.slots, layout=fa.Layout(tp=2),
                      args=(ModelConfig(engine="megatron", **CFG),))
    with pytest.raises(fa.RemoteError, match="spans the whole torch.distributed world"):
        fa.ActorGroup(ctl, ShimmedActor, name="mega_half", slots=ctl.slots[1:],
                      args=(ModelConfig(engine="megatron", **CFG),))
