"""Shared construction for the bf16 tests: one tiny random model in fp32 and bf16 with the same weights, and a
worker that reports its bf16 logits under the group's tensor-parallel mesh (importable on worker processes)."""

from __future__ import annotations

import math

import torch

from engines.models.config import ModelConfig, build_model
from engines.training.parallel import parallelize
from flowactors import ONE_TO_ALL, Batch, Worker, endpoint

SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def random_lm(dtype: str = "float32", seed: int = 0) -> torch.nn.Module:
    """A tiny Llama with O(1) activations and logits (weights ~ N(0, 1/fan_in), norms at 1), in `dtype`.

    Why not the default init: its std 0.02 makes every logit ~0, so bf16 rounding would barely show. Here log-probs
    span about -2 to -8, like a trained model's. The weights are drawn in fp32 and cast, so the fp32 and bf16
    models hold the same numbers up to bf16 rounding."""
    model = build_model(ModelConfig(**SIZES), "lm")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    if dtype == "float32":
        return model
    cast = build_model(ModelConfig(**SIZES, dtype=dtype), "lm")  # the path a bf16 run takes: ModelConfig.dtype
    cast.load_state_dict(model.state_dict())
    return cast


class Bf16LogitsProbe(Worker):
    """The bf16 model under this group's mesh (TP and/or FSDP2 when the group has more than one rank)."""

    def __init__(self, dtype: str = "bfloat16") -> None:
        model = random_lm(dtype)
        self.model = parallelize(model, self.mesh) if self.world_size > 1 else model
        self.model.eval()

    @endpoint(protocol=ONE_TO_ALL)
    def logits(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        return out.float()
