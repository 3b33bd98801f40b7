"""Sequence packing: packed forward and backward passes equal the padded ones (log-probs, entropy, values, scores
and gradients), on one process and through sharded groups; what cannot pack is refused."""

import copy

import pytest
import torch

import flowactors as fa
from engines import ActorWorker, CriticWorker, ModelConfig, SamplingConfig, build_model, build_tokenizer
from engines.training.common import OptimConfig
from engines.training.packing import check_packable, pack, packed_micro_batches
from engines.training.torch_native import TrainEngine
from flowactors import Batch, Layout
from tests.engines.probes import pg_loss, squared_value_loss

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5)
PAD = 0


def long_tailed(n: int = 16, prompt: int = 8, resp: int = 24, seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses, most short, a few as long as the batch allows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (n, prompt + resp), generator=g)
    mask = torch.ones_like(ids)
    p_len = torch.randint(1, prompt + 1, (n,), generator=g)
    r_len = (torch.distributions.Exponential(0.25).sample((n,)).long() + 1).clamp(max=resp)
    r_len[0] = resp  # one full-length row sets the width
    for i in range(n):
        mask[i, : prompt - p_len[i]] = 0
        mask[i, prompt + r_len[i] :] = 0
    ids = ids * mask  # pad id 0 where masked
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].clone(),
            "advantages": torch.randn(n, resp, generator=g),
            "returns": torch.randn(n, resp, generator=g),
            "scores_target": torch.randn(n, generator=g),
        }
    )


def engines(head: str, budget: int = 96) -> tuple[TrainEngine, TrainEngine]:
    tok = build_tokenizer(CFG)
    model = build_model(CFG, head, tok)
    if head != "lm":
        torch.nn.init.normal_(model.score.weight, std=0.5)  # a head that reads something
    optim = OptimConfig(lr=1e-3, micro_batch_tokens=budget, grad_clip=0.0)
    padded = TrainEngine(model, optim)
    packed = TrainEngine(copy.deepcopy(model), optim, pack_sequences=True, pad_token_id=tok.pad_token_id)
    return padded, packed


def test_pack_lays_each_row_end_to_end_with_its_own_positions():
    b = long_tailed()
    p = pack(b, PAD)
    mask = b["attention_mask"].bool()
    bins, width = p.input_ids.shape
    assert width == b["input_ids"].shape[1] and bins < len(b) / 2  # short rows share bins
    flat_ids, flat_pos = p.input_ids.reshape(-1), p.position_ids.reshape(-1)
    for r in range(len(b)):
        n = int(mask[r].sum())
        start = int(p.last_index[r]) - n + 1  # every row here ends on a non-pad token
        assert torch.equal(flat_ids[start : start + n], b["input_ids"][r][mask[r]])
        assert flat_pos[start : start + n].tolist() == list(range(n))
        assert start // width == (start + n - 1) // width  # a row never spans two bins
    assert int((p.input_ids != PAD).sum()) == int((b["input_ids"] != PAD).sum())


def test_packed_micro_batches_fill_the_budget_with_valid_tokens():
    b = long_tailed()
    lengths = b["attention_mask"].sum(-1)
    mbs = packed_micro_batches(b, 60)
    assert sum(len(m) for m in mbs) == len(b)
    assert all(int(m["attention_mask"].sum()) <= 60 or len(m) == 1 for m in mbs)
    assert len(mbs) < len(b) // (60 // b["input_ids"].shape[1])  # fewer passes than padded rows allow
    assert torch.equal(torch.cat([m["attention_mask"].sum(-1) for m in mbs]), lengths)


def test_packed_log_probs_entropy_values_and_scores_equal_padded():
    b = long_tailed()
    valid = b["response_mask"].bool()
    padded, packed = engines("lm")
    a, c = padded.log_probs(b, 0.7, with_entropy=True), packed.log_probs(b, 0.7, with_entropy=True)
    assert len(packed.micro_batches(b)) < len(padded.micro_batches(b))
    for key in ("log_probs", "entropy"):
        assert a[key].shape == c[key].shape
        torch.testing.assert_close(c[key][valid], a[key][valid], atol=1e-5, rtol=1e-5)
    padded, packed = engines("value")
    torch.testing.assert_close(packed.values(b)[valid], padded.values(b)[valid], atol=1e-5, rtol=1e-5)
    padded, packed = engines("score")
    s = padded.scores(b)
    assert s.std() > 0.1  # rows differ, so a score read at the wrong row or position would show
    torch.testing.assert_close(packed.scores(b), s, atol=1e-5, rtol=1e-5)


def _grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("head", ["lm", "value", "score"])
def test_packed_gradients_equal_padded(head):
    """One update over the same mini-batch: the accumulated gradient (clipping off) over every parameter."""
    b = long_tailed(seed=1)
    padded, packed = engines(head, budget=64)

    def loss(engine):
        if head == "lm":
            return pg_loss, lambda mb: engine.policy_outputs(mb, 1.0, False)
        if head == "value":
            return squared_value_loss, engine.value_outputs

        def score_loss(outputs, mb):
            err = (outputs["scores"] - mb["scores_target"]) ** 2
            return err.unsqueeze(1), torch.ones_like(err).unsqueeze(1), {}

        return score_loss, engine.score_outputs

    for engine in (padded, packed):
        engine.update([b], *loss(engine))
    ga, gc = _grads(padded), _grads(packed)
    assert ga.keys() == gc.keys() and len(ga) > 5
    for name in ga:
        torch.testing.assert_close(gc[name], ga[name], atol=2e-5, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in ga.values()) > 1e-3  # the gradients are not all zero


def test_packed_roles_on_sharded_groups_equal_padded(controller4):
    """The actor on the 3D-HybridEngine (tp=2, Megatron's layout) and an FSDP2 critic over dp=2, packed, score
    the actor's own samples as their padded twins do."""
    cfg = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5, pad_vocab_to=2)
    plain, packed = ModelConfig(**cfg), ModelConfig(**cfg, pack_sequences=True)
    tok = build_tokenizer(plain)
    enc = tok([f"sum {'7' * (i % 5)} {i}:" for i in range(8)], padding=True, return_tensors="pt")
    prompts = Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "seed": torch.arange(8)})
    out = {}
    for name, model in (("plain", plain), ("packed", packed)):
        actor = fa.ActorGroup(
            controller4,
            ActorWorker,
            name=f"pk_actor_{name}",
            slots=controller4.slots[:2],
            layout=Layout(tp=2),
            args=(model, None, SamplingConfig(max_new_tokens=12), 1),
        )
        critic = fa.ActorGroup(
            controller4,
            CriticWorker,
            name=f"pk_critic_{name}",
            slots=controller4.slots[2:],
            layout=Layout(dp=2),
            args=(model,),
        )
        try:
            samples = actor.generate_sequences(prompts).result()
            out[name] = (samples, actor.compute_log_prob(samples).result(), critic.compute_values(samples).result())
        finally:
            actor.close()
            critic.close()
    (s0, lp0, v0), (s1, lp1, v1) = out["plain"], out["packed"]
    assert torch.equal(s0["responses"], s1["responses"])
    valid = s0["response_mask"].bool()
    assert valid.sum(-1).min() < valid.sum(-1).max()  # lengths differ, so there is padding to drop
    torch.testing.assert_close(lp1["old_log_probs"][valid], lp0["old_log_probs"][valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v1["values"][valid], v0["values"][valid], atol=1e-5, rtol=1e-5)


def test_models_that_cannot_pack_are_refused():
    class NoMask(torch.nn.Module):  # a decoder that builds no block-diagonal mask from position ids
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return input_ids

    with pytest.raises(ValueError, match="cannot take packed rows.*pack_sequences=false"):
        check_packable(NoMask())
    model = build_model(CFG, "lm")
    check_packable(model)  # Llama (and Qwen2) build their masks in create_causal_mask
    model.config._attn_implementation = "paged_attention"
    with pytest.raises(ValueError, match="attention implementation 'paged_attention'"):
        check_packable(model)


def test_pack_sequences_on_megatron_is_refused_before_start():
    from algorithms.run.config import ConfigError, RLConfig, apply_overrides
    from algorithms.run.plan import check_settings

    with pytest.raises(ConfigError, match="pack_sequences=true runs on the torch engine"):
        check_settings(apply_overrides(RLConfig(), ["pack_sequences=true", "model.engine=megatron"]))
    assert apply_overrides(RLConfig(), ["pack_sequences=true"]).model.pack_sequences
