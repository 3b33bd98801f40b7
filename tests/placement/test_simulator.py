"""The cost model against figures worked out by hand (toy fixtures in conftest.py), and its invariants on the
paper's models."""

import pytest

from placement import (ROLES, AutoMapper, Parallel, Simulator, Workload, a100_80gb, iteration_cost, llama_7b,
                       llama_13b, llama_70b)

ACTOR, REF = ROLES["actor"], ROLES["ref"]
F32 = 358_016  # toy forward FLOPs per token over a 32-token sequence


def test_static_memory_is_16_bytes_a_parameter_for_training(toy_sim, toy_spec):
    P = 177_216
    assert toy_sim.static_bytes(toy_spec, ACTOR, Parallel(1, 1, 1)) == 16 * P
    # bf16 weights and gradients split over t·p = 2, fp32 Adam states over t·p·d = 8.
    assert toy_sim.static_bytes(toy_spec, ACTOR, Parallel(1, 2, 4)) == 4 * P / 2 + 12 * P / 8
    assert toy_sim.static_bytes(toy_spec, REF, Parallel(2, 2, 1)) == 2 * P / 4


def test_training_time_by_hand(toy_sim, toy_spec):
    # Two updates of 4 sequences·32 tokens = 128 tokens, 4 forward-equivalents (recompute), 1e12 FLOP/s.
    update = 4 * F32 * 128 / 1e12
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 1, 1)) == pytest.approx(2 * update)
    # t = 2 halves compute and adds 4 all-reduces per layer per micro-batch (4 layers, 2 micro-batches), each
    # moving 2·(1/2)·(64 tokens·64 hidden·2 bytes) over 1e10 B/s.
    tp = 4 * 4 * 2 * (8192 / 1e10)
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 2, 1)) == pytest.approx(2 * (update / 2 + tp))
    # d = 4 (spans two 2-GPU nodes): one sequence per replica, one micro-batch, and a gradient all-reduce of
    # 2·(3/4)·(2 bytes·177,216) over the inter-node share 8e9/2 per GPU.
    dp = 2 * 0.75 * 354_432 / 4e9
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 1, 4)) == pytest.approx(2 * (4 * F32 * 32 / 1e12 + dp))


def test_pipeline_bubble_and_hops_by_hand(toy_sim, toy_spec):
    # p = 2 over 2 micro-batches: compute/2, two hops (activations forward, gradients back) of 8192 bytes per
    # micro-batch over NVLink, stretched by the 1F1B bubble 1 + (p-1)/m = 1.5.
    compute = 4 * F32 * 128 / 1e12 / 2
    hops = 2 * 2 * 8192 / 1e10
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(2, 1, 1)) == pytest.approx(2 * (compute + hops) * 1.5)


def test_scoring_is_one_forward_pass(toy_sim, toy_spec):
    # All 8 sequences (256 tokens) once; pure data parallelism just divides them.
    assert toy_sim.inference_s(toy_spec, REF, Parallel(1, 1, 1)) == pytest.approx(F32 * 256 / 1e12)
    assert toy_sim.inference_s(toy_spec, REF, Parallel(1, 1, 4)) == pytest.approx(F32 * 64 / 1e12)


def test_transition_matches_hybridflow_table_2(toy_sim, toy_spec):
    M = 2 * 177_216
    # (t·p − t_g·p_g)/(t_g·p_g·t·p)·M bytes per rank: (2 − 1)/(1·2) = 1/2 of M on NVLink inside a 2-GPU node;
    assert toy_sim.transition_s(toy_spec, Parallel(1, 2, 1, 1, 1)) == pytest.approx(M / 2 / 1e10)
    # (4 − 2)/(2·4) = 1/4 of M over the network share 8e9/2 once the t·p = 4 group spans two nodes;
    assert toy_sim.transition_s(toy_spec, Parallel(2, 2, 1, 1, 2)) == pytest.approx(M / 4 / 4e9)
    # ...nothing when generation keeps the training sizes.
    assert toy_sim.transition_s(toy_spec, Parallel(2, 2, 1, 2, 2)) == 0.0
    big = llama_70b()
    sim = Simulator(a100_80gb())
    # 70B, t = 8, p = 2 -> t_g = 4, p_g = 1: (16 − 4)/(4·16) = 3/16 of 2·69.0e9 bytes over the network share.
    expected = 10e-6 + 3 / 16 * 2 * big.params() / (200e9 / 8 / 8)
    assert sim.transition_s(big, Parallel(2, 8, 1, 1, 4)) == pytest.approx(expected)


def test_generation_by_hand(toy_sim, toy_spec):
    cfg = Parallel(1, 1, 1, 1, 1)
    kv_seq = 1024 * 32  # a whole 32-token sequence is reserved
    assert toy_sim.kv_bytes_per_sequence(toy_spec, cfg) == kv_seq

    def wave(batch):
        prefill = batch * 16 * (2 * 170_816 + 2 * 4 * 16 * 64) / 1e12
        # Per step: weights (2·170,816 bytes) and the batch's KV at mean context 24 over 1e11 B/s; compute is lower.
        step = (2 * 170_816 + batch * 24 * 1024) / 1e11
        assert batch * (2 * 170_816 + 4 * 4 * 24 * 64) / 1e12 < step
        return prefill + 16 * step

    assert toy_sim.generation_s(toy_spec, cfg, 1e9) == pytest.approx(wave(8))  # all 8 sequences at once
    # Room for 3 sequences: 3 waves of 3 (the KV limit is respected, never exceeded).
    assert toy_sim.max_batch(toy_spec, cfg, 3 * kv_seq + 100) == 3
    assert toy_sim.generation_s(toy_spec, cfg, 3 * kv_seq + 100) == pytest.approx(3 * wave(3))
    assert toy_sim.generation_s(toy_spec, cfg, kv_seq - 1) is None


def test_generation_shard_and_kv_split(toy_sim, toy_spec):
    cfg = Parallel(2, 2, 1, 1, 1)  # trains on a quarter of the weights, generates with all of them
    assert toy_sim.generation_extra_bytes(toy_spec, cfg) == 2 * 177_216 * (1 - 1 / 4)
    assert toy_sim.kv_bytes_per_sequence(toy_spec, Parallel(2, 2, 1, 2, 2)) == 1024 * 32 / 4


def test_iteration_cost_sums_stages_of_the_slowest_set():
    colocated = (1.0 + 2.0, 3.0, 4.0 + 1.0)  # two models in one set: their stage times add up
    concurrent = (0.0, 5.0, 2.0)
    assert iteration_cost([colocated, concurrent]) == 3.0 + 5.0 + 5.0
    assert iteration_cost([colocated]) == 11.0
    assert iteration_cost([]) == 0.0


def test_colocated_peak_is_all_state_plus_the_largest_working_set(toy_sim, toy_spec):
    a, r = Parallel(1, 1, 1, 1, 1), Parallel(1, 1, 1)
    static = toy_sim.static_bytes(toy_spec, ACTOR, a) + toy_sim.static_bytes(toy_spec, REF, r)
    working = max(toy_sim.activation_bytes(toy_spec, ACTOR, a), toy_sim.activation_bytes(toy_spec, REF, r),
                  toy_sim.kv_bytes_per_sequence(toy_spec, a))
    assert toy_sim.colocated_peak_bytes([(toy_spec, ACTOR, a), (toy_spec, REF, r)]) == static + working


@pytest.mark.parametrize("spec", [llama_7b(), llama_13b(), llama_70b()], ids=["7b", "13b", "70b"])
def test_doubling_devices_never_slows_a_compute_bound_stage(spec):
    mapper = AutoMapper({"actor": spec, "critic": spec, "ref": spec})
    for role, stage in (("actor", 2), ("critic", 2), ("critic", 1), ("ref", 1)):
        best = [min((o.stages[stage] for o in mapper.options(role, 2**i)), default=None) for i in range(10)]
        times = [b for b in best if b is not None]
        assert len(times) >= 4
        assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(times, times[1:])), (role, stage, times)


def test_workload_validation_names_the_fix():
    with pytest.raises(ValueError, match="mini_batches_per_step=3"):
        Workload(prompts_per_step=8, mini_batches_per_step=3)
    with pytest.raises(ValueError, match="Workload.prompt_tokens"):
        Workload(prompt_tokens=0)
    assert Workload(samples_per_prompt=4, baseline_samples_per_prompt=1).generated_sequences == 1024 * 5
