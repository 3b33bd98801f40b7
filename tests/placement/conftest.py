"""A toy model, hardware and workload whose costs are small round numbers, worked out by hand in the tests."""

import pytest

from placement import Hardware, LlamaSpec, Simulator, Workload


@pytest.fixture
def toy_spec() -> LlamaSpec:
    # Per layer: q, o 64·64 each; k, v 64·(4·16) each; MLP 3·64·128; two norms 64 each = 41,088.
    # Total: embedding 100·64 + 4·41,088 + final norm 64 + LM head 100·64 = 177,216.
    return LlamaSpec(hidden=64, layers=4, heads=4, ffn=128, vocab=100)


@pytest.fixture
def toy_hw() -> Hardware:
    # Efficiencies 1, no latencies and no host time, so every time is bytes or FLOPs over a round rate. Two GPUs a
    # node: NVLink 1e10 B/s per GPU, 8e9 B/s of network per node.
    return Hardware(
        "toy",
        memory_bytes=1e9,
        peak_flops=1e12,
        hbm_bytes_s=1e11,
        nvlink_bytes_s=1e10,
        network_bytes_s=8e9,
        gpus_per_node=2,
        mfu=1,
        mbu=1,
        nvlink_efficiency=1,
        network_efficiency=1,
        usable_memory_fraction=1,
        nvlink_latency_s=0,
        network_latency_s=0,
        decode_step_host_s=0,
        decode_sequence_host_s=0,
    )


@pytest.fixture
def toy_workload() -> Workload:
    # 8 sequences of 16 + 16 tokens; 2 mini-batches of 4 sequences (128 tokens); 64-token micro-batches.
    return Workload(
        prompts_per_step=8, prompt_tokens=16, response_tokens=16, mini_batches_per_step=2, micro_batch_tokens=64
    )


@pytest.fixture
def toy_sim(toy_hw, toy_workload) -> Simulator:
    return Simulator(toy_hw, toy_workload)
