"""Sharded weight sync (engines.rollout.replica): every trainer rank sends only the blocks it holds, bucket by
bucket, over a link to the replica ranks; the replicas end with exactly the weights the whole-dict path (rank 0)
gives them, for every parameter, with FSDP2 and ZeRO-1 trainers and LoRA (whose later syncs move only the
adapters), and no rank holds more than two buckets of it at once."""

from __future__ import annotations

import pytest
import torch

import flowactors as fa
from engines import ActorWorker, ModelConfig, OptimConfig, UpdateSpec, build_model, build_tokenizer
from engines.rollout.replica import Piece, address, plan_sync, sync_subgroups
from engines.training.lora import apply_lora
from flowactors import Layout
from tests.engines.probes import pg_loss
from tests.engines.test_packing import long_tailed

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=7)
BUCKET = 8 << 10  # 8 KiB: the tiny model's 60-odd KiB travel in many buckets


def test_the_plan_puts_every_piece_in_one_bucket_in_order_and_aligned():
    pieces = [Piece(f"p{i}", s, (s * 4, 0), (4, 8), "float32") for i in range(5) for s in (0, 1)]  # 128 B each
    plan = plan_sync(pieces, [f"p{i}" for i in range(5)], bucket_bytes=300)
    placed = [piece for bucket in plan.buckets for per in bucket.values() for piece, _ in per]
    assert sorted(placed, key=str) == sorted(pieces, key=str)
    assert [len(b) for b in plan.buckets] == [2, 2, 2, 2, 2]  # 2 pieces (256 B) fit, a third would not
    for b, bucket in enumerate(plan.buckets):
        for key, per in bucket.items():
            offsets = [at for _, at in per]
            assert all(at % 16 == 0 for at in offsets) and offsets == sorted(offsets)
            assert plan.sizes(b)[key] >= per[-1][1] + per[-1][0].nbytes
    assert plan.total_bytes == 10 * 128
    one = plan_sync(pieces, [f"p{i}" for i in range(5)], bucket_bytes=1)  # every piece a bucket of its own
    assert len(one.buckets) == 10


def _groups(ctl: fa.Controller, name: str, optim: OptimConfig, seed_replica: int = 99):
    trainer = fa.ActorGroup(
        ctl, ActorWorker, name=f"{name}_trainer", slots=ctl.slots[:2], layout=Layout(dp=2), args=(CFG, optim)
    )
    replica_optim = OptimConfig(zero_stage=1, lora_rank=optim.lora_rank, lora_alpha=optim.lora_alpha)
    replica_model = ModelConfig(**{**CFG.__dict__, "seed": seed_replica})  # other weights until the sync
    replicas = fa.ActorGroup(
        ctl,
        ActorWorker,
        name=f"{name}_replicas",
        slots=ctl.slots[2:4],
        layout=Layout(dp=2),
        args=(replica_model, replica_optim),
    )
    return trainer, replicas


def _sync(ctl, trainer, replicas, link, version, changed_only=False):
    sent = trainer.send_policy(link, BUCKET, changed_only)
    got = replicas.receive_policy(link, BUCKET, version, changed_only)
    return sent.result(), got.result()


def _replica_state(replicas) -> dict[str, torch.Tensor]:
    return replicas.policy_weights().result()  # rank 0 of the replicas, merged where LoRA


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_sharded_sync_equals_the_whole_dict_sync(controller4, zero_stage):
    optim = OptimConfig(lr=1e-2, zero_stage=zero_stage)
    trainer, replicas = _groups(controller4, f"sync_z{zero_stage}", optim)
    try:
        trainer.update_actor(long_tailed(n=8, seed=1), pg_loss, UpdateSpec(mini_batch_samples=8)).result()
        want = trainer.policy_weights().result()
        before = _replica_state(replicas)
        assert any(not torch.equal(before[k], want[k]) for k in want)  # the replicas start elsewhere
        link = controller4.link(f"sync_z{zero_stage}", [trainer, replicas], sync_subgroups(2, Layout(dp=2)))
        sent, got = _sync(controller4, trainer, replicas, link, version=1)
        state = _replica_state(replicas)
        assert state.keys() == want.keys()
        for k in want:
            assert torch.equal(state[k], want[k]), k
        digests = replicas.parameter_digest().result()
        assert digests[0] == digests[1] == pytest.approx(trainer.parameter_digest().result()[0], abs=0)
        model_bytes = sum(p.numel() * p.element_size() for p in want.values())
        # each trainer rank sent its part only; each replica received the whole model once
        assert all(0 < s["bytes"] < 0.75 * model_bytes for s in sent)
        assert sum(s["bytes"] for s in sent) == got[0]["bytes"] == model_bytes
        assert [g["bytes"] for g in got] == [got[0]["bytes"]] * 2
        # no rank held more than two buckets (plus one block's alignment) at once
        assert all(r["peak_bucket_bytes"] <= 2 * BUCKET + 4096 for r in [*sent, *got])

        # the rank-0 path from the same trainer state gives the same replica weights
        replicas.load_policy(trainer.policy_weights(), 2).result()
        assert all(torch.equal(_replica_state(replicas)[k], state[k]) for k in state)
    finally:
        trainer.close()
        replicas.close()


def test_a_link_in_other_than_the_slots_order_is_refused(controller4):
    """torch.distributed numbers a process group's members in the world's order, so a link whose groups come in
    another order would give its members ranks other than the link's: refused, naming the fix."""
    trainer, replicas = _groups(controller4, "sync_order", OptimConfig(zero_stage=1))
    try:
        with pytest.raises(fa.PlacementError, match=r"must come in the order of the cluster's slots .* \[2, 3, 0, 1\]"):
            controller4.link("sync_reversed", [replicas, trainer], sync_subgroups(2, Layout(dp=2)))
    finally:
        trainer.close()
        replicas.close()


def test_lora_syncs_move_only_the_adapters_after_the_first(controller4):
    optim = OptimConfig(lr=1e-2, lora_rank=4, lora_alpha=8.0, zero_stage=3)
    trainer, replicas = _groups(controller4, "sync_lora", optim)
    try:
        link = controller4.link("sync_lora", [trainer, replicas], sync_subgroups(2, Layout(dp=2)))
        _, first = _sync(controller4, trainer, replicas, link, version=1)  # the base and the adapters
        for step in range(2):
            trainer.update_actor(long_tailed(n=8, seed=2 + step), pg_loss, UpdateSpec(mini_batch_samples=8)).result()
        sent, got = _sync(controller4, trainer, replicas, link, version=2, changed_only=True)
        want = trainer.policy_weights().result()  # merged: W + scale B A
        state = _replica_state(replicas)
        for k in want:
            torch.testing.assert_close(state[k], want[k], atol=0, rtol=0, msg=k)
        model = build_model(CFG, "lm")
        apply_lora(model, optim.lora)
        adapters = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n}
        assert got[0]["bytes"] == sum(adapters.values())  # exactly the adapters travel, not the model
        assert got[0]["bytes"] < 0.2 * first[0]["bytes"]
    finally:
        trainer.close()
        replicas.close()


def test_address_cuts_trainer_blocks_to_each_replica_ranks_tp_shard():
    # trainer: rows split over two ranks (FSDP2); replica: a TP-2 pair splitting columns, a whole-copy rank
    pieces = [Piece("w", s, (s * 4, 0), (4, 6), "float32") for s in (0, 1)]
    needs = {
        2: {"w": [((0, 0), (8, 3))]},  # TP rank 0: columns 0-2
        3: {"w": [((0, 3), (8, 3))]},  # TP rank 1: columns 3-5
        4: {"w": [((0, 0), (8, 6))]},  # a whole copy
    }
    cut = address(pieces, needs)
    plan = plan_sync(cut, ["w"], bucket_bytes=1 << 20)
    assert plan.bytes_to(2) == plan.bytes_to(3) == 8 * 3 * 4  # each TP rank: its half, nothing else
    assert plan.bytes_to(4) == 8 * 6 * 4
    for piece in cut:
        for rank in piece.dests:
            (o, s), (ro, rs) = (piece.offset, piece.shape), needs[rank]["w"][0]
            assert all(ro[d] <= o[d] and o[d] + s[d] <= ro[d] + rs[d] for d in range(2))  # inside its shard
    # one layout (every rank the same region): each trainer piece whole, to all at once
    same = address(pieces, {r: {"w": [((0, 0), (8, 6))]} for r in (2, 3)})
    assert sorted((p.source, p.shape, p.dests) for p in same) == [(0, (4, 6), (2, 3)), (1, (4, 6), (2, 3))]


@pytest.mark.parametrize("trainer_stage", [3, 1])
def test_a_replica_with_generation_tp_receives_only_its_shard(controller4, trainer_stage):
    """A replica of TP 2 (the 3D-HybridEngine with equal training and generation TP): after the sharded sync its
    weights are the trainer's, each of its ranks received its TP shard (about half the model, not all of it),
    and it samples what the trainer's own whole weights sample."""
    from engines import GenerationSpec, SamplingConfig

    optim = OptimConfig(lr=1e-2, zero_stage=trainer_stage)
    sampling = SamplingConfig(max_new_tokens=6)
    model = ModelConfig(**{**CFG.__dict__, "pad_vocab_to": 2})  # TP splits the vocabulary
    name = f"sync_tp_z{trainer_stage}"
    trainer = fa.ActorGroup(
        controller4,
        ActorWorker,
        name=f"{name}_trainer",
        slots=controller4.slots[:2],
        layout=Layout(dp=2),
        args=(model, optim, sampling),
    )
    replica_model = ModelConfig(**{**model.__dict__, "seed": 99})
    replicas = fa.ActorGroup(
        controller4,
        ActorWorker,
        name=f"{name}_replicas",
        slots=controller4.slots[2:4],
        layout=Layout(tp=2),
        args=(replica_model, OptimConfig(zero_stage=1), sampling, 2),
    )
    try:
        trainer.update_actor(long_tailed(n=8, seed=3), pg_loss, UpdateSpec(mini_batch_samples=8)).result()
        want = trainer.policy_weights().result()
        link = controller4.link(name, [trainer, replicas], sync_subgroups(2, replicas.layout))
        sent, got = _sync(controller4, trainer, replicas, link, version=1)
        state = replicas.policy_weights().result()  # gathered from the two TP shards
        assert state.keys() == want.keys()
        for k in want:
            assert torch.equal(state[k], want[k]), k
        model_bytes = sum(p.numel() * p.element_size() for p in want.values())
        split = sum(
            t.numel() * t.element_size() for k, t in want.items() if t.dim() == 2
        )  # the linear layers, embedding and head: split by TP; the norms travel whole to both
        for g in got:
            assert g["bytes"] == pytest.approx(model_bytes - split / 2, rel=0.02)
        assert sum(s["bytes"] for s in sent) == model_bytes  # every block leaves the trainer once
        assert all(r["peak_bucket_bytes"] <= 2 * BUCKET + 4096 for r in [*sent, *got])

        enc = build_tokenizer(model)([f"sum {i + 3}:" for i in range(4)], padding=True, return_tensors="pt")
        prompts = fa.Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
        greedy = GenerationSpec(greedy=True)
        mine, theirs = trainer.generate_sequences(prompts, greedy), replicas.generate_sequences(prompts, greedy)
        mine, theirs = mine.result(), theirs.result()
        assert torch.equal(mine["responses"], theirs["responses"])
        torch.testing.assert_close(mine["rollout_log_probs"], theirs["rollout_log_probs"], atol=1e-5, rtol=0)
        # a second sync after training moves the new weights into the same shards
        trainer.update_actor(long_tailed(n=8, seed=4), pg_loss, UpdateSpec(mini_batch_samples=8)).result()
        _sync(controller4, trainer, replicas, link, version=2)
        want, state = trainer.policy_weights().result(), replicas.policy_weights().result()
        assert all(torch.equal(state[k], want[k]) for k in want)
    finally:
        trainer.close()
        replicas.close()


def test_policy_weights_kept_on_a_replica_are_the_weights_of_their_call_not_of_a_later_load(controller4):
    """A replica's `policy_weights` result stays on its worker until a peer fetches it (a join, the sync tree); a
    load in between must not change it. On CPU a plain (unsharded) parameter's `.cpu()` is the parameter itself, so
    the result has to be a copy (on GPU `.cpu()` copies anyway)."""
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=3)
    groups = [
        fa.ActorGroup(
            controller4,
            ActorWorker,
            name=f"snap_{i}",
            slots=controller4.slots[i : i + 1],
            layout=Layout(dp=1),
            args=(ModelConfig(**{**cfg.__dict__, "seed": seed}), OptimConfig(zero_stage=1)),
        )
        for i, seed in enumerate((3, 4))
    ]
    a, b = groups
    try:
        kept = a.policy_weights()  # > 64 KiB: kept on a's worker, fetched when asked for
        a.load_policy(b.policy_weights(), 2).result()
        want = build_model(cfg, "lm", build_tokenizer(cfg)).state_dict()
        got = kept.result()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)  # seed 3's weights, not seed 4's loaded after
        now = a.policy_weights().result()
        assert any(not torch.equal(now[k], want[k]) for k in want)  # (the load did change a's weights)
    finally:
        for g in groups:
            g.close()
