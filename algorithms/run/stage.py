"""The stages before RL (supervised fine-tuning, reward and cost models) as single-controller programs.

Each stage trains one model group on the same engines, placement and runtime as RL: one group over the cluster's
slots (data parallel; `model.engine` chooses the training engine), `UpdateSpec` mini-batches that mean the same at
every data-parallel size, a progress bar, a metrics file written per step, held-out evaluation every `eval_every`
steps and after the last, and a Hugging Face folder written at the end (`out`), which the RL programs load
(`model.path=`, `reward_model=`, `cost_model=`). A stage is a `Stage`: it builds its group, turns a slice of the
dataset into a training batch, and evaluates; `run_stage` does the rest.

Left out for now: checkpoints and resume of a stage (a stage is short; rerun it), and tensor-parallel layouts (the
group is data parallel over every slot).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import flowactors as fa
from algorithms.run.cli import open_controller, parse_args, user_errors
from algorithms.run.config import (
    ConfigError,
    RunConfig,
    check_trainable_layers,
    check_training_engine,
)
from algorithms.run.metrics import MetricsFile
from engines import ModelConfig, OptimConfig
from flowactors import Layout

__all__ = ["StageConfig", "Stage", "run_stage", "pad_rows"]


@dataclass
class StageConfig(RunConfig):
    """What the stages before RL share: data, batch sizes, optimiser, output."""

    ranges: ClassVar[dict[str, str]] = {**RunConfig.ranges, "optim.lr": "(0, inf)"}
    short_forms: ClassVar[dict[str, str | tuple[str, ...]]] = {
        name: f"optim.{name}" for name in ("lr", "warmup_steps", "micro_batch_tokens", "trainable_layers", "zero_stage")
    }

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train: model.path=DIR (a Hugging Face folder; a reward or cost model starts its score head
    from zero on a causal LM's backbone), else a random one of these sizes."""
    train_files: list[str] = field(default_factory=list)
    """Training data, JSONL or Parquet (comma-separated); the columns each stage reads are in its docstring."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out data in the same format, evaluated every eval_every steps and after the last."""
    out: str | None = None
    """The Hugging Face folder written at the end (required)."""
    epochs: int = 1
    """Passes over train_files."""
    samples_per_step: int = 32
    """Examples per optimizer step (global, across data-parallel ranks); the last partial step of an epoch is
    dropped."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The model's training (engines' OptimConfig: AdamW, warm-up, micro-batches, ZeRO stage, trainable layers,
    LoRA); its total_steps is the stage's own count."""
    max_response_tokens: int = 128
    """Responses are cut to this many tokens (EOS included)."""
    eval_every: int = 0
    """Evaluate every K steps (0: only after the last)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("epochs", "samples_per_step", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        check_training_engine(self.model)
        if self.samples_per_step % self.n_slots:
            raise ConfigError(
                f"samples_per_step={self.samples_per_step} cannot be split over data-parallel size "
                f"{self.n_slots} (n_slots); use a multiple of {self.n_slots}"
            )


class Stage:
    """One stage: the examples it reads, the group it trains, a step's update and an evaluation."""

    name = "stage"
    key_metrics: tuple[str, ...] = ()

    def __init__(self, cfg: StageConfig) -> None:
        self.cfg = cfg
        self.examples: list[Any] = []
        self.eval_examples: list[Any] = []

    def load(self) -> None:
        """Read and check train_files / eval_files (on the controller, before any worker starts)."""
        raise NotImplementedError

    def build(self, ctl: fa.Controller, optim: OptimConfig) -> fa.ActorGroup:
        raise NotImplementedError

    def place(self, ctl: fa.Controller) -> tuple[list[str], Layout]:
        """The slots the stage trains on (the embedded cluster's n_slots, or every slot of a cluster it joined)
        and their data-parallel layout; sets `self.dp`."""
        cfg = self.cfg
        slots = ctl.slots[: cfg.n_slots] if cfg.address is None and cfg.cluster == "local" else list(ctl.slots)
        if cfg.samples_per_step % len(slots):
            raise ConfigError(
                f"samples_per_step={cfg.samples_per_step} cannot be split over the cluster's "
                f"{len(slots)} slots; use a multiple of {len(slots)}"
            )
        self.dp = len(slots)
        return slots, Layout(dp=len(slots))

    def update(self, group: fa.ActorGroup, examples: list[Any]) -> fa.CallFuture:
        """Issue one optimizer step on `examples` (samples_per_step of them); the future's value is its metrics."""
        raise NotImplementedError

    def evaluate(self, group: fa.ActorGroup, examples: list[Any]) -> dict[str, float]:
        raise NotImplementedError


def pad_rows(examples: list[Any], multiple: int) -> list[Any]:
    """Repeat the last example until the count divides `multiple` (evaluations drop what the padding scored)."""
    return examples + [examples[-1]] * ((-len(examples)) % multiple)


def run_stage(
    stage_cls: type[Stage], preset: Callable[[], StageConfig], argv: Sequence[str] | None, description: str
) -> list[dict]:
    """Parse, check, load the data, train for `epochs`, evaluate, and write the model to `out`."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg: StageConfig | None = None
    with user_errors(args, lambda: cfg, stage_cls.name):
        cfg = parse_args(args, preset, description)
        if not cfg.out:
            raise ConfigError("out=DIR is required: the Hugging Face folder this stage writes")
        if not cfg.train_files:
            raise ConfigError("train_files=PATH[,PATH] is required (JSONL or Parquet)")
        if cfg.metrics_file and not Path(cfg.metrics_file).resolve().parent.is_dir():
            raise ConfigError(f"metrics_file={cfg.metrics_file}: its directory does not exist")
        check_trainable_layers("trainable_layers", cfg.optim.trainable_layers, cfg.model)
        stage = stage_cls(cfg)
        stage.load()
        per_epoch = len(stage.examples) // cfg.samples_per_step
        if per_epoch == 0:
            raise ConfigError(
                f"train_files hold {len(stage.examples)} examples, fewer than samples_per_step="
                f"{cfg.samples_per_step}; lower samples_per_step or add data"
            )
        fa.configure_logging(cfg.log_format, cfg.log_level)
        with open_controller(cfg) as ctl:
            return _train(stage, ctl, cfg, per_epoch)


def _train(stage: Stage, ctl: fa.Controller, cfg: StageConfig, per_epoch: int) -> list[dict]:
    from tqdm import tqdm

    total = per_epoch * cfg.epochs
    group = stage.build(ctl, dataclasses.replace(cfg.optim, total_steps=max(1, total)))
    metrics_file = MetricsFile(cfg.metrics_file) if cfg.metrics_file else None
    if metrics_file is not None:
        metrics_file.restart_at(0)
    history: list[dict] = []
    bar = tqdm(total=total, desc=stage.name, file=sys.stderr, dynamic_ncols=True)
    try:
        step = 0
        for epoch in range(cfg.epochs):
            order = list(range(len(stage.examples)))
            random.Random(cfg.seed * 1000 + epoch).shuffle(order)
            for k in range(per_epoch):
                t0 = time.perf_counter()
                picked = [stage.examples[i] for i in order[k * cfg.samples_per_step : (k + 1) * cfg.samples_per_step]]
                record = {"step": step, "epoch": epoch, **stage.update(group, picked).result()}
                due = (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == total
                if stage.eval_examples and due:
                    record.update(stage.evaluate(group, stage.eval_examples))
                record["step_s"] = time.perf_counter() - t0
                history.append(record)
                ctl.report_metrics(step, {k: v for k, v in record.items() if isinstance(v, (int, float))})
                if metrics_file is not None:
                    metrics_file.append(record)
                bar.update(1)
                bar.set_postfix({m: f"{record[m]:.3f}" for m in stage.key_metrics if m in record})
                step += 1
    finally:
        bar.close()
    path = group.export_hf(str(Path(cfg.out).resolve())).result()
    last = history[-1]
    shown = ", ".join(f"{m}={last[m]:.4f}" for m in stage.key_metrics if m in last)
    print(f"[{stage.name}] {len(history)} steps; last: {shown}; wrote {path}", file=sys.stderr)
    return history
