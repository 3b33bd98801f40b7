"""LoRA: train low-rank adapters beside frozen weights (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models").

Each target linear layer y = W x gains y += (alpha / r) · B A dropout(x), with A (r × in) initialised as
torch.nn.Linear's weights and B (out × r) zero, so training starts from the base model exactly. Everything else is
frozen except a value or score head (a critic's head starts from zero and must learn).

Why not PEFT. PEFT wraps each target layer in a new module and renames every parameter (`base_layer.weight`,
`lora_A.default.weight`, a `base_model.model.` prefix), while the rest of the engine addresses parameters by their
Hugging Face names: FSDP2 wraps decoder layers by path, the checkpoint and the hybrid engine's layout read names,
and exports and generation copies must load into a plain model. Here the adapter is two parameters on the linear
module itself (`q_proj.lora_A`, `q_proj.lora_B`) and a forward hook, so `q_proj.weight` keeps its name, FSDP2
shards the adapters with their layer, and `merged_state_dict` turns any state dict back into a plain model's. The
adapter's arithmetic is the same as PEFT's (scaling alpha / r, A Kaiming-uniform, B zero), so an adapter
converts to PEFT's format by renaming: `save_peft_adapter` writes the folder `peft.PeftModel.from_pretrained` and
vLLM's LoRA requests load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "LoraConfig",
    "apply_lora",
    "check_targets",
    "is_adapter",
    "merged_state_dict",
    "save_peft_adapter",
    "ALL_LINEAR",
]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers (Llama and Qwen2 names): `lora_target_modules=all-linear`."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_LINEAR

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _hook(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    x = F.dropout(inputs[0], module.lora_dropout, module.training)
    a, b = module.lora_A, module.lora_B  # whole tensors: FSDP2 unshards a layer's parameters for its forward
    return out + F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype) * module.lora_scale


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, trainable_heads: tuple[str, ...] = ()) -> int:
    """Freeze `model` and give each target linear layer an adapter; `trainable_heads` (top-level module names, e.g.
    a critic's `score`) stay trainable. Returns the number of adapted layers; none is an error naming the
    model's linear layers."""
    if cfg.rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {cfg.rank}")
    model.requires_grad_(False)
    adapted = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        weight = module.weight
        a = torch.empty(cfg.rank, module.in_features, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        module.lora_A = torch.nn.Parameter(a.to(weight.dtype))
        module.lora_B = torch.nn.Parameter(torch.zeros(module.out_features, cfg.rank, dtype=weight.dtype))
        module.lora_scale, module.lora_dropout = cfg.scale, cfg.dropout
        module.register_forward_hook(_hook)
        adapted += 1
    if not adapted:
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        check_targets(linear, cfg, type(model).__name__)
    for head in trainable_heads:
        module = getattr(model, head, None)
        if module is not None:
            module.requires_grad_(True)
    return adapted


def check_targets(linear_names: set[str], cfg: LoraConfig, model_name: str = "the model") -> None:
    """Refuse targets that match none of a model's linear layers (their last names, `linear_names`)."""
    if not set(cfg.target_modules) & linear_names:
        raise ValueError(
            f"lora_target_modules={','.join(cfg.target_modules)} matches no linear layer of {model_name}; its "
            f"linear layers: {','.join(sorted(linear_names))} (or all-linear)"
        )


def is_adapter(name: str) -> bool:
    """Whether a state-dict key is a LoRA adapter's (`<linear>.lora_A` / `.lora_B`), not a base weight."""
    return name.endswith((".lora_A", ".lora_B"))


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A plain model's state dict from an adapted one's: W + scale · B A for each adapted layer, adapters dropped
    (the copy a generation engine, an export or a rollout replica loads)."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key, a in state.items():
        if key.endswith(".lora_A"):
            prefix = key[: -len("lora_A")]
            w = out[prefix + "weight"]
            delta = state[prefix + "lora_B"].float() @ a.float() * scale
            out[prefix + "weight"] = (w.float() + delta).to(w.dtype)
    return out


def save_peft_adapter(path: str | Path, state: dict[str, torch.Tensor], cfg: LoraConfig, base: str | None) -> Path:
    """Write the adapters of an adapted model's (unmerged, whole) state dict as a PEFT LoRA folder:
    `adapter_config.json` and `adapter_model.safetensors`, the layout `peft.PeftModel.from_pretrained(base_model,
    path)`, vLLM's `LoRARequest` and merge tools read. `base`: the base model's path or hub name, recorded as
    `base_model_name_or_path` (None for a model built from a config alone). Only the LoRA tensors are written."""
    import json

    from safetensors.torch import save_file

    tensors, targets = {}, set()
    for key, t in state.items():
        if is_adapter(key):
            module, kind = key.rsplit(".", 1)
            tensors[f"base_model.model.{module}.{kind}.weight"] = t.detach().to("cpu").contiguous()
            targets.add(module.rsplit(".", 1)[-1])
    if not tensors:
        raise ValueError("the state dict holds no LoRA adapters (lora_A / lora_B): nothing to write in PEFT's format")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
