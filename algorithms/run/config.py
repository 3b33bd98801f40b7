"""The settings of the algorithm programs: one section per component, composed into one dataclass per program.

Sections: the run and its cluster (`RunConfig`), the model (engines' ModelConfig), each trained role's training
(engines' OptimConfig, as it is: `actor.`, and `critic.` where there is one), the rollout (`rollout.`, with its tool
episodes, engines' AgentConfig), the policy loss and the KL (algorithms.objectives.losses), stage fusion and
asynchronous RL (their own modules under algorithms.rollout), checkpoints. Each section checks its own fields;
rules that span sections are the run plan's (algorithms.run.plan.check_settings). A setting is declared once; every
name typed before the sections existed still works as a short form (`kl_coef=0.1` is `kl.coef=0.1`), and `--help`
lists the dotted names. Batch sizes carry their unit in their name. Presets (`ppo_tiny_cpu()`, ...) are plain
functions; a program's own defaults are its class's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from algorithms.objectives.losses import KLConfig, MismatchConfig, PolicyLossConfig
from algorithms.rollout.asynchronous import AsyncConfig
from algorithms.rollout.fusion import FusionConfig
from algorithms.run.errors import ConfigError
from algorithms.run.settings import apply_overrides, check_numbers, describe_settings, field_docs, validate
from engines.models.config import ModelConfig
from engines.rollout.agent import AgentConfig
from engines.training.common import OptimConfig
from flowactors.slurm import SlurmSettings

__all__ = [
    "RunConfig",
    "RLConfig",
    "RolloutConfig",
    "CheckpointConfig",
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
    "check_training_engine",
    "check_zero_stage",
    "derived_sizes",
    "describe_settings",
    "field_docs",
    "validate",
]


PLACEMENTS = ("colocated", "split", "fused")
"""The placements a run builds without a plan (RLConfig.placement)."""

_SHARED_OPTIM = ("micro_batch_tokens", "zero_stage", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")
"""The training settings whose short form sets every trained role's (the actor's and the critic's)."""


@dataclass
class RunConfig:
    """Where a program runs and what it reports: shared by the RL programs and the stages before RL."""

    ranges: ClassVar[dict[str, str]] = {"slurm.startup_timeout_s": "(0, inf)", "slurm.death_timeout_s": "(0, inf)"}
    """The interval each numeric setting of a section must lie in (settings.check_numbers); every other number
    must be finite."""
    short_forms: ClassVar[dict[str, str | tuple[str, ...]]] = {}
    """Names kept from before the settings had sections: short form → the dotted key (or keys) it sets."""

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
class RolloutConfig:
    """How the actor samples, the `rollout.` section (short forms: `rollout_engine=`, `rollout_tp=`,
    `temperature=`, `max_new_tokens=`, `ignore_eos=`, and the episodes' `max_turns=` ...)."""

    ranges: ClassVar[dict[str, str]] = {"temperature": "(0, inf)"}
    engine: str = "hf"
    """The actor's generation engine: hf (transformers with a KV cache) or vllm (an in-process vLLM engine per
    generation replica, fed the actor's weights in memory after each update; needs vllm installed and, on CPU,
    attention heads of >= 32 dimensions)."""
    tp: int = 0
    """Generation TP size t_g of the actor under the 3D-HybridEngine (must divide the actor's tp; a plan's actor
    "generate" sizes set it); 0: off, a sharded actor gathers its whole weights to generate. With the actor's
    tp > 1 its vocabulary must divide tp: set model.pad_vocab_to. With asynchronous RL the rollout replicas
    generate: each is `tp` ranks of a TP group that receives only its shards of the weights (model.pad_vocab_to
    a multiple of tp)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs of the actor and the reference use the same one."""
    max_new_tokens: int = 0
    """Longest response in tokens (a tool episode's, tool outputs included); 0: the task's default."""
    ignore_eos: bool = False
    """Always generate max_new_tokens (fixed token counts for benchmarks)."""
    dtype: str = ""
    """The generation engine's precision, whatever the trainer's: bfloat16, float16 or float32 ("": the model's
    own). Lower-precision rollouts sample from a slightly different distribution than the trainer's: the mismatch
    monitor shows it, `rollout_correction` corrects it."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes of tasks with tools (the environment is the task's)."""

    def __post_init__(self) -> None:
        if self.engine not in ("hf", "vllm") and ":" not in self.engine:
            raise ConfigError(f"rollout_engine must be hf or vllm (or a registered 'module:name'), got {self.engine!r}")
        if self.tp < 0:
            raise ConfigError(f"rollout_tp must be >= 0 (0: no 3D-HybridEngine), got {self.tp}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0 (0: the task's default), got {self.max_new_tokens}")
        if self.dtype not in ("", "bfloat16", "float16", "float32"):
            raise ConfigError(f"rollout_dtype must be bfloat16, float16 or float32 (or empty), got {self.dtype!r}")


@dataclass
class CheckpointConfig:
    """Checkpoints and recovery from a lost worker, the `checkpoint.` section (short forms: `checkpoint_dir=`,
    `save_every=`, `resume=`, `keep_last=`, `max_recoveries=`, `recovery_wait_s=`)."""

    ranges: ClassVar[dict[str, str]] = {"recovery_wait_s": "[0, inf)"}
    dir: str | None = None
    """Checkpoint root; none disables checkpoints (and so recovery)."""
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

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 1 or self.max_recoveries < 0:
            raise ConfigError("save_every must be >= 0, keep_last >= 1 and max_recoveries >= 0")
        if self.resume not in ("auto", "never") and not self.dir:
            # a checkpoint lives in its store's root: the run goes on saving (and locking) there
            self.dir = str(Path(self.resume).resolve().parent)
        if self.save_every and not self.dir:
            raise ConfigError("save_every needs a checkpoint_dir (--checkpoint-dir D)")


@dataclass
class JudgeConfig:
    """A judge model as the reward (engines.judge), the `judge.` section: a causal LM asked, through `template`,
    whether each response is good; the reward is P(yes) / (P(yes) + P(no)) of its next token, in [0, 1]."""

    path: str | None = None
    """A Hugging Face causal LM folder; set, it replaces the task's rule reward (and reward_model)."""
    template: str = "Question: {prompt} Answer: {response} Is the answer correct? Answer Yes or No:"
    """The judge's prompt: `{prompt}` and `{response}` are replaced by each sample's decoded texts."""
    yes: str = " Yes"
    """The verdict that means good: one token of the judge's vocabulary."""
    no: str = " No"
    """The verdict that means bad: one token of the judge's vocabulary."""

    def __post_init__(self) -> None:
        if self.path is not None and "{response}" not in self.template:
            raise ConfigError(
                f"judge.template must contain {{response}} (and usually {{prompt}}), got {self.template!r}"
            )


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (algorithms/distill.py), the `teacher.` section: a frozen causal LM that
    scores every token the student samples. It must share the student's tokenizer (its log-probs are of the same
    token ids); any size or architecture the training engine loads."""

    path: str | None = None
    """A Hugging Face causal LM folder."""


@dataclass
class RLConfig(RunConfig):
    """What every algorithm program shares: the run, its data and batch sizes, and the sections of the model, the
    actor's training, the rollout, the policy loss, the KL, stage fusion, asynchronous RL and checkpoints."""

    ranges: ClassVar[dict[str, str]] = {**RunConfig.ranges, "sft_lr": "(0, inf)", "actor.lr": "(0, inf)"}
    short_forms: ClassVar[dict[str, str | tuple[str, ...]]] = {
        # the actor's (and the critics') training
        "actor_lr": "actor.lr",
        "critic_lr": "critic.lr",
        "critic_trainable_layers": "critic.trainable_layers",
        **{name: (f"actor.{name}", f"critic.{name}") for name in _SHARED_OPTIM},
        "pack_sequences": "model.pack_sequences",
        # the rollout
        "rollout_engine": "rollout.engine",
        "rollout_tp": "rollout.tp",
        **{name: f"rollout.{name}" for name in ("temperature", "max_new_tokens", "ignore_eos")},
        **{
            name: f"rollout.agent.{name}" for name in ("max_turns", "max_turn_tokens", "tool_workers", "tool_timeout_s")
        },
        "tool_overlap": "rollout.agent.overlap",
        # the loss
        **{name: f"policy_loss.{name}" for name in ("clip_ratio", "clip_ratio_high", "dual_clip", "entropy_coef")},
        "kl_coef": "kl.coef",
        "kl_estimator": "kl.estimator",
        "rollout_correction": "mismatch.correction",
        **{f"rollout_correction_{name}": f"mismatch.{name}" for name in ("level", "cap", "band")},
        "mismatch_warn_kl": "mismatch.warn_kl",
        "rollout_dtype": "rollout.dtype",
        # the features
        **{
            f"async_{name}": f"async_rl.{name}"
            for name in ("staleness", "correction", "tis_cap", "rollout_slots", "sync", "sync_bucket_mb", "replicas")
        },
        "partial_rollout": "async_rl.partial_rollout",
        "partial_segment": "async_rl.partial_segment",
        "partial_surplus": "async_rl.partial_surplus",
        "async_deterministic": "async_rl.deterministic",
        "token_staleness": "async_rl.token_staleness",
        "fuse": "fusion.enabled",
        **{
            f"fuse_{name}": f"fusion.{name}"
            for name in ("chunk_samples", "migrate", "migrate_below", "migrate_to", "train")
        },
        # checkpoints
        "checkpoint_dir": "checkpoint.dir",
        **{
            name: f"checkpoint.{name}"
            for name in ("save_every", "resume", "keep_last", "max_recoveries", "recovery_wait_s")
        },
    }

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
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A judge model as the reward: judge.path=DIR judge.template=... judge.yes=' Yes' judge.no=' No'."""
    tensorboard_dir: str | None = None
    """Also write the step metrics as TensorBoard scalars here (needs the tensorboard package)."""
    export_dir: str | None = None
    """Write the trained policy here as a Hugging Face folder (weights and tokenizer) when the run ends, for
    evaluation or serving (vLLM, transformers); None: the checkpoints are the only copy."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and recovery: checkpoint_dir=D save_every=K ... (or checkpoint.dir=D ...)."""
    # -- cluster and placement ------------------------------------------------------------------------------------
    placement: str = "colocated"
    """colocated (every model on every slot, time-shared), split (actor+ref | critics+reward+cost), or fused (actor
    and reference on every slot, critics, reward and cost on every slot but the first `fuse_migrate_to` (1 where
    the algorithm has none): with fuse_migrate those first slots finish the long tail while the others score)."""
    plan: str | None = None
    """A placement plan (JSON/YAML from `python -m placement.automap --json`); overrides `placement`."""
    # -- batch sizes ----------------------------------------------------------------------------------------------
    prompts_per_step: int = 32
    """Prompts drawn from the dataset each RL step (global, across data-parallel ranks)."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (GRPO's group size); a step trains on prompts_per_step x this samples."""
    mini_batch_samples: int = 32
    """Samples per optimizer step (global, across data-parallel ranks)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    # -- the sections ---------------------------------------------------------------------------------------------
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (and the models started from it): model.path=DIR loads a Hugging Face folder, else sizes."""
    actor: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    """The actor's training (engines.training.common.OptimConfig: AdamW, micro-batches, ZeRO stage, LoRA); the
    frozen roles (reference, reward, cost) hold themselves as `actor.zero_stage` says."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How the actor samples: engine, generation TP, temperature, lengths, tool episodes."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The actor's clipped surrogate."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL to the reference policy."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """The rollout engine against the trainer: measured every step, corrected with rollout_correction=tis|mis."""
    fusion: FusionConfig = field(default_factory=FusionConfig)
    """Stage fusion: fuse=true fuse_chunk_samples=8 fuse_migrate=true ... (or fusion.enabled=true ...)."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous RL: async_staleness=1 ... (or async_rl.staleness=1 ...)."""
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
            "dataset_prompts",
            "sft_samples_per_step",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
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

    @property
    def trained(self) -> dict[str, OptimConfig]:
        """The training sections of the roles this program trains (the actor's; the critic's where it has one)."""
        return {"actor": self.actor}

    def loss_terms(self) -> dict:
        """The policy loss's terms from the run's sections: asynchronous RL's off-policy correction and the
        rollout-trainer mismatch's (algorithms.objectives.losses.PolicyLoss)."""
        return {**self.async_rl.loss_terms(), **self.mismatch.loss_terms()}


@dataclass
class PPOConfig(RLConfig):
    ranges: ClassVar[dict[str, str]] = {
        **RLConfig.ranges,
        "critic.lr": "(0, inf)",
        "critic.trainable_layers": "[0, inf)",
        "gamma": "[0, 1]",
        "lam": "[0, 1]",
        "kl_target": "(0, inf)",
        "value_clip": "(0, inf)",
    }
    task: str = "digit_sum"
    sft_steps: int = 60
    gamma: float = 1.0
    """Discount of GAE (1: undiscounted, the RLHF norm)."""
    lam: float = 0.95
    """GAE's lambda: 1 is Monte-Carlo returns, 0 one-step TD."""
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.02))
    policy_loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(dual_clip=3.0))
    critic: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """The critics' training (Safe-RLHF's cost critic too): `critic.trainable_layers=K` trains only their top K
    decoder layers, the final norm and the value head (torch engine): a critic started from a pretrained policy
    keeps its lower layers, and its backward pass stops there, which on a small device is most of a critic
    update's time."""
    adaptive_kl: bool = False
    """Adapt kl.coef so the measured KL tracks kl_target (Ziegler et al.'s controller)."""
    kl_target: float = 0.1
    """KL per token the adaptive controller aims for."""
    kl_horizon: int = 500
    """Samples over which the adaptive controller corrects a KL error."""
    value_clip: float = 0.2
    """Clip range of the critic's value change per update."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit variance over the step's tokens."""
    whiten_rewards: bool = False
    """Divide each step's model scores (rewards, and Safe-RLHF's costs) by their standard deviation over the step's
    samples, without shifting them (TRL's whiten_rewards): a learned reward model's scale is arbitrary (one trained
    briefly scores within ±0.1), and the KL penalty and λ should act on unit-scale scores. Metrics stay raw."""

    @property
    def trained(self) -> dict[str, OptimConfig]:
        return {"actor": self.actor, "critic": self.critic}


@dataclass
class SafeRLHFConfig(PPOConfig):
    ranges: ClassVar[dict[str, str]] = {
        **PPOConfig.ranges,
        "lambda_lr": "[0, inf)",
        "lambda_init": "[0, inf)",
        "lambda_max": "[0, inf)",
        "ptx_coef": "[0, inf)",
        "pid_kp": "[0, inf)",
        "pid_ki": "[0, inf)",
        "pid_kd": "[0, inf)",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lambda_update not in ("dual", "pid"):
            raise ConfigError(f"lambda_update must be dual or pid, got {self.lambda_update!r}")
        if self.pid_window < 1:
            raise ConfigError(f"pid_window must be >= 1, got {self.pid_window}")
        if self.lambda_unit not in ("cost", "spread"):
            raise ConfigError(f"lambda_unit must be cost or spread, got {self.lambda_unit!r}")
        try:
            self.cost_thresholds = [float(t) for t in self.cost_thresholds]
        except ValueError:
            raise ConfigError(f"cost_thresholds must be numbers, comma-separated, got {self.cost_thresholds}") from None
        if any(not t >= 0 for t in self.cost_thresholds):
            raise ConfigError(f"cost_thresholds must be >= 0 each, got {self.cost_thresholds}")

    @property
    def thresholds(self) -> list[float]:
        """One threshold per constraint."""
        return list(self.cost_thresholds) or [self.cost_threshold]

    task: str = "digit_sum"
    steps: int = 80
    sft_steps: int = 60
    prompts_per_step: int = 64
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.05))
    cost_threshold: float = 0.3
    """Constraint: expected cost per sample ≤ this."""
    cost_thresholds: list[float] = field(default_factory=list)
    """Several constraints (a task whose cost gives one value per constraint): each one's threshold, in the task's
    order (comma-separated); each gets its own λ (lambda_* settings shared) and a head of the shared cost critic.
    Empty: one constraint, `cost_threshold`."""
    lambda_init: float = 0.5
    """Starting Lagrange multiplier λ."""
    lambda_lr: float = 0.1
    """Dual-ascent step of log λ per unit of constraint violation."""
    lambda_max: float = 5.0
    """Upper bound of λ."""
    lambda_update: str = "dual"
    """How λ follows the constraint: `dual` (dual ascent on log λ, lambda_lr) or `pid` (the PID Lagrangian of Stooke
    et al. 2020: pid_kp, pid_ki, pid_kd on the violation of the cost smoothed over pid_window steps)."""
    pid_kp: float = 1.0
    """PID: λ per unit of violation now (reacts before the integral builds up)."""
    pid_ki: float = 0.1
    """PID: the integral's step per unit of violation (dual ascent's role, on λ itself)."""
    pid_kd: float = 0.0
    """PID: λ per unit of rise of the smoothed cost (damps an increasing cost early)."""
    pid_window: int = 1
    """PID: steps the cost is averaged over before the controller sees it."""
    lambda_unit: str = "cost"
    """The unit λ's update reads the violation in, so the unit of lambda_lr and the pid_* gains: `cost` (the cost's
    own) or `spread` (the cost's sampling spread, each step's std of the samples' costs averaged over the steps so
    far: the same gains for a cost model of any scale; with whiten_rewards the advantages are scale-free too)."""
    ptx_coef: float = 0.0
    """Weight of the pretraining (SFT demonstration) loss mixed into actor updates; 0 disables it."""


@dataclass
class GRPOConfig(RLConfig):
    task: str = "reverse"
    sft_steps: int = 60
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    mini_batch_samples: int = 32
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.04, estimator="k3"))


@dataclass
class ReMaxConfig(RLConfig):
    task: str = "digit_sum"
    sft_steps: int = 60
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.02))


@dataclass
class GSPOConfig(GRPOConfig):
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.0, estimator="k3"))  # GSPO's paper uses none
    policy_loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(3e-4, clip_ratio_high=4e-4))


@dataclass
class DAPOConfig(GRPOConfig):
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.0, estimator="k3"))  # DAPO uses none
    policy_loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(0.2, clip_ratio_high=0.28))
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
        if self.overlong_buffer and not 0 < self.overlong_buffer < self.rollout.max_new_tokens:
            raise ConfigError(
                f"overlong_buffer={self.overlong_buffer} needs max_new_tokens > it (the response "
                f"length it is measured against), got max_new_tokens={self.rollout.max_new_tokens}"
            )


@dataclass
class RLOOConfig(RLConfig):
    task: str = "reverse"
    sft_steps: int = 60
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    mini_batch_samples: int = 32
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.02))

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
    kl: KLConfig = field(default_factory=lambda: KLConfig(coef=0.01))


@dataclass
class DistillConfig(RLConfig):
    ranges: ClassVar[dict[str, str]] = {**RLConfig.ranges, "reward_coef": "[0, inf)"}
    task: str = "digit_sum"
    steps: int = 60
    sft_steps: int = 100
    prompts_per_step: int = 32
    samples_per_prompt: int = 2
    mini_batch_samples: int = 32
    actor: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher: teacher.path=DIR (required)."""
    estimator: str = "topk"
    """How the teacher's signal reaches the student: `topk` (the reverse KL over the teacher's `top_k` tokens plus
    a bucket for the rest, at every position the student's samples reach: GKD's loss, no sampling variance) or
    `sampled` (each sampled token's advantage log pi_teacher - log pi_student: Thinking Machines' estimator, one
    log-prob per token from the teacher, the cheapest at a large vocabulary)."""
    top_k: int = 16
    """`topk`: teacher tokens per position (k log-probs and ids travel per response token)."""
    reward_coef: float = 0.0
    """Weight of the task reward's GRPO advantage in the student's policy loss, beside the teacher's signal (0:
    the teacher is the only signal)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.estimator not in ("topk", "sampled"):
            raise ConfigError(f"distill estimator must be topk or sampled, got {self.estimator!r}")
        if self.estimator == "topk" and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1 with estimator=topk, got {self.top_k}")


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
