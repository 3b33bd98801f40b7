"""What both training backends (torch-native and megatron-core) take and share: the optimizer settings, the loss
signature the algorithms supply, and token-mean aggregation of metrics over data-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flowactors import Batch

__all__ = ["LossFn", "OptimConfig", "token_mean"]


LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, torch.Tensor, dict[str, float]]]
"""loss_fn(outputs, micro_batch) -> (per-token loss (B, R), token weights (B, R), metrics).

`outputs` holds `log_probs` and `entropy` (policy) or `values` (critic), each (B, R) over the response."""


@dataclass
class OptimConfig:
    """Optimiser and batching of one trained model."""

    lr: float = 1e-4
    """AdamW's learning rate (the schedule's peak)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates (β1, β2)."""
    eps: float = 1e-8
    """Adam's epsilon: a gradient element much smaller than it moves its weight by less than lr."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_schedule: str = "constant"
    """constant or cosine (decays to 10 % over total_steps)."""
    total_steps: int = 1000
    """Optimizer steps the cosine schedule spans."""
    micro_batch_tokens: int = 4096
    """Tokens (rows x sequence length) per forward/backward on one rank; bounds activation memory."""
    trainable_layers: int = 0
    """Train only the top K decoder layers, the final norm and the head (0: every parameter). The layers below
    get no gradient and no backward pass, so a step costs about a forward pass plus K layers' backward: how a score
    head is fitted on a pretrained backbone cheaply (torch engine)."""
    zero_stage: int = 3
    """How data-parallel ranks hold the model (torch engine, DeepSpeed's numbering): 3 shards parameters,
    gradients and optimizer state (FSDP2: least memory, but every layer's weights are gathered in each forward and
    backward); 1 keeps a whole replica per rank, averages gradients once per step and shards only the optimizer
    state (ZeRO-1: far less communication, for models that fit on one device; with tp > 1 each rank keeps its TP
    shard)."""

    lora_rank: int = 0
    """Train rank-r LoRA adapters on the frozen model instead of every parameter (torch engine, tp = 1, no
    3D-HybridEngine; engines.training.lora); 0: full-parameter training. A critic's value head stays trainable."""
    lora_alpha: float = 16.0
    """LoRA's scaling numerator: the adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    lora_target_modules: str = "all-linear"
    """Comma-separated names of the linear layers that get adapters (q_proj,v_proj, ...), or all-linear (every
    attention and MLP projection)."""

    @property
    def lora(self) -> Any:
        """The adapters' engines.training.lora.LoraConfig, or None for full-parameter training."""
        if not self.lora_rank:
            return None
        from engines.training.lora import ALL_LINEAR, LoraConfig

        targets = self.lora_target_modules
        names = ALL_LINEAR if targets == "all-linear" else tuple(t.strip() for t in targets.split(",") if t.strip())
        return LoraConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, names)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"OptimConfig.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"OptimConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.trainable_layers < 0:
            raise ValueError(
                f"OptimConfig.trainable_layers must be >= 0 (0: train every layer), got {self.trainable_layers}"
            )
        if self.lora_rank < 0 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError(
                f"OptimConfig: lora_rank must be >= 0 (0: off), lora_alpha > 0 and lora_dropout in [0, 1); "
                f"got {self.lora_rank}, {self.lora_alpha}, {self.lora_dropout}"
            )
        if self.lora_rank and self.trainable_layers:
            raise ValueError(
                f"OptimConfig: lora_rank={self.lora_rank} trains adapters on a frozen model; "
                f"trainable_layers={self.trainable_layers} cannot go with it (set one of them to 0)"
            )
        if self.zero_stage not in (1, 3):
            raise ValueError(
                f"OptimConfig.zero_stage must be 1 (replicas, sharded optimizer state) or 3 (FSDP2), "
                f"got {self.zero_stage}"
            )

    def lr_factor(self, step: int) -> float:
        """The schedule's multiplier of `lr` after `step` optimizer steps (linear warm-up, then constant/cosine)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "cosine":
            t = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        return 1.0


def token_mean(sums: dict[str, float], tokens: float, dp_group: Any = None) -> dict[str, float]:
    """Loss metrics over every data-parallel rank's tokens: `sums` (metric × tokens) and `tokens` summed over
    `dp_group` (one all-reduce; None: this rank only), then divided. Each rank alone would report its own share of
    the batch, and the group's result (rank 0's) would not be the batch's loss."""
    keys = sorted(sums)
    if dp_group is not None:
        totals = torch.tensor([tokens, *(sums[k] for k in keys)], dtype=torch.float64)
        dist.all_reduce(totals, group=dp_group)
        tokens, sums = float(totals[0]), {k: float(v) for k, v in zip(keys, totals[1:])}
    return {k: sums[k] / max(tokens, 1e-9) for k in keys}
