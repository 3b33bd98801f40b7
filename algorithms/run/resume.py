"""What a resumed run does with settings that differ from its checkpoint's: apply, or refuse with the list.

A checkpoint holds the resolved config it was saved under. On resume every difference is sorted into one of:

- **the run's environment** (where it runs, what it logs, how often it saves): used as given, not reported;
- **fixed at the run's start** (seed, task, dataset, the model's architecture, the warm start, λ's start, the
  staleness and partial rollouts, which shape the rollouts a checkpoint holds in flight): the
  checkpoint's state was built from them, and a new value could not take effect, so the resume is refused with
  the list, before the cluster starts;
- **applied**, and listed: everything else. Most are read afresh every step (batch sizes, clip ranges, steps).
  Learning rates and the KL coefficient also live in the checkpoint's state (optimizer schedule, KL controller),
  so they are set explicitly after loading; otherwise a changed `actor.lr` would be silently ignored.

Changing a setting that shapes the samples (prompts_per_step, temperature, ...) is the user's call: the run
continues soundly, but no longer reproduces an uninterrupted run with the old settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from algorithms.run.config import ConfigError, RLConfig
from algorithms.run.settings import short_forms

__all__ = ["Change", "describe", "setting_changes", "check_resumable"]

_ENVIRONMENT = (
    "checkpoint.",
    "address",
    "cluster",
    "slurm.",
    "dashboard",
    "metrics_file",
    "tensorboard_dir",
    "log_format",
    "log_level",
    "call_timeout_s",
    "profile_controller",
)
_FIXED_AT_START = (
    "seed",
    "task",
    "dataset_prompts",
    "train_files",
    "model.",
    "sft_steps",
    "sft_samples_per_step",
    "sft_lr",
    "lambda_init",
    "lambda_update",
    "cost_thresholds",
    "async_rl.staleness",
    "async_rl.partial_rollout",
    "async_rl.partial_surplus",
    "async_rl.deterministic",
)


@dataclasses.dataclass(frozen=True)
class Change:
    """One setting whose value differs from the checkpoint's."""

    key: str
    """The dotted key (`kl.coef`)."""
    saved: Any
    now: Any
    name: str = ""
    """What users type for it: its short form where it has one (`kl_coef`), else the key."""

    def __str__(self) -> str:
        return f"{self.name or self.key} {self.saved!r} -> {self.now!r}"


def describe(changes: list[Change]) -> str:
    """The changes as one line (a short form that sets several keys is listed once)."""
    return "; ".join(dict.fromkeys(map(str, changes)))


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _matches(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in names)


def setting_changes(saved_config: dict, cfg: RLConfig) -> list[Change]:
    """The settings (not of the run's environment) whose value differs from the checkpoint's config."""
    saved, now = _flat(saved_config), _flat(dataclasses.asdict(cfg))
    saved_keys = set(saved)
    # a setting newer than the checkpoint ran as its default there (the section did not exist yet)
    defaults = _flat(dataclasses.asdict(type(cfg)()))
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    if saved.get("async_rl.partial_rollout") and "async_rl.deterministic" not in saved_keys:
        saved["async_rl.deterministic"] = True  # partial rollouts ran on the fixed schedule before streaming
    keys = [k for k in now if not _matches(k, _ENVIRONMENT)]
    names = {key: short for short, targets in short_forms(cfg).items() for key in targets}
    return [Change(k, saved.get(k), now[k], names.get(k, k)) for k in keys if saved.get(k) != now[k]]


def check_resumable(saved_config: dict, cfg: RLConfig) -> list[Change]:
    """The changes the resumed run applies; ConfigError listing those it cannot."""
    changes = setting_changes(saved_config, cfg)
    fixed = [c for c in changes if _matches(c.key, _FIXED_AT_START)]
    if fixed:
        raise ConfigError(
            "these settings differ from the checkpoint's and are fixed at a run's start, so a resumed "
            "run cannot change them: "
            + describe(fixed)
            + ". Set them back, or start a new run (resume=never, or another checkpoint_dir)"
        )
    return changes
