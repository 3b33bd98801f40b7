"""The system the simulator costs plans on: accelerator, network and what software reaches of them (HybridFlow §6,
§8.1). Every constant of the cost model lives here, with its source; docs/placement.md tabulates them.

A `Hardware` holds two kinds of numbers:

- **Published peaks** (vendor datasheets, the paper's testbed): device memory, dense bf16 FLOP/s, HBM bandwidth,
  NVLink bandwidth per GPU and direction, network bandwidth per node and direction.
- **Achieved fractions** (public measurements of the software HybridFlow builds on): the FLOP/s that Megatron-style
  training and prefill reach (`mfu`), the HBM bandwidth that decoding reaches (`mbu`), the link rate NCCL's
  collectives reach, the memory left to models, collective latencies, and the host time a generation engine spends
  per decoding step (scheduling, input preparation, sampling), during which the GPU idles.

Sources of the achieved fractions:

- `mfu` 0.50 on A100: Megatron-LM's 3D-parallel GPT runs reach 44-52% of the A100's peak, counting recomputed
  FLOPs (Narayanan et al., SC'21, Table 1); the simulator also counts recomputation, so the two agree. 0.40 on
  Hopper: Llama 3's pre-training reports 38-43% bf16 MFU on H100 (Dubey et al. 2024); H200 has the same tensor cores.
- `mbu` 0.60: decoding kernels read weights and KV cache at 50-70% of peak HBM bandwidth in public serving studies
  (e.g. the "model bandwidth utilisation" figures of Databricks' 2023 LLM inference study).
- NVLink efficiency: nccl-tests' all-reduce bus bandwidth on 8 x A100 SXM is about 230 GB/s of the 300 GB/s per
  direction (0.77); on 8 x H100 about 360 GB/s of 450 without NVLink SHARP (0.8).
- Network efficiency 0.9: InfiniBand collectives reach about 90% of the line rate in nccl-tests.
- Latencies: a small NCCL collective inside a node costs about 10 us, across nodes about 25 us.
- Usable memory 0.9: the CUDA context, NCCL buffers and allocator slack; vLLM's default `gpu_memory_utilization`.
- Decoding host time 4 ms per step plus 30 us per running sequence: vLLM's multi-step scheduling RFC
  (vllm-project/vllm#6854) measures 5-13 ms of GPU idle per decoding step spent on scheduling, input preparation
  and output processing, growing with the batch; 4 ms + 30 us/sequence spans that range over batches of 32-300.
  This per-sequence term is what makes a smaller generation TP size pay off (HybridFlow Fig. 15): more, smaller
  replicas share the host work, each with its own process.

Deviations, and why:
- A collective whose group crosses nodes shares the node's network with the other groups of its kind that have
  ranks on the node (`Simulator._bandwidth`), rather than modelling NCCL's topology-aware rings and trees.
- One fraction per resource rather than per-kernel profiles: the search compares plans, and a handful of sourced
  numbers keeps the ranking explainable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One accelerator type, the network around it, and what the software stack achieves on them."""

    name: str
    memory_bytes: float
    """Device memory per GPU."""
    peak_flops: float
    """Dense bf16 FLOP/s per GPU."""
    hbm_bytes_s: float
    """HBM bandwidth per GPU, bytes/s."""
    nvlink_bytes_s: float
    """NVLink bandwidth per GPU and direction, bytes/s (half the bidirectional datasheet figure)."""
    network_bytes_s: float
    """Network bandwidth per node and direction, bytes/s, shared by the node's GPUs."""
    gpus_per_node: int = 8
    mfu: float = 0.5
    """Fraction of peak FLOP/s that training, prefill and scoring reach (recomputed FLOPs counted)."""
    mbu: float = 0.6
    """Fraction of HBM bandwidth that decoding reaches."""
    nvlink_efficiency: float = 0.77
    """Fraction of the NVLink rate that NCCL collectives reach (bus bandwidth)."""
    network_efficiency: float = 0.9
    """Fraction of the network rate that NCCL collectives reach."""
    usable_memory_fraction: float = 0.9
    """Fraction of device memory left for model state after the CUDA context, NCCL buffers and allocator slack."""
    nvlink_latency_s: float = 10e-6
    """Start-up cost of one collective (or point-to-point message) inside a node."""
    network_latency_s: float = 25e-6
    """Start-up cost of one collective (or point-to-point message) across nodes."""
    decode_step_host_s: float = 3e-3
    """Host time per decoding step of one generation replica (scheduler, input preparation, sampling)."""
    decode_sequence_host_s: float = 85e-6
    """Host time per decoding step per running sequence of one generation replica."""

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_flops", "hbm_bytes_s", "nvlink_bytes_s", "network_bytes_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Hardware.{field} must be positive, got {getattr(self, field)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"Hardware.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for field in ("mfu", "mbu", "nvlink_efficiency", "network_efficiency", "usable_memory_fraction"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Hardware.{field} must be in (0, 1], got {getattr(self, field)}")
        for field in ("nvlink_latency_s", "network_latency_s", "decode_step_host_s", "decode_sequence_host_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"Hardware.{field} must be >= 0, got {getattr(self, field)}")

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def flops_s(self) -> float:
        """Achieved FLOP/s of one GPU on large matmuls."""
        return self.peak_flops * self.mfu

    @property
    def decode_bytes_s(self) -> float:
        """Achieved HBM bandwidth of one GPU while decoding."""
        return self.hbm_bytes_s * self.mbu

    @property
    def nvlink_busbw(self) -> float:
        """Achieved collective bandwidth per GPU inside a node."""
        return self.nvlink_bytes_s * self.nvlink_efficiency

    @property
    def network_busbw(self) -> float:
        """Achieved collective bandwidth of one node's network, shared by its GPUs."""
        return self.network_bytes_s * self.network_efficiency

    def with_gpus_per_node(self, gpus_per_node: int) -> Hardware:
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)


def a100_80gb() -> Hardware:
    """The HybridFlow testbed (§8.1): A100 SXM 80GB (312 TFLOP/s bf16, 2,039 GB/s HBM2e, NVLink 3 at 600 GB/s
    bidirectional), 8 per machine, 200 Gb/s between machines."""
    return Hardware(
        "a100-80gb",
        memory_bytes=80 * GIB,
        peak_flops=312e12,
        hbm_bytes_s=2.039e12,
        nvlink_bytes_s=300e9,
        network_bytes_s=200e9 / 8,
    )


def h100() -> Hardware:
    """H100 SXM 80GB (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s bidirectional), eight 400 Gb/s
    NICs per node (DGX H100)."""
    return Hardware(
        "h100",
        memory_bytes=80 * GIB,
        peak_flops=989e12,
        hbm_bytes_s=3.35e12,
        nvlink_bytes_s=450e9,
        network_bytes_s=8 * 400e9 / 8,
        mfu=0.4,
        nvlink_efficiency=0.8,
    )


def h200() -> Hardware:
    """H200 SXM 141GB: the H100's compute and NVLink with more and faster HBM (4.8 TB/s HBM3e)."""
    return Hardware(
        "h200",
        memory_bytes=141e9,
        peak_flops=989e12,
        hbm_bytes_s=4.8e12,
        nvlink_bytes_s=450e9,
        network_bytes_s=8 * 400e9 / 8,
        mfu=0.4,
        nvlink_efficiency=0.8,
    )


PROFILES = {"a100-80gb": a100_80gb, "h100": h100, "h200": h200}


def get_hardware(name: str) -> Hardware:
    try:
        return PROFILES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown GPU profile {name!r}; choose one of {', '.join(PROFILES)}") from None
