"""Algorithm 1: enumeration counts, memory floors, exactness of the allocation search, and cases whose best
plan is known by argument."""

import random
import time

import pytest

from placement import (
    ALGORITHMS,
    ROLES,
    AutoMapper,
    Hardware,
    LlamaSpec,
    Parallel,
    Workload,
    allocations,
    auto_map,
    device_counts,
    iteration_cost,
    llama_7b,
    llama_13b,
    llama_70b,
    set_partitions,
)
from placement.search import _best_allocation, _pareto

GIB = 2**30
HETEROGENEOUS = {"actor": llama_13b(), "critic": llama_70b(), "ref": llama_13b(), "reward": llama_70b()}


@pytest.mark.parametrize("n, bell", [(0, 1), (1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)])
def test_placements_are_the_set_partitions(n, bell):
    items = "abcdef"[:n]
    partitions = list(set_partitions(items))
    assert len(partitions) == bell
    canonical = {frozenset(frozenset(s) for s in p) for p in partitions}
    assert len(canonical) == bell  # each once
    assert all(sorted(r for s in p for r in s) == sorted(items) for p in partitions)


def test_device_counts_are_powers_of_two_in_a_node_then_whole_nodes():
    assert device_counts(64, 8) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert device_counts(4, 8) == [1, 2, 4]
    assert device_counts(12, 8) == [1, 2, 4, 8]


def test_allocation_counts():
    # Three sets of at least a node on 4 nodes: one set takes two nodes, in 3 ways.
    assert sorted(allocations([8, 8, 8], 32, device_counts(32, 8))) == [(8, 8, 16), (8, 16, 8), (16, 8, 8)]
    # Three sets inside one 8-GPU node: 4 + 2 + 2 in 3 orders.
    assert len(list(allocations([1, 1, 1], 8, device_counts(8, 8)))) == 3
    # Two sets on 16 nodes: 15 ways to cut 16 nodes in two, none with a partial node (it could not add up).
    assert len(list(allocations([8, 8], 128, device_counts(128, 8)))) == 15


def test_memory_floor_of_a_7b_actor():
    # 18 bytes a parameter + one 2048-token sequence of KV cache, over 90% of 80 GiB: 1.58 -> 2 GPUs.
    need = 18 * 6_738_415_616 + 2048 * 524_288
    assert need / (0.9 * 80 * GIB) == pytest.approx(1.583, abs=1e-3)
    mapper = AutoMapper({"actor": llama_7b()})
    assert mapper.memory_floor(("actor",)) == 2
    assert mapper.min_devices(("actor",), 8) == 2  # and a config fits there: t = 2 holds 9 bytes a parameter


def test_memory_floor_of_70b_ppo():
    # Actor and critic train (18 B/param), ref and reward score (2 B/param): 20 B/param of the LM-head and of the
    # value-head 70B sizes, and one sequence of GQA KV cache.
    lm, value = 68_976_648_192, 68_714_512_384
    need = 20 * (lm + value) + 2048 * 327_680
    assert need / (0.9 * 80 * GIB) == pytest.approx(35.63, abs=0.01)
    mapper = AutoMapper({r: llama_70b() for r in ALGORITHMS["ppo"]})
    roles = tuple(mapper.models)
    assert mapper.memory_floor(roles) == 36
    # 40 GPUs would hold the state, but not the actor's generation shard beside it (with p_g = 1 at least M/8 =
    # 17 GB a GPU); on 48 and 56, p must divide both the 80 layers and 6 or 7 nodes, so t·p <= 16, too few to
    # shard a trained 70B. The first count where every member fits together is 64.
    assert mapper.min_devices(roles, 128) == 64
    with pytest.raises(ValueError, match="no placement of actor, critic, ref, reward fits on 32"):
        mapper.search(32)


def test_memory_floor_of_the_heterogeneous_case():
    # 13B actor (18 B/param) and reference (2), 70B critic (18, value head) and reward (2, value head), one
    # sequence of the 13B's KV cache (819,200 bytes a token): 1,636 GB over 77.3 GB usable -> 22 GPUs; some config
    # of all four fits together from 32.
    need = 20 * 13_015_864_320 + 20 * 68_714_512_384 + 2048 * 819_200
    assert need / (0.9 * 80 * GIB) == pytest.approx(21.17, abs=0.01)
    mapper = AutoMapper(HETEROGENEOUS)
    assert mapper.memory_floor(tuple(mapper.models)) == 22
    assert mapper.min_devices(tuple(mapper.models), 128) == 32


def _random_tables(rng, k):
    counts = device_counts(32, 8)
    tables = []
    for _ in range(k):
        floor = rng.choice(counts[:4])
        tables.append(
            [
                (c, tuple(rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(3)))
                for c in counts
                if c >= floor and rng.random() < 0.85
            ]
        )
    return tables


@pytest.mark.parametrize("seed", range(60))
def test_branch_and_bound_equals_exhaustive_enumeration(seed):
    # Arbitrary stage vectors, neither monotone nor smooth in the count, so every bound must hold in general.
    rng = random.Random(seed)
    tables = [t for t in _random_tables(rng, rng.choice([2, 3, 4, 5])) if t]
    exhaustive = min(
        (iteration_cost([dict(t)[c] for t, c in zip(tables, alloc)]) for alloc in _complete(tables, 32)), default=None
    )
    found, _ = _best_allocation(tables, 32)
    if exhaustive is None or found is None:
        assert exhaustive is None and found is None
    else:
        assert found[0] == pytest.approx(exhaustive)


def _complete(tables, total):
    counts = sorted({c for t in tables for c, _ in t})
    for alloc in allocations([t[0][0] for t in tables], total, counts):
        if all(c in dict(t) for t, c in zip(tables, alloc)):
            yield alloc


def test_search_equals_exhaustive_over_every_placement_and_allocation():
    mapper = AutoMapper({r: llama_7b() for r in ALGORITHMS["ppo"]})
    result = mapper.search(32)
    best = float("inf")
    for placement in set_partitions(list(mapper.models)):
        for alloc in allocations([1] * len(placement), 32, device_counts(32, 8)):
            choices = [mapper.solve_set(s, c) for s, c in zip(placement, alloc)]
            if None not in choices:
                best = min(best, iteration_cost([ch.stages for ch in choices]))
    assert result.estimated_iteration_s == pytest.approx(best)
    assert result.ranking[0][1] == pytest.approx(best)
    assert all(c <= best * 1.1 for _, c in result.ranking[2:])  # the runner-up is listed however far behind


def test_one_scoring_model_uses_pure_data_parallelism():
    # Scoring has no data-parallel communication; t > 1 adds all-reduces and p > 1 a pipeline bubble.
    result = auto_map({"ref": llama_7b()}, 8)
    assert result.plan.to_dict()["placement"] == [["ref"]]
    assert result.plan.model("ref").train == (1, 1, 8)


def test_actor_and_reference_are_colocated():
    # Their stages never overlap (generate, train vs. score), so any split leaves devices idle in every stage.
    result = auto_map({"actor": llama_7b(), "ref": llama_7b()}, 16)
    assert result.plan.to_dict()["placement"] == [["actor", "ref"]]
    assert result.plan.pools() == {"actor+ref": 16}
    # the inference stage is the actor's old log-probs and the reference's, one after the other
    assert result.stages["inference"] == pytest.approx(sum(m.inference_s for m in result.sets[0].models))


def test_models_that_cannot_share_memory_cheaply_are_split():
    # Two identical value-head scorers of 2·301M bytes on 1 GB devices: each fits a device alone, together they
    # need t = 2 or p = 2 (communication, bubble); one device each does the same work with neither.
    hw = Hardware("1gb", 1e9, 1e12, 1e11, 1e10, 8e9, gpus_per_node=2, usable_memory_fraction=1)
    spec = LlamaSpec(hidden=1024, layers=16, heads=16, ffn=4096)
    wl = Workload(prompts_per_step=64, prompt_tokens=128, response_tokens=128, micro_batch_tokens=1024)
    result = auto_map({"reward": spec, "cost": spec}, 2, hw, wl)
    assert result.plan.to_dict()["placement"] == [["reward"], ["cost"]]
    assert result.plan.pools() == {"reward": 1, "cost": 1}
    alone = result.sets[0].models[0].inference_s
    assert result.estimated_iteration_s == pytest.approx(alone)
    together = [c for p, c in result.ranking if len(p) == 1]
    assert not together or together[0] > alone


def test_small_clusters_colocate_everything():
    # On one node every model's memory floor already takes devices; sharing them all wins.
    result = auto_map({r: llama_7b() for r in ALGORITHMS["ppo"]}, 8)
    assert result.plan.to_dict()["placement"] == [["actor", "critic", "ref", "reward"]]


def test_chosen_plan_respects_memory_and_the_kv_limit():
    result = auto_map({"actor": llama_13b(), "critic": llama_13b(), "ref": llama_13b(), "reward": llama_13b()}, 64)
    mapper = AutoMapper({m.role: llama_13b() for m in result.plan.models})
    sim, usable = mapper.sim, mapper.hw.usable_bytes
    for s in result.sets:
        assert s.peak_bytes <= usable
        if "actor" in s.roles:
            actor = next(m for m in s.models if m.role == "actor")
            static = sum(sim.static_bytes(llama_13b(), ROLES[m.role], m.parallel) for m in s.models)
            kv = actor.generation_batch * sim.kv_bytes_per_sequence(llama_13b(), actor.parallel)
            assert actor.generation_batch >= 1
            assert static + sim.generation_extra_bytes(llama_13b(), actor.parallel) + kv <= usable


def test_plan_sizes_are_consistent():
    result = auto_map({r: llama_7b() for r in ALGORITHMS["safe-rlhf"]}, 64)
    assert result.placements == 203
    assert result.plan.total_gpus == 64
    for m in result.plan.models:
        p, t, d = m.train
        assert p * t * d == m.gpus and t <= 8
        if m.role == "actor":
            p_g, t_g = m.generate
            assert p % p_g == 0 and t % t_g == 0
    stages = result.stages
    assert result.estimated_iteration_s == pytest.approx(stages["generate"] + stages["inference"] + stages["train"])


def test_four_models_on_128_gpus_search_within_the_target():
    start = time.perf_counter()
    result = auto_map(HETEROGENEOUS, 128)
    elapsed = time.perf_counter() - start
    assert elapsed < 60  # issue target; measured about 0.1 s on the 2-core CI machine
    assert result.search_s <= elapsed
    assert result.placements == 15


def test_parallel_config_enumeration():
    mapper = AutoMapper({"actor": llama_13b(), "ref": llama_13b()})
    # 13B: 40 heads and 40 layers. On 8 devices t in {1, 2, 4, 8}, p in {1, 2, 4, 8} dividing 40 and 8/t.
    assert sorted(c.train for c in mapper.configs("ref", 8)) == sorted(
        [(1, 1, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1), (1, 2, 4), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 4, 1), (1, 8, 1)]
    )
    # The actor adds every t_g dividing t, with p_g = 1 (pipelined decoding, one batch in flight, pays every stage per
    # step; docs/placement.md): for
    # (2, 4, 1), t_g in {1, 2, 4}.
    assert sorted(c.generate for c in mapper.configs("actor", 8) if c.train == (2, 4, 1)) == [(1, 1), (1, 2), (1, 4)]
    assert Parallel(2, 4, 1, 1, 2) in mapper.configs("actor", 8)
    # Without pipeline parallelism (plans for the torch engine) only p = 1.
    flat = AutoMapper({"actor": llama_13b()}, pipeline=False)
    assert {c.p for c in flat.configs("actor", 8)} == {1}


def test_a_sets_stages_are_its_models_stages_summed():
    # Colocated models take turns: each stage of a set is the sum of its members' times in that stage, and each
    # member's times are the simulator's for its chosen config.
    mapper = AutoMapper(HETEROGENEOUS)
    choice = mapper.solve_set(tuple(mapper.models), 64)
    sim = mapper.sim
    assert choice.stages == pytest.approx(
        (
            sum(m.generate_s + m.transition_s for m in choice.models),
            sum(m.inference_s for m in choice.models),
            sum(m.train_s for m in choice.models),
        )
    )
    for m in choice.models:
        spec, role = HETEROGENEOUS[m.role], ROLES[m.role]
        assert m.inference_s == pytest.approx(sim.inference_s(spec, role, m.parallel))
        assert m.train_s == pytest.approx(sim.train_s(spec, role, m.parallel) if role.trains else 0.0)
    actor = next(m for m in choice.models if m.role == "actor")
    assert actor.transition_s == pytest.approx(sim.transition_s(llama_13b(), actor.parallel))
    assert choice.peak_bytes <= mapper.hw.usable_bytes


def test_concurrent_sets_take_the_maximum_stage_by_stage():
    mapper = AutoMapper(HETEROGENEOUS)
    placement = [("actor", "ref", "reward"), ("critic",)]
    cost, alloc = mapper.cost_placement(placement, 128)
    a, c = (mapper.solve_set(s, n) for s, n in zip(placement, alloc))
    assert cost == pytest.approx(sum(max(x, y) for x, y in zip(a.stages, c.stages)))
    assert c.stages[0] == 0.0  # the critic waits while the actor generates
    # and no other allocation of the two pools does better
    for n in device_counts(128, 8):
        if n < 128 and mapper.solve_set(placement[0], n) and mapper.solve_set(placement[1], 128 - n):
            other = iteration_cost(
                [mapper.solve_set(placement[0], n).stages, mapper.solve_set(placement[1], 128 - n).stages]
            )
            assert other >= cost * (1 - 1e-12)


@pytest.mark.parametrize(
    "models, gpus", [({r: llama_7b() for r in ALGORITHMS["ppo"]}, 32), (HETEROGENEOUS, 64)], ids=["7b-32", "13b70b-64"]
)
def test_runner_up_is_the_best_other_placement(models, gpus):
    mapper = AutoMapper(models)
    result = mapper.search(gpus)
    costs = {
        tuple(p): found[0]
        for p in set_partitions(list(mapper.models))
        if (found := mapper.cost_placement(p, gpus)) is not None
    }
    ordered = sorted(costs.items(), key=lambda kv: kv[1])
    assert result.ranking[0] == (ordered[0][0], pytest.approx(ordered[0][1]))
    assert result.runner_up == (ordered[1][0], pytest.approx(ordered[1][1]))
    assert sum(result.runner_up_pools.values()) == gpus


def test_small_clusters_colocate_all_the_papers_cases():
    # HybridFlow §8.4: with few GPUs every model's memory floor already takes devices; sharing them all wins.
    for models, gpus in (
        ({r: llama_7b() for r in ALGORITHMS["ppo"]}, 16),
        ({r: llama_13b() for r in ALGORITHMS["ppo"]}, 16),
        (HETEROGENEOUS, 64),
    ):
        assert auto_map(models, gpus).plan.to_dict()["placement"] == [list(models)]


def test_large_70b_cluster_puts_actor_and_critic_on_different_devices():
    # HybridFlow §8.4: at scale, actor and critic train side by side on their own devices.
    result = auto_map({r: llama_70b() for r in ALGORITHMS["ppo"]}, 128)
    assert result.plan.pool_of("actor") != result.plan.pool_of("critic")


def test_heterogeneous_split_gains_on_colocation_as_the_cluster_grows():
    # The direction of the paper's crossover: each doubling leaves colocation less ahead of the best split.
    mapper = AutoMapper(HETEROGENEOUS)
    ratios = []
    for gpus in (64, 96, 128):
        result = mapper.search(gpus)
        assert len(result.plan.placement) == 1
        ratios.append(result.runner_up[1] / result.estimated_iteration_s)
    assert ratios[0] > 1.25 and ratios == sorted(ratios, reverse=True)


def test_why_the_heterogeneous_case_stays_colocated():
    # The facts docs/placement.md ("Why the 13B/70B crossover is not reproduced") rests on. The colocated actor
    # generates in one wave (shared memory does not limit its batch), and the 70B critic's training, most of the
    # iteration, speeds up well past what the paper's 128-GPU split would need (a speedup under 1.02x).
    mapper = AutoMapper(HETEROGENEOUS)
    every = tuple(HETEROGENEOUS)
    critic = {}
    for gpus in (64, 96, 128):
        colocated = mapper.solve_set(every, gpus)
        models = {m.role: m for m in colocated.models}
        actor = models["actor"]
        assert actor.generation_batch == mapper.sim._per_replica(actor.parallel)  # one wave
        critic[gpus] = models["critic"].train_s
        assert critic[gpus] > 0.45 * sum(colocated.stages)  # about half of every colocated iteration
    assert 1.7 < critic[64] / critic[128] < 2.0
    halves = [mapper.solve_set(("actor", "ref", "reward"), 64), mapper.solve_set(("critic",), 64)]
    split = iteration_cost([s.stages for s in halves])
    colocated = sum(mapper.solve_set(every, 128).stages)
    assert split > 1.3 * colocated  # the paper's best at 128 (measured), costed here: 233 s against 171 s


@pytest.mark.xfail(
    strict=True,
    reason="HybridFlow measured split ahead from 96 GPUs; under its d_cost with "
    "published A100 figures colocation stays ahead to 128 (docs/placement.md, "
    "'Why the 13B/70B crossover is not reproduced')",
)
def test_heterogeneous_case_switches_from_colocated_to_split_between_64_and_96_gpus():
    mapper = AutoMapper(HETEROGENEOUS)
    assert len(mapper.search(64).plan.placement) == 1
    assert len(mapper.search(96).plan.placement) > 1


def test_plans_with_pipeline_stages_say_they_need_megatron():
    result = auto_map({r: llama_13b() for r in ALGORITHMS["ppo"]}, 64)
    piped = [m.role for m in result.plan.models if m.train[0] > 1]
    assert piped and result.engine == "megatron"
    out = result.to_dict()
    assert out["engine"] == "megatron" and "model.engine=megatron" in out["engine_note"]
    assert all(f"{r} (p=" in out["engine_note"] for r in piped)
    assert all(
        m.generate[0] == 1 for m in result.plan.models if m.generate
    )  # p_g = 1: the search proposes no pipelined decoding


def test_torch_only_search_keeps_p_1():
    models = {r: llama_13b() for r in ALGORITHMS["ppo"]}
    result = auto_map(models, 64, pipeline=False)
    assert all(m.train[0] == 1 for m in result.plan.models)
    assert result.engine == "torch" and "either engine" in result.to_dict()["engine_note"]
    assert result.estimated_iteration_s >= auto_map(models, 64).estimated_iteration_s  # a subset of the plans


@pytest.mark.parametrize("seed", range(20))
def test_pareto_frontier_equals_brute_force(seed):
    rng = random.Random(seed)
    points = [tuple(rng.choice(range(6)) for _ in range(3)) for _ in range(rng.choice([1, 5, 40, 120]))]
    kept = _pareto(points, key=lambda p: p)
    brute = [
        p
        for i, p in enumerate(points)
        if not any(all(a <= b for a, b in zip(q, p)) and (q != p or j < i) for j, q in enumerate(points))
    ]
    assert sorted(kept) == sorted(brute)
