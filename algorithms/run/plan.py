"""The run's plan: what a configuration resolves to before the cluster starts, and where each role runs.

- `check_settings`: the rules that span sections (each section checks its own fields), e.g. LoRA and the
  3D-HybridEngine, asynchronous RL and the placement, a tool setting on a single-response task.
- `check_before_start`: everything a configuration can get wrong that is knowable without a cluster (plan file and
  its sizes, pipeline stages on an engine without them, batch sizes over each role's data-parallel size, model
  folder, output paths), so a mistake fails in a second, not after workers have started. It returns the run's
  `RunPlan` (`resolve`): the placement plan parsed once, the actor's generation sizes and engine, the fused critics.
- `place`: colocated (every model on every slot, time-shared), split (actor + reference on one half of the slots,
  critics + reward + cost on the other, running concurrently; with asynchronous RL the rollout replicas on the
  last slots and every other model on the rest), fused (the first slots finish migrated tails), or a placement
  plan with (p, t, d) per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flowactors as fa
from algorithms.data.tasks import get_task
from algorithms.rollout.fusion import migration_threshold
from algorithms.run.config import (
    ConfigError,
    DistillConfig,
    RLConfig,
    check_trainable_layers,
    check_training_engine,
    derived_sizes,
)
from engines.models.config import head_dim
from engines.registry import check_generation_model, generation_engine, training_engine
from flowactors import Controller, Layout

__all__ = ["Pools", "RunPlan", "resolve", "check_settings", "check_before_start", "place", "reverse_stages"]

_SCORERS = ("critic", "cost_critic", "reward", "cost", "teacher")


@dataclass
class Pools:
    """Where each role runs: its slots and its layout (pp, dp, tp)."""

    roles: dict[str, tuple[list[str], Layout]]

    def __getitem__(self, role: str) -> tuple[list[str], Layout]:
        return self.roles[role]


# -- checks before the cluster starts -----------------------------------------------------------------------------


def check_settings(cfg: RLConfig) -> None:
    """The rules between sections, on the controller before anything starts (ConfigError naming the settings)."""
    check_training_engine(cfg.model)
    task = get_task(cfg.task)
    if cfg.rollout.agent.max_turns is not None and task.environment is None:
        raise ConfigError(
            f"max_turns={cfg.rollout.agent.max_turns} applies to multi-turn tasks (tool_arith, tool_arith_safe, "
            f"tool_arith_chatml); task {task.name!r} samples one response per prompt"
        )
    if cfg.model.pack_sequences and cfg.model.engine != "torch":
        raise ConfigError(
            f"pack_sequences=true runs on the torch engine; the {cfg.model.engine} engine does "
            f"not pack rows yet: set model.engine=torch or pack_sequences=false"
        )
    for role, optim in cfg.trained.items():
        setting = "critic_trainable_layers" if role == "critic" else f"{role}.trainable_layers"
        check_trainable_layers(setting, optim.trainable_layers, cfg.model)
        if optim.lora_rank:
            _check_lora(cfg, role, optim.lora_rank)
    _check_fusion(cfg)
    if cfg.async_rl.staleness:
        _check_async(cfg)


def _check_lora(cfg: RLConfig, role: str, rank: int) -> None:
    from engines.models.config import linear_layer_names
    from engines.training.lora import check_targets

    setting = "lora_rank" if role == "actor" else f"{role}.lora_rank"
    try:
        check_targets(
            linear_layer_names(cfg.model), cfg.trained[role].lora, f"model {cfg.model.path or cfg.model.arch}"
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.model.engine != "torch":
        raise ConfigError(
            f"{setting}={rank} runs on the torch engine; the {cfg.model.engine} engine trains every "
            f"parameter: set model.engine=torch or lora_rank=0"
        )
    if role == "actor" and cfg.rollout.tp:
        raise ConfigError(
            f"lora_rank={rank} with the 3D-HybridEngine (rollout_tp={cfg.rollout.tp}) is not built "
            f"(tensor parallelism would split the adapters with their layers); set rollout_tp=0 or "
            f"lora_rank=0"
        )


def _check_fusion(cfg: RLConfig) -> None:
    receivers = cfg.fusion.migrate_to
    if cfg.placement == "fused" and cfg.address is None and cfg.n_slots <= receivers:
        raise ConfigError(
            f"placement=fused keeps the scorers off the first fuse_migrate_to={receivers} slots, "
            f"so it needs n_slots > {receivers}"
        )
    if cfg.fusion.train and "critic" not in cfg.trained:
        raise ConfigError(
            f"fuse_train fuses the actor's and the critic's training; {type(cfg).__name__} trains no critic"
        )


def _check_async(cfg: RLConfig) -> None:
    k = cfg.async_rl.staleness
    if cfg.async_rl.fleet_bounds() is not None:
        _check_fleet(cfg)
        return
    if cfg.placement != "split" and not cfg.plan:
        raise ConfigError(
            f"async_staleness={k} runs the rollouts on slots of their own while the others train; "
            f"add --placement split (placement={cfg.placement} shares every slot), or set "
            f"async_staleness=0"
        )
    if cfg.fusion.enabled:
        raise ConfigError(
            f"async_staleness={k} with fuse=true is not built yet (a rollout that runs ahead is "
            f"scored whole); drop one of them"
        )
    if cfg.plan:  # the replicas' sizes are the plan's (_check_async_plan, once it is read)
        return
    if cfg.rollout.tp == 1 and cfg.async_rl.partial_rollout and not cfg.async_rl.deterministic:
        raise ConfigError(
            "rollout_tp=1 makes each replica a 3D-HybridEngine of one rank, which streaming partial rollouts do not "
            "run (they decode whole copies); set rollout_tp=0, or add async_deterministic=true"
        )
    _check_replicas(cfg, cfg.rollout.tp or 1)
    if cfg.address is None and cfg.cluster == "local":
        rollout = cfg.async_rl.rollout_slots or cfg.n_slots // 2
        if cfg.n_slots < 2 or rollout >= cfg.n_slots:
            raise ConfigError(
                f"async_staleness={k} needs slots for the rollout replicas and slots for training: "
                f"n_slots={cfg.n_slots} with async_rollout_slots={rollout}; use n_slots >= 2 and "
                f"async_rollout_slots < n_slots"
            )
        tp = cfg.rollout.tp or 1
        if rollout % tp:
            raise ConfigError(
                f"async_rollout_slots={rollout} cannot hold rollout replicas of rollout_tp={tp} ranks each; "
                f"use a multiple of {tp} slots"
            )
        if cfg.async_rl.partial_rollout:
            cfg.async_rl.check_replica_ranks(cfg.prompts_per_step, rollout // tp)


def _check_fleet(cfg: RLConfig) -> None:
    """An elastic rollout fleet: one-rank whole-copy replicas on pool workers; the trainer keeps every slot."""
    what = f"async_rl.replicas={cfg.async_rl.replicas}"
    if cfg.plan:
        raise ConfigError(f"{what} puts the replicas on pool workers, not in a placement plan; drop --plan or it")
    if cfg.rollout.tp:
        raise ConfigError(f"{what}: fleet replicas are whole copies of one rank each; set rollout_tp=0")
    if cfg.fusion.enabled:
        raise ConfigError(f"{what} with fuse=true is not built yet; drop one of them")


def _check_replicas(cfg: RLConfig, tp: int) -> None:
    """What replicas of `tp` ranks each (a generation TP group) need of the settings."""
    if tp > 1:
        if cfg.async_rl.partial_rollout and not cfg.async_rl.deterministic:
            raise ConfigError(
                f"rollout_tp={tp}: a replica's {tp} TP ranks decode in lockstep, which streaming partial rollouts "
                f"(each replica decoding on its own) do not keep; add async_deterministic=true, or set rollout_tp=0"
            )
        if cfg.async_rl.sync != "sharded":
            raise ConfigError(
                f"rollout_tp={tp} gives each rollout replica {tp} ranks, which take their shards by the "
                f"sharded sync; set async_rl.sync=sharded (not {cfg.async_rl.sync})"
            )
        if cfg.model.pad_vocab_to % tp:
            raise ConfigError(
                f"rollout_tp={tp} splits each replica's vocabulary over {tp} ranks: set model.pad_vocab_to={tp} "
                f"(or a multiple; the trainer's model then has the same padded vocabulary)"
            )


def _check_async_plan(cfg: RLConfig, plan) -> None:
    """A placement plan and asynchronous RL: the plan has the replicas' pool (a "rollout" model, alone in its set)
    exactly when the run is asynchronous, and its sizes suit the settings."""
    k = cfg.async_rl.staleness
    if "rollout" not in plan.roles:
        if k:
            raise ConfigError(
                f"async_staleness={k} with a placement plan needs the rollout replicas in it: add a set "
                f'["rollout"] with "gpus" and "parallel": {{"rollout": {{"train": [1, t, d]}}}} (d replicas of t '
                f"ranks), or use --placement split"
            )
        return
    if not k:
        raise ConfigError(
            "the placement plan has a rollout pool, for asynchronous RL's replicas; set async_staleness >= 1, or "
            "drop the rollout set from the plan"
        )
    if plan.pool_of("rollout") != "rollout":
        raise ConfigError(
            f"the rollout replicas generate while the others train, so they need a pool of their own; the plan "
            f"puts them with {plan.pool_of('rollout').replace('+', ', ')}: give rollout a set alone"
        )
    if plan.model("actor").generate is not None or plan.model("actor").rollout_engine is not None:
        raise ConfigError(
            f"under async_staleness={k} the actor trains and the replicas generate: move the actor's 'generate' "
            f"and 'rollout_engine' to the plan's rollout model"
        )
    _, tp, d = plan.model("rollout").train
    _check_replicas(cfg, tp)
    if cfg.async_rl.partial_rollout:
        cfg.async_rl.check_replica_ranks(cfg.prompts_per_step, d)


def check_before_start(cfg: RLConfig) -> RunPlan:
    """The run's plan (`resolve`); ConfigError (or the plan's PlanError) for what is wrong in `cfg` before any
    worker starts."""
    check_settings(cfg)
    run_plan = resolve(cfg)
    if run_plan.plan is not None:
        _check_async_plan(cfg, run_plan.plan)
    for role, dp in run_plan.planned_dp.items():
        try:
            derived_sizes(cfg, dp)
        except ConfigError as e:
            raise ConfigError(f"{role}: {e}") from None
    if cfg.model.path is not None:
        from engines import check_model_dir

        try:
            check_model_dir(cfg.model.path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.path: {e}") from None
    if cfg.address is None and cfg.cluster == "local":  # the embedded cluster's devices are this machine's
        import torch

        try:  # before the install check: the fix for the model is worth knowing before installing vLLM
            check_generation_model(run_plan.rollout_engine, head_dim(cfg.model), cuda=torch.cuda.is_available())
        except ValueError as e:
            raise ConfigError(
                f"rollout_engine: {e}"
                + (
                    " (the tiny default with model.hidden_size=128 model.intermediate_size=256)"
                    if cfg.model.path is None
                    else ""
                )
            ) from None
    try:
        generation_engine(run_plan.rollout_engine)  # known, and installed (vllm)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"rollout_engine: {e}") from None
    for name, path in (("reward_model", cfg.reward_model), ("cost_model", cfg.cost_model)):
        if path:
            _check_score_model(path, name)
    if cfg.judge.path:
        if cfg.reward_model:
            raise ConfigError(
                f"judge.path={cfg.judge.path} and reward_model={cfg.reward_model} both name the reward; keep one"
            )
        from engines import check_model_dir

        try:
            archs = check_model_dir(cfg.judge.path).get("architectures") or []
        except (ValueError, OSError) as e:
            raise ConfigError(f"judge.path: {e}") from None
        if not any(a.endswith("ForCausalLM") for a in archs):
            raise ConfigError(
                f"judge.path={cfg.judge.path} holds {archs or 'a model without architectures'}, not a causal LM; "
                f"a judge answers in tokens (a score-head model goes to reward_model=)"
            )
    if isinstance(cfg, DistillConfig):
        _check_teacher(cfg)
    if cfg.fusion.migrate:
        _check_migration(cfg, run_plan)
    if cfg.fusion.train:
        _check_fused_training(cfg, run_plan)
    for name, value in (
        ("metrics_file", cfg.metrics_file),
        ("tensorboard_dir", cfg.tensorboard_dir),
        ("export_dir", cfg.export_dir),
    ):
        if value and not Path(value).resolve().parent.is_dir():
            raise ConfigError(
                f"{name}={value}: the directory {Path(value).resolve().parent} does not exist; "
                f"create it or choose another path"
            )
    if (
        cfg.checkpoint.resume not in ("auto", "never")
        and not Path(cfg.checkpoint.resume).is_dir()
        and not (cfg.checkpoint.dir and (Path(cfg.checkpoint.dir) / cfg.checkpoint.resume).is_dir())
    ):
        raise ConfigError(
            f"resume={cfg.checkpoint.resume} is not a checkpoint directory; give one (e.g. "
            f"{cfg.checkpoint.dir or 'CKPT_DIR'}/step_00000010), auto (the newest complete one in "
            f"checkpoint_dir) or never"
        )
    if cfg.export_dir and Path(cfg.export_dir).exists() and not Path(cfg.export_dir).is_dir():
        raise ConfigError(f"export_dir={cfg.export_dir} is a file; the policy is written as a folder there")
    if cfg.checkpoint.dir:
        try:
            Path(cfg.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"checkpoint_dir={cfg.checkpoint.dir} cannot be a directory: {e.strerror or e}") from None
    return run_plan


def _check_teacher(cfg: DistillConfig) -> None:
    """The teacher is a causal LM whose token ids mean what the student's do (its log-probs score the student's
    tokens one by one; distillation across tokenizers is not built)."""
    from engines import ModelConfig, build_tokenizer, check_model_dir
    from engines.models.config import same_vocabulary

    path = cfg.teacher.path
    if not path:
        raise ConfigError(
            "distillation needs a teacher: teacher.path=DIR, a Hugging Face causal LM folder with the student's "
            "tokenizer (e.g. the export_dir of a longer run)"
        )
    try:
        archs = check_model_dir(path).get("architectures") or []
    except (ValueError, OSError) as e:
        raise ConfigError(f"teacher.path: {e}") from None
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"teacher.path={path} holds {archs or 'a model without architectures'}, not a causal LM")
    if cfg.estimator == "topk" and cfg.model.engine != "torch":
        raise ConfigError(
            f"estimator=topk gathers the student's log-probs at the teacher's top-k tokens, which the "
            f"{cfg.model.engine!r} engine's vocabulary-parallel head does not; use model.engine=torch or "
            f"estimator=sampled"
        )
    if not same_vocabulary(build_tokenizer(ModelConfig(path=path)), build_tokenizer(cfg.model)):
        raise ConfigError(
            f"teacher.path={path} has another tokenizer than the student (model.path="
            f"{cfg.model.path or 'the tiny default'}); on-policy distillation scores the student's token ids with the teacher, so both need the "
            f"same vocabulary"
        )


def _check_score_model(path: str, setting: str) -> None:
    """A reward/cost model folder must hold a sequence-classification head with one output: a causal LM there
    would be scored through a freshly initialised head, i.e. noise."""
    from engines import check_model_dir

    try:
        hf = check_model_dir(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{setting}: {e}") from None
    archs = hf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"{setting}={path} holds {archs or 'a model without architectures'}, not a model with a "
            f"score head (…ForSequenceClassification); train one (e.g. Bradley-Terry on preference "
            f"pairs) or give such a folder"
        )
    if hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
        raise ConfigError(
            f"{setting}={path} has {hf.get('num_labels', len(hf.get('id2label', {})))} score "
            f"outputs; a reward or cost model has one"
        )


def _load_plan(cfg: RLConfig):
    from placement import Plan

    if not Path(cfg.plan).is_file():
        raise ConfigError(
            f"plan file {cfg.plan} does not exist; write one with python -m placement.automap "
            f"--algorithm ALGO --size 7b --gpus N --json > plan.json"
        )
    plan = Plan.load(cfg.plan)
    if cfg.model.engine == "torch":
        piped = [f"{m.role} (p={m.train[0]})" for m in plan.models if m.train[0] > 1]
        if piped:
            raise ConfigError(
                f"the plan gives pipeline stages to {', '.join(piped)}, but the torch engine has no "
                f"pipeline parallelism; give those models train [1, t, d] in the plan"
                f" (same p·t·d), or train on model.engine=megatron"
            )
    return plan


def _check_migration(cfg: RLConfig, run_plan: RunPlan) -> None:
    """fuse_migrate on a layout or engine it cannot run on, refused before the cluster starts (the same rules as
    algorithms.rollout.fusion.migration_threshold, which the step applies to the actor's actual layout)."""
    if run_plan.rollout_tp is not None:
        raise ConfigError(
            "fuse_migrate moves decoding rows between actor ranks that each generate with whole "
            "weights; drop rollout_tp (or the plan's generation sizes), or fuse_migrate"
        )
    if run_plan.plan is not None:
        p, t, d = run_plan.plan.model("actor").train
        layout = Layout(pp=p, dp=d, tp=t)
    elif (dp := run_plan.planned_dp.get("actor")) is not None:
        layout = Layout(dp=dp)
    else:
        return  # the cluster's slots decide; the first step checks
    try:
        migration_threshold(
            layout,
            cfg.prompts_per_step * cfg.samples_per_prompt // layout.dp,
            cfg.fusion.migrate_below,
            cfg.fusion.migrate_to,
        )
    except ValueError as e:
        raise ConfigError(f"fuse_migrate: {e}; --placement fused puts the actor on every slot") from None


def _check_fused_training(cfg: RLConfig, run_plan: RunPlan) -> None:
    """fuse_train where the actor and critic cannot share one pipeline, refused before the cluster starts."""
    if not cfg.plan:
        raise ConfigError(
            "fuse_train fuses the actor's and the critic's pipeline-parallel training; give a --plan "
            "with both in one pool and the same train sizes [p, t, d], p >= 2 (on model.engine="
            "megatron), or drop fuse_train"
        )
    plan = run_plan.plan
    if "critic" not in {m.role for m in plan.models}:
        raise ConfigError("fuse_train fuses the actor with the critic; the plan has no critic")
    actor, critic = plan.model("actor"), plan.model("critic")
    if not _in_actor_pipeline(plan, "critic") or actor.train[0] < 2:
        raise ConfigError(
            f"fuse_train needs the actor and the critic in one pool with the same train sizes and "
            f"p >= 2; the plan has actor {actor.train} in {plan.pool_of('actor')}, critic "
            f"{critic.train} in {plan.pool_of('critic')}"
        )
    if not training_engine(cfg.model.engine).fused_pipelines:
        raise ConfigError(
            f"fuse_train needs an engine whose pipelines can share a schedule; "
            f"model.engine={cfg.model.engine} has none (use model.engine=megatron)"
        )


def _in_actor_pipeline(plan, role: str) -> bool:
    """`role` can share the actor's fused pipeline: the actor's pool and train sizes."""
    return plan.pool_of(role) == plan.pool_of("actor") and plan.model(role).train == plan.model("actor").train


def reverse_stages(addresses: list[str], layout: Layout) -> list[str]:
    """The same slots with the pipeline stages in the opposite order (group rank (p, d, t) on the slot of
    (pp - 1 - p, d, t)): a fused pipeline's second model (engines.training.megatron.pipeline_fusion)."""
    per_stage = layout.dp * layout.tp
    return [addresses[(layout.pp - 1 - r // per_stage) * per_stage + r % per_stage] for r in range(len(addresses))]


def _planned_dp(cfg: RLConfig, plan) -> dict[str, int]:
    """Each role's data-parallel size where it is known before connecting: a plan's, or the embedded cluster's."""
    if plan is not None:
        return {m.role: m.train[2] for m in plan.models}
    if cfg.address is not None or cfg.cluster != "local":
        return {}  # known once the cluster's slots are (place() checks then)
    if cfg.placement == "split" and cfg.async_rl.staleness and not cfg.async_rl.replicas:
        rollout = cfg.async_rl.rollout_slots or cfg.n_slots // 2
        return {"actor": cfg.n_slots - rollout, "rollout": rollout // (cfg.rollout.tp or 1)}
    if cfg.placement == "split":
        half = cfg.n_slots // 2
        return {"actor": half, "critic": cfg.n_slots - half}
    if cfg.placement == "fused":
        return {"actor": cfg.n_slots, "critic": cfg.n_slots - 1}
    return {"actor": cfg.n_slots}


@dataclass(frozen=True)
class RunPlan:
    """What a configuration resolves to before the cluster starts (`resolve`), read by everything after it: the
    placement plan (its file parsed once), the actor's generation sizes and engine, the data-parallel sizes known
    before connecting, and which critics train in the actor's fused pipeline."""

    plan: Any
    """The placement plan (placement.Plan) of `--plan`, or None: cfg.placement decides on the cluster's slots."""
    rollout_engine: str
    """The actor's generation engine: a plan's actor "rollout_engine" when it names one, else cfg.rollout.engine."""
    rollout_tp: int | None
    """The actor's generation TP size under the 3D-HybridEngine: a plan's actor "generate" sizes, else
    cfg.rollout.tp; None when off, and for a plan on an engine without the 3D-HybridEngine (one registered with
    resharding=False), whose actor generates from its gathered whole weights instead."""
    rollout_pp: int
    """The actor's generation pipeline stages p_g (a plan's, dividing its training p; the megatron engine), else 1."""
    planned_dp: dict[str, int]
    """Each role's data-parallel size where it is known before connecting: a plan's, or the embedded cluster's."""
    fused_critics: tuple[str, ...]
    """The critics fusion.train trains in the actor's pipeline: those the plan puts in the actor's pool with the
    actor's train sizes (the critic always, check_before_start makes sure; Safe-RLHF's cost critic where the plan
    puts it there too, else it trains on its own)."""


def resolve(cfg: RLConfig) -> RunPlan:
    """The run's plan from its configuration (ConfigError or PlanError for one that cannot be resolved)."""
    plan = _load_plan(cfg) if cfg.plan else None
    actor = plan.model("actor") if plan is not None else None
    if plan is not None and "rollout" in plan.roles:  # asynchronous RL: the replicas generate, with their sizes
        replicas = plan.model("rollout")
        engine = replicas.rollout_engine or cfg.rollout.engine
        tp = replicas.train[1]
        return RunPlan(plan, engine, tp if tp > 1 else None, 1, _planned_dp(cfg, plan), ())
    engine = actor.rollout_engine if actor is not None and actor.rollout_engine is not None else cfg.rollout.engine
    tp, pp = cfg.rollout.tp or None, 1
    if actor is not None and actor.generate is not None:
        p_g, t_g = actor.generate
        if p_g != 1 and engine != "hf":
            raise ConfigError(
                f"the plan generates the actor over p_g={p_g} pipeline stages, which the {engine!r} "
                f"rollout engine does not take inside the actor: plan generate [1, t_g] or "
                f"rollout_engine hf"
            )
        # without the 3D-HybridEngine the actor generates from its gathered whole weights
        tp, pp = (t_g, p_g) if training_engine(cfg.model.engine).resharding else (None, 1)
    fused = ()
    if cfg.fusion.train and plan is not None:
        planned = {m.role for m in plan.models}
        fused = tuple(r for r in ("critic", "cost_critic") if r in planned and _in_actor_pipeline(plan, r))
    return RunPlan(plan, engine, tp, pp, _planned_dp(cfg, plan), fused)


# -- placement ------------------------------------------------------------------------------------------------------


def _async_split(cfg: RLConfig, slots: list[str]) -> dict[str, tuple[list[str], Layout]]:
    """Asynchronous RL's split: the rollout replicas on the last `async_rl.rollout_slots` slots (0: half), the
    actor, reference, critics and scorers together on the others."""
    n = cfg.async_rl.rollout_slots or len(slots) // 2
    if not 0 < n < len(slots):
        raise fa.PlacementError(
            f"async_staleness={cfg.async_rl.staleness} puts the rollout replicas on "
            f"async_rollout_slots={n} of the cluster's {len(slots)} slots and training on the "
            f"others; give the cluster at least 2 slots and async_rollout_slots < {len(slots)}"
        )
    tp = cfg.rollout.tp or 1  # each replica's generation TP: replicas of tp ranks
    if n % tp:
        raise fa.PlacementError(
            f"async_rollout_slots={n} cannot hold rollout replicas of rollout_tp={tp} ranks each; use a "
            f"multiple of {tp}"
        )
    train, rollout = slots[: len(slots) - n], slots[len(slots) - n :]
    t = (train, Layout(dp=len(train)))
    return {"actor": t, "ref": t, **{r: t for r in _SCORERS}, "rollout": (rollout, Layout(dp=n // tp, tp=tp))}


def place(ctl: Controller, cfg: RLConfig, run_plan: RunPlan | None = None) -> Pools:
    """Colocated, split, or a placement plan (which also fixes each model's parallel sizes); each role's batch
    sizes are checked against its data-parallel size. `run_plan`: `resolve(cfg)`, resolved here if not given."""
    run_plan = run_plan or resolve(cfg)
    slots = ctl.slots[: cfg.n_slots] if cfg.address is None and cfg.cluster == "local" else ctl.slots
    if not slots:
        raise fa.PlacementError("the cluster has no device slots; start workers with --nthreads 1 --resources slot=1")
    if run_plan.plan is not None:
        from placement import pools_for_plan, validate

        plan = run_plan.plan
        validate(plan, len(slots))
        pools = pools_for_plan(plan, slots)
        out = {}
        for m in plan.models:
            p, t, d = m.train
            out[m.role] = (list(pools[plan.pool_of(m.role)].addresses)[: m.gpus], Layout(pp=p, dp=d, tp=t))
        scorer = next((out[r] for r in _SCORERS if r in out), out["actor"])
        for role in ("ref", *_SCORERS):
            out.setdefault(role, scorer if role != "ref" else out["actor"])
        if cfg.fusion.train:  # the critic's stages run the other way (only its)
            addresses, layout = out["critic"]
            out["critic"] = (reverse_stages(addresses, layout), layout)
        result = Pools(out)
    elif cfg.async_rl.staleness and not cfg.async_rl.replicas:  # the replicas on the last slots, the rest on the others
        result = Pools(_async_split(cfg, list(slots)))
    else:
        actor_side = scorer_side = list(slots)
        if cfg.placement == "split":
            half = len(slots) // 2
            actor_side, scorer_side = list(slots[:half]), list(slots[half:])
        elif cfg.placement == "fused":  # the first slots finish the migrated tails, the others score meanwhile
            receivers = cfg.fusion.migrate_to
            if len(slots) <= receivers:
                raise fa.PlacementError(
                    f"placement=fused puts the scorers on the slots after the first "
                    f"{receivers} (fuse_migrate_to), so it needs more than {receivers} slots; the "
                    f"cluster has {len(slots)}"
                )
            scorer_side = list(slots[receivers:])
        a, s = (actor_side, Layout(dp=len(actor_side))), (scorer_side, Layout(dp=len(scorer_side)))
        result = Pools({"actor": a, "ref": a, **{r: s for r in _SCORERS}})
    for role, (_, layout) in result.roles.items():
        try:
            derived_sizes(cfg, layout.dp)
        except ConfigError as e:
            raise ConfigError(f"{role}: {e}") from None
    return result
