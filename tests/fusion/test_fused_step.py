"""Stage fusion on a real 2-slot cluster: the same batch and update as the unfused step, chunks in completion
order, scoring beside the long tail, and a failed chunk failing the step by name.

Bit-identical scores need batch-invariant kernels. On this CPU every op of the models is, except the one-column
value and score heads, and those too when a sequence (prompt width + max_new_tokens) is a multiple of 8 tokens
(see algorithms/rollout/fusion.py); the exact tests use such a width, the others check samples exactly and scores to
rounding."""

import pytest
import torch
from distributed import get_task_stream
from distributed.metrics import time as metrics_time

import flowactors as fa
from algorithms.data.prompts import PromptData
from algorithms.data.tasks import get_task
from algorithms.objectives.advantages import join
from algorithms.ppo import PPO
from algorithms.rollout.fusion import FusionConfig, fused_rollout, overlap_note
from algorithms.run.build import Roles
from algorithms.run.config import ConfigError, PPOConfig, apply_overrides
from engines import (
    ActorWorker,
    CriticWorker,
    ModelConfig,
    OptimConfig,
    RefWorker,
    RuleRewardWorker,
    SamplingConfig,
    build_tokenizer,
)
from engines.rollout.stream import ROW_INDEX, share_tails
from flowactors import Batch, Layout
from tests.fusion.workers import FailingReward, SlowDecodeActor

MODEL = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
TASK = get_task("digit_sum")
N = 16


@pytest.fixture(scope="module")
def ctl():
    c = fa.Controller.local(2, dashboard=None, collective_timeout_s=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def data():
    return PromptData(TASK, build_tokenizer(MODEL), 64, seed=3)


def long_tail(prompts: Batch) -> Batch:
    """Most rows stop after a few tokens, a few run to the maximum (EOS may end any of them earlier)."""
    stop = torch.tensor([2, 3, 16, 1, 4, 2, 12, 3, 2, 5, 1, 16, 3, 2, 8, 4])[: len(prompts)]
    return Batch({**prompts.tensors, "stop_at": stop}, prompts.rows, prompts.meta)


ALIGNED = 24 - 7  # digit_sum prompts are 7 tokens wide: 24-token sequences


def groups(
    ctl,
    tag,
    *,
    actor_slots,
    scorer_slots,
    actor_cls=ActorWorker,
    reward=None,
    actor_kwargs=None,
    max_new_tokens=ALIGNED,
):
    """actor + ref on `actor_slots`, critic + reward on `scorer_slots`, all from the same seeded initialisation."""

    def group(role, cls, slots, *args, kwargs=None):
        return fa.ActorGroup(
            ctl, cls, name=f"{role}_{tag}", slots=slots, layout=Layout(dp=len(slots)), args=args, kwargs=kwargs
        )

    optim = OptimConfig(lr=1e-3, micro_batch_tokens=512)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    return {
        "actor": group("actor", actor_cls, actor_slots, MODEL, optim, sampling, kwargs=actor_kwargs),
        "ref": group("ref", RefWorker, actor_slots, MODEL),
        "critic": group("critic", CriticWorker, scorer_slots, MODEL, optim),
        "reward": reward(tag) if reward else group("reward", RuleRewardWorker, scorer_slots, TASK.reward, MODEL),
    }


def compute_spans(records) -> dict:
    """{group.method: [(start, stop), ...]} of every call's compute, from task-stream and direct-path records."""
    spans = {}
    for t in records:
        s = next(x for x in t["startstops"] if x["action"] == "compute")
        spans.setdefault(t["key"].split("-")[0], []).append((s["start"], s["stop"]))
    return spans


def close(g):
    for x in g.values():
        x.close()


def ppo(ctl, g, fuse, data, migrate=False):
    algo = PPO(
        PPOConfig(
            prompts_per_step=N,
            mini_batch_samples=8,
            ppo_epochs=2,
            dashboard="none",
            fusion=FusionConfig(fuse, chunk_samples=3, migrate=migrate and fuse),
        )
    )
    algo.setup(ctl, Roles(**g), data)
    return algo


def assert_fused_equals_unfused(prompts, build, trained, approx=()) -> dict:
    """Run the steps unfused, then fused, each on the groups and algorithm `build(fuse)` makes fresh (building
    seeds the models the same way each time), and assert the fused steps give the unfused metrics, scored batches
    (where the algorithm keeps `last_batch`; the fields in `approx` to rounding) and updated `trained` roles.
    Returns {fuse: (steps, digests)}."""
    runs = {}
    for fuse in (False, True):
        g, algo = build(fuse)
        try:
            steps = [
                (algo.step(p, i), algo.last_batch.result() if hasattr(algo, "last_batch") else None)
                for i, p in enumerate(prompts)
            ]
            runs[fuse] = steps, [g[r].parameter_digest().result() for r in trained]  # the updates
        finally:
            close(g)
    (plain, plain_digests), (fused, fused_digests) = runs[False], runs[True]
    for (m_plain, b_plain), (m_fused, b_fused) in zip(plain, fused):
        if b_plain is not None:
            exact = [k for k in b_plain.keys() if k not in approx]
            assert sorted(b_fused.keys()) == sorted(b_plain.keys())
            assert b_fused.select(*exact).equals(b_plain.select(*exact))
            for k in approx:
                assert torch.allclose(b_fused[k], b_plain[k], rtol=0, atol=1e-5), k
        if "rollout_log_probs" in approx:  # the mismatch monitor reads them: its figures to the same rounding
            near = {k for k in m_plain if "mismatch_" in k}
            assert all(abs(m_fused[k] - m_plain[k]) < 1e-5 for k in near), {k: (m_fused[k], m_plain[k]) for k in near}
            m_fused, m_plain = ({k: v for k, v in m.items() if k not in near} for m in (m_fused, m_plain))
        assert m_fused == m_plain
    assert fused_digests == plain_digests
    return runs


def test_fused_steps_give_the_unfused_batches_and_updates(ctl, data):
    prompts = [long_tail(data.next_batch(N, 1)) for _ in range(2)]

    def build(fuse):
        g = groups(ctl, f"fuse{int(fuse)}", actor_slots=ctl.slots[:1], scorer_slots=ctl.slots[1:])
        return g, ppo(ctl, g, fuse, data)

    assert_fused_equals_unfused(prompts, build, ("actor", "critic"))


def test_chunks_arrive_in_completion_order_while_scorers_run(ctl, data):
    g = groups(
        ctl,
        "slow",
        actor_slots=ctl.slots[:1],
        scorer_slots=ctl.slots[1:],
        actor_cls=SlowDecodeActor,
        actor_kwargs={"step_s": 0.03},
        max_new_tokens=16,
    )  # 23-token sequences
    try:
        prompts = long_tail(data.next_batch(N, 1))
        scorers = [g["ref"].compute_ref_log_prob, g["critic"].compute_values, g["reward"].compute_reward]
        t0 = metrics_time()
        with get_task_stream(client=ctl.client) as ts:
            rollout = fused_rollout(ctl, g["actor"], prompts, scorers, chunk_samples=4)
            fused = rollout.parts[0].result().union(*(p.result() for p in rollout.parts[1:]))
        ran = ts.data + ctl.call_records(t0, metrics_time())  # tasks, and the calls on the direct path
        samples = g["actor"].generate_sequences(prompts)
        plain = join(samples.result(), *(s(samples).result() for s in scorers))
        assert sorted(fused.keys()) == sorted(plain.keys()) and fused.rows == plain.rows
        for name, t in plain.tensors.items():  # samples, log-probs and rule rewards exact; at this width the
            if name == "values":  # critic's one-column head rounds differently in smaller batches
                assert torch.allclose(fused[name], t, rtol=0, atol=1e-6)
            else:
                assert torch.equal(fused[name], t), name
        assert rollout.streamed == ("critic_slow.compute_values", "reward_slow.compute_reward")
        assert rollout.deferred == ("ref_slow.compute_ref_log_prob",)

        chunks = [c.result() for c in rollout.chunks]
        assert [len(c) for c in chunks] == [4, 4, 4, 4]
        order = [(int(n), int(i)) for c in chunks for n, i in zip(c["response_mask"].sum(-1), c[ROW_INDEX])]
        assert order == sorted(order)  # finished first, first out
        assert sorted(i for _, i in order) == list(range(N))

        spans = compute_spans(ran)
        generation_end = max(stop for _, stop in spans["actor_slow.next_generated_chunk"])
        first_scoring = min(start for start, _ in spans["critic_slow.compute_values"])
        assert first_scoring < generation_end - 0.2  # the tail runs >= 10 more slow steps after chunk 0
    finally:
        close(g)


def test_failed_chunk_scoring_fails_the_step_by_name(ctl, data):
    def failing(tag):
        return fa.ActorGroup(ctl, FailingReward, name=f"reward_{tag}", slots=ctl.slots[1:], args=(6,))

    g = groups(ctl, "bad", actor_slots=ctl.slots[:1], scorer_slots=ctl.slots[1:], reward=failing)
    try:
        algo = ppo(ctl, g, True, data)
        with pytest.raises(fa.RemoteError, match="reward model cannot score row 6") as err:
            algo.step(long_tail(data.next_batch(N, 1)), 0)
        assert (err.value.group, err.value.method) == ("reward_bad", "compute_reward")
        # the actor is left clean: its decoding thread was joined and it generates again
        rollout = fused_rollout(
            ctl, g["actor"], long_tail(data.next_batch(N, 1)), [g["critic"].compute_values], chunk_samples=5
        )
        assert len(rollout.parts[0].result()) == N
    finally:
        close(g)


def test_data_parallel_actor_offsets_rows_and_colocated_scorers_wait(ctl, data):
    both = dict(actor_slots=ctl.slots, scorer_slots=ctl.slots)
    g = groups(ctl, "dp2", **both)
    try:
        prompts = long_tail(data.next_batch(N, 1))
        scorers = [g["actor"].compute_log_prob, g["critic"].compute_values, g["reward"].compute_reward]
        rollout = fused_rollout(ctl, g["actor"], prompts, scorers, chunk_samples=3)
        assert rollout.streamed == () and len(rollout.deferred) == 3
        # the run tells the user, since fusion overlaps nothing here (with or without migration)
        others = [g["critic"], g["reward"]]
        assert "fuse: every scorer shares the actor's slots" in overlap_note(g["actor"], others, migrate=False)
        assert "--placement fused" in overlap_note(g["actor"], others, migrate=True)
        chunk0 = rollout.chunks[0].result()  # 3 rows from each rank: rows 0-7 and 8-15
        assert sorted(int(i) >= N // 2 for i in chunk0[ROW_INDEX]) == [False] * 3 + [True] * 3
        fused = rollout.parts[0].result().union(*(p.result() for p in rollout.parts[1:]))
        samples = g["actor"].generate_sequences(prompts)
        assert fused.equals(join(samples.result(), *(s(samples).result() for s in scorers)))
    finally:
        close(g)


@pytest.mark.parametrize("migrate", [False, True], ids=["split", "migrated"])
def test_safe_rlhf_fused_steps_give_the_unfused_metrics_and_updates(ctl, data, migrate):
    """Safe-RLHF's six scorers (log-probs, reference, two critics, reward, cost) through the fused stage; with
    migration, actor and reference on both slots, the other scorers on the second."""
    from algorithms.run.config import SafeRLHFConfig
    from algorithms.safe_rlhf import SafeRLHF

    prompts = [long_tail(data.next_batch(N, 1)) for _ in range(2)]

    def build(fuse):
        tag = f"safe{int(fuse)}{'m' * migrate}"
        g = groups(ctl, tag, actor_slots=ctl.slots if migrate else ctl.slots[:1], scorer_slots=ctl.slots[1:])
        g["cost_critic"] = fa.ActorGroup(
            ctl,
            CriticWorker,
            name=f"cost_critic_{tag}",
            slots=ctl.slots[1:],
            args=(MODEL, OptimConfig(lr=1e-3, micro_batch_tokens=512), "cost_values"),
        )
        g["cost"] = fa.ActorGroup(
            ctl, RuleRewardWorker, name=f"cost_{tag}", slots=ctl.slots[1:], args=(TASK.cost, MODEL)
        )
        algo = SafeRLHF(
            SafeRLHFConfig(
                prompts_per_step=N,
                mini_batch_samples=8,
                dashboard="none",
                fusion=FusionConfig(fuse, chunk_samples=3, migrate=fuse and migrate),
            )
        )
        algo.setup(ctl, Roles(**g), data)
        return g, algo

    runs = assert_fused_equals_unfused(
        prompts, build, ("actor", "critic", "cost_critic"), approx=("rollout_log_probs",) if migrate else ()
    )
    assert runs[True][0][0][0]["cost_mean"] > 0  # the cost scorer ran on the fused chunks


def test_hybrid_actor_streams_split_rows_and_matches_unfused(ctl, data):
    """A TP=2 actor under the 3D-HybridEngine (rollout_tp=1: two generation replicas) streams each replica's rows
    and joins chunk k of both: the fused step's batch and update equal the unfused step's."""
    model = ModelConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, pad_vocab_to=2
    )  # the vocabulary splits over tp=2
    prompts = [long_tail(data.next_batch(N, 1)) for _ in range(2)]
    optim = OptimConfig(lr=1e-3, micro_batch_tokens=512)

    def build(fuse):
        tag, two = f"hyfuse{int(fuse)}", Layout(dp=2)
        g = {
            "actor": fa.ActorGroup(
                ctl,
                ActorWorker,
                name=f"actor_{tag}",
                layout=Layout(tp=2),
                args=(model, optim, SamplingConfig(max_new_tokens=ALIGNED)),
                kwargs={"rollout_tp": 1},
            ),
            "ref": fa.ActorGroup(ctl, RefWorker, name=f"ref_{tag}", layout=two, args=(model,)),
            "critic": fa.ActorGroup(ctl, CriticWorker, name=f"critic_{tag}", layout=two, args=(model, optim)),
            "reward": fa.ActorGroup(ctl, RuleRewardWorker, name=f"reward_{tag}", layout=two, args=(TASK.reward, model)),
        }
        algo = PPO(
            PPOConfig(
                prompts_per_step=N,
                mini_batch_samples=8,
                ppo_epochs=2,
                dashboard="none",
                fusion=FusionConfig(fuse, chunk_samples=4),
            )
        )  # 4 = 2 rows from each replica
        algo.setup(ctl, Roles(**g), data)
        return g, algo

    assert_fused_equals_unfused(prompts, build, ("actor", "critic"))


def test_migrated_tails_give_the_unfused_batches_and_updates(ctl, data):
    """Long-tail migration: a dp=2 actor on both slots hands each rank's last rows to rank 0 (the two ranks pause at
    different steps), critic and reward on slot 1 score the chunks once its rank has handed over; the steps give
    the unfused samples, scores, metrics and updates (the moved rows' rollout log-probs to rounding)."""
    prompts = [long_tail(data.next_batch(N, 1)) for _ in range(2)]

    def build(fuse):
        g = groups(ctl, f"mig{int(fuse)}", actor_slots=ctl.slots, scorer_slots=ctl.slots[1:])
        return g, ppo(ctl, g, fuse, data, migrate=True)

    assert_fused_equals_unfused(prompts, build, ("actor", "critic"), approx=("rollout_log_probs",))


def test_freed_slot_scores_while_rank_zero_finishes_the_tail(ctl, data):
    g = groups(
        ctl,
        "migslow",
        actor_slots=ctl.slots,
        scorer_slots=ctl.slots[1:],
        actor_cls=SlowDecodeActor,
        actor_kwargs={"step_s": 0.05},
        max_new_tokens=16,
    )
    try:
        prompts = long_tail(data.next_batch(N, 1))
        scorers = [g["actor"].compute_log_prob, g["critic"].compute_values, g["reward"].compute_reward]
        t0 = metrics_time()
        with get_task_stream(client=ctl.client) as ts:
            rollout = fused_rollout(ctl, g["actor"], prompts, scorers, chunk_samples=3, migrate_below=0.25)
            fused = rollout.parts[0].result().union(*(p.result() for p in rollout.parts[1:]))
        ran = ts.data + ctl.call_records(t0, metrics_time())
        assert rollout.streamed == ("critic_migslow.compute_values", "reward_migslow.compute_reward")
        assert overlap_note(g["actor"], [g["critic"], g["reward"]], migrate=True) is None
        assert "--placement split" in overlap_note(g["actor"], [g["critic"], g["reward"]], migrate=False)
        assert rollout.deferred == ("actor_migslow.compute_log_prob",)
        # 2 of each rank's 8 rows migrate (16 and 12 steps long on rank 0, 16 and 8 on rank 1): two chunks of
        # 3 rows per rank, then the rest (every row not yet taken) from rank 0
        chunks = [c.result() for c in rollout.chunks]
        assert [len(c) for c in chunks] == [6, 6, 4]
        assert sorted(torch.cat([c[ROW_INDEX] for c in chunks]).tolist()) == list(range(N))
        samples = g["actor"].generate_sequences(prompts)
        plain = join(samples.result(), *(s(samples).result() for s in scorers))
        assert torch.equal(fused["responses"], plain["responses"])

        spans = compute_spans(ran)
        tail_end = max(stop for _, stop in spans["actor_migslow.finish_tail"])
        handed_over = max(stop for _, stop in spans["actor_migslow.hand_over_tail"])
        first_scoring = min(start for start, _ in spans["critic_migslow.compute_values"])
        assert first_scoring < tail_end - 0.2  # rank 0 decodes >= 10 more slow steps after slot 1 is free
        assert first_scoring >= min(stop for _, stop in spans["actor_migslow.hand_over_tail"])
        assert handed_over < tail_end
    finally:
        close(g)


def test_share_tails_gives_each_tail_to_the_receiver_with_the_fewest_rows():
    tails = [Batch({"x": torch.zeros(n, 1)}) for n in (3, 1, 2, 2)]
    assert [[len(t) for t in share] for share in share_tails(tails, 2)] == [[3, 2], [1, 2]]
    assert [[len(t) for t in share] for share in share_tails(tails, 1)] == [[3, 1, 2, 2]]
    assert share_tails([], 3) == [[], [], []]


@pytest.mark.e2e  # CI's second tier (.ci/run)
def test_two_receiving_ranks_finish_the_tails_of_the_other_two(data):
    """dp = 4, migrate_to = 2: ranks 2 and 3 pause (at steps 2 and 3) and their tails go one to rank 0, one to
    rank 1, which finish them beside their own rows; the rollout is generate_sequences' (tokens exactly, the
    moved rows' log-probs to rounding), by the endpoints and through fused_rollout."""
    from algorithms.rollout.fusion import migration_threshold, reassemble

    stop = torch.tensor([16, 1, 12, 2, 1, 16, 2, 8, 2, 1, 16, 16, 1, 3, 16, 4])  # 4 rows per rank
    prompts = Batch({**data.next_batch(N, 1).tensors, "stop_at": stop})
    with fa.Controller.local(4, dashboard=None, collective_timeout_s=60) as c4:
        actor = fa.ActorGroup(
            c4,
            ActorWorker,
            name="actor_mig4",
            slots=c4.slots,
            layout=Layout(dp=4),
            args=(MODEL, OptimConfig(), SamplingConfig(max_new_tokens=16, ignore_eos=True)),
        )
        ref = actor.generate_sequences(prompts).result()
        keep = migration_threshold(actor.layout, 4, 0.5, 2)
        actor.start_generation(prompts, 1, None, keep, 2).result()
        chunks = [actor.next_generated_chunk(k) for k in range(2)]
        per_rank = actor.finish_tail(actor.hand_over_tail()).result()
        assert per_rank[2] is None and per_rank[3] is None
        assert sorted(per_rank[0][ROW_INDEX].tolist()) == [0, 2, 10, 11]  # its own long rows + rank 2's tail
        assert sorted(per_rank[1][ROW_INDEX].tolist()) == [5, 7, 14, 15]  # its own + rank 3's
        by_endpoints = reassemble(*(c.result() for c in chunks), per_rank[0], per_rank[1])
        fused = fused_rollout(c4, actor, prompts, [], chunk_samples=1, migrate_below=0.5, migrate_to=2)
        through_rollout = fused.parts[0].result()
    for rows in (by_endpoints, through_rollout):
        for key in ("responses", "response_mask", "input_ids"):
            assert torch.equal(rows[key], ref[key]), key
        torch.testing.assert_close(rows["rollout_log_probs"], ref["rollout_log_probs"], rtol=0, atol=1e-5)


def test_migration_refuses_a_layout_it_cannot_run(ctl, data):
    g = groups(ctl, "mig1", actor_slots=ctl.slots[:1], scorer_slots=ctl.slots[1:])
    try:
        with pytest.raises(ValueError, match="needs an actor of dp >= 2"):
            fused_rollout(
                ctl,
                g["actor"],
                long_tail(data.next_batch(N, 1)),
                [g["critic"].compute_values],
                chunk_samples=3,
                migrate_below=0.25,
            )
        with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
            fused_rollout(
                ctl,
                g["actor"],
                long_tail(data.next_batch(N, 1)),
                [g["critic"].compute_values],
                chunk_samples=3,
                migrate_below=1.5,
            )
    finally:
        close(g)
    with pytest.raises(ConfigError, match="set fuse=true"):
        apply_overrides(PPOConfig(), ["fuse_migrate=true"])
    with pytest.raises(ConfigError, match="fuse_migrate_to is how many actor ranks"):
        PPOConfig(fusion=FusionConfig(True, migrate=True, migrate_to=0))
    from algorithms.rollout.fusion import migration_threshold

    with pytest.raises(ValueError, match="some rank must hand over"):
        migration_threshold(Layout(dp=2), 8, 0.25, 2)


@pytest.mark.e2e  # CI's second tier (.ci/run)
def test_the_ppo_program_migrates_on_the_fused_placement_and_changes_nothing(tmp_path):
    """`--placement fused fuse=true fuse_migrate=true`: actor and reference on both slots, critic and reward on
    the second; the run's metrics equal the unfused run's on the same placement, step by step."""
    assert_the_ppo_program_migrates_and_changes_nothing(tmp_path)


def assert_the_ppo_program_migrates_and_changes_nothing(tmp_path, *overrides: str) -> None:
    """PPO on `--placement fused` for 2 steps, unfused and with fuse_migrate: equal metrics, step by step."""
    from algorithms.ppo import main
    from tests.algorithms.test_learning import run

    common = [
        *overrides,
        "--placement",
        "fused",
        "--steps",
        "2",
        f"max_new_tokens={ALIGNED}",
        "prompts_per_step=16",
        "mini_batch_samples=8",
        "fuse_chunk_samples=2",
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run(main, tmp_path / "a", *common, "fuse=false")
    migrated = run(main, tmp_path / "b", *common, "fuse=true", "fuse_migrate=true")
    for a, b in zip(plain, migrated, strict=True):
        for key in ("reward_mean", "kl", "entropy", "response_length_mean", "critic/vf_loss"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.slow  # 20 s; the in-process tests above cover the split placement by default
def test_the_ppo_program_fuses_on_a_planned_placement_and_changes_nothing(tmp_path):
    """`--plan` with the actor and reference on one slot, critic and reward on the other: fuse=true streams the
    chunks to the critic and reward there, and the run's metrics equal the unfused run's, step by step."""
    from algorithms.ppo import main
    from placement import ModelPlan, Plan
    from tests.algorithms.test_learning import run

    plan = Plan(
        placement=[["actor", "ref"], ["critic", "reward"]],
        models=[ModelPlan(r, 1, (1, 1, 1)) for r in ("actor", "ref", "critic", "reward")],
    )
    plan.save(tmp_path / "plan.json")
    common = [
        "--plan",
        str(tmp_path / "plan.json"),
        "--steps",
        "2",
        f"max_new_tokens={ALIGNED}",
        "prompts_per_step=16",
        "mini_batch_samples=8",
        "fuse_chunk_samples=4",
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run(main, tmp_path / "a", *common, "fuse=false")
    fused = run(main, tmp_path / "b", *common, "fuse=true")
    for a, b in zip(plain, fused, strict=True):
        for key in ("reward_mean", "kl", "entropy", "response_length_mean", "critic/vf_loss", "actor/grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
