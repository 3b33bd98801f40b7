"""Typed configs of the algorithm programs, presets as functions, and `key=value` command-line overrides.

One dataclass per algorithm, each field documented where it is declared and validated in `__post_init__`.
Batch sizes carry their unit in their name: prompts per step, samples per prompt, mini-batch in samples,
micro-batch in tokens. Presets (`ppo_tiny_cpu()`, ...) are plain functions; larger presets derive from them by
changing a few fields. Overrides use the same dataclass: `model.hidden_size=128 steps=20`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.models.config import ModelConfig
from engines.training.common import OptimConfig
from flowactors.slurm import SlurmSettings

__all__ = [
    "RunConfig",
    "RLConfig",
    "FusionConfig",
    "AsyncConfig",
    "SHORT_FORMS",
    "PPOConfig",
    "SafeRLHFConfig",
    "GRPOConfig",
    "ReMaxConfig",
    "RLOOConfig",
    "ReinforcePPConfig",
    "GSPOConfig",
    "DAPOConfig",
    "ConfigError",
    "PLACEMENTS",
    "apply_overrides",
    "check_trainable_layers",
    "check_zero_stage",
    "derived_sizes",
    "describe_settings",
    "field_docs",
    "validate",
]


PLACEMENTS = ("colocated", "split", "fused")
"""The placements a run builds without a plan (RLConfig.placement)."""


class ConfigError(ValueError):
    """A setting the user gave cannot work; the message names it and says what to change."""


RANGES: dict[str, str] = {
    # learning rates and step sizes
    "actor_lr": "(0, inf)",
    "critic_lr": "(0, inf)",
    "sft_lr": "(0, inf)",
    "lambda_lr": "[0, inf)",
    # the loss
    "temperature": "(0, inf)",
    "kl_coef": "[0, inf)",
    "kl_target": "(0, inf)",
    "clip_ratio": "(0, inf)",
    "clip_ratio_high": "(0, inf)",
    "dual_clip": "(1, inf)",
    "value_clip": "(0, inf)",
    "entropy_coef": "[0, inf)",
    "ptx_coef": "[0, inf)",
    "gamma": "[0, 1]",
    "lam": "[0, 1]",
    # Safe-RLHF's multiplier
    "lambda_init": "[0, inf)",
    "lambda_max": "[0, inf)",
    # fractions, caps and times
    "recovery_wait_s": "[0, inf)",
    "slurm.startup_timeout_s": "(0, inf)",
    "slurm.death_timeout_s": "(0, inf)",
}
"""The interval each numeric setting must lie in, by its dotted name; every other float must be finite (nan and
inf are refused everywhere: a nan learning rate or threshold would run and report success)."""


def check_numbers(cfg: Any, prefix: str = "") -> None:
    """Refuse a numeric setting that is nan, infinite or outside `RANGES`, naming it and the interval, before
    anything starts; nested sections (`model.`, `fusion.`, `slurm.` ...) are walked too."""
    import math

    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_numbers(value, name + ".")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ConfigError(
                f"{name}={value} is not a finite number; give one" + (f" in {RANGES[name]}" if name in RANGES else "")
            )
        interval = RANGES.get(name)
        if interval is None:
            continue
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if not (above and below):
            raise ConfigError(f"{name}={value} is outside {interval}; give a number in {interval}")


@dataclass
class RunConfig:
    """Where a program runs and what it reports: shared by the RL programs and the stages before RL."""

    seed: int = 0
    """Seeds the data order, the per-row sampling seeds and the controller's RNG; models have model.seed."""
    metrics_file: str | None = None
    """Write one JSON object per step here (JSONL)."""
    log_format: str = "console"
    """Structured logs (one event per call): console or json."""
    log_level: str = "warning"
    """debug: every call and the traceback of a user error (= --debug); info: every call; warning: failures only."""
    address: str | None = None
    """Dask scheduler address (tcp://host:8786); None starts the cluster named by `cluster`."""
    cluster: str = "local"
    """Without an address: local (an embedded LocalCluster of n_slots processes) or slurm (jobs submitted through
    dask-jobqueue, one worker process per GPU, as set in `slurm.*`)."""
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    """The Slurm jobs of cluster=slurm: slurm.nodes=2 slurm.gpus_per_node=8 slurm.partition=gpu ..."""
    n_slots: int = 2
    """Worker processes (device slots) of the embedded cluster."""
    call_timeout_s: float | None = 1800.0
    """Watchdog per blocking wait: past it the step fails with every stuck rank's Python stack."""
    dashboard: str | None = "127.0.0.1:8787"
    """Dashboard address of the embedded cluster; none turns it off."""
    secure: bool = True
    """The embedded and Slurm clusters' listeners serve only this run: TLS with credentials made for it, and the
    direct-call sockets behind secrets learned over it (docs/security.md). false: plain TCP, which any user who can
    reach the ports can use to run code as the trainer; only on a machine you alone use."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.n_slots < 1:
            raise ConfigError(f"n_slots must be >= 1, got {self.n_slots}")
        if self.cluster not in ("local", "slurm"):
            raise ConfigError(f"cluster must be 'local' or 'slurm', got {self.cluster!r}")
        if self.log_format not in ("console", "json"):
            raise ConfigError(f"log_format must be 'console' or 'json', got {self.log_format!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.call_timeout_s is not None and not self.call_timeout_s > 0:
            raise ConfigError(f"call_timeout_s must be > 0 seconds (or none: no watchdog), got {self.call_timeout_s}")
        if self.dashboard is not None and self.dashboard.lower() in ("none", "", "false", "off", "no"):
            self.dashboard = None
        if self.dashboard is not None:
            _, colon, port = self.dashboard.rpartition(":")
            if not colon or not port.isdigit():
                raise ConfigError(
                    f"dashboard={self.dashboard} is not an address HOST:PORT (or :PORT); none turns the dashboard off"
                )


@dataclass
class FusionConfig:
    """Stage fusion (RLHFuse; algorithms/rollout/fusion.py), the `fusion.` section of every RL program. Each field has a
    short form on the command line (`fuse=true` for `fusion.enabled=true`: SHORT_FORMS)."""

    enabled: bool = False
    """Score finished samples in chunks while generation goes on (scorers on the actor's slots still wait).
    The same samples, scores and update as without it."""
    chunk_samples: int = 8
    """Samples per chunk on each generation (actor data-parallel) rank: smaller chunks start scoring sooner, at
    the cost of more calls."""
    migrate: bool = False
    """Long-tail migration (RLHFuse; needs fuse and an actor of dp >= 2, tp = pp = 1, no rollout_tp): once at
    most `fusion.migrate_below` of a generation rank's rows are still running, the rank hands them to one of the
    first `fusion.migrate_to` actor ranks, which admits them into its running decode (hf: with their KV caches;
    vllm: re-prefilled, with their seeds and sampling generators), and scorers on the freed slots start at once.
    The same samples and update; rollout log-probs of rows that change decode batch (the moved rows, and with hf
    the receiver's own after they join) may differ in the last bit."""
    migrate_below: float = 0.25
    """The fraction of a generation rank's rows still running at which its tail migrates."""
    migrate_to: int = 1
    """Actor ranks that finish the migrated tails (the first ones; fewer than the actor's data-parallel size):
    each other rank's tail goes, whole, to the one with the fewest rows so far. `--placement fused` keeps the
    scorers off their slots."""
    train: bool = False
    """Train the actor and the critic as one fused pipeline (RLHFuse's intra-stage fusion;
    engines.training.megatron.pipeline_fusion): needs critics, and a plan that puts the actor and the critic in one
    pool with the same train sizes, p >= 2, on a pipeline-parallel engine (megatron). The critic's stages then run
    the other way over the slots, so each model fills the other's pipeline bubbles; Safe-RLHF's cost critic joins
    the same pipeline where the plan gives it the actor's pool and sizes too. The same updates as without it."""

    def __post_init__(self) -> None:
        if self.chunk_samples < 1:
            raise ConfigError(f"fuse_chunk_samples must be >= 1, got {self.chunk_samples}")
        if not 0 < self.migrate_below < 1:
            raise ConfigError(
                f"fuse_migrate_below is a fraction of each generation rank's rows and must be in "
                f"(0, 1), got {self.migrate_below}"
            )
        if self.migrate_to < 1:
            raise ConfigError(
                f"fuse_migrate_to is how many actor ranks finish the migrated tails, at least 1; got {self.migrate_to}"
            )
        if self.migrate and not self.enabled:
            raise ConfigError("fuse_migrate moves the long tail of a fused rollout; set fuse=true with it")


@dataclass
class AsyncConfig:
    """Asynchronous RL (algorithms/rollout/asynchronous.py), the `async_rl.` section of every RL program: rollouts run on
    slots of their own up to `staleness` policy versions ahead of training. Short forms: `async_staleness=1` for
    `async_rl.staleness=1`, ... (SHORT_FORMS)."""

    staleness: int = 0
    """K: step i trains on samples generated by the policy of step i - K (fewer at the start), while the rollout
    replicas already generate the next steps'. 0: today's synchronous on-policy step, bit for bit. K > 0 needs
    `--placement split` (the rollout replicas on `async_rl.rollout_slots` slots, every model that trains or scores
    on the others)."""
    partial_rollout: bool = False
    """Interrupt in-flight generation at each update and continue the unfinished samples under the new weights.
    Not built yet: refused with the reason."""
    correction: str = "tis"
    """How the loss corrects for samples from an older policy: `tis` (decoupled PPO with truncated importance
    sampling, as AReaL and verl: the ratio is clipped against the trainer's own log-probs before the update (the
    proximal policy), and each token is weighted by min(pi_prox / pi_behaviour, tis_cap), the behaviour log-probs
    recorded at generation); `none` (PPO clipped against the behaviour log-probs directly, as OpenRLHF's async
    mode: no proximal pass for GRPO's one-optimizer-step case)."""
    tis_cap: float = 2.0
    """The truncation of `tis`'s importance weight (>= 1)."""
    rollout_slots: int = 0
    """Slots of the rollout replicas (the last ones); 0: half of the run's slots, rounded down."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ConfigError(
                f"async_staleness is how many policy versions rollouts may run ahead, >= 0 (0: "
                f"synchronous); got {self.staleness}"
            )
        if self.partial_rollout and self.staleness == 0:
            raise ConfigError(
                "partial_rollout interrupts rollouts that run ahead of training; set async_staleness "
                ">= 1 with it, or drop partial_rollout"
            )
        if self.partial_rollout:
            raise ConfigError(
                "partial_rollout is not built yet (rollouts finish under the weights they started "
                "with); drop it: async_staleness alone overlaps rollout and training"
            )
        if self.correction not in ("tis", "none"):
            raise ConfigError(f"async_correction must be tis or none, got {self.correction!r}")
        if not self.tis_cap >= 1:
            raise ConfigError(f"async_tis_cap truncates an importance weight and must be >= 1, got {self.tis_cap}")
        if self.rollout_slots < 0:
            raise ConfigError(f"async_rollout_slots must be >= 0 (0: half of the slots), got {self.rollout_slots}")


SHORT_FORMS = {
    "async_staleness": "async_rl.staleness",
    "partial_rollout": "async_rl.partial_rollout",
    "async_correction": "async_rl.correction",
    "async_tis_cap": "async_rl.tis_cap",
    "async_rollout_slots": "async_rl.rollout_slots",
    "fuse": "fusion.enabled",
    "fuse_chunk_samples": "fusion.chunk_samples",
    "fuse_migrate": "fusion.migrate",
    "fuse_migrate_below": "fusion.migrate_below",
    "fuse_migrate_to": "fusion.migrate_to",
    "fuse_train": "fusion.train",
}
"""Command-line names kept from before the settings had sections: `fuse=true` is `fusion.enabled=true`."""


@dataclass
class RLConfig(RunConfig):
    """What every algorithm program shares: run, cluster, batch sizes, model, warm start."""

    # -- run ------------------------------------------------------------------------------------------------------
    steps: int = 40
    """RL steps (one generate → score → update round each)."""
    task: str = "digit_sum"
    """Synthetic task (algorithms.data.tasks): digit_sum, add, reverse; multi-turn with tools: tool_arith,
    tool_arith_safe."""
    dataset_prompts: int = 512
    """Prompts in the task's dataset; epochs wrap around it."""
    train_files: list[str] = field(default_factory=list)
    """Prompt datasets, JSONL or Parquet (comma-separated), instead of the task's prompts: a `prompt` column (text or
    chat messages) or `messages`, chat rendered with the policy tokenizer's template; a `response` column feeds the
    warm start; other columns reach rule rewards. The task still gives the rule reward and response length."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompts (same formats) for eval_every."""
    eval_every: int = 0
    """Evaluate every K steps and after the last (0: never): reward (and cost) means of greedy and of sampled
    responses to eval_files' prompts, as eval/* metrics in the metrics file and on the dashboard."""
    eval_prompts: int = 256
    """At most this many eval_files prompts per evaluation (the first ones)."""
    reward_model: str | None = None
    """A Hugging Face folder with a sequence-classification (score) head, Llama or Qwen2 family: the reward role
    scores with it instead of the task's rule reward (texts re-tokenized when its tokenizer differs)."""
    cost_model: str | None = None
    """The same for Safe-RLHF's cost role."""
    tensorboard_dir: str | None = None
    """Also write the step metrics as TensorBoard scalars here (needs the tensorboard package)."""
    export_dir: str | None = None
    """Write the trained policy here as a Hugging Face folder (weights and tokenizer) when the run ends, for
    evaluation or serving (vLLM, transformers); None: the checkpoints are the only copy."""
    # -- checkpoints and recovery ---------------------------------------------------------------------------------
    checkpoint_dir: str | None = None
    """Checkpoint root; None disables checkpoints (and so recovery)."""
    save_every: int = 0
    """Save every K steps (0: never)."""
    resume: str = "auto"
    """auto (newest complete checkpoint in checkpoint_dir, if any), never, or a checkpoint path (whose parent
    directory is then the checkpoint_dir, unless one is given)."""
    keep_last: int = 3
    """Complete checkpoints kept."""
    max_recoveries: int = 2
    """Lost-worker recoveries allowed in one run; past it the run fails."""
    recovery_wait_s: float = 60.0
    """How long a recovery waits for the lost slots to come back before using the live ones."""
    # -- cluster and placement ------------------------------------------------------------------------------------
    placement: str = "colocated"
    """colocated (every model on every slot, time-shared), split (actor+ref | critics+reward+cost), or fused (actor
    and reference on every slot, critics, reward and cost on every slot but the first `fuse_migrate_to` (1 where
    the algorithm has none): with fuse_migrate those first slots finish the long tail while the others score)."""
    plan: str | None = None
    """A placement plan (JSON/YAML from `python -m placement.automap --json`); overrides `placement`."""
    fusion: FusionConfig = field(default_factory=FusionConfig)
    """Stage fusion: fuse=true fuse_chunk_samples=8 fuse_migrate=true ... (or fusion.enabled=true ...)."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous RL: async_staleness=1 ... (or async_rl.staleness=1 ...)."""
    # -- batch sizes ----------------------------------------------------------------------------------------------
    prompts_per_step: int = 32
    """Prompts drawn from the dataset each RL step (global, across data-parallel ranks)."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (GRPO's group size); a step trains on prompts_per_step x this samples."""
    mini_batch_samples: int = 32
    """Samples per optimizer step (global, across data-parallel ranks)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    micro_batch_tokens: int = OptimConfig.micro_batch_tokens
    """Tokens per forward/backward on one rank (gradient accumulation beyond it)."""
    zero_stage: int = OptimConfig.zero_stage
    """How the actor's and critics' data-parallel ranks hold them (torch engine): 3 = FSDP2 (everything sharded);
    1 = a whole replica per rank (its TP shard when tp > 1), gradients averaged once per mini-batch, Adam state
    sharded (ZeRO-1), and the actor samples from its own replica: less communication for models that fit on one
    device. The 3D-HybridEngine (rollout_tp) always keeps replicas."""
    pack_sequences: bool = False
    """Pack rows of different lengths end to end in every role's forward and backward passes instead of padding
    each to the longest (torch engine; the same numbers, less compute where lengths vary); sets
    model.pack_sequences."""
    lora_rank: int = 0
    """Train rank-R LoRA adapters on the actor and the critics instead of every parameter (torch engine, tp = 1,
    no rollout_tp); generation, exports and the reference see the merged weights; checkpoints hold only the
    adapters (and the critics' heads) with their optimizer state. 0: full-parameter training."""
    lora_alpha: float = OptimConfig.lora_alpha
    """LoRA scaling: adapters' outputs times lora_alpha / lora_rank."""
    lora_dropout: float = OptimConfig.lora_dropout
    """Dropout on the adapters' inputs while training."""
    lora_target_modules: str = OptimConfig.lora_target_modules
    """Linear layers that get adapters: all-linear, or comma-separated names (q_proj,k_proj,v_proj,o_proj,...)."""
    # -- model and sampling ---------------------------------------------------------------------------------------
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (and the models started from it): model.path=DIR loads a Hugging Face folder, else sizes."""
    actor_lr: float = 2e-4
    """Actor learning rate (AdamW) during RL."""
    rollout_tp: int = 0
    """Generation TP size t_g of the actor under the 3D-HybridEngine (must divide the actor's tp; a plan's actor
    "generate" sizes set it); 0: off, a sharded actor gathers its whole weights to generate. With the actor's
    tp > 1 its vocabulary must divide tp: set model.pad_vocab_to."""
    rollout_engine: str = "hf"
    """The actor's generation engine: hf (transformers with a KV cache) or vllm (an in-process vLLM engine per
    generation replica, fed the actor's weights in memory after each update; needs vllm installed and, on CPU,
    attention heads of >= 32 dimensions)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs of the actor and the reference use the same one."""
    max_new_tokens: int = 0
    """Longest response in tokens; 0: the task's default."""
    ignore_eos: bool = False
    """Always generate max_new_tokens (fixed token counts for benchmarks)."""
    # -- multi-turn episodes (tasks with tools) --------------------------------------------------------------------
    max_turns: int = 0
    """Model turns per episode of a multi-turn task (0: the task's default); the response budget (max_new_tokens)
    covers the whole episode, tool outputs included."""
    max_turn_tokens: int = 0
    """Tokens per model turn (0: what is left of the episode's budget)."""
    tool_workers: int = 8
    """Tool calls running at once on each actor rank."""
    tool_timeout_s: float = 5.0
    """A tool call not answered after this many seconds becomes an error the model reads."""
    tool_overlap: bool = True
    """Run tools while the rest of the batch decodes; false: turn by turn, waiting for each tool."""
    profile_controller: bool = False
    """Record each step's controller share: the fraction of step time in which no worker was computing."""
    # -- supervised warm start ------------------------------------------------------------------------------------
    sft_steps: int = 150
    """Supervised steps on the task's demonstrations before RL (0: none); the reference and critics start from
    the result."""
    sft_samples_per_step: int = 64
    """Demonstrations per supervised step."""
    sft_lr: float = 3e-3
    """Learning rate of the supervised warm start."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive = (
            "steps",
            "prompts_per_step",
            "samples_per_prompt",
            "mini_batch_samples",
            "ppo_epochs",
            "micro_batch_tokens",
            "dataset_prompts",
            "sft_samples_per_step",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rollout_engine not in ("hf", "vllm") and ":" not in self.rollout_engine:
            raise ConfigError(
                f"rollout_engine must be hf or vllm (or a registered 'module:name'), got {self.rollout_engine!r}"
            )
        check_zero_stage(self.zero_stage)
        check_training_engine(self.model)
        if self.max_turns < 0 or self.max_turn_tokens < 0 or self.tool_workers < 1 or not self.tool_timeout_s > 0:
            raise ConfigError(
                f"max_turns and max_turn_tokens must be >= 0, tool_workers >= 1 and tool_timeout_s > 0; "
                f"got {self.max_turns}, {self.max_turn_tokens}, {self.tool_workers}, "
                f"{self.tool_timeout_s}"
            )
        if self.pack_sequences or self.model.pack_sequences:
            if self.model.engine != "torch":
                raise ConfigError(
                    f"pack_sequences=true runs on the torch engine; the {self.model.engine} engine does "
                    f"not pack rows yet: set model.engine=torch or pack_sequences=false"
                )
            self.pack_sequences = self.model.pack_sequences = True
        if self.lora_rank:
            self._check_lora()
        if self.rollout_tp < 0:
            raise ConfigError(f"rollout_tp must be >= 0 (0: no 3D-HybridEngine), got {self.rollout_tp}")
        if self.save_every < 0 or self.keep_last < 1 or self.max_recoveries < 0:
            raise ConfigError("save_every must be >= 0, keep_last >= 1 and max_recoveries >= 0")
        if self.resume not in ("auto", "never") and not self.checkpoint_dir:
            # a checkpoint lives in its store's root: the run goes on saving (and locking) there
            self.checkpoint_dir = str(Path(self.resume).resolve().parent)
        if self.save_every and not self.checkpoint_dir:
            raise ConfigError("save_every needs a checkpoint_dir (--checkpoint-dir D)")
        if self.sft_steps < 0:
            raise ConfigError(f"sft_steps must be >= 0, got {self.sft_steps}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.placement in ("split", "fused") and self.n_slots < 2:
            raise ConfigError(
                f"placement={self.placement} needs n_slots >= 2 (the scorers' slots differ from the "
                f"actor's {'' if self.placement == 'split' else 'first '}slot)"
            )
        samples = self.prompts_per_step * self.samples_per_prompt
        if samples % self.mini_batch_samples:
            raise ConfigError(
                f"mini_batch_samples={self.mini_batch_samples} does not divide the "
                f"{samples} samples of a step (prompts_per_step x samples_per_prompt); choose a divisor"
            )
        if self.eval_every < 0 or self.eval_prompts < 1:
            raise ConfigError(
                f"eval_every must be >= 0 and eval_prompts >= 1, got {self.eval_every}, {self.eval_prompts}"
            )
        if self.eval_every and not self.eval_files:
            raise ConfigError(f"eval_every={self.eval_every} needs eval_files=PATH[,PATH] (held-out prompts)")
        self.fusion.__post_init__()  # before the cross-checks below read it
        receivers = self.fusion.migrate_to
        if self.placement == "fused" and self.address is None and self.n_slots <= receivers:
            raise ConfigError(
                f"placement=fused keeps the scorers off the first fuse_migrate_to={receivers} slots, "
                f"so it needs n_slots > {receivers}"
            )
        if self.fusion.train and not self.has_critic:
            raise ConfigError(
                f"fuse_train fuses the actor's and the critic's training; {type(self).__name__} trains no critic"
            )
        self.async_rl.__post_init__()
        if self.async_rl.staleness:
            self._check_async()

    def _check_lora(self) -> None:
        r = self.lora_rank
        try:
            OptimConfig(lora_rank=r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout)
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("OptimConfig: ")) from None
        if self.model.engine != "torch":
            raise ConfigError(
                f"lora_rank={r} runs on the torch engine; the {self.model.engine} engine trains every "
                f"parameter: set model.engine=torch or lora_rank=0"
            )
        if self.rollout_tp:
            raise ConfigError(
                f"lora_rank={r} with the 3D-HybridEngine (rollout_tp={self.rollout_tp}) is not built "
                f"(tensor parallelism would split the adapters with their layers); set rollout_tp=0 or "
                f"lora_rank=0"
            )
        if getattr(self, "critic_trainable_layers", 0):
            raise ConfigError(
                f"lora_rank={r} trains adapters on frozen critics; critic_trainable_layers="
                f"{self.critic_trainable_layers} cannot go with it (set one of them to 0)"
            )

    def _check_async(self) -> None:
        k = self.async_rl.staleness
        if self.placement != "split" and not self.plan:
            raise ConfigError(
                f"async_staleness={k} runs the rollouts on slots of their own while the others train; "
                f"add --placement split (placement={self.placement} shares every slot), or set "
                f"async_staleness=0"
            )
        if self.plan:
            raise ConfigError(f"async_staleness={k} with a placement plan is not built yet; use --placement split")
        if self.fusion.enabled:
            raise ConfigError(
                f"async_staleness={k} with fuse=true is not built yet (a rollout that runs ahead is "
                f"scored whole); drop one of them"
            )
        if self.address is None and self.cluster == "local":
            rollout = self.async_rl.rollout_slots or self.n_slots // 2
            if self.n_slots < 2 or rollout >= self.n_slots:
                raise ConfigError(
                    f"async_staleness={k} needs slots for the rollout replicas and slots for training: "
                    f"n_slots={self.n_slots} with async_rollout_slots={rollout}; use n_slots >= 2 and "
                    f"async_rollout_slots < n_slots"
                )

    has_critic: typing.ClassVar[bool] = False
    """Whether the program trains a critic (PPO, Safe-RLHF): what fusion.train fuses with the actor."""


@dataclass
class PPOConfig(RLConfig):
    has_critic: typing.ClassVar[bool] = True
    task: str = "digit_sum"
    sft_steps: int = 60
    gamma: float = 1.0
    """Discount of GAE (1: undiscounted, the RLHF norm)."""
    lam: float = 0.95
    """GAE's lambda: 1 is Monte-Carlo returns, 0 one-step TD."""
    kl_coef: float = 0.02
    """KL penalty in the reward (per token, against the reference)."""
    adaptive_kl: bool = False
    """Adapt kl_coef so the measured KL tracks kl_target (Ziegler et al.'s controller)."""
    kl_target: float = 0.1
    """KL per token the adaptive controller aims for."""
    kl_horizon: int = 500
    """Samples over which the adaptive controller corrects a KL error."""
    kl_estimator: str = "k1"
    """KL estimator in the reward penalty: k1 (log-ratio), k2 (squared) or k3 (Schulman's unbiased, positive)."""
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio."""
    dual_clip: float = 3.0
    """Dual-clip bound on negative advantages (Ye et al. 2020); must be > 1."""
    value_clip: float = 0.2
    """Clip range of the critic's value change per update."""
    entropy_coef: float = 0.0
    """Entropy bonus in the policy loss (0: none)."""
    critic_lr: float = 1e-3
    """Critic learning rate (AdamW)."""
    critic_trainable_layers: int = 0
    """Critics (and Safe-RLHF's cost critic) train only their top K decoder layers, the final norm and the value
    head (0: every parameter; torch engine): a critic started from a pretrained policy keeps its lower layers, and
    its backward pass stops there, which on a small device is most of a critic update's time."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit variance over the step's tokens."""
    whiten_rewards: bool = False
    """Divide each step's model scores (rewards, and Safe-RLHF's costs) by their standard deviation over the step's
    samples, without shifting them (TRL's whiten_rewards): a learned reward model's scale is arbitrary (one trained
    briefly scores within ±0.1), and the KL penalty and λ should act on unit-scale scores. Metrics stay raw."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")


@dataclass
class SafeRLHFConfig(PPOConfig):
    task: str = "digit_sum"
    steps: int = 80
    sft_steps: int = 60
    prompts_per_step: int = 64
    kl_coef: float = 0.05
    cost_threshold: float = 0.3
    """Constraint: expected cost per sample ≤ this."""
    lambda_init: float = 0.5
    """Starting Lagrange multiplier λ."""
    lambda_lr: float = 0.1
    """Dual-ascent step of log λ per unit of constraint violation."""
    lambda_max: float = 5.0
    """Upper bound of λ."""
    ptx_coef: float = 0.0
    """Weight of the pretraining (SFT demonstration) loss mixed into actor updates; 0 disables it."""


@dataclass
class GRPOConfig(RLConfig):
    task: str = "reverse"
    sft_steps: int = 60
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    mini_batch_samples: int = 32
    kl_coef: float = 0.04
    """KL to the reference, in the loss (k3)."""
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio."""
    entropy_coef: float = 0.0
    """Entropy bonus in the policy loss (0: none)."""


@dataclass
class ReMaxConfig(RLConfig):
    task: str = "digit_sum"
    sft_steps: int = 60
    kl_coef: float = 0.02
    """KL penalty subtracted from each sample's return (k1, against the reference)."""
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio."""


@dataclass
class GSPOConfig(GRPOConfig):
    kl_coef: float = 0.0
    """KL to the reference, in the loss (k3); GSPO's paper uses none."""
    clip_ratio: float = 3e-4
    """Lower clip of the sequence-level ratio, 1 − clip_ratio (GSPO's ε_left: ratios of whole sequences stay close
    to 1, so the range is far narrower than a token's)."""
    clip_ratio_high: float = 4e-4
    """Upper clip of the sequence-level ratio, 1 + clip_ratio_high (GSPO's ε_right)."""


@dataclass
class DAPOConfig(GRPOConfig):
    kl_coef: float = 0.0
    """KL to the reference, in the loss (k3); DAPO uses none."""
    clip_ratio: float = 0.2
    """Lower clip of the token ratio, 1 − clip_ratio (DAPO's ε_low)."""
    clip_ratio_high: float = 0.28
    """Upper clip, 1 + clip_ratio_high (DAPO's clip-higher, ε_high > ε_low: room for unlikely tokens to grow)."""
    dynamic_sampling: bool = True
    """Drop the groups whose rewards are all equal (no advantage, no gradient) and generate more prompts until a
    step's batch is full again."""
    max_gen_rounds: int = 4
    """Generation rounds a step may take to fill its batch with groups that vary; past it the run stops with the
    reason."""
    overlong_buffer: int = 0
    """DAPO's overlong reward shaping: a response longer than max_new_tokens − overlong_buffer loses up to
    overlong_penalty, linearly over the buffer (0: off; needs max_new_tokens)."""
    overlong_penalty: float = 1.0
    """The most a response at max_new_tokens loses under overlong shaping."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ConfigError(
                f"dynamic_sampling keeps the groups whose rewards vary, which needs samples_per_prompt "
                f">= 2, got {self.samples_per_prompt}; or dynamic_sampling=false"
            )
        if self.dynamic_sampling and self.async_rl.staleness:
            raise ConfigError(
                "dynamic_sampling with async_staleness is not built yet (the rollout replicas would "
                "have to refill a step's batch); set one of them off"
            )
        if self.max_gen_rounds < 1:
            raise ConfigError(f"max_gen_rounds must be >= 1, got {self.max_gen_rounds}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError("overlong_buffer and overlong_penalty must be >= 0")
        if self.overlong_buffer and not 0 < self.overlong_buffer < self.max_new_tokens:
            raise ConfigError(
                f"overlong_buffer={self.overlong_buffer} needs max_new_tokens > it (the response "
                f"length it is measured against), got max_new_tokens={self.max_new_tokens}"
            )


@dataclass
class RLOOConfig(RLConfig):
    task: str = "reverse"
    sft_steps: int = 60
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    mini_batch_samples: int = 32
    kl_coef: float = 0.02
    """KL penalty (k1, summed over the response) subtracted from each sample's reward before the baseline."""
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples_per_prompt < 2:
            raise ConfigError(
                f"RLOO's baseline is the mean reward of a prompt's other samples: samples_per_prompt "
                f"must be >= 2, got {self.samples_per_prompt}"
            )


@dataclass
class ReinforcePPConfig(RLConfig):
    task: str = "reverse"
    sft_steps: int = 60
    prompts_per_step: int = 32
    samples_per_prompt: int = 1
    mini_batch_samples: int = 32
    kl_coef: float = 0.01
    """KL penalty per token (k1) in the reward."""
    clip_ratio: float = 0.2
    """PPO's clip range of the probability ratio."""


def check_trainable_layers(setting: str, value: int, model: ModelConfig) -> None:
    """Refuse on the controller, before any worker starts, a layer count the model cannot train (`setting` names
    the option in the message)."""
    if not value:
        return
    if value < 0:
        raise ConfigError(f"{setting}={value} must be >= 0 (0 trains every parameter)")
    if model.engine != "torch":
        raise ConfigError(
            f"{setting}={value} needs model.engine=torch (the {model.engine} engine trains every "
            f"layer); or set {setting}=0"
        )
    if model.path:
        from engines import check_model_dir

        layers = check_model_dir(model.path)["num_hidden_layers"]
    else:
        layers = model.num_layers
    if value > layers:
        raise ConfigError(
            f"{setting}={value} but the model has {layers} decoder layers; give 1..{layers}, or 0 to "
            f"train every parameter"
        )


def check_training_engine(model: ModelConfig, setting: str = "model.engine") -> None:
    """Refuse, before any worker starts, a training engine the registry does not know (names with a
    'package.module:name' are imported first, as the workers will)."""
    from engines.registry import training_engine

    try:
        training_engine(model.engine)
    except ValueError as e:
        raise ConfigError(f"{setting}={model.engine}: {e}") from None


def check_zero_stage(zero_stage: int) -> None:
    """Refuse a bad `zero_stage` on the controller, before any worker starts, with OptimConfig's own check."""
    try:
        OptimConfig(zero_stage=zero_stage)
    except ValueError as e:
        raise ConfigError(str(e).removeprefix("OptimConfig.")) from None


def derived_sizes(cfg: RLConfig, dp: int) -> dict[str, int]:
    """The numbers a user would otherwise compute by hand, checked for divisibility over `dp` ranks."""
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    if cfg.mini_batch_samples % dp:
        raise ConfigError(
            f"mini_batch_samples={cfg.mini_batch_samples} cannot be split over data-parallel size {dp}; "
            f"use a multiple of {dp}"
        )
    if cfg.prompts_per_step % dp:
        raise ConfigError(
            f"prompts_per_step={cfg.prompts_per_step} cannot be split over data-parallel size {dp}; "
            f"use a multiple of {dp}"
        )
    return {
        "samples_per_step": samples,
        "samples_per_rank": samples // dp,
        "optimizer_steps_per_rl_step": samples // cfg.mini_batch_samples * cfg.ppo_epochs,
        "mini_batch_samples_per_rank": cfg.mini_batch_samples // dp,
    }


def _coerce(value: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value.lower() in ("none", "null"):
            return None
        return _coerce(value, args[0])
    if tp is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected a boolean, got {value!r}")
    if tp in (int, float, str):
        return tp(value)
    if origin is list and not value.lstrip().startswith("["):  # a,b,c as well as ["a", "b", "c"]
        return [x for x in value.split(",") if x]
    return json.loads(value)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """`key=value` (nested with dots) onto a config dataclass, then validate it and its nested settings.

    Every mistake is a `ConfigError` naming the setting: unknown keys (with the closest known one), values of the
    wrong type, and values the dataclasses' own checks reject."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r} is not a key=value setting (e.g. steps=10); --help lists them all")
        key, value = item.split("=", 1)
        obj, name = _resolve(cfg, SHORT_FORMS.get(key, key) if hasattr(cfg, "fusion") else key)  # errors: as typed
        if dataclasses.is_dataclass(getattr(obj, name)):
            raise ConfigError(
                f"{key} is a group of settings, not one; set its fields ({key}.FIELD=VALUE, listed by --help)"
            )
        hints = typing.get_type_hints(type(obj))
        try:
            setattr(obj, name, _coerce(value, hints[name]))
        except ValueError as e:
            raise ConfigError(f"bad value for {key}: {e}") from None
    try:
        validate(cfg)
    except ConfigError:
        raise
    except ValueError as e:  # a nested dataclass's own check (ModelConfig, SlurmSettings)
        raise ConfigError(str(e)) from None
    return cfg


def validate(cfg: Any) -> None:
    """Run the `__post_init__` checks of `cfg` and of every dataclass nested in it (after fields were set)."""
    post = getattr(cfg, "__post_init__", None)
    if post:
        post()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value)


def _resolve(cfg: Any, key: str) -> tuple[Any, str]:
    """The dataclass holding dotted `key` and the field's name in it."""
    obj, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            prefix = ".".join(parts[:depth])
            known = [f"{prefix}.{n}" if prefix else n for n in names]
            close = difflib.get_close_matches(part, names, n=1)
            if close:
                raise ConfigError(
                    f"unknown setting {key!r}; did you mean {prefix + '.' if prefix else ''}{close[0]}? "
                    f"(--help lists every setting)"
                )
            raise ConfigError(f"unknown setting {key!r}; {type(obj).__name__} has: {', '.join(sorted(known))}")
        if depth == len(parts) - 1:
            return obj, part
        child = getattr(obj, part)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(
                f"{'.'.join(parts[: depth + 1])} has no settings inside it; set it as a whole "
                f"({'.'.join(parts[: depth + 1])}=VALUE)"
            )
        obj = child
    raise AssertionError("unreachable")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and its bases), read from the source: the one place
    a setting is documented is where it is declared."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_settings(cfg: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, current value, doc) of every setting of `cfg`, nested dataclasses flattened with dots."""
    docs = field_docs(type(cfg))
    out: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += describe_settings(value, f"{prefix}{f.name}.")
        else:
            shown = json.dumps(value) if isinstance(value, (list, dict)) else "none" if value is None else str(value)
            key = prefix + f.name
            short = next((k for k, v in SHORT_FORMS.items() if v == key), None)
            out.append((key, shown, (f"(short form: {short}=) " if short else "") + docs.get(f.name, "")))
    return out
