"""Torch-native parallelism for transformers decoders: DTensor tensor parallel and FSDP2 over a DeviceMesh.

The runtime gives each rank a mesh with dims ("pp", "dp", "tp"). Tensor parallel follows Megatron's split of a
decoder layer: q/k/v and gate/up column-parallel, o and down row-parallel, so each layer needs one all-reduce in
attention and one in the MLP; HF attention reshapes with -1 heads, so local head counts need no patching.
Embeddings, norms and the output head stay replicated (small at the sizes this path targets), unless
`vocab_parallel`: then, as in Megatron, the embedding and the output head are split over the vocabulary (the
layout the 3D-HybridEngine reshards). FSDP2 (`fully_shard`) then shards every decoder layer and the root over
"dp"; with tp > 1 it composes into 2-D. With `fsdp=False` the DP ranks keep whole replicas of their TP shard
(Megatron's DDP layout; the engine averages gradients). Pipeline parallel is the Megatron engine's job; asking for
it here is an error.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize", "tensor_parallel", "check_divisible"]

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_divisible(config, tp: int) -> None:
    """Clear error when the model's heads or MLP width cannot be split `tp` ways."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(config, field, None)
        if v is not None and v % tp:
            raise ValueError(
                f"tensor-parallel size {tp} does not divide the model's {field} ({v}); choose a tp that divides {field}"
            )


def tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, *, vocab_parallel: bool = False) -> torch.nn.Module:
    """Megatron's TP split of every decoder layer over a 1-D mesh (also a model on the meta device: generation
    skeletons are parallelized before their weights exist)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    check_divisible(model.config, tp)
    plan = {**{n: ColwiseParallel() for n in _COLWISE}, **{n: RowwiseParallel() for n in _ROWWISE}}
    for layer in _layers(model):
        parallelize_module(layer, tp_mesh, plan)
    if vocab_parallel:
        vocab = model.config.vocab_size
        if vocab % tp:
            raise ValueError(
                f"vocab_size={vocab} cannot be split over tp={tp}; pad the vocabulary to a multiple of "
                f"{tp} (ModelConfig.pad_vocab_to)"
            )
        base = getattr(model, model.base_model_prefix)
        parallelize_module(base.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        head = getattr(model, "lm_head", None)
        if head is not None:
            parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = getattr(model, model.base_model_prefix)
    return base.layers


def parallelize(
    model: torch.nn.Module, mesh: DeviceMesh, *, fsdp: bool = True, vocab_parallel: bool = False
) -> torch.nn.Module:
    """Apply TP over mesh["tp"] and FSDP2 over mesh["dp"] in place; returns the model."""
    pp, dp, tp = (mesh.size(mesh.mesh_dim_names.index(d)) for d in ("pp", "dp", "tp"))
    if pp > 1:
        raise ValueError(
            f"the torch-native engine has no pipeline parallel (pp={pp}); use pp=1 here or the "
            f"megatron engine for pipeline stages"
        )
    if tp > 1:
        tensor_parallel(model, mesh["tp"], vocab_parallel=vocab_parallel)
    if dp > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns when the root's output is a view: the value/score heads' logits are one (nn.Linear on a
        # (B, T, H) input views its 2-D matmul). The hazard it names, an in-place op on that output dropping the
        # pre-backward hook, cannot happen here: the engines only slice, squeeze and cast outputs (new tensors).
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
        )
        dp_mesh = mesh["dp"]
        for layer in _layers(model):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model
