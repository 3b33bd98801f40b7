"""Step metrics: computed next to the data, written as each step ends, summarised when the run ends.

`summarize` runs as a Dask task beside the scored batch, so only a small dict reaches the controller.
`MetricsFile` appends one JSON line per finished step (a run stopped by Ctrl-C, a failure or a lost worker keeps
the steps it finished); a resumed run first drops the lines of the steps it is about to redo, so the file always
holds one line per step. `print_summary` compares the first and last quarter of the run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from algorithms.objectives.losses import masked_mean
from engines.fields import POLICY_VERSIONS, RESPONSE_MASK, SUCCESS
from engines.rollout.agent import EPISODE_FIELDS
from flowactors import Batch

__all__ = [
    "EPISODE_METRICS",
    "summarize",
    "staleness_metrics",
    "update_metrics",
    "AS_REPORTED",
    "MetricsFile",
    "print_summary",
]

EPISODE_METRICS = ("success_mean", *(f"{k}_mean" for k in EPISODE_FIELDS))
"""What a multi-turn task's steps report beyond an algorithm's own metrics (and the dashboard charts)."""

AS_REPORTED = ""
"""The name of an update whose metrics already carry their roles' names (a fused actor-and-critics pipeline's)."""


MISMATCH_KL = "actor/mismatch_kl"
"""The step's KL between the rollout engine's and the trainer's token distributions (PolicyLoss's monitor)."""


def update_metrics(updates: Mapping[str, Any]) -> dict[str, float]:
    """A step's update results merged into one dict: each update's metrics under its name (`critic/vf_loss`), an
    update named AS_REPORTED as it reported them. `updates`: name -> CallFuture (or the metrics themselves)."""
    out: dict[str, float] = {}
    for name, update in updates.items():
        metrics = update.result() if hasattr(update, "result") else update
        out.update(metrics if name == AS_REPORTED else {f"{name}/{k}": v for k, v in metrics.items()})
    return out


def summarize(batch: Batch, extra_keys: Sequence[str] = ()) -> dict[str, float]:
    """Per-step metrics, computed next to the data; only this small dict reaches the controller."""
    mask = batch["response_mask"].float()
    out = {
        "reward_mean": float(batch["rewards"].float().mean()),
        "response_length_mean": float(mask.sum(-1).mean()),
        "prompt_tokens": float(batch["attention_mask"][:, : batch["prompts"].shape[1]].sum()),
        "response_tokens": float(mask.sum()),
    }
    if "entropy" in batch:
        out["entropy"] = float(masked_mean(batch["entropy"], mask))
    if "ref_log_probs" in batch and "old_log_probs" in batch:
        out["kl"] = float(masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask))
    if "teacher_log_probs" in batch and "old_log_probs" in batch:  # on-policy distillation: per token, sampled
        out["distill/reverse_kl"] = float(masked_mean(batch["old_log_probs"] - batch["teacher_log_probs"], mask))
    if "costs" in batch:  # the mean and the samples' spread (the sampling noise of the mean a multiplier reads)
        costs = batch["costs"].float()
        columns = costs.unsqueeze(-1) if costs.dim() == 1 else costs  # several constraints: _k for the k-th
        for k in range(columns.shape[1]):
            suffix = f"_{k}" if k else ""
            out[f"cost_mean{suffix}"] = float(columns[:, k].mean())
            out[f"cost_std{suffix}"] = float(columns[:, k].std(correction=0))
    if SUCCESS in batch:
        out["success_mean"] = float(batch[SUCCESS].float().mean())
    for k in EPISODE_FIELDS:  # multi-turn episodes (engines.rollout.agent)
        if k in batch:
            out[f"{k}_mean"] = float(batch[k].float().mean())
    for k in extra_keys:
        if k in batch:
            out[k] = float(batch[k].float().mean())
    if POLICY_VERSIONS in batch and "trainer_version" in batch.meta:  # asynchronous rollouts (Generated.meta)
        out.update(
            staleness_metrics(batch, version=batch.meta["trainer_version"], max_staleness=batch.meta["max_staleness"])
        )
    return out


def staleness_metrics(samples: Batch, *, version: int, max_staleness: int) -> dict[str, float]:
    """How many versions old the step's response tokens are (the trainer is at `version`): mean, max, the
    fraction at each age 0..max_staleness, how many tokens are older than that (whole rollouts: 0 by the
    schedule, a non-zero count is a bug worth seeing; partial rollouts: the tokens the policy loss masks), and how
    many samples were continued under a newer version than they started with (`async/requeued`)."""
    mask = samples[RESPONSE_MASK].bool()
    versions = samples[POLICY_VERSIONS]
    ages = (version - versions)[mask].float()
    n = max(int(ages.numel()), 1)
    big = torch.iinfo(versions.dtype).max
    spans = (versions.masked_fill(~mask, -big).amax(-1) > versions.masked_fill(~mask, big).amin(-1)) & mask.any(-1)
    out = {
        "async/staleness_mean": float(ages.mean()) if ages.numel() else 0.0,
        "async/staleness_max": float(ages.max()) if ages.numel() else 0.0,
        "async/too_stale": float((ages > max_staleness).sum()),
        "async/requeued": float(spans.sum()),
    }
    for k in range(max_staleness + 1):
        out[f"async/staleness_frac_{k}"] = float((ages == k).sum()) / n
    return out


class MetricsFile:
    """A JSONL file with one object per step, written as steps finish."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def restart_at(self, step: int) -> None:
        """Keep the lines of steps before `step` (an earlier run's, before a resume) and drop the rest."""
        old = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()] if self.path.exists() else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] < step))

    def append(self, record: Mapping) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(dict(record)) + "\n")


def _num(x: float) -> str:
    """Three decimals, or three significant digits for what they would show as 0.000 (a small mismatch KL)."""
    return f"{x:>9.3f}" if x == 0 or abs(x) >= 5e-4 else f"{x:>9.2e}"


def print_summary(name: str, history: list[dict], keys: Sequence[str], notes: Mapping[str, str] | None = None) -> None:
    """The mean of `keys` over the first and the last quarter of the steps; `notes` adds text after a key's line
    (e.g. Safe-RLHF's cost threshold next to cost_mean)."""
    if not history:
        return
    notes = notes or {}
    w = max(1, len(history) // 4)
    first, last = history[:w], history[-w:]
    lines = [f"[{name}] {len(history)} steps; mean of the first and last {w} steps:"]
    for k in keys:
        if k in history[0]:
            line = f"  {k:<22} {_num(sum(r[k] for r in first) / w)} -> {_num(sum(r[k] for r in last) / w)}"
            lines.append(f"{line}   {notes[k]}" if k in notes else line)
    tps = sum(r["tokens_per_s"] for r in history) / len(history)
    lines.append(f"  {'tokens_per_s':<22} {tps:>9.1f}")
    print("\n".join(lines), file=sys.stderr)
