"""How Llama/Qwen2 weights are cut into training and generation shards, as pure functions over tensors.

Training layout (Megatron's, used by our engines):

* Transformer layers split evenly and contiguously over the p stages; ``embed_tokens`` on stage 0, the final
  ``norm`` and ``lm_head`` on the last stage.
* Column-parallel (split dim 0): ``embed_tokens`` and ``lm_head`` (vocab), q/k/v fused as
  ``self_attn.qkv_proj`` and gate/up fused as ``mlp.gate_up_proj``. A fused tensor's TP shard i is the
  concatenation of *each part's* shard i (``[q_i; k_i; v_i]``, ``[gate_i; up_i]``), so a rank holds whole heads
  of q, k and v and matching columns of gate and up. q/k/v biases (Qwen2, Llama ``attention_bias``) and gate/up
  biases (Llama ``mlp_bias``) are fused and split with their weights.
* Row-parallel (split dim 1): ``o_proj``, ``down_proj``. Their biases and every norm are replicated.

A training shard lives in one flat 1-D buffer (`TrainShard.flat`) with named views into it; the training engine
trains on those views, as Megatron's DDP trains on views of its contiguous parameter buffer. The buffer holds the
TP-sharded tensors first (the *sharded payload*) and the replicated ones after (the *replicated payload*), each
contiguous: these two slices are what the resharding collectives send and, on the sending rank, receive into in
place, so the local training memory is itself one piece of the generation shard.

Generation shard (t_g, j) of a column-parallel tensor is, part by part, training shards j·r … j·r + r − 1
concatenated (r = t/t_g): a fused tensor is split into its parts and each part re-concatenated. Row-parallel
tensors concatenate along dim 1. `generation_tensors` builds these from gathered payload pieces; a tensor that
needs only one piece (r = 1, or a replicated tensor) comes out as a view, with no copy.

`expected_generation_state_dict` computes the same shard straight from the full Hugging Face weights, by a
different route (narrowing each HF tensor), so tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from engines.hybrid.layout import HybridLayout

__all__ = [
    "ModelGeometry",
    "ShardLayout",
    "TensorRule",
    "TrainShard",
    "WeightFormat",
    "build_train_shard",
    "check_model_fits",
    "expected_generation_state_dict",
    "generation_pieces",
    "generation_tensors",
    "merge_generation_shards",
    "model_rules",
    "shard_layout",
    "stage_layers",
]

WeightFormat = Literal["hf", "fused"]
"""``"hf"``: Hugging Face names (q_proj, k_proj, v_proj, gate_proj, up_proj separate), what a transformers model and
vLLM's ``load_weights`` take. ``"fused"``: the training names (qkv_proj, gate_up_proj) re-fused per TP shard."""


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes of a Llama-family decoder that decide how it shards."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    qkv_bias: bool = False
    """q/k/v projections have biases (always for Qwen2; Llama with ``attention_bias``)."""
    o_bias: bool = False
    """o_proj has a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool = False
    """gate/up/down projections have biases (Llama with ``mlp_bias``)."""
    tied_embeddings: bool = False
    """lm_head shares the input embedding (``tie_word_embeddings``). The megatron conversion reads it; the
    3D-HybridEngine unties a model before reading its geometry (Megatron's layout shards the two apart)."""

    @classmethod
    def from_hf_config(cls, config) -> ModelGeometry:
        """Read a transformers ``LlamaConfig``/``Qwen2Config`` (or one with the same names)."""
        model_type = getattr(config, "model_type", "")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(
                f"model_type {model_type!r} is not one this resharder knows (llama, qwen2, mistral); its tensor "
                f"names and fused layouts are defined in engines/hybrid/shards.py:model_rules"
            )
        attention_bias = bool(getattr(config, "attention_bias", False) or False)
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False) or False),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def numel(self) -> int:
        return sum(rule.numel for rule in model_rules(self))

    @property
    def replicated_numel(self) -> int:
        return sum(rule.numel for rule in model_rules(self) if rule.split_dim is None)


@dataclass(frozen=True)
class TensorRule:
    """One training tensor: its full (unsharded, fused) shape and how TP splits it."""

    name: str
    """Name in the training shard; fused q/k/v is ``…self_attn.qkv_proj.*``, gate/up ``…mlp.gate_up_proj.*``."""
    shape: tuple[int, ...]
    split_dim: int | None
    """Dimension TP splits, or None for a tensor every TP rank holds whole."""
    parts: tuple[tuple[str, int], ...]
    """(Hugging Face name, extent along split_dim) of each fused part, in order; one part when not fused (its
    extent 0 when the tensor is replicated)."""
    layer: int | None
    """Transformer layer, or None for embed_tokens (first stage) and norm/lm_head (last stage)."""

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    def shard_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] //= tp_size
        return tuple(shape)

    def part_views(self, shard: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
        """Views of each fused part inside one TP shard (at TP size tp_size) of this tensor."""
        if self.split_dim is None or len(self.parts) == 1:
            return [shard]
        return list(torch.split(shard, [extent // tp_size for _, extent in self.parts], dim=self.split_dim))


def _rule(name: str, shape: tuple[int, ...], split_dim: int | None, layer: int | None, parts=None) -> TensorRule:
    if parts is None:
        parts = ((name, shape[split_dim] if split_dim is not None else 0),)
    return TensorRule(name=name, shape=shape, split_dim=split_dim, parts=tuple(parts), layer=layer)


@lru_cache(maxsize=64)
def model_rules(geometry: ModelGeometry) -> tuple[TensorRule, ...]:
    """Every training tensor of the model, in model order (embed, layer 0 … L−1, norm, lm_head)."""
    g = geometry
    h, inter = g.hidden_size, g.intermediate_size
    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    rules = [_rule("model.embed_tokens.weight", (g.vocab_size, h), 0, None)]
    for i in range(g.num_layers):
        pre, attn, mlp = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"

        def qkv_parts(kind: str) -> tuple[tuple[str, int], ...]:
            return (f"{attn}.q_proj.{kind}", q), (f"{attn}.k_proj.{kind}", kv), (f"{attn}.v_proj.{kind}", kv)

        def gu_parts(kind: str) -> tuple[tuple[str, int], ...]:
            return (f"{mlp}.gate_proj.{kind}", inter), (f"{mlp}.up_proj.{kind}", inter)

        rules.append(_rule(f"{pre}.input_layernorm.weight", (h,), None, i))
        rules.append(_rule(f"{attn}.qkv_proj.weight", (q + 2 * kv, h), 0, i, qkv_parts("weight")))
        if g.qkv_bias:
            rules.append(_rule(f"{attn}.qkv_proj.bias", (q + 2 * kv,), 0, i, qkv_parts("bias")))
        rules.append(_rule(f"{attn}.o_proj.weight", (h, q), 1, i))
        if g.o_bias:
            rules.append(_rule(f"{attn}.o_proj.bias", (h,), None, i))
        rules.append(_rule(f"{pre}.post_attention_layernorm.weight", (h,), None, i))
        rules.append(_rule(f"{mlp}.gate_up_proj.weight", (2 * inter, h), 0, i, gu_parts("weight")))
        if g.mlp_bias:
            rules.append(_rule(f"{mlp}.gate_up_proj.bias", (2 * inter,), 0, i, gu_parts("bias")))
        rules.append(_rule(f"{mlp}.down_proj.weight", (h, inter), 1, i))
        if g.mlp_bias:
            rules.append(_rule(f"{mlp}.down_proj.bias", (h,), None, i))
    rules.append(_rule("model.norm.weight", (h,), None, None))
    rules.append(_rule("lm_head.weight", (g.vocab_size, h), 0, None))
    return tuple(rules)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """Layers of pipeline stage `stage` when num_layers are split evenly and contiguously over num_stages."""
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def _rule_stage(rule: TensorRule, num_layers: int, num_stages: int) -> int:
    if rule.layer is not None:
        return rule.layer // (num_layers // num_stages)
    return 0 if rule.name == "model.embed_tokens.weight" else num_stages - 1


def check_model_fits(geometry: ModelGeometry, layout: HybridLayout) -> None:
    """Raise ValueError, naming the fix, when the model cannot be cut by the layout's training sizes."""
    g, t, p = geometry, layout.train_tp, layout.train_pp
    for what, size, fix in (
        ("num_attention_heads", g.num_heads, "train_tp"),
        ("num_key_value_heads", g.num_kv_heads, "train_tp (key/value heads are split, never replicated)"),
        ("intermediate_size", g.intermediate_size, "train_tp"),
        ("vocab_size", g.vocab_size, "train_tp, or pad the vocabulary to a multiple of it"),
    ):
        if size % t:
            raise ValueError(f"{what}={size} cannot be split over train_tp={t}; choose a {fix} that divides {size}")
    if g.num_layers % p:
        raise ValueError(
            f"num_hidden_layers={g.num_layers} cannot be split evenly over train_pp={p} stages; choose a train_pp "
            f"that divides {g.num_layers}"
        )


# ---- one training shard as a flat buffer ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardEntry:
    rule: TensorRule
    shape: tuple[int, ...]
    offset: int  # element offset in the flat buffer

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor of one training shard (a stage at a TP size) sits in its flat buffer."""

    stage: int
    tp_size: int
    entries: tuple[ShardEntry, ...]  # sharded tensors first, replicated after, each group in model order
    sharded_numel: int
    replicated_numel: int

    @property
    def numel(self) -> int:
        return self.sharded_numel + self.replicated_numel

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.rule.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}


@lru_cache(maxsize=256)
def shard_layout(geometry: ModelGeometry, num_stages: int, stage: int, tp_size: int) -> ShardLayout:
    """The flat-buffer layout of training shard (stage, any TP rank) at TP size tp_size."""
    rules = [r for r in model_rules(geometry) if _rule_stage(r, geometry.num_layers, num_stages) == stage]
    ordered = [r for r in rules if r.split_dim is not None] + [r for r in rules if r.split_dim is None]
    entries, offset = [], 0
    for rule in ordered:
        entry = ShardEntry(rule=rule, shape=rule.shard_shape(tp_size), offset=offset)
        entries.append(entry)
        offset += entry.numel
    sharded = sum(e.numel for e in entries if e.rule.split_dim is not None)
    return ShardLayout(
        stage=stage, tp_size=tp_size, entries=tuple(entries), sharded_numel=sharded, replicated_numel=offset - sharded
    )


@dataclass
class TrainShard:
    """One rank's training weights: a flat buffer and named views into it (the tensors to train on)."""

    flat: torch.Tensor
    layout: ShardLayout
    tensors: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, layout: ShardLayout, dtype: torch.dtype = torch.float32, device="cpu") -> TrainShard:
        flat = torch.empty(layout.numel, dtype=dtype, device=device)
        return cls(flat=flat, layout=layout, tensors=layout.views(flat))

    @property
    def sharded(self) -> torch.Tensor:
        """The TP-sharded payload: the slice of `flat` the micro-DP all-gather sends."""
        return self.flat[: self.layout.sharded_numel]

    @property
    def replicated(self) -> torch.Tensor:
        """The TP-replicated payload (norms, row-parallel biases)."""
        return self.flat[self.layout.sharded_numel :]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def check_views(self) -> None:
        """Raise if `tensors` are no longer the views of `flat` (e.g. an engine replaced them with copies)."""
        base = self.flat.untyped_storage().data_ptr()
        for entry in self.layout.entries:
            tensor = self.tensors.get(entry.rule.name)
            if tensor is None or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"training shard lacks {entry.rule.name} of shape {entry.shape}")
            expected = base + (self.flat.storage_offset() + entry.offset) * self.flat.element_size()
            if tensor.data_ptr() != expected:
                raise ValueError(
                    f"training tensor {entry.rule.name} is not the view of TrainShard.flat it was built as; train on "
                    f"TrainShard.tensors (or set param.data to them) so resharding can use the memory in place"
                )


def _full_hf_tensor(full: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in full:
        return full[name]
    if name == "lm_head.weight" and "model.embed_tokens.weight" in full:
        return full["model.embed_tokens.weight"]  # tied embeddings: the last stage keeps its own copy
    raise KeyError(f"the full state dict has no {name!r}; is it a Llama/Qwen2 checkpoint of this geometry?")


def build_train_shard(
    full_state_dict: Mapping[str, torch.Tensor],
    geometry: ModelGeometry,
    layout: HybridLayout,
    rank: int,
    dtype: torch.dtype | None = None,
) -> TrainShard:
    """Cut rank's training shard out of the full Hugging Face state dict (no full fused tensor is built)."""
    check_model_fits(geometry, layout)
    coord = layout.train_coord(rank)
    t = layout.train_tp
    shard_spec = shard_layout(geometry, layout.train_pp, coord.pp, t)
    if dtype is None:
        dtype = full_state_dict["model.embed_tokens.weight"].dtype
    shard = TrainShard.allocate(shard_spec, dtype=dtype)
    for entry in shard_spec.entries:
        rule = entry.rule
        view = shard.tensors[rule.name]
        for (hf_name, extent), part in zip(rule.parts, rule.part_views(view, t)):
            src = _full_hf_tensor(full_state_dict, hf_name)
            if rule.split_dim is not None:
                src = src.narrow(rule.split_dim, coord.tp * (extent // t), extent // t)
            part.copy_(src)
    return shard


# ---- generation shards --------------------------------------------------------------------------------------


def _generation_rules(
    geometry: ModelGeometry,
    layout: HybridLayout,
    gen_stage: int,
    gen_tp_rank: int,
    sharded: Mapping[tuple[int, int], torch.Tensor],
    replicated: Mapping[int, torch.Tensor],
    gen_pp: int | None,
    gen_tp: int | None,
) -> Iterator[tuple[TensorRule, list[torch.Tensor]]]:
    """(rule, its r sub-shard views, or the one view of a replicated tensor) in model order."""
    p, t = layout.train_pp, layout.train_tp
    gen_pp = layout.gen_pp if gen_pp is None else gen_pp
    gen_tp = layout.gen_tp if gen_tp is None else gen_tp
    r, s = t // gen_tp, p // gen_pp
    subs = range(gen_tp_rank * r, (gen_tp_rank + 1) * r)
    for stage in range(gen_stage * s, (gen_stage + 1) * s):
        spec = shard_layout(geometry, p, stage, t)
        for entry in sorted(spec.entries, key=lambda e: _model_position(geometry, e.rule.name)):
            if entry.rule.split_dim is None:
                start = entry.offset - spec.sharded_numel
                yield entry.rule, [replicated[stage][start : start + entry.numel].view(entry.shape)]
            else:
                yield (
                    entry.rule,
                    [sharded[(stage, tp)][entry.offset : entry.offset + entry.numel].view(entry.shape) for tp in subs],
                )


def generation_pieces(
    geometry: ModelGeometry,
    layout: HybridLayout,
    gen_stage: int,
    gen_tp_rank: int,
    sharded: Mapping[tuple[int, int], torch.Tensor],
    replicated: Mapping[int, torch.Tensor],
    gen_pp: int | None = None,
    gen_tp: int | None = None,
) -> Iterator[tuple[str, list[torch.Tensor], int | None]]:
    """Yield the generation shard (gen_stage, gen_tp_rank) as (HF name, its r sub-shards, split dim), copying
    nothing: each sub-shard is a view of the gathered payload it came in, in order along the split dim (a
    replicated tensor comes as one view with dim None).

    sharded[(pp, tp)] is the sharded payload of training shard (pp, tp), replicated[pp] the replicated payload of
    training stage pp, for every piece the generation shard needs. Generation sizes default to the layout's
    (gen_pp, gen_tp); the baselines pass (1, 1) to build the full model.
    """
    t = layout.train_tp
    for rule, pieces in _generation_rules(
        geometry, layout, gen_stage, gen_tp_rank, sharded, replicated, gen_pp, gen_tp
    ):
        if rule.split_dim is None:
            yield rule.parts[0][0], pieces, None
            continue
        per_part = [rule.part_views(piece, t) for piece in pieces]  # [sub][part]
        for k, (hf_name, _) in enumerate(rule.parts):
            yield hf_name, [sub[k] for sub in per_part], rule.split_dim


def generation_tensors(
    geometry: ModelGeometry,
    layout: HybridLayout,
    gen_stage: int,
    gen_tp_rank: int,
    sharded: Mapping[tuple[int, int], torch.Tensor],
    replicated: Mapping[int, torch.Tensor],
    fmt: WeightFormat = "hf",
    gen_pp: int | None = None,
    gen_tp: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the generation shard (gen_stage, gen_tp_rank) tensor by tensor, built from gathered payloads.

    A tensor that needs one piece is a view of it; one that merges r TP sub-shards (`generation_pieces`) is
    concatenated here, one tensor at a time. "fused" re-fuses q/k/v and gate/up per generation shard.
    """
    if fmt == "hf":
        for name, views, dim in generation_pieces(
            geometry, layout, gen_stage, gen_tp_rank, sharded, replicated, gen_pp, gen_tp
        ):
            yield name, views[0] if dim is None else _cat(views, dim)
        return
    t = layout.train_tp
    for rule, pieces in _generation_rules(
        geometry, layout, gen_stage, gen_tp_rank, sharded, replicated, gen_pp, gen_tp
    ):
        if rule.split_dim is None or len(pieces) == 1:
            yield rule.name, pieces[0]
            continue
        per_part = [rule.part_views(piece, t) for piece in pieces]  # [sub][part]
        merged = [_cat([sub[k] for sub in per_part], rule.split_dim) for k in range(len(rule.parts))]
        yield rule.name, _cat(merged, rule.split_dim)


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


@lru_cache(maxsize=64)
def _positions(geometry: ModelGeometry) -> dict[str, int]:
    return {rule.name: i for i, rule in enumerate(model_rules(geometry))}


def _model_position(geometry: ModelGeometry, name: str) -> int:
    return _positions(geometry)[name]


def expected_generation_state_dict(
    full_state_dict: Mapping[str, torch.Tensor],
    geometry: ModelGeometry,
    layout: HybridLayout,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Rank's generation shard in "hf" format, sliced straight from the full HF weights (the test reference)."""
    coord = layout.gen_coord(rank)
    layers = stage_layers(geometry.num_layers, layout.gen_pp, coord.pp)
    out = {}
    for rule in model_rules(geometry):
        stage = _rule_stage(rule, geometry.num_layers, layout.gen_pp)
        if stage != coord.pp or (rule.layer is not None and rule.layer not in layers):
            continue
        for hf_name, extent in rule.parts:
            tensor = _full_hf_tensor(full_state_dict, hf_name)
            if rule.split_dim is not None:
                size = extent // layout.gen_tp
                tensor = tensor.narrow(rule.split_dim, coord.tp * size, size)
            out[hf_name] = tensor
    return out


def merge_generation_shards(
    geometry: ModelGeometry,
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    gen_tp: int,
) -> dict[str, torch.Tensor]:
    """Rebuild the full HF state dict from the "hf"-format shards {(gen_stage, gen_tp_rank): state dict} of one
    generation TP×PP group (used by tests to run the unsharded reference on what generation received)."""
    split = {hf: rule.split_dim for rule in model_rules(geometry) for hf, _ in rule.parts}
    names = {name: stage for (stage, _), sd in shards.items() for name in sd}
    full = {}
    for name, stage in names.items():
        if split[name] is None:
            full[name] = shards[(stage, 0)][name]
        else:
            full[name] = torch.cat([shards[(stage, j)][name] for j in range(gen_tp)], dim=split[name])
    return full
