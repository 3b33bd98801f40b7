"""Hugging Face Llama/Qwen2 weights <-> megatron-core GPTModel shards, as pure functions over tensors.

megatron-core's GPTModel (local layer spec) names and fuses a decoder differently from transformers:

===============================================  ====================================================
Hugging Face                                     megatron-core (layer index local to the PP stage)
===============================================  ====================================================
model.embed_tokens.weight                        embedding.word_embeddings.weight      (first stage)
model.layers.i.input_layernorm.weight            decoder.layers.j.input_layernorm.weight
model.layers.i.self_attn.{q,k,v}_proj.{w,b}      decoder.layers.j.self_attention.linear_qkv.{w,b}
model.layers.i.self_attn.o_proj.weight           decoder.layers.j.self_attention.linear_proj.weight
model.layers.i.post_attention_layernorm.weight   decoder.layers.j.pre_mlp_layernorm.weight
model.layers.i.mlp.{gate,up}_proj.weight         decoder.layers.j.mlp.linear_fc1.weight
model.layers.i.mlp.down_proj.weight              decoder.layers.j.mlp.linear_fc2.weight
model.norm.weight                                decoder.final_layernorm.weight        (last stage)
lm_head.weight                                   output_layer.weight                   (last stage)
score.weight (and score.bias), scalar heads      output_layer.weight (and .bias)       (last stage, whole)
===============================================  ====================================================

Scalar heads. A critic ("value": transformers *ForTokenClassification) or a reward/cost model ("score":
*ForSequenceClassification) with num_labels = 1 replaces the vocabulary projection by `score`, a [1, hidden]
linear (the token classifier also has a bias). The engine builds it as a plain, TP-replicated `torch.nn.Linear`
in place of `output_layer`, so it is never split: every TP rank of the last stage holds it whole. Such models
have no output embedding, so `tie_word_embeddings` does not apply to them.

Fused q/k/v. megatron-core 0.16.1 (`SelfAttention.get_query_key_value_tensors`) views the output of
`linear_qkv` as [num_query_groups, (q_per_group + 2) * head_dim]: the rows are interleaved *per query group*,
``[q heads of group 0; k_0; v_0; q heads of group 1; k_1; v_1; ...]``, and TP shard r is the contiguous block of
groups r·ng/t … (r+1)·ng/t − 1. This differs from the layout in engines/hybrid/shards.py (``[q_r; k_r; v_r]`` per
shard), which is the training layout of our own resharder, not megatron-core's.

Fused gate/up. `linear_fc1` is column-parallel over 2·ffn rows and the gated MLP splits each shard's output in
two halves (``torch.chunk(x, 2, -1)``, first half through SiLU), so TP shard r is ``[gate_r; up_r]``.

Pipeline stages hold contiguous, equal blocks of layers (megatron's default split). With tied embeddings the last
stage holds its own copy of the embedding as ``output_layer.weight`` (megatron keeps the two copies equal by
all-reducing their gradients over the embedding group); `megatron_to_hf` reads the tied weight from stage 0.

Sizes. The model's sizes are engines.hybrid's `ModelGeometry`, the one description of a Llama-family decoder that
the 3D-HybridEngine's resharder and this conversion share; `megatron_geometry` reads it and refuses the bias
layouts megatron-core cannot express.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engines.hybrid.shards import ModelGeometry

__all__ = ["megatron_geometry", "hf_to_megatron", "megatron_to_hf", "check_megatron_fits", "HEADS"]

HEADS = ("lm", "value", "score")
"""Output heads (engines.models.config): the causal LM's vocabulary projection, or a scalar `score` linear."""


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")


def megatron_geometry(config) -> ModelGeometry:
    """The sizes of a transformers LlamaConfig/Qwen2Config (engines.hybrid's ModelGeometry, the one reader of a
    Llama-family config), refusing what megatron-core's GPTModel cannot express."""
    model_type = getattr(config, "model_type", "")
    if model_type not in ("llama", "qwen2"):
        raise ValueError(f"model_type {model_type!r} has no megatron-core conversion here; supported: llama, qwen2")
    g = ModelGeometry.from_hf_config(config)
    if g.mlp_bias or g.o_bias:
        # megatron's add_bias_linear puts biases on every linear (qkv, proj, fc1, fc2) at once
        raise ValueError(
            "Llama with attention_bias or mlp_bias has no megatron-core equivalent of its bias "
            "layout; use a model without them or the torch-native TrainEngine"
        )
    return g


def _geometry(config) -> ModelGeometry:
    return config if isinstance(config, ModelGeometry) else megatron_geometry(config)


def _stage_layers(g: ModelGeometry, pp_rank: int, pp_size: int) -> range:
    """The layers of stage pp_rank: contiguous, equal blocks (megatron's default split)."""
    per = g.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def check_megatron_fits(geometry: ModelGeometry, tp_size: int, pp_size: int) -> None:
    """Raise ValueError, naming the fix, when the model cannot be cut tp × pp ways (call before any collective)."""
    g = geometry
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp ({tp_size}) and pp ({pp_size}) must be >= 1")
    for field, size, fix in (
        ("num_attention_heads", g.num_heads, "a tp that divides it"),
        (
            "num_key_value_heads",
            g.num_kv_heads,
            "a tp that divides it (key/value heads are split, never replicated, in this conversion)",
        ),
        ("intermediate_size", g.intermediate_size, "a tp that divides it"),
        ("vocab_size", g.vocab_size, "a tp that divides it, or pad the vocabulary to a multiple of tp"),
    ):
        if size % tp_size:
            raise ValueError(
                f"tensor-parallel size tp={tp_size} does not divide the model's {field} ({size}); choose {fix}"
            )
    if g.num_layers % pp_size:
        raise ValueError(
            f"pipeline-parallel size pp={pp_size} does not divide num_hidden_layers "
            f"({g.num_layers}); choose a pp that divides {g.num_layers} (stages get equal layer counts)"
        )


def _rows(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: range, qpg: int, d: int) -> torch.Tensor:
    """[q_g; k_g; v_g] for each query group g in `groups` (rows of q, k, v indexed from group groups[0])."""
    parts = []
    for grp in groups:
        parts += [q[grp * qpg * d : (grp + 1) * qpg * d], k[grp * d : (grp + 1) * d], v[grp * d : (grp + 1) * d]]
    return torch.cat(parts)


def _deinterleave_qkv(
    fused: torch.Tensor, groups: int, qpg: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_interleave_qkv` over `groups` consecutive query groups."""
    per_group = fused.reshape(groups, (qpg + 2) * d, *fused.shape[1:])
    q, k, v = torch.split(per_group, [qpg * d, d, d], dim=1)
    tail = fused.shape[1:]
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _fuse_qkv(
    g: ModelGeometry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """TP shard of the per-group interleaved [q_g; k_g; v_g] tensor (weights or biases: rows are dim 0)."""
    groups = range(tp_rank * g.num_kv_heads // tp_size, (tp_rank + 1) * g.num_kv_heads // tp_size)
    return _interleave_qkv(q, k, v, groups, g.num_heads // g.num_kv_heads, g.head_dim)


def _split_qkv(g: ModelGeometry, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of the full (all TP shards concatenated) per-group interleave."""
    return _deinterleave_qkv(fused, g.num_kv_heads, g.num_heads // g.num_kv_heads, g.head_dim)


def hf_to_megatron(
    state_dict: Mapping[str, torch.Tensor],
    config,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    head: str = "lm",
) -> dict[str, torch.Tensor]:
    """The GPTModel state dict of shard (pp_rank, tp_rank), cut from a full Hugging Face state dict of a causal LM
    (head "lm") or of a scalar-head model (head "value" / "score", whose `score` must have one output)."""
    g = _geometry(config)
    check_megatron_fits(g, tp_size, pp_size)
    _check_head(head)
    sd, out = state_dict, {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _rows(sd["model.embed_tokens.weight"], tp_rank, tp_size)
    for local, i in enumerate(_stage_layers(g, pp_rank, pp_size)):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{local}"
        attn = f"{hf}.self_attn"
        out[f"{mg}.input_layernorm.weight"] = sd[f"{hf}.input_layernorm.weight"]
        kinds = ("weight", "bias") if g.qkv_bias else ("weight",)
        for kind in kinds:
            out[f"{mg}.self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                g,
                sd[f"{attn}.q_proj.{kind}"],
                sd[f"{attn}.k_proj.{kind}"],
                sd[f"{attn}.v_proj.{kind}"],
                tp_rank,
                tp_size,
            )
        out[f"{mg}.self_attention.linear_proj.weight"] = _rows(sd[f"{attn}.o_proj.weight"], tp_rank, tp_size, 1)
        out[f"{mg}.pre_mlp_layernorm.weight"] = sd[f"{hf}.post_attention_layernorm.weight"]
        out[f"{mg}.mlp.linear_fc1.weight"] = torch.cat(
            [
                _rows(sd[f"{hf}.mlp.gate_proj.weight"], tp_rank, tp_size),
                _rows(sd[f"{hf}.mlp.up_proj.weight"], tp_rank, tp_size),
            ]
        )
        out[f"{mg}.mlp.linear_fc2.weight"] = _rows(sd[f"{hf}.mlp.down_proj.weight"], tp_rank, tp_size, 1)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        if head != "lm":
            if sd["score.weight"].shape[0] != 1:
                raise ValueError(
                    f"the {head} head has {sd['score.weight'].shape[0]} outputs; the megatron engine "
                    f"builds scalar heads only (num_labels=1)"
                )
            out["output_layer.weight"] = sd["score.weight"]
            if "score.bias" in sd:
                out["output_layer.bias"] = sd["score.bias"]
        elif not g.tied_embeddings:
            out["output_layer.weight"] = _rows(sd["lm_head.weight"], tp_rank, tp_size)
        elif pp_size > 1:  # the last stage's own copy of the tied embedding; with one stage it is the embedding
            out["output_layer.weight"] = _rows(sd["model.embed_tokens.weight"], tp_rank, tp_size)
    return {k: v.clone() for k, v in out.items()}


def megatron_to_hf(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], config, tp_size: int, pp_size: int, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """Merge every shard {(pp_rank, tp_rank): GPTModel state dict} back into one Hugging Face state dict, named as
    the transformers class of `head` names it (lm_head for "lm", score for "value" / "score")."""
    g = _geometry(config)
    check_megatron_fits(g, tp_size, pp_size)
    _check_head(head)
    missing = [(p, t) for p in range(pp_size) for t in range(tp_size) if (p, t) not in shards]
    if missing:
        raise ValueError(f"megatron_to_hf needs every (pp_rank, tp_rank) shard; missing {missing}")

    def cat(stage: int, name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([shards[(stage, t)][name] for t in range(tp_size)], dim=dim)

    def one(stage: int, name: str) -> torch.Tensor:
        return shards[(stage, 0)][name]

    out = {"model.embed_tokens.weight": cat(0, "embedding.word_embeddings.weight")}
    for stage in range(pp_size):
        for local, i in enumerate(_stage_layers(g, stage, pp_size)):
            hf, mg = f"model.layers.{i}", f"decoder.layers.{local}"
            out[f"{hf}.input_layernorm.weight"] = one(stage, f"{mg}.input_layernorm.weight")
            for kind in ("weight", "bias") if g.qkv_bias else ("weight",):
                q, k, v = _split_qkv(g, cat(stage, f"{mg}.self_attention.linear_qkv.{kind}"))
                out[f"{hf}.self_attn.q_proj.{kind}"] = q
                out[f"{hf}.self_attn.k_proj.{kind}"] = k
                out[f"{hf}.self_attn.v_proj.{kind}"] = v
            out[f"{hf}.self_attn.o_proj.weight"] = cat(stage, f"{mg}.self_attention.linear_proj.weight", 1)
            out[f"{hf}.post_attention_layernorm.weight"] = one(stage, f"{mg}.pre_mlp_layernorm.weight")
            halves = [shards[(stage, t)][f"{mg}.mlp.linear_fc1.weight"].chunk(2) for t in range(tp_size)]
            out[f"{hf}.mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
            out[f"{hf}.mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
            out[f"{hf}.mlp.down_proj.weight"] = cat(stage, f"{mg}.mlp.linear_fc2.weight", 1)
    last = pp_size - 1
    out["model.norm.weight"] = one(last, "decoder.final_layernorm.weight")
    if head != "lm":  # TP-replicated: TP rank 0's copy is the head
        out["score.weight"] = one(last, "output_layer.weight")
        if "output_layer.bias" in shards[(last, 0)]:
            out["score.bias"] = one(last, "output_layer.bias")
        return {k: v.detach().clone() for k, v in out.items()}
    out = {k: v.detach().clone() for k, v in out.items()}
    # tied: transformers' state_dict() lists lm_head.weight as the embedding itself, so mirror that
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if g.tied_embeddings else cat(last, "output_layer.weight")
    return out


def megatron_shard_to_hf_local(
    shard: Mapping[str, torch.Tensor], config, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """One causal-LM shard (pp_rank, tp_rank) under Hugging Face names, each tensor this TP rank's slice as a
    vocab- and tensor-parallel transformers model holds it (rows of q/k/v, gate/up, embedding and lm_head; columns
    of o_proj and down_proj; norms whole), with global layer indices: the pieces the 3D-HybridEngine's training
    layout is made of. No collective; views of `shard` where no reordering is needed."""
    g = _geometry(config)
    d, qpg, groups = g.head_dim, g.num_heads // g.num_kv_heads, g.num_kv_heads // tp_size
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["model.embed_tokens.weight"] = shard["embedding.word_embeddings.weight"]
    for local, i in enumerate(_stage_layers(g, pp_rank, pp_size)):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{local}"
        out[f"{hf}.input_layernorm.weight"] = shard[f"{mg}.input_layernorm.weight"]
        for kind in ("weight", "bias") if g.qkv_bias else ("weight",):
            q, k, v = _deinterleave_qkv(shard[f"{mg}.self_attention.linear_qkv.{kind}"], groups, qpg, d)
            out[f"{hf}.self_attn.q_proj.{kind}"] = q
            out[f"{hf}.self_attn.k_proj.{kind}"] = k
            out[f"{hf}.self_attn.v_proj.{kind}"] = v
        out[f"{hf}.self_attn.o_proj.weight"] = shard[f"{mg}.self_attention.linear_proj.weight"]
        out[f"{hf}.post_attention_layernorm.weight"] = shard[f"{mg}.pre_mlp_layernorm.weight"]
        gate, up = shard[f"{mg}.mlp.linear_fc1.weight"].chunk(2)
        out[f"{hf}.mlp.gate_proj.weight"], out[f"{hf}.mlp.up_proj.weight"] = gate, up
        out[f"{hf}.mlp.down_proj.weight"] = shard[f"{mg}.mlp.linear_fc2.weight"]
    if pp_rank == pp_size - 1:
        out["model.norm.weight"] = shard["decoder.final_layernorm.weight"]
        if head != "lm":
            out["score.weight"] = shard["output_layer.weight"]
            if "output_layer.bias" in shard:
                out["score.bias"] = shard["output_layer.bias"]
        else:  # a tied model with one stage projects with the embedding itself; else the last stage holds the head
            out["lm_head.weight"] = shard.get("output_layer.weight", shard.get("embedding.word_embeddings.weight"))
    return out


def hf_local_to_megatron_shard(
    pieces: Mapping[str, torch.Tensor], config, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, head: str = "lm"
) -> dict[str, torch.Tensor]:
    """Inverse of `megatron_shard_to_hf_local`: the GPTModel state dict of shard (pp_rank, tp_rank) from this TP
    rank's slices under Hugging Face names (q/k/v interleaved per query group, gate/up fused)."""
    g = _geometry(config)
    d, qpg, groups = g.head_dim, g.num_heads // g.num_kv_heads, g.num_kv_heads // tp_size
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = pieces["model.embed_tokens.weight"]
    for local, i in enumerate(_stage_layers(g, pp_rank, pp_size)):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{local}"
        attn = f"{hf}.self_attn"
        out[f"{mg}.input_layernorm.weight"] = pieces[f"{hf}.input_layernorm.weight"]
        for kind in ("weight", "bias") if g.qkv_bias else ("weight",):
            q, k, v = (pieces[f"{attn}.{x}_proj.{kind}"] for x in "qkv")
            out[f"{mg}.self_attention.linear_qkv.{kind}"] = _interleave_qkv(q, k, v, range(groups), qpg, d)
        out[f"{mg}.self_attention.linear_proj.weight"] = pieces[f"{attn}.o_proj.weight"]
        out[f"{mg}.pre_mlp_layernorm.weight"] = pieces[f"{hf}.post_attention_layernorm.weight"]
        out[f"{mg}.mlp.linear_fc1.weight"] = torch.cat(
            [pieces[f"{hf}.mlp.gate_proj.weight"], pieces[f"{hf}.mlp.up_proj.weight"]]
        )
        out[f"{mg}.mlp.linear_fc2.weight"] = pieces[f"{hf}.mlp.down_proj.weight"]
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = pieces["model.norm.weight"]
        if head != "lm":
            out["output_layer.weight"] = pieces["score.weight"]
            if "score.bias" in pieces:
                out["output_layer.bias"] = pieces["score.bias"]
        elif not g.tied_embeddings or pp_size > 1:
            out["output_layer.weight"] = pieces["lm_head.weight"]
    return out


def hf_local_placement(name: str) -> tuple[str, int | None]:
    """How a Hugging Face tensor of a TP-split model is cut over TP: ("shard", dim) or ("replicate", None)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "shard", 1
    if "norm" in name or name.startswith("score."):
        return "replicate", None
    return "shard", 0
