"""The megatron-core training engine: the GPU production path for TP / PP / DP (docs/design.md §4).

`MegatronEngine` implements engines.interfaces.TrainingEngine, as the torch-native
`engines.training.torch_native.TrainEngine` does, so a role holds either; `ModelConfig(engine="megatron")` chooses it
(engines.registry). Inside, everything is megatron-core's own machinery (a `GPTModel`, its DDP and distributed
optimizer, the pipeline schedules of `get_forward_backward_func`) over process groups built from the flowactors
group's mesh (engines.training.megatron.groups), so models on different slots or with different layouts live side by
side. Weights come in and go out in Hugging Face format (engines.training.megatron.convert); checkpoints hold them
and the optimizer state in model space, so they load under any (p, t, d). megatron-core (pinned to 0.16.1) is
imported lazily: importing this module works without it; only building an engine needs it.

How it works (loss aggregation, heads, vocab-parallel log-probs), how it differs from TrainEngine, and what runs on
CPU: docs/engines.md (megatron-core).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engines.hybrid.shards import ModelGeometry
from engines.ops import response_logits
from engines.training.common import LossFn, OptimConfig, token_mean
from engines.training.megatron.convert import (
    HEADS,
    check_megatron_fits,
    hf_to_megatron,
    megatron_geometry,
    megatron_to_hf,
)
from engines.training.megatron.groups import MegatronGroups, world_groups
from flowactors import Batch

__all__ = ["MegatronEngine", "megatron_available"]

_ADAM_STATE = ("param", "exp_avg", "exp_avg_sq")
"""What a checkpoint keeps of each distributed-optimizer shard (its main parameter and Adam moments)."""

_GRAD_CLIP_OFF = 1e30
"""megatron computes the gradient norm only when clipping; with grad_clip = 0 we clip at a norm never reached."""


def megatron_available() -> bool:
    """Whether megatron-core can be imported here (it is an optional extra: pip install '.[megatron]')."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def _check_hf_config(config) -> None:
    """Refuse transformers settings this GPTModel does not reproduce, naming the setting."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the megatron engine builds SwiGLU (silu) MLPs only")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={rope.get('rope_type')!r} (rope scaling) is not converted to megatron-core here; "
            f"use a checkpoint with default rotary embeddings or the torch-native TrainEngine"
        )
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by the megatron engine")


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _transformer_config(config, g: ModelGeometry, tp: int, pp: int, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=g.num_layers,
        hidden_size=g.hidden_size,
        ffn_hidden_size=g.intermediate_size,
        num_attention_heads=g.num_heads,
        num_query_groups=g.num_kv_heads,
        kv_channels=g.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=g.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # micro-batches differ in rows and width; the pipeline exchanges shapes before activations
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # unused (no experts), but the default refuses variable lengths
        calculate_per_token_loss=True,
        # weights are loaded from the HF checkpoint right after construction
        perform_initialization=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # the fused kernels need CUDA (and some Apex / TE); the plain paths are numerically the reference ones
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )


def _quiet() -> None:
    """Filter what megatron-core 0.16.1 says on every build or step that asks nothing of the user: that Transformer
    Engine / Apex are missing (we build the local layer spec and torch optimizers on purpose; on GPU they are used
    where installed), its own deprecated default `cuda_graph_scope`, and torch's renames of the collectives its
    DDP calls (`reduce_scatter_tensor`, `all_gather_into_tensor`; same operations)."""
    for message, category in (
        (r".*(Transformer Engine|Apex).* not installed", UserWarning),
        (r"full scope is deprecated", UserWarning),
        (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning),
    ):
        warnings.filterwarnings("ignore", message=message, category=category)


_quiet()  # before megatron-core is first imported, which is where most of these are said


def _process_state(tp_rank: int) -> None:
    """The process-global pieces megatron keeps besides its groups, none tied to a layout: the RNG tracker (its
    dropout streams differ per TP rank; required by the attention layer; seeded again, with the same seed, by
    each engine a process builds) and the scratch buffer its attention and TP layers borrow. `parallel_state`
    creates the buffer only inside `initialize_model_parallel`, which we never call (it would bind the process to
    one layout over the whole world), so it is created here through its private setter, once per process."""
    from megatron.core import parallel_state, tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def _attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """megatron's boolean mask [b, 1, s, s], True where a query must NOT attend: causal and key padding."""
    t = mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    return ~(causal[None] & mask.bool()[:, None, :])[:, None]


def vocab_parallel_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool, tp_group: Any
) -> dict[str, torch.Tensor]:
    """log p(token) (and entropy) in float32 from logits split over the TP group's vocabulary shards."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def tp_sum(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=tp_group)

    z = logits.float() / temperature
    local_vocab = z.shape[-1]
    start = dist.get_rank(tp_group) * local_vocab
    peak = z.detach().max(-1).values  # a constant shift, so no gradient through the max
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    z = z - peak.unsqueeze(-1)
    exp = z.exp()
    log_norm = tp_sum(exp.sum(-1)).log()
    local = tokens - start
    inside = (local >= 0) & (local < local_vocab)
    picked = z.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1) * inside
    out = {"log_probs": tp_sum(picked) - log_norm}
    if with_entropy:
        out["entropy"] = log_norm - tp_sum((exp * z).sum(-1)) / log_norm.exp()
    return out


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag TP-sharded weights the way megatron's initialisers do.

    megatron-core 0.16.1 sets `tensor_model_parallel` / `partition_dim` on a parallel layer's weight only inside
    its random initialisers, which we skip (perform_initialization=False: the weights come from the checkpoint).
    Untagged shards count as TP replicas, so the gradient norm (and with it clipping) would drop every TP rank's
    shard but rank 0's."""
    from megatron.core import tensor_parallel as mtp

    dims = {mtp.ColumnParallelLinear: 0, mtp.VocabParallelEmbedding: 0, mtp.RowParallelLinear: 1}
    for module in model.modules():
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            mtp.set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


@contextlib.contextmanager
def _default_group_is(group: Any) -> Iterator[None]:
    """Within this block, `all_gather_object` and `get_world_size` without a group mean `group`.

    megatron-core 0.16.1's `get_megatron_optimizer` aligns its parameter groups with an all_gather_object over
    the default (whole-world) group even when given a ProcessGroupCollection (optimizer/__init__.py,
    `_get_param_groups`), so a model on part of the world would wait there for ranks that never come. Only the
    task thread calls torch.distributed, so redirecting the default for the duration of that call is safe; the
    gather only agrees on which parameter groups exist, for which the model's own ranks are the right set."""
    gather, size = dist.all_gather_object, dist.get_world_size

    def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
        return gather(object_list, obj, group=group if group is not None else default)

    def get_world_size(group: Any = None) -> int:
        return size(group if group is not None else default)

    default = group
    dist.all_gather_object, dist.get_world_size = all_gather_object, get_world_size
    try:
        yield
    finally:
        dist.all_gather_object, dist.get_world_size = gather, size


class _ScalarHead(torch.nn.Linear):
    """A value/score head in place of GPTModel's `output_layer`: TP-replicated, called the way GPTModel calls its
    output layer (`weight` / `runtime_gather_output` keywords, an (output, bias) pair back)."""

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        return super().forward(hidden), None


def _head_of(model: torch.nn.Module) -> str:
    """The engines.models.config head of a transformers model, from its class name."""
    name = type(model).__name__
    for suffix, head in (
        ("ForCausalLM", "lm"),
        ("ForTokenClassification", "value"),
        ("ForSequenceClassification", "score"),
    ):
        if name.endswith(suffix):
            return head
    raise ValueError(f"{name} is not a causal-LM, token- or sequence-classification model; pass head= explicitly")


class MegatronEngine:
    """A megatron-core GPTModel shard (this rank's TP × PP piece) with megatron's DDP and optimizer.

    `head`: "lm" (causal LM: actor, reference), "value" (a scalar per token: critic) or "score" (a scalar per
    sequence: reward / cost model); `state_dict` is the matching transformers model's. `groups`: this rank's
    megatron process groups (engines.training.megatron.groups; a flowactors role passes its group's); None builds them
    over the whole torch.distributed world (every rank must then construct the engine)."""

    def __init__(
        self,
        hf_config,
        state_dict: Mapping[str, torch.Tensor],
        optim: OptimConfig | None,
        *,
        tp: int = 1,
        pp: int = 1,
        trainable: bool = True,
        distributed_optimizer: bool = True,
        dtype: torch.dtype | None = None,
        head: str = "lm",
        groups: MegatronGroups | None = None,
    ) -> None:
        _check_hf_config(hf_config)
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.head = head
        self.pad_token_id = getattr(hf_config, "pad_token_id", None)
        self.geometry = megatron_geometry(hf_config)
        check_megatron_fits(self.geometry, tp, pp)  # before any collective
        if not megatron_available():
            raise ImportError("the megatron engine needs megatron-core==0.16.1: pip install '.[megatron]'")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; the megatron engine runs inside a process "
                "group (a flowactors group, or dist.init_process_group for a single process)"
            )
        self.hf_config, self.cfg = hf_config, optim or OptimConfig()
        self.groups = groups or world_groups(tp, pp)
        if (self.groups.tp, self.groups.pp) != (tp, pp):
            raise ValueError(
                f"the process groups are laid out for (tp, pp) = {(self.groups.tp, self.groups.pp)}, not {(tp, pp)}"
            )
        self.tp, self.pp, self.dp_size = tp, pp, self.groups.dp
        if self.groups.reversed_stages and self.geometry.tied_embeddings and head == "lm":
            raise ValueError(
                "a model whose stages run down its ranks cannot tie its word embeddings: megatron ties "
                "the first and last stages through the PP group's rank order; reverse the critic (the "
                "fused pipeline's second model), or untie the embeddings"
            )
        self.tp_rank, self.pp_rank, self.dp_rank = self.groups.tp_rank, self.groups.pp_rank, self.groups.dp_rank
        self.first_stage, self.last_stage = self.groups.first_stage, self.groups.last_stage
        _process_state(self.tp_rank)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        dtype = dtype or state_dict["model.embed_tokens.weight"].dtype
        self.config = _transformer_config(hf_config, self.geometry, tp, pp, dtype)
        self.module = self._build_model(state_dict, dtype)
        self.model: torch.nn.Module = self.module
        self.optimizer = None
        self.compute_dtype: torch.dtype | None = None  # the parameters' dtype is the compute dtype (no autocast)
        self._peak_lr, self._steps = self.cfg.lr, 0
        if trainable:
            self._wrap_for_training(distributed_optimizer)
        else:
            self.module.requires_grad_(False)
        self._pending: tuple[Batch, torch.Tensor] | None = None

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, optim: OptimConfig | None, **kwargs: Any) -> MegatronEngine:
        """Build from a transformers model (e.g. engines.build_model(cfg, head)); every rank passes the same. The
        head follows the class (*ForCausalLM, *ForTokenClassification, *ForSequenceClassification) unless given."""
        kwargs.setdefault("head", _head_of(model))
        return cls(model.config, model.state_dict(), optim, **kwargs)

    # -- construction -----------------------------------------------------------------------------------------
    def _build_model(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        g = self.geometry
        scalar = self.head != "lm"
        model = GPTModel(
            config=self.config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=g.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            share_embeddings_and_output_weights=g.tied_embeddings and not scalar,
            position_embedding_type="rope",
            rotary_base=_rope_theta(self.hf_config),
            parallel_output=True,
            pg_collection=self.groups.collection,
        )
        if scalar and self.last_stage:  # the vocab projection GPTModel built goes; the scalar head takes its place
            model.output_layer = _ScalarHead(g.hidden_size, 1, bias="score.bias" in state_dict, dtype=dtype)
        shard = hf_to_megatron(state_dict, g, self.tp_rank, self.tp, self.pp_rank, self.pp, self.head)
        expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        if set(shard) != expected:
            raise RuntimeError(
                f"converted shard and GPTModel disagree: missing {sorted(expected - set(shard))}, "
                f"unexpected {sorted(set(shard) - expected)}"
            )
        model.load_state_dict({k: v.to(dtype) for k, v in shard.items()}, strict=False)
        _mark_tensor_parallel(model)
        return model.to(self.device)

    def _wrap_for_training(self, distributed_optimizer: bool) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        self.model = DistributedDataParallel(
            config=self.config, ddp_config=ddp_config, module=self.module, pg_collection=self.groups.collection
        )
        self.config.finalize_model_grads_func = finalize_model_grads  # the schedule passes our groups
        self.config.no_sync_func = self.model.no_sync
        c = self.cfg
        with _default_group_is(self.groups.collection.intra_dist_opt):  # see _default_group_is
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=c.lr,
                    weight_decay=c.weight_decay,
                    adam_beta1=c.betas[0],
                    adam_beta2=c.betas[1],
                    adam_eps=c.eps,
                    clip_grad=c.grad_clip or _GRAD_CLIP_OFF,
                    use_distributed_optimizer=distributed_optimizer,
                    bf16=self.config.bf16,
                    fp16=self.config.fp16,
                    params_dtype=self.config.params_dtype,
                ),
                [self.model],
                use_gloo_process_groups=False,
                pg_collection=self.groups.collection,
            )
        self._apply_lr()

    # -- learning rate ----------------------------------------------------------------------------------------
    def _lr_factor(self, step: int) -> float:
        return self.cfg.lr_factor(step)

    def _apply_lr(self) -> float:
        lr = self._peak_lr * self._lr_factor(self._steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate the schedule scales (e.g. warm start and RL use different rates)."""
        self._peak_lr = lr
        if self.optimizer is not None:
            self._apply_lr()

    # -- forward passes ---------------------------------------------------------------------------------------
    def micro_batches(self, batch: Batch) -> list[Batch]:
        """Token-budget micro-batches, on this rank's device (so the algorithm's loss sees device tensors)."""
        width = int(batch["input_ids"].shape[1])
        rows = max(1, self.cfg.micro_batch_tokens // max(1, width))
        return [
            Batch({k: v.to(self.device) for k, v in mb.tensors.items()}, mb.rows, mb.meta)
            for mb in (batch.chunk(rows) if len(batch) else [])
        ]

    def _run_model(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        ids = mb["input_ids"].to(self.device)
        mask = mb["attention_mask"].to(self.device)
        pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)  # rope uses sequence index anyway
        return model(input_ids=ids, position_ids=pos, attention_mask=_attention_mask(mask))

    def _logits(self, mb: Batch) -> torch.Tensor:
        """This micro-batch's head output: vocab-sharded logits (B, T, V/tp), or (B, T, 1) from a scalar head; the
        schedule's output when inside one."""
        if self._pending is not None and self._pending[0] is mb:
            return self._pending[1]
        if self.pp > 1:
            raise RuntimeError(
                "with pp > 1 the head's output exists only inside the pipeline schedule; call "
                "log_probs / values / scores or update, whose outputs_fn runs on the last stage"
            )
        return self._run_model(self.model, mb)

    def _require(self, head: str, what: str) -> None:
        if self.head != head:
            raise RuntimeError(f"{what} needs the {head!r} head; this engine was built with head={self.head!r}")

    def policy_outputs(self, mb: Batch, temperature: float, with_entropy: bool) -> dict[str, torch.Tensor]:
        self._require("lm", "policy_outputs")
        resp = mb["responses"].to(self.device)
        logits = response_logits(self._logits(mb), resp.shape[1])
        return vocab_parallel_log_probs(logits, resp, temperature, with_entropy, self.groups.collection.tp)

    def value_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        """{"values": (B, R) float32}: the value head at the positions that predict each response token."""
        self._require("value", "value_outputs")
        return {"values": response_logits(self._logits(mb), mb["responses"].shape[1]).squeeze(-1).float()}

    def score_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        """{"scores": (B,) float32}: the score head at each row's last token that is not padding.

        As transformers' *ForSequenceClassification pools: the rightmost token != pad_token_id (so left and right
        padding both work), the last token when the config has no pad token and the micro-batch one row."""
        self._require("score", "score_outputs")
        out = self._logits(mb).squeeze(-1)
        ids = mb["input_ids"].to(out.device)
        if self.pad_token_id is None:
            if ids.shape[0] != 1:
                raise ValueError(
                    "the score model's config has no pad_token_id, so the last real token of a padded "
                    "row is unknown; set config.pad_token_id (engines.build_model does)"
                )
            last = torch.full((1,), ids.shape[1] - 1, device=out.device)
        else:
            index = torch.arange(ids.shape[1], device=out.device)
            last = (index * (ids != self.pad_token_id)).argmax(-1)
        return {"scores": out[torch.arange(ids.shape[0], device=out.device), last].float()}

    def _schedule(
        self, mbs: list[Batch], loss_step: Callable[[Batch, torch.Tensor], tuple], forward_only: bool
    ) -> list[Any]:
        """Run megatron's forward(-backward) schedule over the micro-batches; returns the last stage's records.
        A pipeline whose stages run down its ranks is outside megatron's schedules: it runs as a plan of one."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if self.groups.reversed_stages:
            from engines.training.megatron.pipeline_fusion import PipelineJob, finalize_grads, plan_pipelines, run_plan

            job = PipelineJob(self, mbs, loss_step, forward_only)
            run_plan([job], plan_pipelines(self.pp, [len(mbs)], reverse=[True], forward_only=forward_only))
            if not forward_only:
                finalize_grads(job)
            return job.records

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._run_model(model, mb), partial(loss_step, mb)

        groups = self.groups.collection
        p2p = P2PCommunicator(pp_group=groups.pp, config=self.config) if self.pp > 1 else None
        first = mbs[0]["input_ids"].shape
        return get_forward_backward_func(pp_size=self.pp)(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=int(first[1]),
            micro_batch_size=int(first[0]),
            forward_only=forward_only,
            p2p_communicator=p2p,
            pg_collection=groups,
        )

    def _from_last_stage(self, obj: Any) -> Any:
        """Every PP stage gets the last stage's Python object (outputs, metrics)."""
        if self.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.groups.last_stage_rank(), group=self.groups.collection.pp)
        return box[0]

    def _outputs_at(
        self, mb: Batch, output: torch.Tensor, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """`outputs_fn(mb)` inside the schedule's loss step, reading the schedule's `output` for `mb`."""
        self._pending = (mb, output)
        try:
            return outputs_fn(mb)
        finally:
            self._pending = None

    @torch.no_grad()
    def _forward_only(self, batch: Batch, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]) -> Batch:
        """`outputs_fn` of every micro-batch, evaluated on the last stage inside a forward-only schedule and
        handed to every stage; concatenated over the micro-batches."""
        self.model.eval()
        mbs = self.micro_batches(batch)
        if not mbs:
            return Batch()

        def loss_step(mb: Batch, output: torch.Tensor):
            out = self._outputs_at(mb, output, outputs_fn)
            return torch.zeros((), device=self.device), {k: v.cpu() for k, v in out.items()}

        records = self._from_last_stage(self._schedule(mbs, loss_step, forward_only=True))
        return Batch({k: torch.cat([r[k] for r in records]) for k in records[0]})

    def log_probs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> Batch:
        return self._forward_only(batch, lambda mb: self.policy_outputs(mb, temperature, with_entropy))

    def values(self, batch: Batch) -> torch.Tensor:
        """(B, R) float32 values over the response (critic head)."""
        self._require("value", "values")
        return self._forward_only(batch, self.value_outputs)["values"]

    def scores(self, batch: Batch) -> torch.Tensor:
        """(B,) float32, one scalar per sequence (score head: reward or cost model)."""
        self._require("score", "scores")
        return self._forward_only(batch, self.score_outputs)["scores"]

    # -- updates ----------------------------------------------------------------------------------------------
    def update(
        self, mini_batches: list[Batch], loss_fn: LossFn, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """One optimizer step per mini-batch; returns metrics averaged over the steps (token-weighted).

        `outputs_fn(mb)` is evaluated on the last pipeline stage inside the schedule, where `policy_outputs` /
        `value_outputs` read the schedule's output instead of running a forward of their own. (Two models
        training on the same slots can share one pipeline instead: engines.training.megatron.pipeline_fusion.fused_update.)"""
        run = self.begin_update()
        loss_step = self.train_loss_step(loss_fn, outputs_fn)
        for mini in mini_batches:
            self.zero_grads()
            self.optimizer_step(run, self._schedule(self.micro_batches(mini), loss_step, forward_only=False))
        return self.end_update(run)

    def begin_update(self) -> dict[str, Any]:
        """Start an update: training mode, and the metric sums `optimizer_step` adds to."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (trainable=False); it cannot update")
        self.model.train()
        return {"sums": {}, "tokens": 0.0, "norms": []}

    def zero_grads(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train_loss_step(
        self, loss_fn: LossFn, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]
    ) -> Callable[[Batch, torch.Tensor], tuple]:
        """The schedule's loss step: a micro-batch's summed weighted token loss, its token count, its metrics."""

        def loss_step(mb: Batch, output: torch.Tensor):
            token_loss, weight, metrics = loss_fn(self._outputs_at(mb, output, outputs_fn), mb)
            count = mb["response_mask"].sum().to(device=self.device, dtype=torch.int)
            loss = (token_loss.to(self.device) * weight.to(self.device)).sum()
            return loss, count, {"metrics": {k: float(v) for k, v in metrics.items()}, "tokens": float(count)}

        return loss_step

    def optimizer_step(self, run: dict[str, Any], records: list[Any]) -> None:
        """The optimizer step on finalised gradients; the last stage's loss-step records join the metrics."""
        for r in records if self.last_stage else []:
            for k, v in r["metrics"].items():
                run["sums"][k] = run["sums"].get(k, 0.0) + v * r["tokens"]
            run["tokens"] += r["tokens"]
        self._apply_lr()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron's optimizer skipped the step (non-finite gradients)")
        run["norms"].append(float(grad_norm))
        self._steps += 1

    def end_update(self, run: dict[str, Any]) -> dict[str, float]:
        """Metrics of the update, token-weighted over DP ranks and handed to every stage."""
        dp_group = self.groups.collection.dp if self.dp_size > 1 else None
        out = self._from_last_stage(token_mean(run["sums"], run["tokens"], dp_group) if self.last_stage else {})
        out["grad_norm"] = sum(run["norms"]) / max(len(run["norms"]), 1)
        out["lr"] = self._peak_lr * self._lr_factor(self._steps)
        return out

    # -- weights ----------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's state for torch.distributed.checkpoint, in model space, so it loads under any (p, t, d).

        Every tensor is named as the Hugging Face model names it (global layer indices) and is this rank's TP slice
        as a DTensor over the TP group (`megatron_shard_to_hf_local`: q/k/v out of megatron's per-group
        interleave, gate/up apart), so DCP records which part of the whole tensor each rank holds and hands a
        rank of another layout exactly the parts it needs; data-parallel replicas hold equal keys and are written
        once. "model": the weights. When training, "optim": the distributed optimizer's main parameters and Adam
        moments in the same space — each DP rank owns a flat range of every TP-local parameter, so the ranges
        are summed over the DP group into whole TP-local tensors first (transient: one shard's optimizer state) —
        plus the Adam step; "scheduler": steps taken and peak LR."""
        local = {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}
        state: dict[str, Any] = {"model": self._model_space(local)}
        if self.optimizer is None:
            return state
        moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _ADAM_STATE}
        step = 0
        named = dict(self.module.named_parameters())
        for name, param in named.items():
            whole = {k: torch.zeros(param.shape, dtype=torch.float32, device=param.device) for k in _ADAM_STATE}
            for opt in self._distributed_optimizers():
                if param not in opt.model_param_group_index_map:
                    continue
                rng = opt._get_model_param_range_map(param)["param"]
                group, order = opt.model_param_group_index_map[param]
                main = opt.optimizer.param_groups[group]["params"][order]
                held = {"param": main, **opt.optimizer.state.get(main, {})}
                for k in _ADAM_STATE:
                    if k in held:
                        whole[k].view(-1)[rng.start : rng.end] = held[k].detach().float()
                if "step" in held:
                    step = int(held["step"])
            for k in _ADAM_STATE:
                moments[k][name] = whole[k]
        if self.dp_size > 1:  # every element is owned by one DP rank: the sum over DP is the whole tensor
            flat = [t for k in _ADAM_STATE for t in moments[k].values()]
            for t in flat:
                dist.all_reduce(t, group=self.groups.collection.dp)
            box = torch.tensor([step], dtype=torch.int64)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.groups.collection.dp)
            step = int(box)
        state["optim"] = {k: self._model_space(moments[k]) for k in _ADAM_STATE}
        state["optim"]["step"] = step
        state["scheduler"] = {"steps": self._steps, "peak_lr": self._peak_lr}
        return state

    def _model_space(self, local: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """megatron-named tensors of this rank's shard → Hugging Face names, TP slices as DTensors."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from engines.training.megatron.convert import hf_local_placement, megatron_shard_to_hf_local

        pieces = megatron_shard_to_hf_local(
            local, self.hf_config, self.tp_rank, self.tp, self.pp_rank, self.pp, self.head
        )
        out = {}
        for name, t in pieces.items():
            kind, dim = hf_local_placement(name)
            placement = Shard(dim) if kind == "shard" else Replicate()
            out[name] = DTensor.from_local(t.contiguous(), self.groups.tp_mesh, [placement], run_check=False)
        return out

    def _from_model_space(self, tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        from engines.training.megatron.convert import hf_local_to_megatron_shard

        pieces = {k: v.to_local() for k, v in tensors.items()}
        return hf_local_to_megatron_shard(
            pieces, self.hf_config, self.tp_rank, self.tp, self.pp_rank, self.pp, self.head
        )

    def _distributed_optimizers(self) -> list[Any]:
        """The DistributedOptimizers behind megatron's optimizer (a ChainedOptimizer of one per parameter kind)."""
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        if not all(hasattr(o, "model_param_group_index_map") for o in opts):
            raise NotImplementedError(
                "checkpoints of the megatron engine keep the distributed optimizer's state; "
                "build it with distributed_optimizer=True (the default)"
            )
        return opts

    def hybrid_engine(
        self, model: torch.nn.Module, mesh: Any, gen_tp: int, subgroups: Mapping[tuple[int, ...], Any], gen_pp: int = 1
    ) -> Any:
        """The 3D-HybridEngine over this actor's shards: (p, t, d) → (p_g, t_g) by all-gather inside micro-DP groups
        (engines.hybrid.actor), fed from megatron's own parameters. megatron-core keeps its weights in its DDP
        buffers, which the resharder's training layout cannot alias, so each transition copies this rank's shard
        (megatron_shard_to_hf_local: q/k/v out of the per-group interleave, gate/up apart) into a training shard
        that lives only while generating. `model` (the transformers model the engine was built from) lends its
        class and config to the generation skeleton; no weights of it are kept."""
        import copy

        from engines.hybrid.actor import HybridEngine
        from engines.training.megatron.convert import megatron_shard_to_hf_local

        if self.head != "lm":
            raise ValueError(f"the 3D-HybridEngine reshards a causal LM; this engine has head={self.head!r}")
        config = copy.deepcopy(self.hf_config)
        config.tie_word_embeddings = False  # the resharder keeps lm_head apart, as megatron's output layer is
        with torch.device("meta"):
            template = type(model)(config)

        def pieces() -> dict[str, torch.Tensor]:
            local = {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}
            return megatron_shard_to_hf_local(local, self.hf_config, self.tp_rank, self.tp, self.pp_rank, self.pp)

        return HybridEngine(template, mesh, gen_tp, subgroups, pieces=pieces, gen_pp=gen_pp)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a `checkpoint_state()` dict that torch.distributed.checkpoint has filled (from a save under any
        layout): weights, and when training the optimizer's ranges this DP rank owns, step and LR schedule."""
        with torch.no_grad():
            own = self.module.state_dict()
            for k, v in self._from_model_space(state["model"]).items():
                own[k].copy_(v)
        if self.optimizer is None or "optim" not in state:
            return
        moments = {k: self._from_model_space(state["optim"][k]) for k in _ADAM_STATE}
        step = int(state["optim"]["step"])
        named = dict(self.module.named_parameters())
        for opt in self._distributed_optimizers():
            with torch.no_grad():
                for name, param in named.items():
                    if param not in opt.model_param_group_index_map:
                        continue
                    rng = opt._get_model_param_range_map(param)["param"]
                    group, order = opt.model_param_group_index_map[param]
                    main = opt.optimizer.param_groups[group]["params"][order]
                    main.copy_(moments["param"][name].reshape(-1)[rng.start : rng.end])
                    if step == 0:
                        continue  # saved before the first step: no moments yet
                    held = opt.optimizer.state[main]
                    for k in ("exp_avg", "exp_avg_sq"):
                        held[k] = moments[k][name].reshape(-1)[rng.start : rng.end].to(main.dtype).clone()
                    # one step tensor per parameter: torch's Adam increments each in place
                    held["step"] = torch.tensor(float(step), dtype=torch.float32)
        self._steps, self._peak_lr = int(state["scheduler"]["steps"]), float(state["scheduler"]["peak_lr"])
        self._apply_lr()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded Hugging Face state dict on CPU (every rank of the model-parallel group must call this: it
        gathers every TP × PP shard)."""
        # copies (`.cpu()` of a CPU tensor is itself: a later update would change a kept result)
        local = {
            k: v.detach().to("cpu", copy=True)
            for k, v in self.module.state_dict().items()
            if not k.endswith("_extra_state")
        }
        mine = ((self.pp_rank, self.tp_rank), local)
        if self.tp * self.pp == 1:
            gathered = [mine]
        else:
            group = self.groups.collection.mp
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
        return megatron_to_hf(dict(gathered), self.geometry, self.tp, self.pp, self.head)
