"""Hardware profiles for the latency simulator (HybridFlow §6 and §8.1).

A profile holds the handful of numbers the simulator needs: device memory, peak bf16 FLOP/s, HBM bandwidth, and
the two network levels (NVLink inside a node, the network between nodes). `a100_80gb()` is the paper's testbed:
8 A100-80GB per node, 600 GB/s NVLink, 200 Gb/s between machines.

Deviations, and why:
- The inter-node figure is per node and shared by its GPUs (`inter_node_bytes_per_gpu`), because a collective that
  crosses nodes (data-parallel gradients, a pipeline hop) runs on every GPU of the node at once. This is pessimistic
  where each GPU has its own NIC, so the H100/H200 profiles give the node eight 400 Gb/s NICs.
- Achievable rates are peak times an efficiency (`flops_efficiency`, `hbm_efficiency`) rather than per-kernel
  profiles: the search compares plans, and one efficiency per resource keeps the ranking while staying readable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and the network around it."""

    name: str
    memory_bytes: float
    """Device memory per GPU."""
    peak_flops: float
    """Dense bf16 FLOP/s per GPU."""
    hbm_bytes_s: float
    """HBM bandwidth per GPU, bytes/s."""
    intra_node_bytes_s: float
    """NVLink bandwidth per GPU inside a node, bytes/s."""
    inter_node_bytes_s: float
    """Network bandwidth per node, bytes/s, shared by the node's GPUs."""
    gpus_per_node: int = 8
    flops_efficiency: float = 0.5
    """Fraction of peak FLOP/s that large matmuls reach (training, prefill, scoring)."""
    hbm_efficiency: float = 0.7
    """Fraction of HBM bandwidth that decoding reaches."""
    usable_memory_fraction: float = 0.9
    """Fraction of device memory left for model state after the CUDA context, allocator slack and buffers."""
    collective_latency_s: float = 10e-6
    """Fixed start-up cost of one collective call."""

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_flops", "hbm_bytes_s", "intra_node_bytes_s", "inter_node_bytes_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Hardware.{field} must be positive, got {getattr(self, field)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"Hardware.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for field in ("flops_efficiency", "hbm_efficiency", "usable_memory_fraction"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Hardware.{field} must be in (0, 1], got {getattr(self, field)}")
        if self.collective_latency_s < 0:
            raise ValueError(f"Hardware.collective_latency_s must be >= 0, got {self.collective_latency_s}")

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def inter_node_bytes_per_gpu(self) -> float:
        return self.inter_node_bytes_s / self.gpus_per_node

    def with_gpus_per_node(self, gpus_per_node: int) -> Hardware:
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)


def a100_80gb() -> Hardware:
    """The HybridFlow testbed (§8.1): 600 GB/s NVLink, 200 Gb/s per machine."""
    return Hardware("a100-80gb", 80 * GIB, 312e12, 2.039e12, 600e9, 200e9 / 8)


def h100() -> Hardware:
    """H100 SXM 80GB, NVLink 4 (900 GB/s), eight 400 Gb/s NICs per node."""
    return Hardware("h100", 80 * GIB, 989e12, 3.35e12, 900e9, 8 * 400e9 / 8)


def h200() -> Hardware:
    """H200 SXM 141GB: the H100 compute with more and faster HBM."""
    return Hardware("h200", 141e9, 989e12, 4.8e12, 900e9, 8 * 400e9 / 8)


PROFILES = {"a100-80gb": a100_80gb, "h100": h100, "h200": h200}


def get_hardware(name: str) -> Hardware:
    try:
        return PROFILES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown GPU profile {name!r}; choose one of {', '.join(PROFILES)}") from None
