"""Torch-native parallelism for transformers decoders: DTensor tensor parallel and FSDP2 over a DeviceMesh.

The runtime gives each rank a mesh with dims ("pp", "dp", "tp"). Tensor parallel follows Megatron's split of a
decoder layer: q/k/v and gate/up column-parallel, o and down row-parallel, so each layer needs one all-reduce in
attention and one in the MLP; HF attention reshapes with -1 heads, so local head counts need no patching.
Embeddings, norms and the output head stay replicated (small at the sizes this path targets). FSDP2
(`fully_shard`) then shards every decoder layer and the root over "dp"; with tp > 1 it composes into 2-D.
Pipeline parallel is the Megatron engine's job; asking for it here is an error.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize", "check_divisible"]

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_divisible(config, tp: int) -> None:
    """Clear error when the model's heads or MLP width cannot be split `tp` ways."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(config, field, None)
        if v is not None and v % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the model's {field} ({v}); choose a tp "
                             f"that divides {field}")


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = getattr(model, model.base_model_prefix)
    return base.layers


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Apply TP over mesh["tp"] and FSDP2 over mesh["dp"] in place; returns the model."""
    pp, dp, tp = (mesh.size(mesh.mesh_dim_names.index(d)) for d in ("pp", "dp", "tp"))
    if pp > 1:
        raise ValueError(f"the torch-native engine has no pipeline parallel (pp={pp}); use pp=1 here or the "
                         f"megatron engine for pipeline stages")
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        check_divisible(model.config, tp)
        plan = {**{n: ColwiseParallel() for n in _COLWISE}, **{n: RowwiseParallel() for n in _ROWWISE}}
        for layer in _layers(model):
            parallelize_module(layer, mesh["tp"], plan)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"]
        for layer in _layers(model):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model
