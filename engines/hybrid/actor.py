"""The 3D-HybridEngine bound to a torch actor: trains on Megatron-layout shards, generates on resharded ones.

`HybridEngine` takes a transformers decoder already split by `engines.training.parallel.parallelize(..., fsdp=False,
vocab_parallel=True)` (TP over the mesh's "tp" dim, whole replicas over "dp": the (p, t, d) layout of HybridFlow,
p = 1 in the torch engine) and moves every parameter into one flat training buffer (`TrainShard`): each
parameter's local tensor becomes a view of that buffer, q/k/v and gate/up side by side as Megatron fuses them. The
optimizer, checkpoints and forward passes see ordinary (D)Tensor parameters; only their memory moved.

`generation_model()` reshards with `Resharder` (all-gather inside micro-DP groups, the local piece being the
training buffer itself) and builds the generation model around the gathered pieces where they lie: every linear,
the embedding and the output head of a parameter-less (meta) copy of the model is replaced by a module that
computes on the r = t/t_g sub-shards of its generation shard (`named_pieces`: column-parallel pieces give
adjacent output features, row-parallel ones sum over their input blocks, vocab pieces cover adjacent id ranges),
with Megatron's TP collectives over the generation TP group (t_g ranks at stride r): an all-reduce after each
row-parallel layer and the embedding, an all-gather of the logits. Nothing is copied, so generation holds the
training memory plus the received pieces, HybridFlow Table 2's figures exactly. `release()` drops the model and
frees the received pieces; training memory was never written.

Generation then runs at data-parallel size d·d_g: `micro_slice` gives each generation replica its part of the
rows of its training replica, and `gather_micro` joins the parts again (over the micro-DP group, in micro order),
so callers see the same rows as without resharding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from engines.hybrid.layout import HybridLayout
from engines.hybrid.limits import GenerationEngineLimits, transformers_engine_limits
from engines.hybrid.reshard import Method, Resharder, ReshardGroups, ReshardStats
from engines.hybrid.shards import ModelGeometry, TrainShard, check_model_fits, shard_layout
from flowactors import Batch

__all__ = ["HybridEngine", "bind_training_shard", "fill_training_shard", "layout_of", "untie_embeddings"]


def _split_name(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def _rebind(
    model: torch.nn.Module, name: str, tensor: torch.Tensor, *, like: torch.Tensor, requires_grad: bool
) -> torch.nn.Parameter:
    """Make parameter `name` of `model` hold `tensor` (its local shard when `like` is a DTensor), without a copy."""
    module_name, attr = _split_name(name)
    module = model.get_submodule(module_name)
    if isinstance(like, DTensor):
        tensor = DTensor.from_local(
            tensor, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    param = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    module._parameters[attr] = param
    return param


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def untie_embeddings(model: torch.nn.Module) -> None:
    """Give lm_head its own copy of a tied embedding (e.g. SmolLM2): Megatron's layout shards the two apart."""
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings()
    if head is not None and head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
        model.config.tie_word_embeddings = False


def bind_training_shard(model: torch.nn.Module, geometry: ModelGeometry, layout: HybridLayout, rank: int) -> TrainShard:
    """Move rank's parameters into one flat training buffer in the resharder's layout; they become its views.

    Call before building the optimizer (it holds the parameter objects)."""
    coord = layout.train_coord(rank)
    t = layout.train_tp
    spec = shard_layout(geometry, layout.train_pp, coord.pp, t)
    params = dict(model.named_parameters())
    if "lm_head.weight" not in params and "lm_head.weight" in model.state_dict():
        raise ValueError(
            "the model ties lm_head to embed_tokens; the hybrid engine shards them separately (as "
            "Megatron does): untie them first (ModelConfig builds untied models)"
        )
    dtype = next(iter(params.values())).dtype
    shard = TrainShard.allocate(spec, dtype=dtype, device=_local(next(iter(params.values()))).device)
    bound = set()
    for entry in spec.entries:
        rule = entry.rule
        for (hf_name, _), part in zip(rule.parts, rule.part_views(shard.tensors[rule.name], t)):
            if hf_name not in params:
                raise ValueError(
                    f"the model has no parameter {hf_name!r} that a {geometry} decoder needs; is it a "
                    f"Llama/Qwen2 causal LM?"
                )
            param = params[hf_name]
            local = _local(param.data)
            if tuple(local.shape) != tuple(part.shape):
                raise ValueError(
                    f"{hf_name}: this rank holds a {tuple(local.shape)} shard, the training layout "
                    f"expects {tuple(part.shape)}; parallelize the model with vocab_parallel=True and "
                    f"fsdp=False over the same tp size ({t})"
                )
            part.copy_(local)
            _rebind(model, hf_name, part, like=param.data, requires_grad=param.requires_grad)
            bound.add(hf_name)
    extra = sorted(set(params) - bound)
    if extra:
        raise ValueError(
            f"parameters outside the Llama/Qwen2 training layout: {extra}; the hybrid engine reshards "
            f"causal-LM decoders only"
        )
    return shard


def fill_training_shard(shard: TrainShard, pieces: Mapping[str, torch.Tensor]) -> None:
    """Copy a rank's training pieces (Hugging Face names, this TP rank's slices) into `shard`'s layout."""
    t = shard.layout.tp_size
    for entry in shard.layout.entries:
        rule = entry.rule
        for (hf_name, _), part in zip(rule.parts, rule.part_views(shard.tensors[rule.name], t)):
            if hf_name not in pieces:
                raise ValueError(f"no training piece {hf_name!r} for stage {shard.layout.stage} of the hybrid layout")
            part.copy_(pieces[hf_name])


def layout_of(mesh_or_sizes: DeviceMesh | tuple[int, int, int], gen_tp: int, gen_pp: int = 1) -> HybridLayout:
    """The hybrid layout of an actor whose training mesh is (pp, dp, tp), generating at (gen_pp, gen_tp)."""
    if isinstance(mesh_or_sizes, DeviceMesh):
        mesh = mesh_or_sizes
        pp, dp, tp = (mesh.size(mesh.mesh_dim_names.index(d)) for d in ("pp", "dp", "tp"))
    else:
        pp, dp, tp = mesh_or_sizes
    return HybridLayout(train_pp=pp, train_tp=tp, train_dp=dp, gen_pp=gen_pp, gen_tp=gen_tp)


class HybridEngine:
    """One actor rank's weights between the training layout (p, t, d) and the generation layout (p_g, t_g).

    Collective: every rank of the actor's mesh constructs it, and calls `generation_model`/`release` in step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        gen_tp: int,
        subgroups: Mapping[tuple[int, ...], dist.ProcessGroup],
        *,
        method: Method = "micro-dp",
        limits: GenerationEngineLimits | None = None,
        pieces: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        gen_pp: int = 1,
    ) -> None:
        """`subgroups`: this rank's process groups among the mesh's ranks, keyed by mesh rank tuples, created
        beforehand from `HybridEngine.process_groups` (flowactors' `Worker.process_groups` does that).

        `pieces`: for a training engine that keeps its weights in its own buffers (megatron-core): returns this
        rank's current training pieces (Hugging Face names, TP-local slices, e.g.
        engines.training.megatron.convert.megatron_shard_to_hf_local). Each transition then copies them into a training
        shard that lives only while generating (one shard of extra memory, counted in extra_generation_bytes);
        `model` only lends its class and config to the generation skeleton.

        `gen_pp` > 1 (it must divide the training pp): generation keeps pipeline stages, each rank running its
        stage's layers (`_PipelineStage`)."""
        self.layout = layout_of(mesh, gen_tp, gen_pp)
        self.geometry = ModelGeometry.from_hf_config(model.config)
        self.method = method
        limits = limits or transformers_engine_limits()
        check_model_fits(self.geometry, self.layout)  # pure checks, identical on every rank, before any collective
        limits.check(self.geometry, self.layout)
        global_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        groups = ReshardGroups.create(self.layout, [method], global_ranks=global_ranks, existing=subgroups)
        self.rank = groups.rank
        self.groups = groups
        self.train_model = model
        self._pieces = pieces
        self._train_spec = shard_layout(
            self.geometry, self.layout.train_pp, self.layout.train_coord(self.rank).pp, self.layout.train_tp
        )
        self.train: TrainShard | None = (
            None if pieces else bind_training_shard(model, self.geometry, self.layout, self.rank)
        )
        self.resharder = Resharder(self.geometry, self.layout, groups, method=method, engine=limits)
        self.gen_tp = gen_tp if method == "micro-dp" else 1  # the baselines gather the whole model
        self._tp_group: dist.ProcessGroup | None = None  # the generation TP group's collectives
        self._tp_order: list[int] = []  # group rank of generation TP rank 0, 1, …
        if self.gen_tp > 1:
            members = self.layout.gen_tp_group(self.rank)
            self._tp_group = subgroups[members]
            by_tp = {global_ranks[m]: self.layout.gen_coord(m).tp for m in members}
            ranks = dist.get_process_group_ranks(self._tp_group)
            self._tp_order = sorted(range(len(ranks)), key=lambda i: by_tp[ranks[i]])
        self.gen_pp = self.layout.gen_pp if method == "micro-dp" else 1
        self._pp_group: dist.ProcessGroup | None = None  # this rank's generation pipeline, group rank = stage
        if self.gen_pp > 1:
            members = self.layout.gen_pp_group(self.rank)
            self._pp_group = subgroups[members]
            stages = [self.layout.gen_coord(m).pp for m in members]
            if stages != list(range(self.gen_pp)) or members != tuple(sorted(members)):
                raise ValueError(f"generation pipeline group {members}: group ranks out of stage order")
        self._model: torch.nn.Module | None = None
        self.held_extra_bytes = 0
        """extra_generation_bytes during the last generation (kept after release, for reports)."""

    @staticmethod
    def process_groups(layout: HybridLayout, method: Method = "micro-dp") -> list[tuple[int, ...]]:
        """The groups (mesh ranks) an engine of this layout needs: resharding, plus the generation TP groups."""
        groups = ReshardGroups.needed(layout, [method])
        if method == "micro-dp" and layout.gen_tp > 1:
            groups += [g for g in layout.gen_tp_groups() if g not in groups]
        if method == "micro-dp" and layout.gen_pp > 1:
            groups += [g for g in layout.gen_pp_groups() if g not in groups]
        return groups

    # ---- generation replicas -------------------------------------------------------------------------------

    @property
    def micro_index(self) -> int:
        """This rank's generation replica inside its training replica (0 … d_g − 1); 0 for the baselines."""
        return self.layout.gen_coord(self.rank).micro if self.method == "micro-dp" else 0

    @property
    def micro_size(self) -> int:
        """d_g generation replicas per training replica (1 for the baselines: every rank has the whole model)."""
        return self.layout.micro_dp if self.method == "micro-dp" else 1

    def micro_slice(self, rows: int) -> slice:
        """The rows of a training replica's share this generation replica samples (contiguous, sizes differ by
        at most one)."""
        base, extra = divmod(rows, self.micro_size)
        m = self.micro_index
        start = m * base + min(m, extra)
        return slice(start, start + base + (1 if m < extra else 0))

    def gather_micro(self, part: Batch) -> Batch:
        """Join the d_g generation replicas' outputs into the training replica's share (collective over the
        micro-DP group; every member gets the whole share)."""
        group = self.groups.micro_dp if self.method == "micro-dp" else None
        if group is None or self.micro_size == 1:
            return part
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, part, group=group)
        members = dist.get_process_group_ranks(group)  # in group-rank order, as all_gather_object fills `parts`
        micro = [self.layout.gen_coord(self.groups.global_ranks.index(g)).micro for g in members]
        ordered = [parts[i] for i in sorted(range(len(parts)), key=micro.__getitem__)]
        return Batch.concat(ordered)

    # ---- the transition ------------------------------------------------------------------------------------

    @property
    def stats(self) -> ReshardStats | None:
        """Figures of the last train → generate transition on this rank."""
        return self.resharder.stats

    @property
    def in_generation(self) -> bool:
        return self.resharder.in_generation

    @property
    def extra_generation_bytes(self) -> int:
        """Parameter bytes this rank holds for generation beyond its training memory: the received pieces (0 in
        training). The generation model adds none of its own."""
        gen = self.resharder.generation
        if gen is None:
            return 0
        own = self.train.flat.untyped_storage().data_ptr()
        received = sum(p.numel() * p.element_size() for p in gen.pieces() if p.untyped_storage().data_ptr() != own)
        copied = self.train.flat.numel() * self.train.flat.element_size() if self._pieces else 0
        return received + copied

    def _to_generation(self):  # -> engines.hybrid.reshard.GenerationShard
        if self.resharder.in_generation:
            self.release()
        if self._pieces is not None:
            pieces = self._pieces()
            first = next(iter(pieces.values()))
            self.train = TrainShard.allocate(self._train_spec, dtype=first.dtype, device=first.device)
            with torch.no_grad():
                fill_training_shard(self.train, pieces)
        return self.resharder.to_generation(self.train)

    def hand_over(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], object]) -> object:
        """Reshard to the generation layout (collective), give `load` this rank's generation shard in the fused
        per-rank layout an inference engine keeps (q/k/v → qkv_proj, gate/up → gate_up_proj, this TP rank's
        vocabulary rows: vLLM's), one tensor at a time, then free the received pieces; returns what `load`
        returned. For an engine that holds its own weights (engines.rollout.vllm_engine)."""
        shard = self._to_generation()
        self.held_extra_bytes = self.extra_generation_bytes
        try:
            return load(shard.named_weights("fused"))
        finally:
            self.release()

    def generation_model(self) -> torch.nn.Module:
        """Reshard to the generation layout (collective) and return a model that computes on the gathered pieces."""
        shard = self._to_generation()
        layers = shard.layers if self.gen_pp > 1 else None
        model = self._skeleton(len(layers) if layers is not None else None)
        modules: dict[str, dict[str, tuple[list[torch.Tensor], int | None]]] = {}
        for name, views, dim in shard.named_pieces():
            if layers is not None:
                name = _local_layer_name(name, layers.start)
            module, attr = _split_name(name)
            modules.setdefault(module, {})[attr] = (views, dim)
        vocab_per_rank = self.geometry.vocab_size // self.gen_tp
        start = self.layout.gen_coord(self.rank).tp * vocab_per_rank if self.method == "micro-dp" else 0
        for module, tensors in modules.items():
            views, dim = tensors["weight"]
            bias = tensors.get("bias", (None, None))[0]
            if dim is None:  # norms: the replicated weight itself
                _rebind(model, f"{module}.weight", views[0], like=views[0], requires_grad=False)
                continue
            parent, attr = _split_name(module)
            if attr == "embed_tokens":
                piece = _VocabPieces(views, start, self._tp_group)
            elif dim == 0:
                piece = _ColumnPieces(views, bias, self._tp_group if attr == "lm_head" else None, self._tp_order)
            else:
                piece = _RowPieces(views, bias[0] if bias else None, self._tp_group)
            setattr(model.get_submodule(parent), attr, piece)
        if layers is not None:
            stage = self.layout.gen_coord(self.rank).pp
            model = _PipelineStage(model, stage, self.gen_pp, self._pp_group, self.geometry.vocab_size)
        self._model = model
        self.held_extra_bytes = self.extra_generation_bytes
        return model

    def release(self) -> None:
        """Back to training: drop the generation model and free the received pieces. Local."""
        self._model = None
        if self.resharder.in_generation:
            self.resharder.to_training()
        if self._pieces is not None:
            self.train = None  # the copy lives only while generating

    def generation_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The generation shard as whole tensors (HF names; merged tensors are copies), for checks and for
        engines that load weights (vLLM)."""
        if not self.in_generation:
            raise RuntimeError("not in generation; call generation_model() first")
        return self.resharder.generation.named_weights("hf")

    def _skeleton(self, num_layers: int | None = None) -> torch.nn.Module:
        """A parameter-less (meta) copy of the training model (with `num_layers`: one pipeline stage's layers);
        its linears and embedding get replaced by pieces."""
        config = copy.deepcopy(self.train_model.config)
        if num_layers is not None:
            config.num_hidden_layers = num_layers
            if getattr(config, "layer_types", None) is not None:
                config.layer_types = config.layer_types[:num_layers]
        with torch.device("meta"):
            model = type(self.train_model)(config)
        base = getattr(model, model.base_model_prefix)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None:  # its inv_freq buffer is computed, not loaded: build it for real
            base.rotary_emb = type(rotary)(config=config)
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(f"generation skeleton has computed buffers this engine cannot rebuild: {meta_buffers}")
        return model.eval()


def _local_layer_name(name: str, first: int) -> str:
    """`model.layers.{i}.…` of the whole model → the stage skeleton's `model.layers.{i − first}.…`."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        parts[2] = str(int(parts[2]) - first)
    return ".".join(parts)


class _PipelineStage(torch.nn.Module):
    """One generation pipeline stage of a causal LM, called like the whole model by the decode loop on every
    stage's rank in step (same rows, same seeds).

    Stage 0 embeds the ids; each stage runs its layers over the hidden states from the previous stage (received
    as float32) and sends its own to the next; the last stage applies the final norm and the output head to the
    last position, and broadcasts those logits over the pipeline, so every stage samples the same token and keeps
    its own layers' KV cache. One micro-batch in flight: the stages take turns (a decode step's latency is the sum
    of the stages'), as a pipeline does for a single batch; the layout's point is that no rank holds more than
    its stage."""

    def __init__(
        self, model: torch.nn.Module, stage: int, stages: int, group: dist.ProcessGroup, vocab_size: int
    ) -> None:
        super().__init__()
        from engines.rollout.hf import cache_argument

        self.stage, self.stages, self.group, self.vocab_size = stage, stages, group, vocab_size
        self.base = getattr(model, model.base_model_prefix)
        self.cache_arg = cache_argument(self.base)
        self.first, self.last = stage == 0, stage == stages - 1
        if not self.first:
            self.base.embed_tokens = torch.nn.Identity()  # the hidden states come from the previous stage
        if not self.last:
            self.base.norm = torch.nn.Identity()  # the final norm belongs to the last stage
        self.lm_head = model.lm_head if self.last else None
        self.hidden_size = model.config.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        use_cache: bool = True,
        past_key_values: object = None,
        cache: object = None,
    ) -> object:
        kwargs = {
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": use_cache,
            self.cache_arg: cache if cache is not None else past_key_values,
        }
        if self.first:
            out = self.base(input_ids=input_ids, **kwargs)
        else:
            hidden = torch.empty((*input_ids.shape, self.hidden_size), dtype=torch.float32)
            dist.recv(hidden, group=self.group, group_src=self.stage - 1)
            out = self.base(inputs_embeds=hidden, **kwargs)
        if self.last:
            logits = self.lm_head(out.last_hidden_state[:, -1:]).float().contiguous()
            if logits.shape[-1] != self.vocab_size:
                raise ValueError(
                    f"the output head gives {logits.shape[-1]} logits, the model's vocabulary is {self.vocab_size}"
                )
        else:
            dist.send(out.last_hidden_state.float().contiguous(), group=self.group, group_dst=self.stage + 1)
            logits = torch.empty((input_ids.shape[0], 1, self.vocab_size), dtype=torch.float32)
        dist.broadcast(logits, group=self.group, group_src=self.stages - 1)
        kv = getattr(out, "cache", None)
        kv = getattr(out, "past_key_values", None) if kv is None else kv
        return SimpleNamespace(logits=logits, cache=kv, past_key_values=kv)


class _ColumnPieces(torch.nn.Module):
    """A column-parallel linear over r sub-shards: their outputs are adjacent blocks of the output features.
    With a group (the output head), the generation TP ranks' blocks are all-gathered into whole logits."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor] | None,
        group: dist.ProcessGroup | None = None,
        order: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.weights, self.biases = weights, biases or [None] * len(weights)
        self.group, self.order = group, order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(self.weights, self.biases)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.group is None:
            return y
        parts = [torch.empty_like(y) for _ in self.order]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat([parts[i] for i in self.order], dim=-1)


class _RowPieces(torch.nn.Module):
    """A row-parallel linear over r sub-shards: each takes its block of the input features; the partial sums of
    the generation TP ranks are all-reduced, then the (replicated) bias is added."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weights, self.bias, self.group = weights, bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = torch.split(x, [w.shape[1] for w in self.weights], dim=-1)
        y = torch.nn.functional.linear(blocks[0], self.weights[0])
        for block, w in zip(blocks[1:], self.weights[1:]):
            y = y + torch.nn.functional.linear(block, w)
        if self.group is not None:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class _VocabPieces(torch.nn.Module):
    """A vocab-parallel embedding over r sub-tables covering adjacent id ranges from `start`; ids outside this
    generation TP rank's range embed to zero and the ranks' embeddings are all-reduced (Megatron's scheme)."""

    def __init__(self, tables: list[torch.Tensor], start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.tables, self.start, self.group = tables, start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.tables[0].shape[0]
        local = ids - self.start
        out = self.tables[0].new_zeros((*ids.shape, self.tables[0].shape[1]))
        for i, table in enumerate(self.tables):
            hit = (local >= i * rows) & (local < (i + 1) * rows)
            out[hit] = table[local[hit] - i * rows]
        if self.group is not None:
            dist.all_reduce(out, group=self.group)
        return out
