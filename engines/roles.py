"""The RLHF roles as flowactors workers, exposing HybridFlow's Table 4 primitives as endpoints.

Each role owns one model on its ranks and says, per primitive, how a call is split (`MESH`: by data-parallel
rank, replicated over tensor-parallel ranks; `MINIBATCH` for updates). Roles know nothing about a particular
algorithm: losses arrive as functions with the update call, and the call's settings as typed arguments
(`UpdateSpec`, `GenerationSpec`: engines.specs). Roles know no particular engine either: they call the
`TrainingEngine` / `GenerationEngine` interfaces (engines.interfaces) of engines built by name (`ModelConfig.engine`,
`ActorWorker(rollout_engine=...)`) through engines.registry.

The actor is hybrid: it trains and generates on the same weights. With `rollout_tp=t_g` the 3D-HybridEngine
(engines.hybrid.actor) does the transition: training is TP over the mesh's tp dim with whole DP replicas
(Megatron's layout, vocab-parallel embeddings), and generation reshards inside micro-DP groups to TP = t_g, each
of the d_g generation replicas sampling its part of the rows. Without it, a sharded actor (FSDP2) gathers its full
weights into an unsharded generation copy before sampling and drops them afterwards (the "all-gather" baseline
of HybridFlow Table 2); an unsharded actor samples from its training model directly.

Stage fusion (docs/design.md §7): `start_generation` + `next_generated_chunk(k)` sample the same rows as
`generate_sequences`, handed out in chunks in the order they finish, while decoding goes on in a background
thread (`engines.rollout.stream.GenerationStream`). Weights are gathered in `start_generation`, in the task thread, so
the thread runs no collective; the call that takes the last chunk joins the thread, and calls to one worker process
run one at a time in issue order, so no later call on the actor runs beside the decoding.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engines.fields import (
    COSTS,
    ENTROPY,
    OLD_LOG_PROBS,
    POLICY_VERSIONS,
    REF_LOG_PROBS,
    RESPONSE_MASK,
    REWARD_VALUES,
    REWARDS,
    SUCCESS,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_IDS,
    TEACHER_TOP_LOG_PROBS,
)
from engines.interfaces import GenerationSetup, TrainingEngine, TrainingSetup
from engines.models.config import ModelConfig, build_model, build_tokenizer, same_vocabulary, save_pretrained
from engines.protocols import MINIBATCH
from engines.registry import check_training_layout, generation_engine, training_engine
from engines.rollout.agent import AgentConfig, EpisodeEngine
from engines.rollout.fused import FusedRolloutEndpoints
from engines.rollout.replica import ReplicaEndpoints, between_segments
from engines.rollout.stream import SamplingConfig
from engines.specs import GenerationSpec, UpdateSpec, generation_spec
from engines.training.common import LossFn, OptimConfig
from flowactors import MESH, ONE_TO_ALL, RANK_ZERO, Batch, Layout, Worker, endpoint

__all__ = ["ActorWorker", "RefWorker", "CriticWorker", "RewardModelWorker", "RuleRewardWorker", "ModelWorker"]


class ModelWorker(Worker):
    """Common set-up: tokenizer, model with the requested head, and its training engine, built by the factory that
    `ModelConfig.engine` names (engines.registry)."""

    head = "lm"
    engine: TrainingEngine

    @classmethod
    def process_groups(cls, layout: Layout, *args: Any, **kwargs: Any) -> list[tuple[int, ...]]:
        """The extra groups the model's engine asks for (engines.registry; megatron's, say); refuses, on the
        controller, a layout the engine cannot run (pp > 1 without pipeline parallelism). Every role takes its
        ModelConfig first (`model`)."""
        model = args[0] if args else kwargs.get("model")
        if not isinstance(model, ModelConfig):
            return []
        check_training_layout(model.engine, layout.pp)
        subgroups = training_engine(model.engine).subgroups
        return subgroups(layout.pp, layout.dp, layout.tp) if subgroups else []

    def _setup(
        self,
        model: ModelConfig,
        optim: OptimConfig | None,
        trainable: bool,
        rollout_tp: int | None = None,
        rollout_pp: int = 1,
        zero_stage: int = 3,
    ) -> None:
        """`zero_stage` (3 or 1, see TrainingSetup) for a frozen model; a trainable one's comes from `optim`."""
        torch.manual_seed(model.seed)
        self.model_config = model
        self.tokenizer = build_tokenizer(model)
        net = build_model(model, self.head, self.tokenizer)
        self.hf_config = net.config
        self._lm_class = type(net).__name__
        built = training_engine(model.engine).build(
            TrainingSetup(
                model=net,
                config=model,
                head=self.head,
                optim=optim,
                trainable=trainable,
                layout=self.layout,
                mesh=self.mesh,
                subgroups=self.subgroups,
                rollout_tp=rollout_tp,
                rollout_pp=rollout_pp,
                zero_stage=optim.zero_stage if optim is not None else zero_stage,
            )
        )
        self.engine = built.engine
        self.hybrid = built.hybrid
        self.sharded = built.gathers_to_generate
        self.lora = optim.lora if optim is not None and trainable else None
        """The adapters' LoraConfig of a model trained with LoRA (engines.training.lora), else None."""

    weights_version = 0
    """Bumped whenever this rank's weights change (an update, a checkpoint load)."""
    _base_loaded = False
    """Whether a generator serving LoRA adapters holds this rank's frozen base (False again once a checkpoint or a
    whole sync brings a base)."""

    def _update(
        self,
        shares: list[Batch],
        loss_fn: LossFn,
        outputs_fn: Callable[[Batch], dict[str, torch.Tensor]],
        spec: UpdateSpec,
    ) -> dict[str, float]:
        self.weights_version += 1
        with self._lr_of(spec):
            return self.engine.update(self._mini_batches(shares, spec), loss_fn, outputs_fn)

    def _mini_batches(self, shares: list[Batch], spec: UpdateSpec) -> list[Batch]:
        mb = spec.mini_batch_samples // self.layout.dp
        return [m for local in shares for m in local.chunk(mb)]

    @contextlib.contextmanager
    def _lr_of(self, spec: UpdateSpec) -> Iterator[None]:
        """spec.lr applies to this call only (e.g. the warm start)."""
        if spec.lr is None:
            yield
            return
        peak = self.engine.cfg.lr
        self.engine.set_lr(float(spec.lr))
        try:
            yield
        finally:
            self.engine.set_lr(peak)

    @endpoint(protocol=RANK_ZERO)
    def export_hf(self, path: str) -> str:
        """Write this model as a Hugging Face folder (all ranks gather; rank 0 writes). A language model trained
        with LoRA is written merged, and its adapters beside it in PEFT's format (`path/adapter`: for
        `peft.PeftModel.from_pretrained` onto the base, vLLM's LoRA requests, merge tools)."""
        lora = self.lora if self.head == "lm" else None
        state = self.engine.full_state_dict(merged=False) if lora is not None else self.engine.full_state_dict()
        if self.rank == 0:
            if lora is not None:
                from engines.training.lora import merged_state_dict, save_peft_adapter

                save_peft_adapter(Path(path) / "adapter", state, lora, self.model_config.path)
                state = merged_state_dict(state, lora.scale)
            model = build_model(self.model_config, self.head, self.tokenizer)
            save_pretrained(model, self.tokenizer, Path(path), state_dict=state)
        return str(path)

    @endpoint(protocol=ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Save this rank's shards of the model, optimizer and LR schedule (collective), and its RNG state.

        torch.distributed.checkpoint writes each rank's shards plus a global index, so the checkpoint loads under
        other parallel sizes."""
        from flowactors.checkpoint import capture_rng, save_sharded

        save_sharded(self.engine.checkpoint_state(), directory, process_group=self.process_group)
        torch.save(capture_rng(), Path(directory) / f"rng_rank{self.rank}_of{self.world_size}.pt")

    @endpoint(protocol=ONE_TO_ALL)
    def load_checkpoint(self, directory: str, base: str | None = None) -> None:
        """Load shards saved under any parallel sizes into this group's layout; RNG only under the same size.
        `base`: another model's checkpoint that holds this one's frozen weights by the same names (a LoRA model's
        checkpoint holds only its adapters: its base is the reference's)."""
        from flowactors.checkpoint import load_sharded, restore_rng

        if base is not None:
            frozen = self.engine.frozen_state()
            load_sharded(frozen, base, process_group=self.process_group)
            self.engine.load_frozen_state(frozen)
            self._base_loaded = False
        state = self.engine.checkpoint_state()
        load_sharded(state, directory, process_group=self.process_group)
        self.engine.load_checkpoint_state(state)
        self.weights_version += 1
        rng = Path(directory) / f"rng_rank{self.rank}_of{self.world_size}.pt"
        if rng.exists():
            restore_rng(torch.load(rng, weights_only=False))

    @endpoint(protocol=ONE_TO_ALL)
    def set_lr(self, lr: float) -> None:
        """Make `lr` the peak learning rate from now on (a resumed run applying a changed actor_lr/critic_lr: the
        checkpoint's optimizer and schedule state carry the old one)."""
        if not lr > 0:
            raise ValueError(f"a learning rate must be > 0, got {lr}")
        self.engine.cfg.lr = lr
        self.engine.set_lr(lr)

    @endpoint(protocol=ONE_TO_ALL)
    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state (its shards), and the device's peak
        allocation so far (CUDA; 0 on CPU): what a role costs, per rank."""
        params = list(self.engine.model.parameters())
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        state = getattr(self.engine.optimizer, "state", None) or {}  # megatron's distributed optimizer: its own
        optim = sum(
            size(local(v))
            for st in state.values()
            if isinstance(st, dict)
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return {
            "param_bytes": sum(size(local(p)) for p in params),
            "grad_bytes": sum(size(local(p.grad)) for p in params if p.grad is not None),
            "optimizer_bytes": optim,
            "device_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        }

    @endpoint(protocol=ONE_TO_ALL)
    def parameter_digest(self) -> float:
        """A cheap fingerprint of the full weights (sum of all parameters), for tests and sanity checks."""
        return float(sum(t.double().sum() for t in self.engine.full_state_dict().values()))


class ActorWorker(ModelWorker, FusedRolloutEndpoints, ReplicaEndpoints):
    """Hybrid actor: generate_sequences, compute_log_prob, update_actor."""

    def __init__(
        self,
        model: ModelConfig,
        optim: OptimConfig | None = None,
        sampling: SamplingConfig | None = None,
        rollout_tp: int | None = None,
        rollout_engine: str = "hf",
        rollout_pp: int = 1,
        agent: AgentConfig | None = None,
    ) -> None:
        """`rollout_tp`: generation tensor-parallel size t_g (dividing the group's tp) for the 3D-HybridEngine;
        None keeps the FSDP2 training layout and gathers whole weights to generate. `rollout_pp`: generation
        pipeline stages p_g (dividing the group's pp; with rollout_tp, on a pipeline-parallel engine: megatron).
        `rollout_engine`: the
        generation engine by name (engines.registry; "hf": transformers with a KV cache, "vllm": an in-process
        vLLM engine per generation replica, fed in memory after each update). `agent`: sample multi-turn,
        tool-using episodes instead of single responses (engines.rollout.agent), on every path that samples."""
        build_generator = generation_engine(rollout_engine)  # an unknown name fails before the model is built
        self._setup(model, optim or OptimConfig(), trainable=True, rollout_tp=rollout_tp, rollout_pp=rollout_pp)
        self.sampling = sampling or SamplingConfig()
        hf_config = copy.deepcopy(self.hf_config)  # as an engine building its own copy (vLLM) must see it
        hf_config.architectures = hf_config.architectures or [self._lm_class]
        if self.hybrid is not None:
            hf_config.tie_word_embeddings = False  # the hybrid layout shards lm_head apart from the embedding
        self.generator = build_generator(
            GenerationSetup(
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                max_context=self.hf_config.max_position_embeddings,
                compute_dtype=getattr(torch, self.sampling.dtype) if self.sampling.dtype else self.engine.compute_dtype,
                config=model,
                rollout_tp=rollout_tp,
                hf_config=hf_config,
                lora=self.lora if self.hybrid is None else None,
                group=self._replica_group(),
            )
        )
        if agent is not None:
            if self.hybrid is not None and self.hybrid.gen_tp > 1:
                raise ValueError(
                    f"multi-turn episodes with generation tensor parallelism (rollout_tp="
                    f"{rollout_tp}) are not built: the ranks of a generation TP group would have to "
                    f"decode every turn in lockstep while tools answer at different times; use "
                    f"rollout_tp=1 or 0"
                )
            self.generator = EpisodeEngine(self.generator, self.tokenizer, agent)
        self._loaded_version = -1  # the weights_version the generator holds (engines that hold weights)
        self.handover: dict[str, Any] = {}
        self._gen_model: torch.nn.Module | None = None

    @classmethod
    def process_groups(cls, layout: Layout, *args: Any, **kwargs: Any) -> list[tuple[int, ...]]:
        """The 3D-HybridEngine's resharding and generation-TP groups (none without rollout_tp); an impossible
        rollout_tp, an unknown rollout_engine or a layout the training engine cannot run fails here, on the
        controller, before any rank starts. Reads the arguments as ActorWorker's constructor would bind them (a
        subclass forwarding them keeps working; its own extra keywords are left out)."""
        import inspect

        engine_groups = super().process_groups(layout, *args, **kwargs)
        signature = inspect.signature(ActorWorker.__init__)
        known = {k: v for k, v in kwargs.items() if k in signature.parameters}
        try:
            bound = signature.bind(None, *args, **known).arguments
        except TypeError:
            return []  # the constructor itself will name the bad arguments
        generation_engine(bound.get("rollout_engine", "hf"))
        rollout_tp, rollout_pp = bound.get("rollout_tp"), bound.get("rollout_pp", 1)
        if rollout_pp != 1 and (rollout_tp is None or bound.get("rollout_engine", "hf") != "hf"):
            raise ValueError(
                f"rollout_pp={rollout_pp}: generation over pipeline stages runs in the 3D-HybridEngine "
                f"with the hf rollout engine (set rollout_tp, rollout_engine='hf'), or use rollout_pp=1"
            )
        if bound.get("rollout_engine") == "vllm" and (rollout_tp or 1) == 1:  # vLLM's world: the rank alone
            engine_groups = [*engine_groups, *((r,) for r in range(layout.world_size) if (r,) not in engine_groups)]
        if rollout_tp is None:
            return engine_groups
        model = bound.get("model")
        if isinstance(model, ModelConfig) and not training_engine(model.engine).resharding:
            raise ValueError(
                f"rollout_tp={rollout_tp}: the 3D-HybridEngine does not run on the {model.engine!r} "
                f"training engine yet (it gathers whole weights to generate); drop rollout_tp or use "
                f"engine='torch'"
            )
        from engines.hybrid.actor import HybridEngine, layout_of

        hybrid = HybridEngine.process_groups(layout_of((layout.pp, layout.dp, layout.tp), rollout_tp, rollout_pp))
        return [*engine_groups, *(g for g in hybrid if g not in engine_groups)]

    def _replica_group(self) -> Any:
        """This rank's generation replica as a process group: its generation TP group under the 3D-HybridEngine
        with t_g > 1, else the rank alone (declared by `process_groups` for engines that need it); None when it
        was not declared."""
        if self.hybrid is not None and self.hybrid.gen_tp > 1:
            members = self.hybrid.layout.gen_tp_group(self.rank)
            if members.index(self.rank) != self.hybrid.layout.gen_coord(self.rank).tp:
                raise ValueError(f"generation TP group {members}: group ranks out of TP order")
            return self.subgroups.get(members)
        return self.subgroups.get((self.rank,))

    def _send_weights(self) -> None:
        """Bring an engine that holds its own weights up to this rank's weights_version (collective over the
        actor's ranks): this rank's generation shard from the 3D-HybridEngine, else whole gathered tensors."""
        if not self.generator.holds_weights or self._loaded_version == self.weights_version:
            return
        import time

        t0 = time.perf_counter()
        if self.hybrid is not None:
            copied = self.hybrid.hand_over(self.generator.load_shard)
            received = self.hybrid.stats.received_bytes
        elif getattr(self.generator, "serves_adapters", False):  # LoRA requests: the base once, then adapters
            # gather the base only when the engine must take it; the adapters every time
            state = self.engine.full_state_dict(merged=False, adapters_only=self._base_loaded)
            copied = received = 0
            if not self._base_loaded:
                from engines.training.lora import is_adapter

                base = {k: t for k, t in state.items() if not is_adapter(k)}
                self.generator.load_weights(base.items())
                copied = sum(t.numel() * t.element_size() for t in base.values())
                self._base_loaded = True
            copied += self.generator.load_adapter(state, self.lora, self.weights_version)
            received = copied if self.sharded else 0
            del state
        else:
            adapted = getattr(self.engine, "lora_scale", None) is not None  # merged into plain weights
            state = self.engine.full_state_dict() if self.sharded or adapted else self.engine.model.state_dict()
            copied = sum(t.numel() * t.element_size() for t in state.values())
            received = copied if self.sharded else 0
            self.generator.load_weights(state.items())
            del state
        self._loaded_version = self.weights_version
        self.handover = {
            "seconds": time.perf_counter() - t0,
            "bytes_received": int(received),
            "bytes_loaded": int(copied),
            "engine_weight_bytes": int(self.generator.weight_bytes),
            "loads": self.handover.get("loads", 0) + 1,
        }

    def _generation_target(self) -> torch.nn.Module | None:
        """What the generator decodes with: None for an engine that holds its own weights (vLLM, first brought up
        to this rank's weights), else the model to sample from."""
        if self.generator.holds_weights:
            self._send_weights()
            return None
        return self._generation_model()

    def _generation_model(self) -> torch.nn.Module:
        if self.hybrid is not None:
            return self.hybrid.generation_model()
        if not self.sharded:
            return self.engine.model
        if self._gen_model is None:
            self._gen_model = build_model(self.model_config, "lm", self.tokenizer)
        self._gen_model.load_state_dict(self.engine.full_state_dict())
        return self._gen_model

    @endpoint(protocol=MESH)
    @between_segments
    def generate_sequences(self, prompts: Batch, spec: GenerationSpec | None = None) -> Batch:
        """Sample one response per prompt row; `spec`: greedy or sampled, and the base seed for rows without a
        `seed` column (None: GenerationSpec()). A rollout replica (one that `load_policy` fed) also records the
        policy version of every response token (POLICY_VERSIONS)."""
        out = self._generate(prompts, spec)
        if self.policy_version is None:
            return out
        versions = torch.full_like(out[RESPONSE_MASK], self.policy_version, dtype=torch.int64)
        return Batch({**out.tensors, POLICY_VERSIONS: versions}, out.rows, out.meta)

    def _generate(self, prompts: Batch, spec: GenerationSpec | None) -> Batch:
        self._end_receiving()
        spec = generation_spec(spec)
        greedy, seed = spec.greedy, spec.seed
        if self.generator.holds_weights:
            self._send_weights()
            rows = self.hybrid.micro_slice(len(prompts)) if self.hybrid is not None else slice(0, len(prompts))
            part = self.generator.generate(
                None,
                prompts.slice(rows.start, rows.stop),
                self.sampling,
                greedy=greedy,
                seed=seed,
                seed_offset=rows.start,
            )
            return self.hybrid.gather_micro(part) if self.hybrid is not None else part
        if self.hybrid is None:
            return self.generator.generate(self._generation_model(), prompts, self.sampling, greedy=greedy, seed=seed)
        rows = self.hybrid.micro_slice(len(prompts))  # this generation replica's rows of the DP share
        model = self.hybrid.generation_model()
        try:
            part = self.generator.generate(
                model,
                prompts.slice(rows.start, rows.stop),
                self.sampling,
                greedy=greedy,
                seed=seed,
                seed_offset=rows.start,
            )
        finally:
            self.hybrid.release()
        return self.hybrid.gather_micro(part)

    def _release_generation(self) -> None:
        if self.hybrid is not None and self.hybrid.in_generation:
            self.hybrid.release()

    @endpoint(protocol=ONE_TO_ALL)
    def reshard_stats(self) -> dict[str, Any] | None:
        """This rank's figures of its last train → generate transition under the 3D-HybridEngine (bytes received,
        generation parameter bytes, redundant bytes, seconds; extra_generation_bytes: what it held beyond
        training memory while generating); None without rollout_tp."""
        if self.hybrid is None or self.hybrid.stats is None:
            return None
        from dataclasses import asdict

        return {**asdict(self.hybrid.stats), "extra_generation_bytes": self.hybrid.held_extra_bytes}

    def shutdown(self) -> None:
        self._end_stream()
        self._stop_decoding()
        close = getattr(self.generator, "shutdown", None)
        if close is not None:
            close()

    @endpoint(protocol=ONE_TO_ALL)
    def handover_stats(self) -> dict[str, Any]:
        """This rank's last weight hand-over to a generation engine that holds its own weights (vLLM): seconds,
        bytes_received (the micro-DP all-gather under the 3D-HybridEngine, else the whole-model gather),
        bytes_loaded into the engine, engine_weight_bytes (what the engine holds) and loads so far; {} before the
        first one and for engines that sample from the actor's own modules."""
        return dict(self.handover)

    @endpoint(protocol=MESH)
    def compute_log_prob(self, batch: Batch) -> Batch:
        self._end_receiving()
        lp = self.engine.log_probs(batch, self.sampling.temperature, with_entropy=True)
        return Batch({OLD_LOG_PROBS: lp["log_probs"], ENTROPY: lp["entropy"]})

    @endpoint(protocol=MINIBATCH)
    def update_actor(self, shares: list[Batch], loss_fn: LossFn, spec: UpdateSpec) -> dict[str, float]:
        """Policy update: MINIBATCH hands this rank its shares of the global mini-batches that `spec` cuts."""
        self._end_receiving()
        return self._update(shares, loss_fn, self._policy_outputs, spec)

    def _policy_outputs(self, mb: Batch) -> dict[str, torch.Tensor]:
        return self.engine.policy_outputs(mb, self.sampling.temperature, with_entropy=True)

    @endpoint(protocol=MINIBATCH)
    def update_actor_and_critics(
        self, shares: list[Batch], loss_fn: LossFn, spec: UpdateSpec, critics: dict[str, LossFn]
    ) -> dict[str, float]:
        """The actor's and critics' updates as one fused pipeline (RLHFuse's intra-stage fusion,
        engines.training.megatron.pipeline_fusion): the same updates as update_actor and each update_critic, with the
        models' pipelines filling each other's bubbles. `critics`: critic group name -> its loss; each group is on this
        group's slots with the same layout (stages running either way). Metrics come back as "actor/..." and
        "<critic group>/...". A critic's failure here is reported as this call's (on the actor's group)."""
        from engines.training.megatron.pipeline_fusion import fused_update

        self._end_receiving()
        others = {name: self.colocated(name) for name in critics}
        for name, other in {"actor": self, **others}.items():
            if name != "actor" and not isinstance(other, CriticWorker):
                raise TypeError(
                    f"update_actor_and_critics fuses with critics; group {name!r} is a {type(other).__name__}"
                )
            if other.layout != self.layout or self.layout.pp < 2 or not hasattr(other.engine, "train_loss_step"):
                raise ValueError(
                    f"a fused pipeline needs the actor and its critics on a pipeline-parallel engine "
                    f"(megatron) with the same layout, pp >= 2; got actor {self.layout}, {name} "
                    f"{other.layout} on {type(other.engine).__name__}"
                )
        mini_batches = self._mini_batches(shares, spec)
        models = [(self.engine, mini_batches, loss_fn, self._policy_outputs)]
        models += [(o.engine, mini_batches, critics[name], o.engine.value_outputs) for name, o in others.items()]
        for worker in (self, *others.values()):
            worker.weights_version += 1
        with contextlib.ExitStack() as stack:
            for worker in (self, *others.values()):
                stack.enter_context(worker._lr_of(spec))
            metrics, _ = fused_update(models)
        return {f"{prefix}/{k}": v for prefix, m in zip(["actor", *others], metrics) for k, v in m.items()}


class RefWorker(ModelWorker):
    """Frozen reference policy: compute_ref_log_prob."""

    def __init__(self, model: ModelConfig, temperature: float = 1.0, zero_stage: int = 3) -> None:
        """`zero_stage=1`: a whole replica per DP rank, no weight gathers in its forwards (see TrainingSetup)."""
        self._setup(model, None, trainable=False, zero_stage=zero_stage)
        self.temperature = temperature

    @endpoint(protocol=MESH)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return Batch({REF_LOG_PROBS: self.engine.log_probs(batch, self.temperature)["log_probs"]})


class TeacherWorker(RefWorker):
    """A frozen teacher that scores the student's samples token by token (on-policy distillation,
    algorithms/distill.py): the reference's forward on another model, its output under a name of its own so a
    step can carry both."""

    def __init__(self, model: ModelConfig, temperature: float = 1.0, zero_stage: int = 3, top_k: int = 0) -> None:
        """`top_k`: also its k most likely tokens at each response position (distillation over its top-k)."""
        super().__init__(model, temperature, zero_stage)
        if top_k and "top_k" not in inspect.signature(self.engine.log_probs).parameters:
            raise ValueError(
                f"the teacher's top-k needs a training engine that returns it; {type(self.engine).__name__} does "
                f"not (model.engine=torch, or estimator=sampled)"
            )
        self.top_k = top_k

    @endpoint(protocol=MESH)
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """The teacher's log-probs of the sampled tokens (and, with top_k, its top-k tokens' log-probs and ids)."""
        if not self.top_k:
            return Batch({TEACHER_LOG_PROBS: self.engine.log_probs(batch, self.temperature)["log_probs"]})
        out = self.engine.log_probs(batch, self.temperature, top_k=self.top_k)
        return Batch(
            {
                TEACHER_LOG_PROBS: out["log_probs"],
                TEACHER_TOP_LOG_PROBS: out["top_log_probs"],
                TEACHER_TOP_IDS: out["top_ids"],
            }
        )


class CriticWorker(ModelWorker):
    """Value model: compute_values and update_critic; `key` names its output (engines.fields.CRITIC_FIELDS)."""

    head = "value"

    def __init__(self, model: ModelConfig, optim: OptimConfig | None = None, key: str = REWARD_VALUES.values) -> None:
        self._setup(model, optim or OptimConfig(), trainable=True)
        self.key = key

    @endpoint(protocol=MESH)
    def compute_values(self, batch: Batch) -> Batch:
        return Batch({self.key: self.engine.values(batch)})

    @endpoint(protocol=MINIBATCH)
    def update_critic(self, shares: list[Batch], loss_fn: LossFn, spec: UpdateSpec) -> dict[str, float]:
        """Value update: MINIBATCH hands this rank its shares of the global mini-batches that `spec` cuts."""
        return self._update(shares, loss_fn, self.engine.value_outputs, spec)


class RewardModelWorker(ModelWorker):
    """Sequence-score model used as a reward model (compute_reward) or a cost model (compute_cost).

    `policy`: the model whose samples it scores. When its tokenizer's vocabulary differs from this model's, the
    samples are decoded with the policy's tokenizer and re-tokenized with this one (as OpenRLHF and TRL do): token
    ids from another vocabulary are never scored."""

    head = "score"

    def __init__(
        self,
        model: ModelConfig,
        policy: ModelConfig | None = None,
        optim: OptimConfig | None = None,
        zero_stage: int = 3,
    ) -> None:
        """`optim`: train this model (`update_scorer`), e.g. a reward model on preference pairs; None: frozen,
        held as `zero_stage` says (TrainingSetup)."""
        self._setup(model, optim, trainable=optim is not None, zero_stage=zero_stage)
        policy_tokenizer = build_tokenizer(policy) if policy is not None else None
        self.policy_tokenizer = (
            None if policy_tokenizer is None or same_vocabulary(policy_tokenizer, self.tokenizer) else policy_tokenizer
        )

    def _scores(self, batch: Batch) -> torch.Tensor:
        if self.policy_tokenizer is None:
            return self.engine.scores(batch)
        decode = self.policy_tokenizer.batch_decode
        texts = [
            p + r
            for p, r in zip(
                decode(batch["prompts"], skip_special_tokens=True), decode(batch["responses"], skip_special_tokens=True)
            )
        ]
        enc = self.tokenizer(texts, padding=True, return_tensors="pt")
        return self.engine.scores(Batch({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}))

    @endpoint(protocol=MESH)
    def compute_reward(self, batch: Batch) -> Batch:
        return Batch({REWARDS: self._scores(batch)})

    @endpoint(protocol=MESH)
    def compute_cost(self, batch: Batch) -> Batch:
        return Batch({COSTS: self._scores(batch)})

    @endpoint(protocol=MINIBATCH)
    def update_scorer(self, shares: list[Batch], loss_fn: LossFn, spec: UpdateSpec) -> dict[str, float]:
        """Train on pairs: each row holds a `chosen` sequence (`input_ids`, `attention_mask`) and a `rejected` one
        (`rejected_input_ids`, `rejected_attention_mask`) of this model's tokenizer, and `response_mask` (B, 1) of
        ones (the update averages over pairs). `loss_fn` sees {"chosen": (B,), "rejected": (B,)} scores."""

        def outputs(mb: Batch) -> dict[str, torch.Tensor]:
            rejected = Batch({"input_ids": mb["rejected_input_ids"], "attention_mask": mb["rejected_attention_mask"]})
            return {
                "chosen": self.engine.score_outputs(mb)["scores"],
                "rejected": self.engine.score_outputs(rejected)["scores"],
            }

        return self._update(shares, loss_fn, outputs, spec)


def _scores(value: Any) -> float | list[float]:
    """A rule's value: a float, or one per constraint (a sequence: the field becomes (B, K))."""
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)


class RuleRewardWorker(Worker):
    """A rule-based reward or cost: `fn(prompt_text, response_text, row) -> float` on decoded text (a cost may
    return one value per constraint: a sequence of floats).

    `row` holds the batch's per-row values (e.g. the task's target) for that sample.
    """

    def __init__(
        self,
        fn: Callable[[str, str, dict[str, Any]], float],
        model: ModelConfig | None = None,
        success: Callable[[str, str, dict[str, Any]], bool] | None = None,
    ) -> None:
        """`success`: whether a response solved its prompt, reported beside the reward (a `success` field) where
        the reward is shaped."""
        self.fn, self.success = fn, success
        self.tokenizer = build_tokenizer(model or ModelConfig())

    def _score(self, batch: Batch, **fns: Callable[[str, str, dict[str, Any]], float] | None) -> Batch:
        """Each named rule over the decoded texts (decoded once), as a field; None rules are left out."""
        prompts = self.tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True)
        responses = self.tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
        rows = [{k: v[i] for k, v in batch.rows.items()} for i in range(len(batch))]
        return Batch(
            {
                name: torch.tensor([_scores(fn(p, r, row)) for p, r, row in zip(prompts, responses, rows)])
                for name, fn in fns.items()
                if fn is not None
            }
        )

    @endpoint(protocol=MESH)
    def compute_reward(self, batch: Batch) -> Batch:
        return self._score(batch, **{REWARDS: self.fn, SUCCESS: self.success})

    @endpoint(protocol=MESH)
    def compute_cost(self, batch: Batch) -> Batch:
        return self._score(batch, **{COSTS: self.fn})
