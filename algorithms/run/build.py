"""The model roles of a program and how they start.

- `Roles`: the groups a program uses, typed (actor, reference, reward; critics and cost where the algorithm has
  them), so a program reads `roles.critic`, not `groups["critic"]`.
- `build_roles` and `run_warm_start`: the groups on the run's placement (algorithms.run.plan), after a supervised
  warm start of the actor whose Hugging Face export the reference and the critics start from (SFT → RLHF, as real
  pipelines do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import flowactors as fa
from algorithms.data.datasets import load_examples
from algorithms.data.prompts import PromptData
from algorithms.data.tasks import Task, get_task
from algorithms.objectives.losses import SFTLoss
from algorithms.run.config import ConfigError, RLConfig
from algorithms.run.plan import RunPlan, place
from engines import AgentConfig, ModelConfig, OptimConfig, SamplingConfig, UpdateSpec
from engines.fields import CRITIC_FIELDS
from flowactors import Controller

__all__ = ["Roles", "build_roles", "prompt_data", "run_warm_start"]


@dataclass
class Roles:
    """The model groups of one program; roles the algorithm does not use are None."""

    actor: fa.ActorGroup
    """Generates and trains (hybrid)."""
    ref: fa.ActorGroup
    """The frozen reference policy (KL)."""
    reward: fa.ActorGroup
    """Scores responses (a rule reward for the synthetic tasks)."""
    critic: fa.ActorGroup | None = None
    """Value model of the reward (PPO, Safe-RLHF)."""
    cost_critic: fa.ActorGroup | None = None
    """Value model of the cost (Safe-RLHF)."""
    cost: fa.ActorGroup | None = None
    """Scores each response's cost (Safe-RLHF)."""
    teacher: fa.ActorGroup | None = None
    """A frozen teacher that scores the actor's tokens (on-policy distillation), placed as a scorer."""
    rollout: fa.ActorGroup | None = None
    """The actor's rollout replicas, on slots of their own (asynchronous RL: algorithms.rollout.asynchronous); they hold a
    copy of a recent policy, so checkpoints leave them out."""
    replica_factory: Callable[[str, str], fa.ActorGroup] | None = None
    """An elastic fleet's replicas: `replica_factory(name, address)` builds one on a pool worker
    (algorithms.rollout.fleet); None otherwise."""
    fused_critics: tuple[str, ...] = ()
    """The critics that train in the actor's fused pipeline (fusion.train; RunPlan.fused_critics)."""

    def groups(self) -> dict[str, fa.ActorGroup]:
        """The present roles by name, in declaration order."""
        return {f.name: g for f in fields(self) if isinstance(g := getattr(self, f.name), fa.ActorGroup)}

    def close(self) -> None:
        for g in self.groups().values():
            g.close()


# -- building -------------------------------------------------------------------------------------------------------


def sampling(cfg: RLConfig, task: Task) -> SamplingConfig:
    r = cfg.rollout
    return SamplingConfig(
        max_new_tokens=r.max_new_tokens or task.max_new_tokens,
        temperature=r.temperature,
        ignore_eos=r.ignore_eos,
        dtype=r.dtype,
    )


def agent_config(cfg: RLConfig, task: Task) -> AgentConfig | None:
    """How the actor samples a multi-turn task's episodes: the run's settings with the task's environment (and its
    turn count, unless given); None for single-response tasks."""
    if task.environment is None:
        return None
    agent = cfg.rollout.agent
    return dataclasses.replace(agent, environment=task.environment, max_turns=agent.max_turns or task.max_turns)


def prompt_data(cfg: RLConfig) -> tuple[PromptData, PromptData | None]:
    """The run's training prompts (the task's, or train_files) and its eval prompts (eval_files, if any), built on
    the controller before any worker starts, so a bad dataset fails first."""
    from engines import build_tokenizer

    task, tokenizer = get_task(cfg.task), build_tokenizer(cfg.model)
    examples = load_examples(cfg.train_files, tokenizer, "train_files") if cfg.train_files else None
    data = PromptData(task, tokenizer, cfg.dataset_prompts, cfg.seed, examples=examples)
    if cfg.sft_steps and not data.has_demonstrations:
        raise ConfigError(
            f"sft_steps={cfg.sft_steps} needs demonstrations: a `response` column (or a final "
            f"assistant message) in every row of train_files; or set sft_steps=0"
        )
    evaluation = None
    if cfg.eval_files:
        evaluation = PromptData(
            task, tokenizer, 0, cfg.seed, examples=load_examples(cfg.eval_files, tokenizer, "eval_files")
        )
    return data, evaluation


def run_warm_start(actor: fa.ActorGroup, data: PromptData, cfg: RLConfig, export_dir: Path) -> ModelConfig:
    """SFT on the task's demonstrations, then export; returns the config that loads the SFT model."""
    if cfg.sft_steps:
        response_tokens = cfg.rollout.max_new_tokens or data.task.max_new_tokens
        batch = data.sft_batch(cfg.sft_steps * cfg.sft_samples_per_step, response_tokens, cfg.seed + 17)
        spec = UpdateSpec(cfg.sft_samples_per_step, epochs=1, shuffle_seed=cfg.seed, lr=cfg.sft_lr)
        actor.update_actor(batch, SFTLoss(), spec).result()
    path = actor.export_hf(str(export_dir / "sft")).result()
    return ModelConfig(
        path=path, dtype=cfg.model.dtype, engine=cfg.model.engine, pack_sequences=cfg.model.pack_sequences
    )


def build_roles(
    ctl: Controller,
    cfg: RLConfig,
    run_plan: RunPlan,
    data: PromptData,
    workdir: Path,
    *,
    critics: Sequence[str] = (),
    with_cost: bool = False,
    warm_start: bool = True,
    constraints: int = 1,
) -> Roles:
    """Actor, reference, the named critics and the rule reward (and cost) on the configured placement.

    With `warm_start`, the actor is fine-tuned on demonstrations first and the reference and critics start from
    its export; without (resuming), every model starts from `cfg.model` and is then loaded from a checkpoint."""
    from engines import ActorWorker, CriticWorker, RefWorker

    task = data.task
    if with_cost and task.cost is None and not cfg.cost_model:
        raise ConfigError(
            f"task {task.name!r} defines no cost; Safe-RLHF needs a cost: cost_model=DIR, or a task "
            f"with a rule cost (digit_sum)"
        )
    agent = agent_config(cfg, task)
    pools = place(ctl, cfg, run_plan)

    def group(role: str, cls: type, *args: object) -> fa.ActorGroup:
        slots, layout = pools[role]
        return fa.ActorGroup(ctl, cls, name=role, slots=slots, layout=layout, args=args)

    def build_actor(model: ModelConfig, optim: OptimConfig) -> fa.ActorGroup:
        return group(
            "actor",
            ActorWorker,
            model,
            optim,
            sampling(cfg, task),
            None if cfg.async_rl.staleness else run_plan.rollout_tp,  # (async: the replicas generate)
            run_plan.rollout_engine,
            run_plan.rollout_pp,
            agent,
        )

    if cfg.actor.lora_rank and warm_start and cfg.sft_steps:
        # LoRA adapts a fine-tuned model: the warm start trains every parameter, then RL trains adapters on its
        # export, which is also the reference (so a resumed run rebuilds the base from the reference's checkpoint)
        full = build_actor(cfg.model, dataclasses.replace(cfg.actor, lora_rank=0))
        try:
            sft = run_warm_start(full, data, cfg, workdir)
        finally:
            full.close()
        actor = build_actor(sft, cfg.actor)
    else:
        actor = build_actor(cfg.model, cfg.actor)
        sft = run_warm_start(actor, data, cfg, workdir) if warm_start else cfg.model
    ref = group("ref", RefWorker, sft, cfg.rollout.temperature, cfg.actor.zero_stage)
    built = {}
    for key in critics:  # the programs that name critics train them: cfg.trained has the critic's section
        # the cost critic has a head per constraint (one model: the constraints share what they learn of the text)
        heads = constraints if key == "cost_critic" else 1
        model = dataclasses.replace(sft, num_labels=heads) if heads > 1 else sft
        built[key] = group(key, CriticWorker, model, cfg.trained["critic"], CRITIC_FIELDS[key].values)
    if cfg.judge.path:  # a judge model as the reward (the task's rule still reports success)
        from engines import JudgeRewardWorker

        j = cfg.judge
        judge_model = ModelConfig(path=j.path, dtype=cfg.model.dtype)
        args = (judge_model, cfg.model, j.template, (j.yes, j.no), cfg.actor.zero_stage, task.success)
        reward = group("reward", JudgeRewardWorker, *args)
    else:
        reward = _scorer(group, "reward", cfg.reward_model, task.reward, cfg.model, cfg.actor.zero_stage, task.success)
    teacher = getattr(cfg, "teacher", None)
    if teacher is not None and teacher.path:  # on-policy distillation (algorithms/distill.py)
        from engines import TeacherWorker

        teacher_model = ModelConfig(path=teacher.path, dtype=cfg.model.dtype, engine=cfg.model.engine)
        top_k = cfg.top_k if cfg.estimator == "topk" else 0
        built["teacher"] = group(
            "teacher", TeacherWorker, teacher_model, cfg.rollout.temperature, cfg.actor.zero_stage, top_k
        )
    if with_cost:
        built["cost"] = _scorer(group, "cost", cfg.cost_model, task.cost, cfg.model, cfg.actor.zero_stage)
    replica_factory = None
    if cfg.async_rl.staleness:  # the replicas, on the torch engine, take the actor's policy
        # a whole copy per replica rank, or with rollout_tp a TP shard per rank of each replica (the
        # 3D-HybridEngine with equal training and generation TP: it generates from the shards it receives); with
        # the sharded sync LoRA's adapters on it too (syncs then move only them), else the merged weights rank 0
        # sends
        fleet = cfg.async_rl.fleet_bounds() is not None
        lora = cfg.actor.lora_rank if cfg.async_rl.sync == "sharded" and not fleet else 0
        optim = dataclasses.replace(cfg.actor, zero_stage=1, lora_rank=lora)
        model = dataclasses.replace(cfg.model, engine="torch")
        args = (model, optim, sampling(cfg, task), run_plan.rollout_tp, run_plan.rollout_engine, 1, agent)
        if fleet:  # one-rank replicas on pool workers, built as they arrive (algorithms.rollout.fleet)

            def replica_factory(name: str, address: str) -> fa.ActorGroup:
                return fa.ActorGroup(ctl, ActorWorker, name=name, slots=[address], args=args, own_world=True)

        else:
            built["rollout"] = group("rollout", ActorWorker, *args)
    return Roles(
        replica_factory=replica_factory,
        actor=actor,
        ref=ref,
        reward=reward,
        **built,
        fused_critics=tuple(c for c in run_plan.fused_critics if c in critics),
    )


def _scorer(
    group: Callable[..., fa.ActorGroup],
    role: str,
    model_dir: str | None,
    rule: Callable,
    policy: ModelConfig,
    zero_stage: int,
    success: Callable | None = None,
) -> fa.ActorGroup:
    """A learned model (a score-head folder) when one is given, else the task's rule."""
    from engines import RewardModelWorker, RuleRewardWorker

    if model_dir:
        scorer = ModelConfig(
            path=model_dir, dtype=policy.dtype, engine=policy.engine, pack_sequences=policy.pack_sequences
        )
        return group(role, RewardModelWorker, scorer, policy, None, zero_stage)
    return group(role, RuleRewardWorker, rule, policy, success)
