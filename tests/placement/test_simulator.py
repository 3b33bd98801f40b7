"""The cost model against figures worked out by hand (toy fixtures in conftest.py: two GPUs a node, NVLink 1e10 B/s
per GPU, 8e9 B/s of network per node, 1e12 FLOP/s, 1e11 B/s HBM, no latencies), and its invariants on the paper's
models."""

import dataclasses

import pytest

from placement import (
    ROLES,
    AutoMapper,
    Parallel,
    Simulator,
    Workload,
    a100_80gb,
    h100,
    h200,
    iteration_cost,
    llama_7b,
    llama_13b,
    llama_70b,
)

ACTOR, REF = ROLES["actor"], ROLES["ref"]
P = 177_216  # toy parameters (LM head included)
F32 = 358_016  # toy forward FLOPs per token over a 32-token sequence


def test_static_memory_is_18_bytes_a_parameter_for_training(toy_sim, toy_spec):
    # bf16 weights (2) and fp32 gradients (4) of the t·p shard, fp32 master, m, v (12) over t·p·d as well.
    assert toy_sim.static_bytes(toy_spec, ACTOR, Parallel(1, 1, 1)) == 18 * P
    assert toy_sim.static_bytes(toy_spec, ACTOR, Parallel(1, 2, 4)) == 6 * P / 2 + 12 * P / 8
    assert toy_sim.static_bytes(toy_spec, REF, Parallel(2, 2, 1)) == 2 * P / 4


def test_training_time_by_hand(toy_sim, toy_spec):
    # Two updates of 4 sequences·32 tokens = 128 tokens, 4 forward-equivalents (recompute), 1e12 FLOP/s.
    update = 4 * F32 * 128 / 1e12
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 1, 1)) == pytest.approx(2 * update)
    # t = 2 halves compute and adds 6 all-reduce equivalents per layer per micro-batch (forward, recompute,
    # backward; 4 layers, 2 micro-batches of 64 tokens), each sending 2·(1/2)·(64·64·2 bytes) over NVLink.
    tp = 6 * 4 * 2 * (8192 / 1e10)
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 2, 1)) == pytest.approx(2 * (update / 2 + tp))


def test_gradient_sync_shares_the_node_network(toy_sim, toy_spec):
    # d = 4 over two 2-GPU nodes, t = 1: one sequence per replica, one micro-batch; the distributed optimizer
    # reduce-scatters fp32 gradients and all-gathers bf16 weights: each rank sends (3/4)·(4 + 2)·P bytes. Two of
    # the group's ranks sit on each node, so the ring crosses each node's 8e9 B/s once: 8e9·2/2 per rank.
    dp = 0.75 * 6 * P / 8e9
    assert toy_sim.gradient_sync_s(toy_spec, ACTOR, Parallel(1, 1, 4)) == pytest.approx(dp)
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(1, 1, 4)) == pytest.approx(2 * (4 * F32 * 32 / 1e12 + dp))
    # t = 2, d = 2: the two DP groups (one per TP rank) each cross the node boundary and share its network:
    # 8e9/2 per rank for (1/2)·6·(P/2) bytes.
    assert toy_sim.gradient_sync_s(toy_spec, ACTOR, Parallel(1, 2, 2)) == pytest.approx(0.5 * 6 * P / 2 / 4e9)
    assert toy_sim.gradient_sync_s(toy_spec, ACTOR, Parallel(1, 2, 1)) == 0.0


def test_pipeline_bubble_hops_and_sync_add_up_by_hand(toy_sim, toy_spec):
    # p = 2 over 2 micro-batches inside a node: compute/2, four hops (activations forward, gradients back, per
    # micro-batch) of 8192 bytes over NVLink, stretched by the 1F1B bubble (m + p - 1)/m = 1.5.
    compute = 4 * F32 * 128 / 1e12 / 2
    hops = 4 * 8192 / 1e10
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(2, 1, 1)) == pytest.approx(2 * (compute + hops) * 1.5)
    # p = 2, d = 2 on two nodes: stages are t·d = 2 ranks apart, on different nodes, each node's network shared by
    # its two GPUs (4e9 per rank); one 64-token micro-batch per replica, bubble (1 + 1)/1 = 2; the DP pair shares a
    # node (NVLink) for (1/2)·6·(P/2) bytes.
    compute = 4 * F32 * 64 / 1e12 / 2
    hops = 2 * 8192 / 4e9
    dp = 0.5 * 6 * P / 2 / 1e10
    assert toy_sim.train_s(toy_spec, ACTOR, Parallel(2, 1, 2)) == pytest.approx(2 * ((compute + hops) * 2 + dp))


def test_scoring_is_one_forward_pass(toy_sim, toy_spec):
    # All 8 sequences (256 tokens) once; pure data parallelism just divides them.
    assert toy_sim.inference_s(toy_spec, REF, Parallel(1, 1, 1)) == pytest.approx(F32 * 256 / 1e12)
    assert toy_sim.inference_s(toy_spec, REF, Parallel(1, 1, 4)) == pytest.approx(F32 * 64 / 1e12)


@pytest.mark.parametrize(
    "cfg, fraction",
    [
        (Parallel(1, 8, 1, 1, 2), (8 - 2) / (2 * 8)),  # TP 8 -> 2: each rank gathers 3/8 of the model
        (Parallel(2, 4, 1, 1, 2), (8 - 2) / (2 * 8)),  # PP 2 x TP 4 -> TP 2
        (Parallel(4, 4, 1, 2, 2), (16 - 4) / (4 * 16)),  # p_g > 1 too
        (Parallel(2, 2, 1, 2, 2), 0.0),  # generation keeps the training sizes: nothing moves
    ],
)
def test_transition_bytes_are_hybridflow_table_2(toy_sim, toy_spec, cfg, fraction):
    # (t·p − t_g·p_g)/(t_g·p_g·t·p)·M bytes received per rank, M the bf16 weights.
    assert toy_sim.transition_bytes(toy_spec, cfg) == pytest.approx(fraction * 2 * P)


def test_transition_time_over_the_real_links(toy_sim, toy_spec):
    M = 2 * P
    # 1/2 of M inside a 2-GPU node, over NVLink.
    assert toy_sim.transition_s(toy_spec, Parallel(1, 2, 1, 1, 1)) == pytest.approx(M / 2 / 1e10)
    # 1/4 of M across the two stages of a (2, 2) model, on different nodes: the node's network over its two GPUs.
    assert toy_sim.transition_s(toy_spec, Parallel(2, 2, 1, 1, 2)) == pytest.approx(M / 4 / 4e9)
    assert toy_sim.transition_s(toy_spec, Parallel(2, 2, 1, 2, 2)) == 0.0
    # 70B on A100s, t = 8, p = 2 -> t_g = 4: 3/16 of 2·69.0e9 bytes; the micro-DP group has 2 ranks on each of two
    # nodes, so 4 groups share each 200 Gb/s network at 90%: 25e9·0.9·2/8 per rank, plus one network latency.
    big, sim = llama_70b(), Simulator(a100_80gb())
    expected = 25e-6 + 3 / 16 * 2 * big.params() / (25e9 * 0.9 * 2 / 8)
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


def test_decoding_waits_for_the_engine_host_work(toy_hw, toy_workload, toy_spec):
    # 1 ms a step plus 0.1 ms a running sequence, added to the GPU's step (the GPU idles meanwhile).
    host = Simulator(dataclasses.replace(toy_hw, decode_step_host_s=1e-3, decode_sequence_host_s=1e-4), toy_workload)
    bare = Simulator(toy_hw, toy_workload)
    cfg = Parallel(1, 1, 1, 1, 1)
    for batch in (1, 8):
        assert host.decode_step_s(toy_spec, cfg, batch) == pytest.approx(
            bare.decode_step_s(toy_spec, cfg, batch) + 1e-3 + 1e-4 * batch
        )
    # 8 sequences, one wave of 16 steps.
    assert host.generation_s(toy_spec, cfg, 1e9) == pytest.approx(
        bare.generation_s(toy_spec, cfg, 1e9) + 16 * (1e-3 + 8e-4)
    )


def test_generation_shard_and_kv_split(toy_sim, toy_spec):
    cfg = Parallel(2, 2, 1, 1, 1)  # trains on a quarter of the weights, generates with all of them
    assert toy_sim.generation_extra_bytes(toy_spec, cfg) == 2 * P * (1 - 1 / 4)
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
    working = max(
        toy_sim.activation_bytes(toy_spec, ACTOR, a),
        toy_sim.activation_bytes(toy_spec, REF, r),
        toy_sim.kv_bytes_per_sequence(toy_spec, a),
    )
    assert toy_sim.colocated_peak_bytes([(toy_spec, ACTOR, a), (toy_spec, REF, r)]) == static + working


def test_links_follow_megatrons_rank_order():
    sim = Simulator(a100_80gb())
    nvlink, network = 300e9 * 0.77, 25e9 * 0.9
    assert sim._link(1, 8) == (pytest.approx(nvlink), 10e-6)  # a TP group of 8: one node
    assert sim._link(8, 4) == (pytest.approx(network / 8), 25e-6)  # DP after t = 8: 8 groups share each node
    assert sim._link(1, 16)[0] == pytest.approx(network)  # DP with t = 1: 8 ranks a node, one crossing per node
    assert sim._link(2, 16)[0] == pytest.approx(network / 2)  # t = 2: 4 ranks a node, the 2 TP ranks' groups share


@pytest.mark.parametrize(
    "profile, flops, hbm",
    [
        (a100_80gb, 312e12 * 0.5, 2.039e12 * 0.6),
        (h100, 989e12 * 0.4, 3.35e12 * 0.6),
        (h200, 989e12 * 0.4, 4.8e12 * 0.6),
    ],
)
def test_profiles_are_datasheet_peaks_times_measured_fractions(profile, flops, hbm):
    hw = profile()
    assert hw.flops_s == pytest.approx(flops)
    assert hw.decode_bytes_s == pytest.approx(hbm)


@pytest.mark.parametrize("spec, gpus, best", [(llama_7b(), 16, 2), (llama_13b(), 32, 4)], ids=["7b", "13b"])
def test_generation_prefers_a_smaller_tp_than_training(spec, gpus, best):
    # HybridFlow Fig. 15: an actor trained with t = 8 generates fastest with t_g = 2 (7B) or 4 (13B); t_g = 8
    # leaves each replica so many sequences that the engine's per-sequence host work and KV reads dominate.
    sim = Simulator(a100_80gb())
    times = {}
    for t_g in (1, 2, 4, 8):
        cfg = Parallel(1, 8, gpus // 8, 1, t_g)
        times[t_g] = sim.generation_s(spec, cfg, sim.hw.usable_bytes - sim.static_bytes(spec, ACTOR, cfg))
    assert min(times, key=times.get) == best
    assert times[8] > 1.1 * times[best]


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
