"""The 3D-HybridEngine bound to a torch actor: trains on Megatron-layout shards, generates on resharded ones.

`HybridEngine` takes a transformers decoder already split by `engines.parallel.parallelize(..., fsdp=False,
vocab_parallel=True)` (TP over the mesh's "tp" dim, whole replicas over "dp": the (p, t, d) layout of HybridFlow,
p = 1 in the torch engine) and moves every parameter into one flat training buffer (`TrainShard`): each
parameter's local tensor becomes a view of that buffer, q/k/v and gate/up side by side as Megatron fuses them. The
optimizer, checkpoints and forward passes see ordinary (D)Tensor parameters; only their memory moved.

`generation_model()` reshards with `Resharder` (all-gather inside micro-DP groups, the local piece being the
training buffer itself) and binds the generation shard to a parameter-less copy of the model, split over the
generation TP group (t_g ranks at stride t/t_g) with the same TP plan: the tensors are bound, not copied, so a
generation shard built from one piece is training memory and one built from r pieces is the merged tensor (see
reshard.py). `release()` unbinds them and frees the received pieces; training memory was never written. What the
merge costs: with r = t/t_g > 1 each sharded weight is concatenated once while binding (`bound_copy_bytes`,
M_s/t_g per rank, on top of the gathered pieces of HybridFlow Table 2), after which the received pieces are
dropped, so decoding holds training memory + M_s/t_g; with t_g = t nothing is copied or sent.

Generation then runs at data-parallel size d·d_g: `micro_slice` gives each generation replica its part of the
rows of its training replica, and `gather_micro` joins the parts again (over the micro-DP group, in micro order),
so callers see the same rows as without resharding.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from engines.hybrid.layout import HybridLayout
from engines.hybrid.limits import GenerationEngineLimits, transformers_engine_limits
from engines.hybrid.reshard import Method, ReshardGroups, Resharder, ReshardStats
from engines.hybrid.shards import ModelGeometry, TrainShard, check_model_fits, shard_layout
from flowactors import Batch

__all__ = ["HybridEngine", "bind_training_shard", "layout_of", "untie_embeddings"]


def _split_name(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def _rebind(model: torch.nn.Module, name: str, tensor: torch.Tensor, *, like: torch.Tensor,
            requires_grad: bool) -> torch.nn.Parameter:
    """Make parameter `name` of `model` hold `tensor` (its local shard when `like` is a DTensor), without a copy."""
    module_name, attr = _split_name(name)
    module = model.get_submodule(module_name)
    if isinstance(like, DTensor):
        tensor = DTensor.from_local(tensor, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                    stride=like.stride())
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


def bind_training_shard(model: torch.nn.Module, geometry: ModelGeometry, layout: HybridLayout,
                        rank: int) -> TrainShard:
    """Move rank's parameters into one flat training buffer in the resharder's layout; they become its views.

    Call before building the optimizer (it holds the parameter objects)."""
    coord = layout.train_coord(rank)
    t = layout.train_tp
    spec = shard_layout(geometry, layout.train_pp, coord.pp, t)
    params = dict(model.named_parameters())
    if "lm_head.weight" not in params and "lm_head.weight" in model.state_dict():
        raise ValueError("the model ties lm_head to embed_tokens; the hybrid engine shards them separately (as "
                         "Megatron does): untie them first (ModelConfig builds untied models)")
    dtype = next(iter(params.values())).dtype
    shard = TrainShard.allocate(spec, dtype=dtype, device=_local(next(iter(params.values()))).device)
    bound = set()
    for entry in spec.entries:
        rule = entry.rule
        for (hf_name, _), part in zip(rule.parts, rule.part_views(shard.tensors[rule.name], t)):
            if hf_name not in params:
                raise ValueError(f"the model has no parameter {hf_name!r} that a {geometry} decoder needs; is it a "
                                 f"Llama/Qwen2 causal LM?")
            param = params[hf_name]
            local = _local(param.data)
            if tuple(local.shape) != tuple(part.shape):
                raise ValueError(f"{hf_name}: this rank holds a {tuple(local.shape)} shard, the training layout "
                                 f"expects {tuple(part.shape)}; parallelize the model with vocab_parallel=True and "
                                 f"fsdp=False over the same tp size ({t})")
            part.copy_(local)
            _rebind(model, hf_name, part, like=param.data, requires_grad=param.requires_grad)
            bound.add(hf_name)
    extra = sorted(set(params) - bound)
    if extra:
        raise ValueError(f"parameters outside the Llama/Qwen2 training layout: {extra}; the hybrid engine reshards "
                         f"causal-LM decoders only")
    return shard


def layout_of(mesh_or_sizes: DeviceMesh | tuple[int, int, int], gen_tp: int) -> HybridLayout:
    """The hybrid layout of an actor whose training mesh is (pp, dp, tp), generating at TP = gen_tp."""
    if isinstance(mesh_or_sizes, DeviceMesh):
        mesh = mesh_or_sizes
        pp, dp, tp = (mesh.size(mesh.mesh_dim_names.index(d)) for d in ("pp", "dp", "tp"))
    else:
        pp, dp, tp = mesh_or_sizes
    return HybridLayout(train_pp=pp, train_tp=tp, train_dp=dp, gen_pp=1, gen_tp=gen_tp)


class HybridEngine:
    """One actor rank's weights between the training layout (1, t, d) and the generation layout (1, t_g).

    Collective: every rank of the actor's mesh constructs it, and calls `generation_model`/`release` in step.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, gen_tp: int,
                 subgroups: Mapping[tuple[int, ...], dist.ProcessGroup], *, method: Method = "micro-dp",
                 limits: GenerationEngineLimits | None = None) -> None:
        """`subgroups`: this rank's process groups among the mesh's ranks, keyed by mesh rank tuples, created
        beforehand from `HybridEngine.process_groups` (flowactors' `Worker.process_groups` does that)."""
        self.layout = layout_of(mesh, gen_tp)
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
        self.train = bind_training_shard(model, self.geometry, self.layout, self.rank)
        self.resharder = Resharder(self.geometry, self.layout, groups, method=method, engine=limits)
        self.gen_tp = gen_tp if method == "micro-dp" else 1  # the baselines gather the whole model
        self._gen_mesh = None
        if self.gen_tp > 1:
            members = self.layout.gen_tp_group(self.rank)
            self._gen_mesh = DeviceMesh.from_group(subgroups[members], mesh.device_type,
                                                   mesh=[global_ranks[r] for r in members], mesh_dim_names=("tp",))
        self.bound_copy_bytes = 0
        """Bytes of the merged tensors the last binding made: with r = t/t_g > 1 a transformers weight of the
        generation shard is one contiguous tensor built from r gathered pieces (reshard.py), a copy the Table-2
        accounting of the pieces does not include; 0 when t_g = t (every tensor is training memory)."""
        self._skeleton: torch.nn.Module | None = None
        self._meta: dict[str, torch.nn.Parameter] = {}

    @staticmethod
    def process_groups(layout: HybridLayout, method: Method = "micro-dp") -> list[tuple[int, ...]]:
        """The groups (mesh ranks) an engine of this layout needs: resharding, plus the generation TP groups."""
        groups = ReshardGroups.needed(layout, [method])
        if method == "micro-dp" and layout.gen_tp > 1:
            groups += [g for g in layout.gen_tp_groups() if g not in groups]
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
        """Parameter bytes this rank holds for generation beyond its training memory: the merged copies plus the
        received pieces still held (0 in training)."""
        gen = self.resharder.generation
        if gen is None:
            return 0
        own = self.train.flat.untyped_storage().data_ptr()
        received = sum(p.numel() * p.element_size() for p in gen.pieces() if p.untyped_storage().data_ptr() != own)
        return self.bound_copy_bytes + received

    def generation_model(self) -> torch.nn.Module:
        """Reshard to the generation layout (collective) and return the model bound to the generation shard."""
        if self.resharder.in_generation:
            self.release()
        shard = self.resharder.to_generation(self.train)
        model = self._skeleton_model()
        pieces = {p.untyped_storage().data_ptr() for p in shard.pieces()}
        own = self.train.flat.untyped_storage().data_ptr()
        self.bound_copy_bytes, keeps_received = 0, False
        for name, tensor in shard.named_weights("hf"):
            if tensor.untyped_storage().data_ptr() not in pieces:  # merged from r sub-shards: a contiguous copy
                self.bound_copy_bytes += tensor.numel() * tensor.element_size()
            else:
                keeps_received |= tensor.untyped_storage().data_ptr() != own
            _rebind(model, name, tensor, like=self._meta[name], requires_grad=False)
        if not keeps_received:
            shard.drop_pieces()  # every received byte now lives in a merged copy: free the gathered pieces
        return model

    def release(self) -> None:
        """Back to training: unbind the generation model and free the received pieces. Local."""
        if self._skeleton is not None:
            for name, meta in self._meta.items():
                module_name, attr = _split_name(name)
                self._skeleton.get_submodule(module_name)._parameters[attr] = meta
        if self.resharder.in_generation:
            self.resharder.to_training()

    def generation_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The bound generation shard's tensors (local shards, HF names), for checks and other engines."""
        if self._skeleton is None or not self.in_generation:
            raise RuntimeError("not in generation; call generation_model() first")
        for name, param in self._skeleton.named_parameters():
            yield name, _local(param.data)

    def _skeleton_model(self) -> torch.nn.Module:
        """A parameter-less (meta) copy of the training model under the generation TP plan, built once."""
        if self._skeleton is None:
            from engines.parallel import tensor_parallel

            config = copy.deepcopy(self.train_model.config)
            with torch.device("meta"):
                model = type(self.train_model)(config)
            base = getattr(model, model.base_model_prefix)
            rotary = getattr(base, "rotary_emb", None)
            if rotary is not None:  # its inv_freq buffer is computed, not loaded: build it for real
                base.rotary_emb = type(rotary)(config=config)
            if self._gen_mesh is not None:
                tensor_parallel(model, self._gen_mesh, vocab_parallel=True)
            meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
            if meta_buffers:
                raise ValueError(f"generation skeleton has computed buffers this engine cannot rebuild: "
                                 f"{meta_buffers}")
            model.eval()
            self._meta = dict(model.named_parameters())
            self._skeleton = model
        return self._skeleton
