"""Algorithm 1: enumeration counts, memory floors, exactness of the allocation search, and cases whose best
plan is known by argument."""

import random
import time

import pytest

from placement import (ALGORITHMS, ROLES, AutoMapper, Hardware, LlamaSpec, Parallel, Workload, allocations, auto_map,
                       device_counts, iteration_cost, llama_7b, llama_13b, llama_70b, set_partitions)
from placement.search import _best_allocation

GIB = 2**30


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
    # 16 bytes a parameter + one 2048-token sequence of KV cache, over 90% of 80 GiB: 1.41 -> 2 GPUs.
    need = 16 * 6_738_415_616 + 2048 * 524_288
    assert need / (0.9 * 80 * GIB) == pytest.approx(1.408, abs=1e-3)
    mapper = AutoMapper({"actor": llama_7b()})
    assert mapper.memory_floor(("actor",)) == 2
    assert mapper.min_devices(("actor",), 8) == 2  # and a config fits there: t = 2 holds 8 bytes a parameter


def test_memory_floor_of_70b_ppo():
    # Actor and critic train (16 B/param), ref and reward score (2 B/param); LM-head and value-head 70B sizes.
    lm, value = 68_976_648_192, 68_714_512_384
    need = 18 * (lm + value) + 2048 * 327_680
    assert need / (0.9 * 80 * GIB) == pytest.approx(32.07, abs=0.01)
    mapper = AutoMapper({r: llama_70b() for r in ALGORITHMS["ppo"]})
    roles = tuple(mapper.models)
    assert mapper.memory_floor(roles) == 33
    assert mapper.min_devices(roles, 128) == 40  # the next whole node count, where every member fits together
    with pytest.raises(ValueError, match="no placement of actor, critic, ref, reward fits on 32"):
        mapper.search(32)


def _random_tables(rng, k):
    counts = device_counts(32, 8)
    tables = []
    for _ in range(k):
        floor = rng.choice(counts[:4])
        tables.append([(c, tuple(rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(3)))
                       for c in counts if c >= floor and rng.random() < 0.85])
    return tables


@pytest.mark.parametrize("seed", range(60))
def test_branch_and_bound_equals_exhaustive_enumeration(seed):
    # Arbitrary stage vectors, neither monotone nor smooth in the count, so every bound must hold in general.
    rng = random.Random(seed)
    tables = [t for t in _random_tables(rng, rng.choice([2, 3, 4, 5])) if t]
    exhaustive = min((iteration_cost([dict(t)[c] for t, c in zip(tables, alloc)]) for alloc in _complete(tables, 32)),
                     default=None)
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
    assert all(c <= best * 1.1 for _, c in result.ranking)


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
    assert result.stages["inference"] == pytest.approx(result.sets[0].models[1].inference_s)


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
    result = auto_map({"actor": llama_13b(), "critic": llama_70b(), "ref": llama_13b(), "reward": llama_70b()}, 128)
    elapsed = time.perf_counter() - start
    assert elapsed < 60  # issue target; measured about 0.1 s on the 2-core CI machine
    assert result.search_s <= elapsed
    assert result.placements == 15


def test_parallel_config_enumeration():
    mapper = AutoMapper({"actor": llama_13b(), "ref": llama_13b()})
    # 13B: 40 heads and 40 layers. On 8 devices t in {1, 2, 4, 8}, p in {1, 2, 4, 8} dividing 40 and 8/t.
    assert sorted(c.train for c in mapper.configs("ref", 8)) == sorted(
        [(1, 1, 8), (2, 1, 4), (4, 1, 2), (8, 1, 1), (1, 2, 4), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 4, 1),
         (1, 8, 1)])
    # The actor adds every (p_g, t_g) dividing (p, t): for (2, 4, 1), 2 · 3 choices.
    assert sum(1 for c in mapper.configs("actor", 8) if c.train == (2, 4, 1)) == 6
    assert Parallel(2, 4, 1, 1, 2) in mapper.configs("actor", 8)
