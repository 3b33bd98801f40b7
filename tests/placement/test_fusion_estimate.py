"""The cluster-scale fusion estimate (placement/fusion.py) pinned to hand-derived values of its pieces."""

from __future__ import annotations

import pytest

from placement.fusion import decode_timeline, estimate_fusion
from placement.hardware import a100_80gb
from placement.models import llama_13b
from placement.simulator import ROLES, Parallel, Simulator, Workload

WL = Workload(prompts_per_step=64, prompt_tokens=256, response_tokens=256, mini_batches_per_step=2)


def _setup(p: int = 2):
    sim = Simulator(a100_80gb(), WL)
    spec = llama_13b()
    specs = {r: spec for r in ("actor", "critic", "ref", "reward")}
    cfgs = {r: Parallel(p, 4, 16 // (4 * p), *((1, 4) if r == "actor" else ())) for r in specs}
    return sim, spec, specs, cfgs


def test_without_a_tail_nothing_migrates_and_fusion_changes_nothing_there():
    sim, _, specs, cfgs = _setup()
    e = estimate_fusion(sim, specs, cfgs, [256] * 64)
    assert e.migrated == 0 and e.tail_replicas == 0
    assert e.fused_generate_inference_s == pytest.approx(e.generate_s + e.inference_s)


@pytest.mark.parametrize("migrate_by", ["prefill", "kv"])
def test_a_long_tail_migrates_to_one_replica_and_the_freed_devices_score_meanwhile(migrate_by):
    sim, spec, specs, cfgs = _setup()
    lengths = [256] * 4 + [8] * 60  # 4 long rows, one per replica of 4 (16 devices at t_g = 4)
    e = estimate_fusion(sim, specs, cfgs, lengths, migrate_below=0.1, migrate_by=migrate_by)
    assert e.migrated == 4 and e.tail_replicas == 1  # 4 rows <= 6.4 once the short ones end; one replica holds them
    steps = decode_timeline(sim, spec, cfgs["actor"], lengths)
    assert len(steps) == 256 and steps[7] > steps[8]  # the batch empties to one row per replica after step 8
    assert e.generate_s == pytest.approx(sim.prefill_s(spec, cfgs["actor"], 16) + sum(steps))
    # fused: generation up to step 8, the tail re-prefilled (prompt + 8 tokens), or its KV caches (2 · 40 layers ·
    # 40 heads · 128 · 2 bytes a token) moved over one node's link, and decoded on one replica of 4 devices while
    # the other 12 score the 60 finished samples; what is left is scored on all 16
    move = (
        sim.prefill_s(spec, cfgs["actor"], 4) * (256 + 8) / 256
        if migrate_by == "prefill"
        else 4 * (256 + 8) * (2 * 40 * 40 * 128 * 2) / sim.hw.network_busbw
    )
    tail = move + 248 * sim.decode_step_s(spec, cfgs["actor"], 4)
    work = e.inference_s * 16
    left = work - min(work * 60 / 64, 12 * tail)
    want = sim.prefill_s(spec, cfgs["actor"], 16) + sum(steps[:8]) + tail + left / 16
    assert e.fused_generate_inference_s == pytest.approx(want)
    assert e.fused_generate_inference_s < e.generate_s + e.inference_s


@pytest.mark.parametrize("p", [1, 2])
def test_fused_training_pays_the_pipeline_bubble_once(p):
    sim, spec, specs, cfgs = _setup(p)
    e = estimate_fusion(sim, specs, cfgs, [256] * 64)
    a, ma = sim.pass_work(spec, ROLES["actor"], cfgs["actor"], backward=True)
    c, mc = sim.pass_work(spec, ROLES["critic"], cfgs["critic"], backward=True)
    saved = 2 * (p - 1) * (a / ma + c / mc - (a + c) / (ma + mc))  # 2 updates per iteration
    assert e.train_s - e.fused_train_s == pytest.approx(saved)
    assert (saved > 0) == (p > 1)


def test_a_fused_pipeline_planner_sets_the_fused_update():
    """With `fused_pipeline` the fused update is the planner's schedule (here the one the fused training runs):
    what it is given is each model's micro-batch count and one micro-batch's step time, and it plans shorter
    than the bubble-paid-once estimate."""
    from engines.training.megatron.pipeline_fusion import plan_pipelines

    sim, spec, specs, cfgs = _setup(2)
    calls = []

    def planner(stages, micro_batches, step_s):
        calls.append((stages, list(micro_batches), list(step_s)))
        plan = plan_pipelines(
            stages, list(micro_batches), forward_cost=[t / 3 for t in step_s], backward_cost=[2 * t / 3 for t in step_s]
        )
        return plan.makespan

    planned = estimate_fusion(sim, specs, cfgs, [256] * 64, fused_pipeline=planner)
    default = estimate_fusion(sim, specs, cfgs, [256] * 64)
    a, ma = sim.pass_work(spec, ROLES["actor"], cfgs["actor"], backward=True)
    c, mc = sim.pass_work(spec, ROLES["critic"], cfgs["critic"], backward=True)
    assert calls == [(2, [ma, mc], [pytest.approx(a / ma), pytest.approx(c / mc)])]
    sync = sim.gradient_sync_s(spec, ROLES["actor"], cfgs["actor"]) + sim.gradient_sync_s(
        spec, ROLES["critic"], cfgs["critic"]
    )
    assert planned.fused_train_s == pytest.approx(2 * (planner(2, [ma, mc], [a / ma, c / mc]) + sync))
    # each stage's busy time (a + c per update, 2 updates) bounds it below; paying the bubble once, above
    assert 2 * (a + c + sync) <= planned.fused_train_s < default.fused_train_s
    assert planned.train_s == default.train_s


def test_bad_input_is_named():
    sim, _, specs, cfgs = _setup()
    with pytest.raises(ValueError, match="64 response lengths in 1...256"):
        estimate_fusion(sim, specs, cfgs, [256] * 63)
    with pytest.raises(ValueError, match="colocated on the same devices"):
        estimate_fusion(sim, specs, {**cfgs, "ref": Parallel(1, 1, 8)}, [256] * 64)
    with pytest.raises(ValueError, match="generation sizes"):
        estimate_fusion(sim, specs, {**cfgs, "actor": Parallel(2, 4, 2)}, [256] * 64)
    with pytest.raises(ValueError, match="migrate_by must be 'kv' .* or 'prefill'"):
        estimate_fusion(sim, specs, cfgs, [256] * 64, migrate_by="rdma")
