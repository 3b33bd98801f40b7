"""Engines by name: `ModelConfig.engine` chooses a training engine, `ActorWorker(rollout_engine=...)` a generation
engine.

Each name maps to a factory that builds the engine on a rank from a `TrainingSetup` / `GenerationSetup`
(engines.interfaces), so the roles hold no `if engine == ...` branches and a new engine is one entry here, or one
`register_*_engine` call in a module of one's own, registered under a name "package.module:engine" that says where
it lives (the module is imported on first lookup, on the controller and the workers alike). Factories import their
engine on first use: naming "megatron" costs nothing on a machine without megatron-core until a role builds it.

Built in:

* training "torch": engines.training.torch_native.TrainEngine over FSDP2 / DTensor TP, with the 3D-HybridEngine for a
  hybrid actor (`rollout_tp`; its DP replicas shard the optimizer state, ZeRO-1); no pipeline parallelism.
* training "megatron": engines.training.megatron.engine.MegatronEngine (megatron-core TP / PP / DP) on any slots, with
  its own process groups (engines.training.megatron.groups), so groups of different layouts live side by side; the
  3D-HybridEngine for a hybrid actor, fed from its shards, generating over (p_g, t_g) (`rollout_tp`, `rollout_pp`).
* generation "hf": engines.rollout.hf.HFGenerationEngine (transformers with a KV cache).
* generation "vllm": engines.rollout.vllm_engine.VLLMGenerationEngine, one in-process engine per rank over its
  generation replica (t_g = rollout_tp ranks, or the rank alone), started from the model's config with dummy weights;
  the actor sends it weights before each rollout that follows an update. Asking for it where vllm is not installed
  fails on the controller, before any rank starts, naming the install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.interfaces import GenerationEngine, GenerationSetup, TrainingBuild, TrainingSetup
from engines.training.megatron.groups import megatron_subgroups  # plain torch.distributed: no megatron-core import

__all__ = [
    "TrainingEngineEntry",
    "register_training_engine",
    "register_generation_engine",
    "training_engine",
    "generation_engine",
    "training_engine_names",
    "generation_engine_names",
    "check_training_layout",
    "check_generation_model",
]

TrainingFactory = Callable[[TrainingSetup], TrainingBuild]
GenerationFactory = Callable[[GenerationSetup], GenerationEngine]


@dataclass(frozen=True)
class TrainingEngineEntry:
    """A training engine's factory and what its layouts may be."""

    build: TrainingFactory
    pipeline_parallel: bool = False
    """It runs pp > 1 pipeline stages; without it a group with pp > 1 is refused before any rank starts."""
    resharding: bool = False
    """It runs the 3D-HybridEngine (`rollout_tp`: generation in a smaller TP layout); without it the actor gathers
    its whole weights to generate."""
    subgroups: Callable[[int, int, int], list[tuple[int, ...]]] | None = None
    """(pp, dp, tp) → the extra process groups (tuples of group ranks) its ranks need, created with the group
    (the roles' `process_groups`); None: the mesh's dimensions are enough."""
    fused_pipelines: bool = False
    """Its pipelines can share a fused schedule with another model's (`fuse_train`;
    engines.training.megatron.pipeline_fusion)."""


def _build_torch(setup: TrainingSetup) -> TrainingBuild:
    import torch

    from engines.training.parallel import parallelize
    from engines.training.torch_native import TrainEngine

    net, layout = setup.model, setup.layout
    if setup.config.pack_sequences:
        from engines.training.packing import check_packable

        check_packable(net)
        if setup.head == "score" and not isinstance(getattr(net, "score", None), torch.nn.Module):
            raise ValueError(
                f"pack_sequences: {type(net).__name__} has no per-token score head to read packed rows "
                f"at; set pack_sequences=false"
            )
    lora = setup.optim.lora if setup.trainable and setup.optim is not None else None
    if lora is not None:
        from engines.training.lora import apply_lora

        if layout.tp > 1 or setup.rollout_tp is not None:
            raise ValueError(
                f"lora_rank={lora.rank} runs on tp = 1 without the 3D-HybridEngine (got tp={layout.tp}, "
                f"rollout_tp={setup.rollout_tp}): tensor parallelism would split the adapters as their "
                f"layers; use data parallelism, or lora_rank=0"
            )
        apply_lora(net, lora, trainable_heads=() if setup.head == "lm" else ("score",))
    if setup.trainable and setup.optim is not None and setup.optim.trainable_layers:
        from engines.models.config import freeze_lower_layers

        freeze_lower_layers(net, setup.optim.trainable_layers)  # before sharding: FSDP2 groups by requires_grad
    compute_dtype = None
    if setup.trainable and setup.config.torch_dtype != torch.float32:
        net, compute_dtype = net.float(), setup.config.torch_dtype  # float32 master weights, low-precision compute
    # zero_stage 1: whole replicas over DP (each TP shard when tp > 1); a trainable one's gradients are averaged
    # by the engine and its Adam state sharded (ZeRO-1)
    replicas = setup.zero_stage == 1 and setup.rollout_tp is None  # (the hybrid engine keeps replicas anyway)
    sharded = layout.tp > 1 or (layout.dp > 1 and not replicas)
    hybrid = None
    if setup.rollout_tp is not None:
        from engines.hybrid.actor import HybridEngine, untie_embeddings

        untie_embeddings(net)
        net = parallelize(net, setup.mesh, fsdp=False, vocab_parallel=True)
        hybrid = HybridEngine(net, setup.mesh, setup.rollout_tp, setup.subgroups, gen_pp=setup.rollout_pp)
    elif layout.dp > 1 or layout.tp > 1:
        net = parallelize(net, setup.mesh, fsdp=not replicas)
    engine = TrainEngine(
        net,
        setup.optim,
        dp_group=setup.mesh["dp"].get_group(),
        dp_size=layout.dp,
        trainable=setup.trainable,
        sync_grads=hybrid is not None or replicas,
        compute_dtype=compute_dtype,
        pack_sequences=setup.config.pack_sequences,
        pad_token_id=net.config.pad_token_id or 0,
        lora_scale=lora.scale if lora else None,
    )
    return TrainingBuild(engine, gathers_to_generate=sharded, hybrid=hybrid)


def _build_megatron(setup: TrainingSetup) -> TrainingBuild:
    """A megatron model on the group's own slots and layout (its process groups come from the group's mesh and
    the subgroups `megatron_subgroups` asked for); it builds every head (causal LM for actor and reference, value
    for critics, score for reward and cost models). An actor with `rollout_tp` generates through the
    3D-HybridEngine fed from its shards (MegatronEngine.hybrid_engine); without, generation gathers its full
    weights."""
    from engines.training.megatron.engine import MegatronEngine
    from engines.training.megatron.groups import megatron_groups

    if setup.config.pack_sequences:
        raise ValueError(
            "the megatron engine does not pack sequences yet (it would take megatron-core's THD layout "
            "with PackedSeqParams through every role's forward); set pack_sequences=false or "
            "model.engine=torch"
        )
    if setup.trainable and setup.optim is not None and setup.optim.lora_rank:
        raise ValueError(
            f"the megatron engine trains every parameter (lora_rank={setup.optim.lora_rank}); use "
            f"model.engine=torch for LoRA"
        )
    if setup.trainable and setup.optim is not None and setup.optim.trainable_layers:
        raise ValueError(
            f"the megatron engine trains every layer (trainable_layers={setup.optim.trainable_layers}); "
            f"use model.engine=torch to train only the top layers"
        )
    engine = MegatronEngine.from_hf_model(
        setup.model,
        setup.optim,
        tp=setup.layout.tp,
        pp=setup.layout.pp,
        trainable=setup.trainable,
        head=setup.head,
        groups=megatron_groups(setup.mesh, setup.subgroups),
    )
    hybrid = None
    if setup.rollout_tp is not None:
        hybrid = engine.hybrid_engine(
            setup.model, setup.mesh, setup.rollout_tp, setup.subgroups, gen_pp=setup.rollout_pp
        )
    return TrainingBuild(engine, gathers_to_generate=hybrid is None, hybrid=hybrid)


def _build_hf(setup: GenerationSetup) -> GenerationEngine:
    from engines.rollout.hf import HFGenerationEngine

    return HFGenerationEngine(
        setup.eos_token_id, setup.pad_token_id, max_context=setup.max_context, compute_dtype=setup.compute_dtype
    )


def _build_vllm(setup: GenerationSetup) -> GenerationEngine:
    """vLLM over a folder holding only the model's config (weights arrive from the actor); KV cache: vLLM's GPU
    share on CUDA, FLOWACTORS_VLLM_KV_CACHE_MB (default 1024) MiB on CPU."""
    import os
    import tempfile

    import torch

    from engines.rollout.vllm_engine import VLLMGenerationEngine, check_vllm_model

    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # a cluster's workers report nothing home
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the run's progress is the runner's to print
    if not torch.cuda.is_available():  # the slot's cores are the worker's: vLLM must not pin its threads
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    tp = setup.rollout_tp or 1
    check_vllm_model(setup.hf_config, tp)  # identical on every rank, before vLLM's first collective
    folder = tempfile.mkdtemp(prefix="flowactors-vllm-")
    setup.hf_config.save_pretrained(folder)
    dtype = setup.compute_dtype or setup.config.torch_dtype
    on_gpu = torch.cuda.is_available()
    kv = None if on_gpu else int(os.environ.get("FLOWACTORS_VLLM_KV_CACHE_MB", "1024")) << 20
    return VLLMGenerationEngine(
        folder,
        tp=tp,
        group=setup.group,
        eos_token_id=setup.eos_token_id,
        pad_token_id=setup.pad_token_id,
        max_model_len=setup.max_context,
        kv_cache_bytes=kv,
        dtype=str(dtype).removeprefix("torch."),
        seed=setup.config.seed,
        load_format="dummy",
        lora_rank=setup.lora.rank if setup.lora is not None else 0,
        engine_args=None if on_gpu else {"block_size": 32},
    )


def _vllm_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from engines.rollout.vllm_engine import VLLM_INSTALL_HINT

        raise ImportError(
            f"rollout_engine='vllm' needs vllm, which is not installed here: {VLLM_INSTALL_HINT}; "
            f"or use rollout_engine='hf'"
        )


def _vllm_model(head_dim: int, cuda: bool) -> None:
    from engines.rollout.vllm_engine import check_vllm_head_dim

    check_vllm_head_dim(head_dim, cuda=cuda)


_TRAINING: dict[str, TrainingEngineEntry] = {
    "torch": TrainingEngineEntry(_build_torch, resharding=True),
    "megatron": TrainingEngineEntry(
        _build_megatron, pipeline_parallel=True, resharding=True, subgroups=megatron_subgroups, fused_pipelines=True
    ),
}
_GENERATION: dict[str, GenerationFactory] = {"hf": _build_hf, "vllm": _build_vllm}
_GENERATION_CHECKS: dict[str, Callable[[], None]] = {"vllm": _vllm_installed}
"""What a generation engine needs before any rank starts (checked on the controller by `generation_engine`)."""
_GENERATION_MODEL_CHECKS: dict[str, Callable[[int, bool], None]] = {"vllm": _vllm_model}
"""What a generation engine needs of the model on a kind of device: (head_dim, cuda) -> None or ValueError."""


def register_training_engine(
    name: str,
    build: TrainingFactory,
    *,
    pipeline_parallel: bool = False,
    resharding: bool = False,
    subgroups: Callable[[int, int, int], list[tuple[int, ...]]] | None = None,
    fused_pipelines: bool = False,
) -> None:
    """Make a training engine selectable as `ModelConfig(engine=name)`. Register it in a module that both the
    controller (which validates the config) and the worker processes (which build the engine) import."""
    if name in _TRAINING and _TRAINING[name].build is not build:
        raise ValueError(f"a training engine named {name!r} is already registered; choose another name")
    _TRAINING[name] = TrainingEngineEntry(
        build,
        pipeline_parallel=pipeline_parallel,
        resharding=resharding,
        subgroups=subgroups,
        fused_pipelines=fused_pipelines,
    )


def register_generation_engine(name: str, build: GenerationFactory) -> None:
    """Make a generation engine selectable as `ActorWorker(..., rollout_engine=name)` (registered where both the
    controller and the worker processes import it)."""
    if name in _GENERATION and _GENERATION[name] is not build:
        raise ValueError(f"a generation engine named {name!r} is already registered; choose another name")
    _GENERATION[name] = build


def training_engine_names() -> list[str]:
    return sorted(_TRAINING)


def generation_engine_names() -> list[str]:
    """The engines `rollout_engine` can name."""
    return sorted(_GENERATION)


def _import_provider(name: str) -> None:
    """A name "package.module:engine" names the module that registers it: import it first (on the controller and
    on every worker alike, so an engine of one's own needs no set-up on the workers)."""
    module, sep, _ = name.partition(":")
    if sep and module:
        import importlib

        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"engine {name!r}: its module {module!r} cannot be imported here ({e})") from None


def training_engine(name: str) -> TrainingEngineEntry:
    if name not in _TRAINING:
        _import_provider(name)
    try:
        return _TRAINING[name]
    except KeyError:
        raise ValueError(
            f"unknown training engine {name!r}; known: {training_engine_names()} or 'package.module:name' of a "
            f"module that registers one (engines.registry.register_training_engine)"
        ) from None


def generation_engine(name: str) -> GenerationFactory:
    if name not in _GENERATION:
        _import_provider(name)
    try:
        build = _GENERATION[name]
    except KeyError:
        raise ValueError(
            f"unknown generation engine rollout_engine={name!r}; known: {generation_engine_names()} "
            f"(engines.registry.register_generation_engine adds one)"
        ) from None
    if name in _GENERATION_CHECKS:
        _GENERATION_CHECKS[name]()
    return build


def check_generation_model(name: str, head_dim: int, *, cuda: bool) -> None:
    """Refuse, before any rank starts, a model the named generation engine cannot run on CUDA (`cuda`) or on CPU
    devices: vLLM's CPU attention and small heads, say. Needs the engine only where its check does."""
    check = _GENERATION_MODEL_CHECKS.get(name)
    if check is not None:
        check(head_dim, cuda)


def check_training_layout(name: str, pp: int) -> None:
    """Refuse pipeline stages on an engine without pipeline parallelism, naming the fix."""
    if pp > 1 and not training_engine(name).pipeline_parallel:
        capable = [n for n in training_engine_names() if _TRAINING[n].pipeline_parallel]
        raise ValueError(
            f"the {name!r} training engine has no pipeline parallelism, but the group's layout has "
            f"pp={pp}; use pp=1 (put the devices into dp or tp) or ModelConfig.engine in {capable}"
        )
