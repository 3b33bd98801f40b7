"""What every algorithm program shares, so each program is only its dataflow.

- `open_controller` and `place_roles`: the embedded or remote cluster, and the two placements (colocated: every
  model on every slot, time-shared; split: actor + reference on one pool, critics + reward + cost on the other,
  running concurrently).
- `PromptData`: the task's prompts with a data position (epoch, index) that checkpoints can save.
- `run_warm_start`: supervised fine-tuning through `update_actor` with an NLL loss, then the SFT model is exported as
  a Hugging Face folder from which the reference and the critics start (SFT → RLHF, as real pipelines do).
- `summarize`: the per-step metrics, run as a Dask task next to the data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import flowactors as fa
from algorithms.config import RLConfig, apply_overrides, derived_sizes
from algorithms.core import SFTLoss, masked_mean
from algorithms.tasks import Task, get_task
from engines import ModelConfig, OptimConfig, SamplingConfig, build_tokenizer
from engines.generation import assemble_samples
from flowactors import Batch, Controller, Layout

__all__ = ["parse_args", "open_controller", "Pools", "place", "PromptData", "run_warm_start", "summarize",
           "build_common"]


# -- command line -------------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None, preset: Callable[[], RLConfig], description: str) -> RLConfig:
    """`--steps N --address A --metrics-file F` plus `key=value` overrides onto the preset's dataclass."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. steps=10 model.hidden_size=128")
    p.add_argument("--steps", type=int)
    p.add_argument("--address", help="Dask scheduler address (tcp://host:8786); default: embedded cluster")
    p.add_argument("--metrics-file", help="write one JSON object per step to this file")
    p.add_argument("--cluster", choices=["local", "slurm"], help="without --address: embedded (local) or Slurm jobs")
    p.add_argument("--placement", choices=["colocated", "split"])
    p.add_argument("--plan", help="placement plan file (JSON/YAML) from python -m placement.automap --json")
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-dir", help="where checkpoints go (atomic, checksummed)")
    p.add_argument("--save-every", type=int, help="save a checkpoint every K steps")
    p.add_argument("--resume", help="auto (newest complete checkpoint), never, or a checkpoint path")
    args = p.parse_intermixed_args(argv)
    cfg = preset()
    for name in ("steps", "address", "cluster", "metrics_file", "placement", "seed", "plan", "checkpoint_dir",
                 "save_every", "resume"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    return apply_overrides(cfg, list(args.overrides))


def open_controller(cfg: RLConfig) -> Controller:
    if cfg.address:
        return Controller.connect(cfg.address, call_timeout_s=cfg.call_timeout_s)
    if cfg.cluster == "slurm":
        from flowactors.slurm import open_slurm

        # the scheduler runs in this process, like the embedded cluster's: one dashboard setting for both
        return open_slurm(dataclasses.replace(cfg.slurm, dashboard_address=cfg.dashboard),
                          call_timeout_s=cfg.call_timeout_s)
    return Controller.local(cfg.n_slots, dashboard=cfg.dashboard, call_timeout_s=cfg.call_timeout_s)


@dataclass
class Pools:
    """Where each role runs: its slots and its layout (pp, dp, tp)."""

    roles: dict[str, tuple[list[str], Layout]]

    def __getitem__(self, role: str) -> tuple[list[str], Layout]:
        return self.roles[role]


_SCORERS = ("critic", "cost_critic", "reward", "cost")


def rollout_tp(cfg: RLConfig) -> int | None:
    """The actor's generation TP size under the 3D-HybridEngine: a plan's actor "generate" sizes, else
    cfg.rollout_tp; None when off."""
    if cfg.plan:
        from placement import Plan

        actor = next(m for m in Plan.load(cfg.plan).models if m.role == "actor")
        if actor.generate is not None:
            p_g, t_g = actor.generate
            if p_g != 1:
                raise ValueError(f"the plan generates the actor over p_g={p_g} pipeline stages; the transformers "
                                 f"generation engine has none: plan generate [1, t_g]")
            return t_g
    return cfg.rollout_tp or None


def place(ctl: Controller, cfg: RLConfig) -> Pools:
    """Colocated, split, or a placement plan (which also fixes each model's parallel sizes)."""
    slots = ctl.slots[:cfg.n_slots] if cfg.address is None and cfg.cluster == "local" else ctl.slots
    if not slots:
        raise fa.PlacementError("the cluster has no device slots; start workers with --nthreads 1 --resources slot=1")
    if cfg.plan:
        from placement import Plan, pools_for_plan, validate

        plan = Plan.load(cfg.plan)
        validate(plan, len(slots))
        pools = pools_for_plan(plan, slots)
        out = {}
        for m in plan.models:
            p, t, d = m.train
            out[m.role] = (list(pools[plan.pool_of(m.role)].addresses)[:m.gpus], Layout(pp=p, dp=d, tp=t))
        scorer = next((out[r] for r in _SCORERS if r in out), out["actor"])
        for role in ("ref", *_SCORERS):
            out.setdefault(role, scorer if role != "ref" else out["actor"])
        return Pools(out)
    actor_side = scorer_side = list(slots)
    if cfg.placement == "split":
        half = len(slots) // 2
        actor_side, scorer_side = list(slots[:half]), list(slots[half:])
    a, s = (actor_side, Layout(dp=len(actor_side))), (scorer_side, Layout(dp=len(scorer_side)))
    return Pools({"actor": a, "ref": a, **{r: s for r in _SCORERS}})


# -- data -----------------------------------------------------------------------------------------------------------

class PromptData:
    """A fixed, seeded set of task prompts, visited in a per-epoch shuffled order with a saveable position."""

    def __init__(self, task: Task, tokenizer: Any, n_prompts: int, seed: int) -> None:
        rng = random.Random(seed)
        self.task, self.tokenizer, self.seed = task, tokenizer, seed
        self.examples = [task.make_example(rng) for _ in range(n_prompts)]
        self.width = max(len(tokenizer(p).input_ids) for p, _, _ in self.examples)
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1000 + epoch).shuffle(order)
        return order

    def encode(self, examples: list[tuple[str, str, dict]]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer([p for p, _, _ in examples], padding="max_length", max_length=self.width,
                             return_tensors="pt")
        return enc.input_ids, enc.attention_mask

    def next_batch(self, prompts: int, samples_per_prompt: int) -> Batch:
        """`prompts` prompts, each repeated `samples_per_prompt` times with its own sampling seed."""
        picked = []
        while len(picked) < prompts:
            order = self._order(self.epoch)
            take = min(prompts - len(picked), len(order) - self.index)
            picked += [(self.epoch, i) for i in order[self.index:self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        rows = [(e, i, k) for e, i in picked for k in range(samples_per_prompt)]
        examples = [self.examples[i] for _, i, _ in rows]
        ids, mask = self.encode(examples)
        seeds = torch.tensor([hash((self.seed, e, i, k)) % (2**62) for e, i, k in rows])
        groups = torch.tensor([g for g in range(len(picked)) for _ in range(samples_per_prompt)])
        return Batch({"input_ids": ids, "attention_mask": mask, "seed": seeds, "group": groups},
                     {"target": [ex[2]["target"] for ex in examples], "prompt_index": [i for _, i, _ in rows]})

    def sft_batch(self, samples: int, max_new_tokens: int, seed: int) -> Batch:
        """Demonstrations laid out like generated samples (prompt | response + EOS), for the NLL update."""
        rng = random.Random(seed)
        examples = [self.examples[rng.randrange(len(self.examples))] for _ in range(samples)]
        ids, mask = self.encode(examples)
        eos = self.tokenizer.eos_token_id
        resp = torch.full((samples, max_new_tokens), self.tokenizer.pad_token_id, dtype=torch.long)
        for r, (_, demo, _) in enumerate(examples):
            toks = (self.tokenizer(demo, add_special_tokens=False).input_ids + [eos])[:max_new_tokens]
            resp[r, :len(toks)] = torch.tensor(toks)
        return assemble_samples(Batch({"input_ids": ids, "attention_mask": mask}), resp, torch.zeros(resp.shape),
                                eos=eos, pad=self.tokenizer.pad_token_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']} but this run uses {self.seed}")
        self.epoch, self.index = state["epoch"], state["index"]


# -- warm start -------------------------------------------------------------------------------------------------------

def actor_optim(cfg: RLConfig, lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, micro_batch_tokens=cfg.micro_batch_tokens, grad_clip=1.0)


def sampling(cfg: RLConfig, task: Task) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=cfg.max_new_tokens or task.max_new_tokens, temperature=cfg.temperature,
                          ignore_eos=cfg.ignore_eos)


def run_warm_start(actor: fa.ActorGroup, data: PromptData, cfg: RLConfig, task: Task, export_dir: Path) -> ModelConfig:
    """SFT on the task's demonstrations, then export; returns the config that loads the SFT model."""
    if cfg.sft_steps:
        batch = data.sft_batch(cfg.sft_steps * cfg.sft_samples_per_step, cfg.max_new_tokens or task.max_new_tokens,
                               cfg.seed + 17)
        batch = batch.with_meta(mini_batch_samples=cfg.sft_samples_per_step, epochs=1, shuffle_seed=cfg.seed,
                                lr=cfg.sft_lr)
        actor.update_actor(batch, SFTLoss()).result()
    path = actor.export_hf(str(export_dir / "sft")).result()
    return ModelConfig(path=path, dtype=cfg.model.dtype)


# -- batch-level helpers that run as tasks ----------------------------------------------------------------------------

def summarize(batch: Batch, extra_keys: Sequence[str] = ()) -> dict[str, float]:
    """Per-step metrics, computed next to the data; only this small dict reaches the controller."""
    mask = batch["response_mask"].float()
    out = {
        "reward_mean": float(batch["rewards"].float().mean()),
        "response_length_mean": float(mask.sum(-1).mean()),
        "prompt_tokens": float(batch["attention_mask"][:, :batch["prompts"].shape[1]].sum()),
        "response_tokens": float(mask.sum()),
    }
    if "entropy" in batch:
        out["entropy"] = float(masked_mean(batch["entropy"], mask))
    if "ref_log_probs" in batch:
        out["kl"] = float(masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask))
    if "costs" in batch:
        out["cost_mean"] = float(batch["costs"].float().mean())
    for k in extra_keys:
        if k in batch:
            out[k] = float(batch[k].float().mean())
    return out


def build_common(ctl: Controller, cfg: RLConfig, workdir: Path, with_critics: Sequence[str] = (),
                 with_cost: bool = False, warm_start: bool = True) -> dict[str, Any]:
    """Actor, reference, critics and rule reward/cost groups on the configured placement.

    With `warm_start`, the actor is fine-tuned on demonstrations first and the reference and critics start from
    its export; without (resuming), every model starts from `cfg.model` and is then loaded from a checkpoint."""
    from engines import ActorWorker, CriticWorker, RefWorker, RuleRewardWorker

    task = get_task(cfg.task)
    pools = place(ctl, cfg)
    tok = build_tokenizer(cfg.model)
    data = PromptData(task, tok, cfg.dataset_prompts, cfg.seed)
    for role, (_, layout) in pools.roles.items():
        try:
            derived_sizes(cfg, layout.dp)
        except ValueError as e:
            raise ValueError(f"{role}: {e}") from None

    def group(role: str, cls: type, *args: Any) -> fa.ActorGroup:
        slots, layout = pools[role]
        return fa.ActorGroup(ctl, cls, name=role, slots=slots, layout=layout, args=args)

    actor = group("actor", ActorWorker, cfg.model, actor_optim(cfg, cfg.actor_lr), sampling(cfg, task),
                  rollout_tp(cfg))
    sft = run_warm_start(actor, data, cfg, task, workdir) if warm_start else cfg.model
    groups: dict[str, Any] = {"task": task, "data": data, "pools": pools, "actor": actor, "sft": sft}
    groups["ref"] = group("ref", RefWorker, sft, cfg.temperature)
    for key in with_critics:
        optim = OptimConfig(lr=getattr(cfg, "critic_lr", 1e-3), micro_batch_tokens=cfg.micro_batch_tokens)
        groups[key] = group(key, CriticWorker, sft, optim, "values" if key == "critic" else "cost_values")
    groups["reward"] = group("reward", RuleRewardWorker, task.reward, cfg.model)
    if with_cost:
        if task.cost is None:
            raise ValueError(f"task {task.name!r} defines no cost; Safe-RLHF needs a task with a cost (digit_sum)")
        groups["cost"] = group("cost", RuleRewardWorker, task.cost, cfg.model)
    return groups
