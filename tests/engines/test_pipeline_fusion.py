"""Intra-stage fusion (engines.training.megatron.pipeline_fusion): the planner, and a fused actor + critic step on
megatron.

The planner is checked against 1F1B's known shape (one model: megatron's order, bubble (p-1)/(m+p-1) of the
slots) and against what fusion must give (each model's steps in dependency order, no more activations held than
1F1B, a shorter schedule than two 1F1B pipelines one after the other). The megatron part runs in one spawn of two
CPU processes (the CUDA shim, as tests/engines/test_megatron.py): an actor (lm head) whose stages run up the ranks
and a critic (value head) whose stages run down them, trained as one fused pipeline, against the same two models
trained one after the other by megatron's own 1F1B schedules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.training.common import OptimConfig
from engines.training.megatron.pipeline_fusion import plan_pipelines
from flowactors import Batch
from tests.engines.probes import squared_value_loss
from tests.engines.test_megatron import fixed_batch, needs_megatron, pg_loss
from tests.engines.test_megatron_heads import hf_model as head_model
from tests.ranks import free_port, join_world, leave_world

# ---- the planner ---------------------------------------------------------------------------------------------


def _check_valid(plan, micro_batches, forward_only=False) -> None:
    """Every step once, each after what it needs (in the slots' orders, simulated at unit speed), and never more
    activations on a stage than 1F1B holds."""
    p = plan.stages
    finish: dict[tuple, float] = {}
    clocks = [0.0] * p
    pos = [0] * p
    total = sum(len(s) for s in plan.slots)
    assert total == sum(micro_batches) * p * (1 if forward_only else 2)
    held = {}
    while len(finish) < total:
        progressed = False
        for d in range(p):
            if pos[d] == len(plan.slots[d]):
                continue
            op = plan.slots[d][pos[d]]
            assert plan.slot_of(op.job, op.stage) == d
            needs = []
            if op.kind == "F" and op.stage > 0:
                needs.append((op.job, "F", op.mb, op.stage - 1))
            if op.kind == "B":
                needs.append((op.job, "F", op.mb, op.stage))
                if op.stage < p - 1:
                    needs.append((op.job, "B", op.mb, op.stage + 1))
            if all(n in finish for n in needs):
                start = max([clocks[d], *(finish[n] for n in needs)])
                finish[(op.job, op.kind, op.mb, op.stage)] = clocks[d] = start + 1
                key = (op.job, op.stage)
                held[key] = held.get(key, 0) + (1 if op.kind == "F" else -1)
                if not forward_only:
                    assert held[key] <= p - op.stage, f"{key} holds {held[key]} activations"
                pos[d] += 1
                progressed = True
        assert progressed, "the slots' orders wait on each other (deadlock)"


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 2)])
def test_one_model_is_1f1b(p: int, m: int) -> None:
    plan = plan_pipelines(p, [m], reverse=[False])
    _check_valid(plan, [m])
    for s, ops in enumerate(plan.slots):
        warm = min(p - s - 1, m)  # megatron's warm-up forwards, then one forward / one backward, then cool-down
        kinds = "".join(op.kind for op in ops)
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm, (s, kinds)
        assert [op.mb for op in ops if op.kind == "B"] == list(range(m))
    # 1F1B's known length with backward = 2 forwards: (m + p - 1) · 3, so its bubble is (p - 1) / (m + p - 1)
    assert plan.makespan == pytest.approx(3 * (m + p - 1))
    assert plan.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_fused_opposite_pipelines_fill_each_others_bubbles(p: int, m: int) -> None:
    fused = plan_pipelines(p, [m, m], reverse=[False, True])
    _check_valid(fused, [m, m])
    alone = plan_pipelines(p, [m], reverse=[False])
    assert fused.busy == pytest.approx(2 * alone.busy)
    assert fused.makespan < 2 * alone.makespan  # two separate 1F1B steps, one after the other
    # and shorter than both models' micro-batches through one pipeline in the same direction (bubble paid once)
    assert fused.makespan < plan_pipelines(p, [2 * m], reverse=[False]).makespan
    assert fused.bubble_fraction < alone.bubble_fraction
    # the last slot starts at once (with the critic's first stage) instead of waiting p - 1 actor forwards
    first = fused.slots[p - 1][0]
    assert (first.job, first.kind, first.stage) == (1, "F", 0)


@pytest.mark.parametrize(
    "p,m,costs", [(4, 4, ((2.0, 4.0), (1.0, 2.0))), (4, 8, ((1.0, 2.0), (3.0, 6.0))), (2, 3, ((1.0, 3.0), (1.0, 1.0)))]
)
def test_unequal_models_are_never_planned_slower_than_in_turn(p: int, m: int, costs) -> None:
    (fa, ba), (fc, bc) = costs
    fused = plan_pipelines(p, [m, m], forward_cost=[fa, fc], backward_cost=[ba, bc])
    _check_valid(fused, [m, m])
    actor = plan_pipelines(p, [m], reverse=[False], forward_cost=[fa], backward_cost=[ba])
    critic = plan_pipelines(p, [m], reverse=[True], forward_cost=[fc], backward_cost=[bc])
    assert fused.busy == pytest.approx(actor.busy + critic.busy)
    assert fused.makespan <= actor.makespan + critic.makespan


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 8)])
def test_a_slot_budget_bounds_what_a_slot_holds_of_all_models(p: int, m: int) -> None:
    free = plan_pipelines(p, [m, m])
    budget = plan_pipelines(p, [m, m], slot_budget=p)  # the unfused step's busiest slot (the actor's first stage)
    _check_valid(budget, [m, m])
    # two opposite models: up to p - s of one and s + 1 of the other (p = 2 happens to hold 2)
    assert _peak_per_slot(free) == [p + 1 if p > 2 else p] * p
    assert _peak_per_slot(budget) == [p] * p
    in_turn = plan_pipelines(p, [m], reverse=[False]).makespan + plan_pipelines(p, [m], reverse=[True]).makespan
    assert free.makespan <= budget.makespan <= in_turn


def _peak_per_slot(plan) -> list[int]:
    """Most micro-batches whose activations a slot holds at once (a forward done, its backward not yet)."""
    peaks = []
    for ops in plan.slots:
        held = peak = 0
        for op in ops:
            held += 1 if op.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def test_plan_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="one entry per model"):
        plan_pipelines(2, [2, 2], forward_cost=[1.0])
    with pytest.raises(ValueError, match="stages >= 1"):
        plan_pipelines(0, [2])
    with pytest.raises(ValueError, match="slot_budget=0: a slot must hold at least one"):
        plan_pipelines(2, [2, 2], slot_budget=0)


# ---- megatron: fused actor + critic against separate updates -------------------------------------------------

LR = 1e-2
OPTIM = OptimConfig(lr=LR, eps=1e-4, micro_batch_tokens=20)  # 10-token rows: 2 rows per micro-batch


def _batch(n: int = 8) -> Batch:
    """tests/engines/test_megatron.py's batch, with returns for the critic."""
    batch = fixed_batch(n)
    returns = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(1))
    return Batch({**batch.tensors, "returns": returns})


def _models():
    actor = head_model("llama", "value")  # the same backbone config; the actor takes an lm head below
    import transformers

    torch.manual_seed(1)
    lm = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{
                k: getattr(actor.config, k)
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "intermediate_size",
                    "vocab_size",
                    "max_position_embeddings",
                )
            },
            tie_word_embeddings=False,
        )
    ).eval()
    return lm, head_model("qwen2", "value")


def _run(rank: int, world: int, port: int, out_dir: str, tp: int) -> None:
    join_world(rank, world, port, megatron=True)
    import torch.distributed as dist

    from engines.training.megatron.engine import MegatronEngine
    from engines.training.megatron.groups import world_groups
    from engines.training.megatron.pipeline_fusion import fused_update

    try:
        lm, value = _models()
        dp = world // (2 * tp)
        # 2 mini-batches of 4 rows per data-parallel rank (2 micro-batches each); this rank's share of each
        minis = [m.chunk(4)[dist.get_rank() // tp % dp] for m in _batch(8 * dp).chunk(4 * dp)]
        out = {}
        for mode in ("separate", "fused"):
            actor = MegatronEngine.from_hf_model(lm, OPTIM, tp=tp, pp=2)
            critic = MegatronEngine.from_hf_model(
                value, OPTIM, tp=tp, pp=2, groups=world_groups(tp, 2, reverse_stages=mode == "fused")
            )
            values = critic.values(minis[0])
            log_probs = actor.log_probs(minis[0])["log_probs"]
            if mode == "separate":
                metrics = [
                    actor.update(minis, pg_loss, lambda mb, a=actor: a.policy_outputs(mb, 1.0, False)),
                    critic.update(minis, squared_value_loss, critic.value_outputs),
                ]
            else:
                metrics, timings = fused_update(
                    [
                        (actor, minis, pg_loss, lambda mb, a=actor: a.policy_outputs(mb, 1.0, False)),
                        (critic, minis, squared_value_loss, critic.value_outputs),
                    ]
                )
                out["fused_stage"] = critic.pp_rank
                out["timings"] = [(t.wall_s, t.wait_s) for t in timings]
            out[mode] = {
                "actor": actor.full_state_dict(),
                "critic": critic.full_state_dict(),
                "metrics": metrics,
                "values": values,
                "log_probs": log_probs,
            }
            del actor, critic
        from tests.engines.test_megatron import hf_model as lm_model

        try:  # qwen2 ties its word embeddings, which a reversed pipeline cannot
            MegatronEngine.from_hf_model(lm_model("qwen2"), OPTIM, tp=tp, pp=2, groups=world_groups(tp, 2, True))
        except ValueError as e:
            out["tied_refusal"] = str(e)
        out["dp"] = dp
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_world(out_dir)


def _spawn(world: int, out_dir: Path, tp: int = 1) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_run, args=(world, free_port(), str(out_dir), tp), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("pipeline_fusion"))


@needs_megatron
def test_critic_stages_run_down_the_ranks(fused_run) -> None:
    assert [r["fused_stage"] for r in fused_run] == [1, 0]


@needs_megatron
def test_reversed_critic_forward_equals_megatron_schedule(fused_run) -> None:
    for r in fused_run:
        torch.testing.assert_close(r["fused"]["values"], r["separate"]["values"], rtol=0, atol=0)
        torch.testing.assert_close(r["fused"]["log_probs"], r["separate"]["log_probs"], rtol=0, atol=0)


@needs_megatron
def test_fused_step_equals_separate_updates(fused_run) -> None:
    for r in fused_run:
        sep, fused = r["separate"], r["fused"]
        for model in ("actor", "critic"):
            assert sep[model].keys() == fused[model].keys()
            for k in sep[model]:
                torch.testing.assert_close(fused[model][k], sep[model][k], rtol=0, atol=0, msg=f"{model} {k}")
        assert fused["metrics"] == sep["metrics"]
        # and the step did train: the weights moved
    assert not torch.equal(
        fused_run[0]["fused"]["critic"]["score.weight"], head_model("qwen2", "value").state_dict()["score.weight"]
    )


@needs_megatron
@pytest.mark.slow  # 4 processes on 2 cores, 20-30 s each
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2_dp2", "pp2_tp2"])
def test_fused_step_with_data_or_tensor_parallel_pipelines_equals_separate_updates(tmp_path, tp: int) -> None:
    """pp = 2 with dp = 2 or tp = 2 on 4 ranks. dp: each data-parallel pipeline fuses its own actor and critic
    stages; gradients are reduced over data parallel and scaled by the tokens of both pipelines, as megatron's
    schedules do. tp: each tensor-parallel rank exchanges the (replicated) activations with its peer stage."""
    ranks = _spawn(4, tmp_path, tp)
    assert [r["fused_stage"] for r in ranks] == [1, 1, 0, 0] and ranks[0]["dp"] == 4 // (2 * tp)
    # With tp = 2 the reversed critic's 4 ranks sit in another order in the gradient-norm all-reduce (its stages
    # swapped), which sums their 4 shares in another order: the clipped step agrees to float rounding, not bit
    # for bit. The actor, whose ranks keep their order, and every forward stay exact.
    tol = {} if tp == 1 else {"rtol": 1e-5, "atol": 1e-6}
    for r in ranks:
        sep, fused = r["separate"], r["fused"]
        for model in ("actor", "critic"):
            for k in sep[model]:
                torch.testing.assert_close(
                    fused[model][k],
                    sep[model][k],
                    msg=f"{model} {k}",
                    **({"rtol": 0, "atol": 0} if model == "actor" or tp == 1 else tol),
                )
        assert fused["metrics"][0] == sep["metrics"][0]
        assert fused["metrics"][1] == (sep["metrics"][1] if tp == 1 else pytest.approx(sep["metrics"][1], rel=1e-6))
        torch.testing.assert_close(fused["values"], sep["values"], rtol=0, atol=0)


@needs_megatron
def test_a_reversed_model_with_tied_embeddings_is_refused(fused_run) -> None:
    for r in fused_run:
        assert "cannot tie its word embeddings" in r["tied_refusal"]


def test_pipeline_ranks_must_run_up_or_down() -> None:
    from engines.training.megatron.groups import MegatronGroups

    def groups(ranks):
        return MegatronGroups(None, None, len(ranks), 1, 1, 0, 0, 0, tuple(ranks))

    assert not groups([0, 1, 2]).reversed_stages and groups([2, 1, 0]).reversed_stages
    with pytest.raises(ValueError, match=r"run in stage order up or down the global ranks; got \(0, 2, 1\)"):
        groups([0, 2, 1])
    with pytest.raises(ValueError, match="for pp=3"):
        MegatronGroups(None, None, 3, 1, 1, 0, 0, 0, (0, 1))
