"""The step loop every program runs: progress, metrics, checkpoints, exact resume and recovery from a lost worker.

An algorithm is a small class: `setup` binds its groups (and is called again after a recovery rebuilt them),
`step` is the dataflow of one RL step, `state_dict` is its controller-side state (KL coefficient, Lagrange
multiplier). `run_program` does the rest:

- **Checkpoints** (DESIGN §6): every `save_every` steps each model role saves its shards in parallel
  (torch.distributed.checkpoint, so they load under other parallel sizes) into a pending checkpoint, and the
  controller commits it with its own state: step, data position, algorithm state, its RNG, the resolved config.
- **Resume**: `--resume auto` (the newest complete checkpoint), `never`, or a path. Everything that decides a
  step is either restored or derived from the seed and the step number (sampling seeds per row, shuffles), so the
  steps after a resume reproduce an uninterrupted run exactly, including at an epoch boundary.
- **Recovery**: a `WorkerLostError` mid-step (the runtime fails calls on a dead worker within seconds) makes the
  controller wait a bounded time for the slots to come back (a nanny restarts a killed worker; or fewer slots are
  used where the placement allows), rebuild every group, load the last complete checkpoint and continue. After
  `max_recoveries` the run fails with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

import flowactors as fa
from algorithms.config import RLConfig, derived_sizes
from algorithms.runner import PromptData, build_common, open_controller, parse_args
from flowactors.checkpoint import CheckpointStore, capture_rng, restore_rng

__all__ = ["Algorithm", "run_program"]

log = structlog.get_logger("flowactors.algorithms")


class Algorithm:
    """Base of the algorithm programs. Subclasses set the class attributes and write `setup` and `step`."""

    name = "algorithm"
    key_metrics: tuple[str, ...] = ("reward_mean", "kl", "entropy", "response_length_mean")
    critics: tuple[str, ...] = ()
    """Critic roles to build: "critic" (reward values), "cost_critic"."""
    with_cost = False

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.stage: Callable[..., None] = lambda name, *calls: None

    def setup(self, ctl: fa.Controller, groups: dict[str, Any]) -> None:
        raise NotImplementedError

    def step(self, prompts: fa.Batch, i: int) -> dict[str, float]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Run:
    """One program run: the controller, the groups, the loop state."""

    def __init__(self, algo: Algorithm, ctl: fa.Controller, workdir: Path) -> None:
        self.algo, self.cfg, self.ctl, self.workdir = algo, algo.cfg, ctl, workdir
        self.store = CheckpointStore(self.cfg.checkpoint_dir, keep_last=self.cfg.keep_last) \
            if self.cfg.checkpoint_dir else None
        self.history: list[dict] = []
        self.stage_t: dict[str, float] = {}
        self._stage_mark = 0.0
        self.recoveries = 0
        self.groups: dict[str, Any] = {}
        self.data: PromptData | None = None
        self.start = 0
        self.tensorboard = None
        if self.cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(self.cfg.tensorboard_dir)
            except ImportError:
                print(f"[{algo.name}] tensorboard is not installed (pip install tensorboard); metrics go to the "
                      f"console and the metrics file only", file=sys.stderr)

    # -- building, saving, loading ---------------------------------------------------------------------------------
    def build(self, resuming: bool) -> None:
        self.groups = build_common(self.ctl, self.cfg, self.workdir, with_critics=self.algo.critics,
                                   with_cost=self.algo.with_cost, warm_start=not resuming)
        self.data = self.groups["data"]
        if not resuming:
            dp = self.groups["actor"].layout.dp
            sizes = ", ".join(f"{k}={v}" for k, v in derived_sizes(self.cfg, dp).items())
            print(f"[{self.algo.name}] actor data-parallel size {dp}: {sizes}", file=sys.stderr)
        self.algo.stage = self.stage
        self.algo.setup(self.ctl, self.groups)

    def model_groups(self) -> dict[str, fa.ActorGroup]:
        return {k: g for k, g in self.groups.items()
                if isinstance(g, fa.ActorGroup) and "save_checkpoint" in g.endpoints}

    def save(self, step: int) -> None:
        assert self.store is not None and self.data is not None
        t0 = time.perf_counter()
        pending = self.store.begin(step)
        try:
            calls = [g.save_checkpoint(str(pending.role_dir(name))) for name, g in self.model_groups().items()]
            for c in calls:
                c.result()
            self.store.commit(pending, {
                "step": step, "data": self.data.state_dict(), "algorithm": self.algo.state_dict(),
                "rng": capture_rng(), "config": dataclasses.asdict(self.cfg)})
        except BaseException:
            self.store.abort(pending)
            raise
        self.stage_t["checkpoint_s"] = time.perf_counter() - t0

    def load(self, ckpt: Any) -> int:
        assert self.data is not None
        calls = [g.load_checkpoint(str(ckpt.role_dir(name))) for name, g in self.model_groups().items()]
        for c in calls:
            c.result()
        state = ckpt.controller_state()
        self.data.load_state_dict(state["data"])
        self.algo.load_state_dict(state["algorithm"])
        restore_rng(state["rng"])
        print(f"[{self.algo.name}] resumed from {ckpt.path} at step {state['step']}", file=sys.stderr)
        return int(state["step"])

    def recover(self, error: fa.WorkerLostError) -> None:
        self.recoveries += 1
        if self.recoveries > self.cfg.max_recoveries:
            raise fa.FlowactorsError(f"giving up after {self.cfg.max_recoveries} recoveries (max_recoveries); "
                                     f"last failure: {error}") from error
        if self.store is None or self.store.latest_complete() is None:
            raise fa.FlowactorsError("a worker died and there is no complete checkpoint to recover from; run with "
                                     "--checkpoint-dir D --save-every K") from error
        print(f"[{self.algo.name}] {error}\n[{self.algo.name}] recovering ({self.recoveries}/"
              f"{self.cfg.max_recoveries}): rebuilding groups on live slots", file=sys.stderr)
        self.ctl.recover(wait_s=self.cfg.recovery_wait_s)
        self.build(resuming=True)
        self.start = self.load(self.store.latest_complete())
        self.history = [r for r in self.history if r["step"] < self.start]

    # -- the loop ----------------------------------------------------------------------------------------------------
    def stage(self, name: str, *calls: fa.CallFuture) -> None:
        """Time a stage: programs issue the whole step first, then call this for each stage in order, so the
        wait never holds back the graph; a stage's time is from the previous stage's end to its calls' end."""
        self.ctl.wait(list(calls))
        now = time.perf_counter()
        self.stage_t[f"{name}_s"] = self.stage_t.get(f"{name}_s", 0.0) + now - self._stage_mark
        self._stage_mark = now

    def one_step(self, i: int) -> dict:
        assert self.data is not None
        self.ctl.step = i
        self.stage_t = {}
        prompts = self.data.next_batch(self.cfg.prompts_per_step, self.cfg.samples_per_prompt)
        t0 = self._stage_mark = time.perf_counter()
        if self.cfg.profile_controller:
            from distributed import get_task_stream

            with get_task_stream(client=self.ctl.client) as ts:
                metrics = self.algo.step(prompts, i)
                dt = time.perf_counter() - t0
            metrics["controller_share"] = 1 - _busy_seconds(ts.data, t0, t0 + dt) / dt
        else:
            metrics = self.algo.step(prompts, i)
            dt = time.perf_counter() - t0
        tokens = metrics.pop("prompt_tokens", 0.0) + metrics.pop("response_tokens", 0.0)
        return {"step": i, **metrics, **self.stage_t, "step_s": dt, "tokens_per_s": tokens / dt}

    def run(self) -> list[dict]:
        from tqdm import tqdm

        self.build(resuming=False)
        ckpt = self.store.resolve(self.cfg.resume) if self.store else None
        if ckpt is not None:
            self.start = self.load(ckpt)
        bar = tqdm(total=self.cfg.steps, initial=self.start, desc=self.algo.name, file=sys.stderr,
                   dynamic_ncols=True)
        i = self.start
        try:
            while i < self.cfg.steps:
                try:
                    record = self.one_step(i)
                    if self.store and self.cfg.save_every and (i + 1) % self.cfg.save_every == 0:
                        self.save(i + 1)
                except fa.WorkerLostError as e:
                    self.recover(e)
                    i = self.start
                    bar.n = i
                    continue
                self.history.append(record)
                scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
                self.ctl.report_metrics(i, scalars)
                if self.tensorboard is not None:
                    for k, v in scalars.items():
                        self.tensorboard.add_scalar(k, v, i)
                bar.update(1)
                bar.set_postfix({k: f"{record[k]:.3f}" for k in self.algo.key_metrics if k in record})
                i += 1
        finally:
            bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.write_metrics()
        print_summary(self.algo.name, self.history, self.algo.key_metrics)
        return self.history

    def write_metrics(self) -> None:
        """The metrics file holds one line per step; lines of steps this run redid (after a resume) are replaced."""
        if not self.cfg.metrics_file:
            return
        path = Path(self.cfg.metrics_file)
        first = self.history[0]["step"] if self.history else float("inf")  # this run's steps are contiguous
        old = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        rows = [r for r in old if r["step"] < first] + self.history
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def print_summary(name: str, history: list[dict], keys: Sequence[str]) -> None:
    if not history:
        return
    w = max(1, len(history) // 4)
    first, last = history[:w], history[-w:]
    lines = [f"[{name}] {len(history)} steps; mean of the first and last {w} steps:"]
    for k in keys:
        if k in history[0]:
            lines.append(f"  {k:<22} {sum(r[k] for r in first) / w:>9.3f} -> {sum(r[k] for r in last) / w:>9.3f}")
    tps = sum(r["tokens_per_s"] for r in history) / len(history)
    lines.append(f"  {'tokens_per_s':<22} {tps:>9.1f}")
    print("\n".join(lines), file=sys.stderr)


def _busy_seconds(tasks: list[dict], start: float, stop: float) -> float:
    """Seconds within [start, stop] (perf_counter clock) when at least one worker was computing a task."""
    offset = time.time() - time.perf_counter()  # task stream times are wall-clock
    spans = sorted((max(s["start"] - offset, start), min(s["stop"] - offset, stop))
                   for t in tasks for s in t.get("startstops", ()) if s.get("action") == "compute")
    busy, end = 0.0, start
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def run_program(algo_cls: type[Algorithm], preset: Callable[[], RLConfig], argv: Sequence[str] | None,
                description: str) -> list[dict]:
    """Parse the command line onto the preset, open the cluster, and run the algorithm to the end."""
    cfg = parse_args(argv, preset, description)
    fa.configure_logging(cfg.log_format, cfg.log_level)  # before the cluster starts: workers inherit it
    algo = algo_cls(cfg)
    with open_controller(cfg) as ctl, tempfile.TemporaryDirectory(prefix="flowactors-") as tmp:
        if ctl.dashboard_link:
            from flowactors.dashboard import install_dashboard

            page = install_dashboard(ctl.client)
            print(f"[{algo.name}] Dask dashboard: {ctl.dashboard_link} (dataflow, slots, metrics: {page})",
                  file=sys.stderr)
        return _Run(algo, ctl, Path(tmp)).run()
