"""What a role needs from its engines: the `TrainingEngine` and `GenerationEngine` interfaces.

The roles (engines.roles) hold one training engine per model and, for the actor, one generation engine. They call
only the methods below, so any class that has them plugs in: structural typing (`typing.Protocol`), not a base
class, because the two training engines share no implementation (torch-native FSDP2/DTensor in
engines.training.torch_native, megatron-core in engines.training.megatron.engine) and a base class would only add a
third place to keep in step. Engines are chosen by name through engines.registry, which builds them from the
`TrainingSetup` / `GenerationSetup` below.

Both protocols are `runtime_checkable`, so a test can assert that an engine has every member (isinstance checks
names, not signatures).

Two kinds of generation engine. The transformers engine samples from whatever module the role hands it: the
training model itself (unsharded actor), a gathered copy (FSDP2 actor), or the 3D-HybridEngine's generation model
bound to resharded weights. vLLM's engine (engines.rollout.vllm_engine) holds its own copy of the weights instead
(`holds_weights`): after each update the actor sends it the new weights (`load_shard`: this rank's generation shard
straight from the 3D-HybridEngine; `load_weights`: whole tensors) and hands `generate`/`stream` no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from engines.models.config import ModelConfig
    from engines.rollout.stream import SamplingConfig
    from engines.training.common import LossFn, OptimConfig
    from flowactors import Batch, Layout

__all__ = ["TrainingEngine", "GenerationEngine", "TrainingSetup", "TrainingBuild", "GenerationSetup"]


@runtime_checkable
class TrainingEngine(Protocol):
    """One model's shard on this rank with its optimizer: forward passes for scoring, loss-driven updates.

    Every method is collective over the model's ranks (call it on all of them, in the same order)."""

    model: torch.nn.Module
    """The module that runs the forward passes (sharded or wrapped as the engine needs)."""
    optimizer: Any | None
    """None when built without training (reference, reward and cost models)."""
    cfg: OptimConfig
    """Optimizer, LR schedule and micro-batching; `cfg.lr` is the peak LR the schedule scales."""
    compute_dtype: torch.dtype | None
    """Autocast dtype of forward passes over float32 master weights; None: the parameters' own dtype."""

    def log_probs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> Batch:
        """Without gradients: `log_probs` (B, R) of the response tokens at `temperature` (and `entropy` (B, R)),
        float32, in micro-batches of `cfg.micro_batch_tokens`."""
        ...

    def values(self, batch: Batch) -> torch.Tensor:
        """Without gradients: (B, R) float32 values at the positions that predict each response token (value
        head)."""
        ...

    def scores(self, batch: Batch) -> torch.Tensor:
        """Without gradients: (B,) float32, one scalar per sequence at its last non-pad token (score head)."""
        ...

    def policy_outputs(self, mb: Batch, temperature: float, with_entropy: bool) -> dict[str, torch.Tensor]:
        """With gradients, for a loss inside `update`: {"log_probs" (B, R), "entropy" (B, R) if asked}."""
        ...

    def value_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        """With gradients, for a loss inside `update`: {"values": (B, R) float32}."""
        ...

    def score_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        """With gradients, for a loss inside `update`: {"scores": (B,) float32} (training a reward model)."""
        ...

    def update(
        self, mini_batches: list[Batch], loss_fn: LossFn, outputs_fn: Callable[[Batch], dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """One optimizer step per mini-batch (this rank's share of it), the loss token-mean over the whole
        mini-batch across data-parallel ranks, so the step does not depend on the DP size or micro-batch split.
        Returns the loss metrics averaged over the steps (token-weighted), `grad_norm` and `lr`."""
        ...

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate the schedule scales (from the next step on)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded Hugging Face state dict on CPU (gathers every shard): tensors of its own, which later
        updates and loads leave as they were."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's shards of the model (and optimizer and LR schedule when training), as a nested state dict
        that torch.distributed.checkpoint saves and loads in place; NotImplementedError where not wired."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a `checkpoint_state()`-shaped dict that torch.distributed.checkpoint has filled."""
        ...


@runtime_checkable
class GenerationEngine(Protocol):
    """Samples responses from the generation model the role hands it (unsharded on this rank's generation TP
    group); output layout: engines.rollout.stream's module docstring (prompts, responses, input_ids, attention_mask,
    position_ids, response_mask, rollout_log_probs). Runs no collectives unless the model does."""

    holds_weights: bool
    """False: samples from the module handed to each call. True: samples from its own copy of the weights, which
    the actor refreshes after each update with `load_shard(fused per-rank shard)` or `load_weights(whole HF
    tensors)`; the calls below then take `model=None`."""

    def generate(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int = 0,
        seed_offset: int = 0,
    ) -> Batch:
        """One response per prompt row. A row draws from its `seed` column, else from seed * 1000003 +
        seed_offset + its index, so sampling rows a:b separately with seed_offset=a gives the same samples."""
        ...

    def stream(
        self,
        model: torch.nn.Module | None,
        prompts: Batch,
        cfg: SamplingConfig,
        chunk_rows: int,
        *,
        greedy: bool = False,
        seed: int = 0,
        row_offset: int = 0,
        seed_offset: int = 0,
    ) -> Iterator[Batch]:
        """The samples of `generate` (bit-identical rows), yielded in chunks of `chunk_rows` finished rows in the
        order they finish, each row with `row_index` (its index in `prompts` plus `row_offset`). An engine with
        `migrates = True` also takes `pause_below` and `inbox` (long-tail migration; engines.rollout.stream)."""
        ...


@dataclass
class TrainingSetup:
    """What a role hands a training-engine factory (engines.registry) on each of its ranks."""

    model: torch.nn.Module
    """The transformers model with the role's head, built on CPU in `config.dtype`, identical on every rank."""
    config: ModelConfig
    head: str
    """lm, value or score (engines.models.config)."""
    optim: OptimConfig | None
    trainable: bool
    layout: Layout
    """The group's (pp, dp, tp) sizes."""
    mesh: DeviceMesh
    """The group's device mesh, dims ("pp", "dp", "tp")."""
    subgroups: dict[tuple[int, ...], Any]
    """The extra process groups the role's `process_groups` declared (the 3D-HybridEngine's)."""
    rollout_tp: int | None = None
    """The actor's generation TP size for the 3D-HybridEngine; None: no hybrid resharding."""
    rollout_pp: int = 1
    """The actor's generation pipeline stages under the 3D-HybridEngine (dividing the training pp)."""
    zero_stage: int = 3
    """How the DP ranks hold the model (torch engine): 3 shards it (FSDP2), 1 keeps a whole replica per rank (a
    trainable one averages gradients and shards its Adam state, ZeRO-1). A trainable role takes it from its
    OptimConfig."""


@dataclass
class TrainingBuild:
    """What a training-engine factory returns."""

    engine: TrainingEngine
    gathers_to_generate: bool
    """Generation needs the full weights gathered into a separate model (the training model is sharded over
    this rank's group); False: the actor samples from `engine.model` itself."""
    hybrid: Any | None = None
    """The 3D-HybridEngine (engines.hybrid.actor.HybridEngine) when `rollout_tp` was given."""


@dataclass
class GenerationSetup:
    """What the actor hands a generation-engine factory (engines.registry) on each of its ranks."""

    eos_token_id: int
    pad_token_id: int
    max_context: int | None
    """The model's longest sequence (prompt + response); None: unchecked."""
    compute_dtype: torch.dtype | None
    """Autocast dtype of decoding (the training engine's `compute_dtype`)."""
    config: ModelConfig
    rollout_tp: int | None = None
    hf_config: Any = None
    """The transformers config of the model generation runs (untied embeddings under the 3D-HybridEngine), for an
    engine that builds its own copy (vLLM)."""
    lora: Any = None
    """The policy's LoraConfig when it trains LoRA adapters (engines.training.lora), else None: an engine that
    serves adapters itself (vLLM's LoRA requests) takes them instead of merged weights."""
    group: Any = None
    """This rank's generation replica as a process group (the t_g ranks of its generation TP group, or this rank
    alone), for an engine that runs collectives of its own (vLLM's tensor parallel)."""
