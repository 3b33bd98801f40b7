"""The step loop every program runs: progress, metrics, checkpoints, exact resume and recovery from a lost worker.

An algorithm is a small class: `setup` binds its groups (and is called again after a recovery rebuilt them),
`step` is the dataflow of one RL step, `state_dict` is its controller-side state (KL coefficient, Lagrange
multiplier). `run_program` does the rest:

- **Checkpoints** (docs/design.md §6): every `save_every` steps each model role saves its shards in parallel
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

import contextlib
import copy
import dataclasses
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import flowactors as fa
from algorithms.data.prompts import PromptData
from algorithms.data.tasks import get_task
from algorithms.rollout.asynchronous import RolloutPipeline
from algorithms.rollout.fleet import FleetRollouts
from algorithms.rollout.fusion import overlap_note
from algorithms.rollout.streaming import StreamingRollouts
from algorithms.run.build import Roles, build_roles, prompt_data
from algorithms.run.cli import open_controller, parse_args, user_errors
from algorithms.run.config import RLConfig, derived_sizes
from algorithms.run.metrics import MISMATCH_KL, MetricsFile, print_summary
from algorithms.run.plan import RunPlan, check_before_start, resolve
from algorithms.run.resume import Change, check_resumable, describe
from engines import GenerationSpec, UpdateSpec
from flowactors.checkpoint import Checkpoint, CheckpointStore, capture_rng, restore_rng, seed_rng

__all__ = ["Algorithm", "Runner", "Evaluation", "run_program"]


class Algorithm:
    """Base of the algorithm programs. Subclasses set the class attributes and write `setup` and `step`."""

    name = "algorithm"
    key_metrics: tuple[str, ...] = ("reward_mean", "kl", "entropy", "response_length_mean")
    critics: tuple[str, ...] = ()
    """Critic roles to build: "critic" (reward values), "cost_critic"."""
    with_cost = False
    constraints = 1
    """Cost constraints (Safe-RLHF with cost_thresholds): the heads of the shared cost critic."""
    greedy_baseline = False
    """The step also needs greedy responses to its prompts (ReMax): with asynchronous rollouts the replicas
    generate them ahead too (`Generated.greedy`)."""

    def __init__(self, cfg: RLConfig) -> None:
        from algorithms.data.tasks import TASKS
        from algorithms.run.metrics import EPISODE_METRICS

        self.cfg = cfg
        task = TASKS.get(cfg.task)
        if task is not None and task.environment is not None:  # a multi-turn task: its episodes' metrics too
            self.key_metrics = (*self.key_metrics, *(k for k in EPISODE_METRICS if k not in self.key_metrics))
        elif task is not None and task.success is not None:
            self.key_metrics = (*self.key_metrics, "success_mean")
        self.key_metrics = (*self.key_metrics, MISMATCH_KL)  # the rollout engine against the trainer
        self.stage: Callable[..., None] = lambda name, *calls: None

    def setup(self, ctl: fa.Controller, roles: Roles, data: PromptData) -> None:
        """Bind the groups (called again after a recovery rebuilt them) and the prompt data."""
        raise NotImplementedError

    def step(self, prompts: fa.Batch, i: int) -> dict[str, float]:
        raise NotImplementedError

    def update_spec(self, i: int) -> UpdateSpec:
        """How step i's updates walk its samples: `mini_batch_samples` per optimizer step, `ppo_epochs` passes,
        shuffled by a seed of the step (so a resumed run shuffles as an uninterrupted one)."""
        return UpdateSpec(self.cfg.mini_batch_samples, epochs=self.cfg.ppo_epochs, shuffle_seed=self.cfg.seed + i)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def resumed(self, changes: list[Change]) -> None:
        """After loading a checkpoint: apply changed settings that `load_state_dict` restored over (e.g. a KL
        coefficient kept in the algorithm's state). Settings read from `self.cfg` each step need nothing."""

    def summary_notes(self, history: list[dict]) -> dict[str, str]:
        """Text printed after a metric's line in the end-of-run summary (e.g. a constraint and whether it holds)."""
        return {}


Evaluation = Callable[["Runner", int], dict[str, float]]
"""evaluate(runner, steps_done) -> the metrics an evaluation adds to its step's record ("eval/..." names). It may
use the runner's groups (`runner.roles`), prompts (`runner.eval_data`, `runner.data`) and settings."""


class Runner:
    """One program run: the controller, the groups, the loop state. `run_program` drives one; a program of one's
    own (examples/gold_safe_rlhf.py) drives it in-process to add its own evaluation:

    - `evaluate`: replaces the built-in evaluation (mean reward and cost of greedy and sampled answers to the eval
      prompts) every `eval_every` steps and after the last;
    - `evaluate_first`: also evaluates once before the first step (its result is the evaluation's own to keep).
    """

    def __init__(
        self,
        algo: Algorithm,
        ctl: fa.Controller,
        workdir: Path,
        data: PromptData | None = None,
        *,
        eval_data: PromptData | None = None,
        store: CheckpointStore | None = None,
        resume_from: Checkpoint | None = None,
        changes: Sequence[Change] = (),
        evaluate: Evaluation | None = None,
        evaluate_first: bool = False,
        run_plan: RunPlan | None = None,
    ) -> None:
        self.algo, self.cfg, self.ctl, self.workdir = algo, algo.cfg, ctl, workdir
        self.run_plan = run_plan or resolve(self.cfg)  # check_before_start's, when the program checked first
        self._evaluation, self.evaluate_first = evaluate, evaluate_first
        self.store, self.resume_from, self.changes = store, resume_from, list(changes)
        seed_rng(self.cfg.seed)  # the controller's RNGs, which checkpoints save, start from the run's seed
        self.initial = {"rng": capture_rng(), "algorithm": copy.deepcopy(algo.state_dict())}
        self.metrics_file = MetricsFile(self.cfg.metrics_file) if self.cfg.metrics_file else None
        self.history: list[dict] = []
        self.stage_t: dict[str, float] = {}
        self._stage_mark = 0.0
        self.recoveries = 0
        self.roles: Roles | None = None
        self.pipeline: RolloutPipeline | None = None
        self._mismatch_warned = False
        self.data, self.eval_data = (data, eval_data) if data is not None else prompt_data(self.cfg)
        self.start = 0
        self.tensorboard = None
        if self.cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(self.cfg.tensorboard_dir)
            except ImportError:
                print(
                    f"[{algo.name}] tensorboard is not installed (pip install tensorboard); metrics go to the "
                    f"console and the metrics file only",
                    file=sys.stderr,
                )

    # -- building, saving, loading ---------------------------------------------------------------------------------
    def build(self, resuming: bool) -> None:
        t0 = time.perf_counter()
        self.roles = build_roles(
            self.ctl,
            self.cfg,
            self.run_plan,
            self.data,
            self.workdir,
            critics=self.algo.critics,
            with_cost=self.algo.with_cost,
            warm_start=not resuming,
            constraints=self.algo.constraints,
        )
        if not resuming:
            dp = self.roles.actor.layout.dp
            sizes = ", ".join(f"{k}={v}" for k, v in derived_sizes(self.cfg, dp).items())
            warm = f"{self.cfg.sft_steps} warm-start steps, " if self.cfg.sft_steps else ""
            print(
                f"[{self.algo.name}] {len(self.roles.groups())} roles ({', '.join(self.roles.groups())}) ready: "
                f"{warm}{time.perf_counter() - t0:.1f} s; actor data-parallel size {dp}: {sizes}",
                file=sys.stderr,
            )
        if self.cfg.fusion.enabled:
            groups = self.roles.groups()
            note = overlap_note(
                groups["actor"],
                [g for k, g in groups.items() if k != "actor"],
                self.cfg.fusion.migrate,
                self.cfg.fusion.migrate_to,
            )
            if note and not resuming:
                print(f"[{self.algo.name}] {note}", file=sys.stderr)
        self.algo.stage = self.stage
        self.algo.setup(self.ctl, self.roles, self.data)
        self.pipeline = None
        if self.roles.rollout is not None or self.roles.replica_factory is not None:  # started by start_pipeline
            streaming = self.cfg.async_rl.partial_rollout and not self.cfg.async_rl.deterministic
            kind, extra = (StreamingRollouts if streaming else RolloutPipeline), {}
            if self.roles.replica_factory is not None:
                kind = FleetRollouts
                extra = {"make_replica": self.roles.replica_factory, "bounds": self.cfg.async_rl.fleet_bounds()}
            self.pipeline = kind(
                self.ctl,
                self.roles.actor,
                self.roles.rollout,
                self.data,
                self.cfg.async_rl.staleness,
                self.cfg.async_rl,
                self.cfg.steps,
                (self.cfg.prompts_per_step, self.cfg.samples_per_prompt),
                greedy_baseline=self.algo.greedy_baseline,
                past_the_end=bool(self.store and self.cfg.checkpoint.save_every),
                max_new_tokens=self.cfg.rollout.max_new_tokens or self.data.task.max_new_tokens,
                **extra,
            )

    def start_pipeline(self, step: int, state: dict | None = None) -> None:
        """Asynchronous rollouts: fill the pipeline from `step` (with a checkpoint's rollouts in flight)."""
        if self.pipeline is not None:
            self.pipeline.start(step, state)

    def model_groups(self) -> dict[str, fa.ActorGroup]:
        assert self.roles is not None
        return {
            k: g
            for k, g in self.roles.groups().items()
            # the replicas hold a copy of a recent policy; a teacher is frozen and rebuilt from teacher.path
            if "save_checkpoint" in g.endpoints and g is not self.roles.rollout and g is not self.roles.teacher
        }

    def save(self, step: int) -> float:
        """Save a checkpoint of every model role and the controller's state; returns the seconds it took."""
        assert self.store is not None
        t0 = time.perf_counter()
        pending = self.store.begin(step)
        calls: list[fa.CallFuture] = []
        try:
            calls = [g.save_checkpoint(str(pending.role_dir(name))) for name, g in self.model_groups().items()]
            for c in calls:
                c.result()
            state = {
                "step": step,
                "data": self.data.state_dict(),
                "algorithm": self.algo.state_dict(),
                "rng": capture_rng(),
                "config": dataclasses.asdict(self.cfg),
            }
            if self.pipeline is not None:  # the rollouts in flight, whose prompts the data position has passed
                state["async"] = self.pipeline.state_dict()
            self.store.commit(pending, state)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt) and calls:  # let the ranks finish writing what is then removed
                with contextlib.suppress(Exception):
                    self.ctl.wait(calls, timeout=60)
            self.store.abort(pending)
            raise
        return time.perf_counter() - t0

    def load(self, ckpt: Any) -> int:
        # LoRA models' checkpoints hold their adapters; their frozen base is the reference's weights
        adapted = {"actor", *self.algo.critics} if self.cfg.actor.lora_rank else set()
        calls = [
            g.load_checkpoint(str(ckpt.role_dir(name)), str(ckpt.role_dir("ref")) if name in adapted else None)
            for name, g in self.model_groups().items()
        ]
        for c in calls:
            c.result()
        state = ckpt.controller_state()
        self.data.load_state_dict(state["data"])
        self.algo.load_state_dict(state["algorithm"])
        restore_rng(state["rng"])
        self.apply_changes()
        self.start_pipeline(int(state["step"]), state.get("async"))
        print(f"[{self.algo.name}] resumed from {ckpt.path} at step {state['step']}", file=sys.stderr)
        return int(state["step"])

    def apply_changes(self) -> None:
        """Settings that differ from the checkpoint's (algorithms.run.resume) and live in loaded state: set them."""
        if not self.changes:
            return
        assert self.roles is not None
        keys = {c.key for c in self.changes}
        if "actor.lr" in keys:
            self.roles.actor.set_lr(self.cfg.actor.lr).result()
        if "critic.lr" in keys:
            for critic in (self.roles.critic, self.roles.cost_critic):
                if critic is not None:
                    critic.set_lr(self.cfg.critic.lr).result()
        self.algo.resumed(self.changes)
        print(
            f"[{self.algo.name}] settings changed since the checkpoint, applied: " + describe(self.changes),
            file=sys.stderr,
        )

    def restart(self) -> None:
        """Back to step 0 after a worker was lost before any checkpoint: nothing is lost but the steps so far."""
        self.build(resuming=False)
        self.data.load_state_dict({"epoch": 0, "index": 0, "seed": self.cfg.seed})
        self.algo.load_state_dict(copy.deepcopy(self.initial["algorithm"]))
        restore_rng(self.initial["rng"])
        self.start = 0
        self.start_pipeline(0)

    def recover(self, error: fa.WorkerLostError) -> None:
        self.recoveries += 1
        if self.recoveries > self.cfg.checkpoint.max_recoveries:
            raise fa.FlowactorsError(
                f"giving up after {self.cfg.checkpoint.max_recoveries} recoveries (max_recoveries); last failure: {error}"
            ) from error
        latest = self.store.latest_complete() if self.store is not None else None
        if latest is None and self.history and self.history[-1]["step"] + 1 > (self.cfg.checkpoint.save_every or 0) > 0:
            # steps past the first save point with no checkpoint: they would be lost silently
            raise fa.FlowactorsError(
                f"a worker died and {self.cfg.checkpoint.dir} holds no complete checkpoint to recover from"
            ) from error
        where = f"the checkpoint of step {latest.step}" if latest is not None else "step 0 (no checkpoint yet)"
        print(
            f"[{self.algo.name}] {error}\n[{self.algo.name}] recovering ({self.recoveries}/"
            f"{self.cfg.checkpoint.max_recoveries}): rebuilding groups on live slots, restarting from {where}",
            file=sys.stderr,
        )
        self.ctl.recover(wait_s=self.cfg.checkpoint.recovery_wait_s)
        self.roles = None  # the old groups went with the lost worker's world
        if latest is None:
            self.restart()
        else:
            self.build(resuming=True)
            self.start = self.load(latest)
        self.history = [r for r in self.history if r["step"] < self.start]
        if self.metrics_file is not None:
            self.metrics_file.restart_at(self.start)

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
        if self.pipeline is not None:
            prompts = self.pipeline.take(i)  # generated ahead by the rollout replicas
        else:
            prompts = self.data.next_batch(self.cfg.prompts_per_step, self.cfg.samples_per_prompt)
        t0 = self._stage_mark = time.perf_counter()
        with self.ctl.profile() if self.cfg.profile_controller else contextlib.nullcontext() as profile:
            metrics = self.algo.step(prompts, i)
            if self.pipeline is not None:
                self.pipeline.after_update(i)  # the next version to the replicas, the next rollout issued
                metrics.update(self.pipeline.sync_metrics(i))
            dt = time.perf_counter() - t0
        if profile is not None:
            metrics["controller_share"] = profile.controller_share
        tokens = metrics.pop("prompt_tokens", 0.0) + metrics.pop("response_tokens", 0.0)
        record = {"step": i, **metrics, **self.stage_t, "step_s": dt, "tokens_per_s": tokens / dt}
        kl = record.get(MISMATCH_KL, 0.0)
        if kl > self.cfg.mismatch.warn_kl and not self._mismatch_warned:
            self._mismatch_warned = True
            print(
                f"[{self.algo.name}] warning: step {i}: the rollout engine's log-probs are {kl:.2e} (KL) from the "
                f"trainer's (mismatch_warn_kl={self.cfg.mismatch.warn_kl}; max |diff| "
                f"{record.get('actor/mismatch_max_diff', 0.0):.3f}): training is off-policy; consider "
                f"rollout_correction=tis or mis (docs/algorithms.md#rollout-trainer-mismatch)",
                file=sys.stderr,
            )
        if (
            self.eval_data is not None
            and self.cfg.eval_every
            and ((i + 1) % self.cfg.eval_every == 0 or i + 1 == self.cfg.steps)
        ):
            record.update(self.evaluate(i + 1))
        return record

    def evaluate(self, steps_done: int) -> dict[str, float]:
        """The run's evaluation after `steps_done` steps: the `evaluate` hook's, else the built-in one."""
        return self._evaluation(self, steps_done) if self._evaluation is not None else self._evaluate_rewards()

    def _evaluate_rewards(self) -> dict[str, float]:
        """Mean reward (and cost) of greedy and of sampled responses to the eval prompts, with the current actor."""
        assert self.roles is not None and self.eval_data is not None
        roles, t0 = self.roles, time.perf_counter()
        prompts = self.eval_data.eval_batch(self.cfg.eval_prompts)
        n = len(prompts)
        scorers = [("reward", roles.reward.compute_reward, "rewards")]
        if roles.cost is not None:
            scorers.append(("cost", roles.cost.compute_cost, "costs"))
        prompts, _ = prompts.pad_to_multiple(
            math.lcm(*(g.layout.dp for g in (roles.actor, roles.reward, roles.cost) if g is not None))
        )
        calls = {}
        for mode, spec in (("greedy", GenerationSpec(greedy=True)), ("sampled", GenerationSpec())):
            samples = roles.actor.generate_sequences(prompts, spec)
            for name, score, key in scorers:
                calls[f"eval/{name}_{mode}"] = (score(samples), key)
        out = {k: float(call.result()[key][:n].float().mean()) for k, (call, key) in calls.items()}
        return {**out, "eval_s": time.perf_counter() - t0}

    def run(self) -> list[dict]:
        from tqdm import tqdm

        self.build(resuming=self.resume_from is not None)  # no warm start when the checkpoint replaces it
        if self.resume_from is not None:
            self.start = self.load(self.resume_from)
        else:
            self.start_pipeline(self.start)
        if self.metrics_file is not None:
            self.metrics_file.restart_at(self.start)
        bar = tqdm(total=self.cfg.steps, initial=self.start, desc=self.algo.name, file=sys.stderr, dynamic_ncols=True)
        i = self.start
        if self.evaluate_first:
            self.evaluate(i)
        try:
            while i < self.cfg.steps:
                try:
                    record = self.one_step(i)
                    if self.store and self.cfg.checkpoint.save_every and (i + 1) % self.cfg.checkpoint.save_every == 0:
                        record["checkpoint_s"] = self.save(i + 1)
                except fa.WorkerLostError as e:
                    if _INTERRUPTED.is_set():  # the signal reached the workers too: nothing to recover from
                        raise Interrupted(_SIGNAL[0]) from e
                    self.recover(e)
                    i = self.start
                    bar.n = i
                    continue
                self.record(record)
                bar.update(1)
                bar.set_postfix({k: f"{record[k]:.3f}" for k in self.algo.key_metrics if k in record})
                i += 1
        finally:
            bar.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
        if self.pipeline is not None:
            self.pipeline.drain()
        if self.cfg.export_dir:
            path = self.roles.actor.export_hf(str(Path(self.cfg.export_dir).resolve())).result()
            print(f"[{self.algo.name}] trained policy written to {path} (a Hugging Face folder)", file=sys.stderr)
        print_summary(self.algo.name, self.history, self.algo.key_metrics, self.algo.summary_notes(self.history))
        return self.history

    def record(self, record: dict) -> None:
        """A finished step goes to the history, the dashboard, the metrics file and TensorBoard at once."""
        self.history.append(record)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        self.ctl.report_metrics(record["step"], scalars)
        if self.metrics_file is not None:
            self.metrics_file.append(record)
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, record["step"])


def task_settings(cfg: RLConfig) -> tuple[str, list[str]]:
    """The settings the run's task asks for (algorithms.data.tasks.Task.settings), applied unless given."""
    task = get_task(cfg.task)
    return f"[{task.name}] the task's settings", [f"{k}={v}" for k, v in task.settings]


FLEET_METRICS = ("fleet/replicas", "fleet/joined", "fleet/left", "fleet/requeued")


def charted_metrics(algo: Algorithm) -> tuple[str, ...]:
    """The metrics the dashboard charts: the algorithm's key metrics, and an elastic fleet's size and changes over
    time where the run has one."""
    fleet = getattr(getattr(algo, "cfg", None), "async_rl", None)
    extra = FLEET_METRICS if fleet is not None and fleet.replicas else ()
    return (*algo.key_metrics, *extra)


def run_program(
    algo_cls: type[Algorithm], preset: Callable[[], RLConfig], argv: Sequence[str] | None, description: str
) -> list[dict]:
    """Parse the command line onto the preset, check it, open the cluster, and run the algorithm to the end.

    A user's mistake exits with status 2 and one line (algorithms.run.cli); `--debug` shows the traceback. What can
    be decided without a cluster is, before it starts: the settings, the checkpoint to resume from (verified) and
    whether its settings allow the resume. The checkpoint directory is locked for the run. Ctrl-C and SIGTERM
    unwind it all (workers, cluster, lock, temporary files) and end with one line saying what was saved and where
    the metrics are (exit status 130 / 143); a second Ctrl-C while that runs exits at once."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg: RLConfig | None = None
    runner: Runner | None = None
    name = algo_cls.name
    try:
        with user_errors(args, lambda: cfg, name), contextlib.ExitStack() as stack:
            cfg = parse_args(args, preset, description, task_settings)
            run_plan = check_before_start(cfg)
            data, eval_data = prompt_data(cfg)
            store, ckpt, changes = None, None, []
            if cfg.checkpoint.dir:
                store = CheckpointStore(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last)
                store.acquire()
                stack.callback(store.release)
                ckpt = store.resolve(cfg.checkpoint.resume)
                if ckpt is not None:
                    changes = check_resumable(ckpt.controller_state()["config"], cfg)
            fa.configure_logging(cfg.log_format, cfg.log_level)  # before the cluster starts: workers inherit it
            stack.enter_context(_interrupts_as_exit())
            algo = algo_cls(cfg)
            ctl = stack.enter_context(open_controller(cfg))
            stack.callback(_quiet_workers, ctl)  # runs before the controller closes: quiet, if interrupted
            # the SFT export: inside the run's checkpoint directory when there is one (a killed controller's
            # leftover is found and removed by the next run there), else a temporary directory removed on any exit
            if store is not None:
                for stale in Path(cfg.checkpoint.dir).glob(".sft-*"):  # the lock says no other run uses them
                    shutil.rmtree(stale, ignore_errors=True)
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(
                    prefix=".sft-" if store else "flowactors-", dir=cfg.checkpoint.dir if store else None
                )
            )
            if cfg.dashboard and ctl.dashboard_link:
                from algorithms.run.dashboard_style import ROLE_COLORS
                from flowactors.dashboard import install_dashboard

                page = install_dashboard(ctl.client, metrics=charted_metrics(algo), role_colors=ROLE_COLORS)
                print(
                    f"[{algo.name}] Dask dashboard: {ctl.dashboard_link} (dataflow, slots, metrics: {page})",
                    file=sys.stderr,
                )
            runner = Runner(
                algo,
                ctl,
                Path(tmp),
                data,
                eval_data=eval_data,
                store=store,
                resume_from=ckpt,
                changes=changes,
                run_plan=run_plan,
            )
            return runner.run()
    except KeyboardInterrupt as e:  # `Interrupted`, or a Ctrl-C before its handler was installed
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{name}: {interrupted_note(signum, runner)}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except Exception:
        # The signal's `Interrupted` can be raised where Python ignores exceptions (a finalizer the garbage collector
        # ran in the main thread); what fails next (the workers got the signal too) is the interrupt's doing.
        if not _INTERRUPTED.is_set():
            raise
        print(f"{name}: {interrupted_note(_SIGNAL[0], runner)}", file=sys.stderr)
        raise SystemExit(128 + _SIGNAL[0]) from None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM reached the controller: the run unwinds and ends with one line (`run_program`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted_note(signum: int, runner: "Runner | None") -> str:
    """The one line an interrupted run ends with: where it stopped, what was saved, where the metrics are."""
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if runner is None:
        return f"interrupted ({how}) while starting: nothing ran, nothing was saved"
    done = [r["step"] for r in runner.history]
    where = f"after {done[-1] + 1} of {runner.cfg.steps} steps" if done else "before its first step"
    saved = runner.store.steps() if runner.store is not None else []
    if saved:
        ckpt = (
            f"the checkpoint of step {saved[-1]} is in {runner.cfg.checkpoint.dir} (--resume auto "
            f"--checkpoint-dir {runner.cfg.checkpoint.dir} continues from it)"
        )
    elif runner.store is not None:
        ckpt = f"no checkpoint was saved yet in {runner.cfg.checkpoint.dir} (save_every={runner.cfg.checkpoint.save_every})"
    else:
        ckpt = "no checkpoint (--checkpoint-dir D save_every=N saves them)"
    metrics = (
        f"metrics of {len(done)} steps in {runner.cfg.metrics_file}"
        if runner.cfg.metrics_file
        else "no metrics file (--metrics-file F keeps them)"
    )
    return f"interrupted ({how}) {where}; {ckpt}; {metrics}"


@contextlib.contextmanager
def _interrupts_as_exit() -> Iterator[None]:
    """Ctrl-C and SIGTERM (a scheduler's cancel, `kill`) raise `Interrupted` in the main thread, so temporary files,
    the cluster and the lock are cleaned up; only SIGKILL skips that. While that runs, Dask's and flowactors' own
    complaints about connections closing are silenced, and a second Ctrl-C exits at once. Only the main thread can
    install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, _exit_now)
        signal.signal(signal.SIGTERM, _exit_now)
        _INTERRUPTED.set()
        _SIGNAL[0] = signum
        _quiet_logs()
        threading.excepthook = lambda args: None  # the direct path's reader threads, as their connections close
        raise Interrupted(signum)

    _INTERRUPTED.clear()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _exit_now(signum: int, frame: Any) -> None:
    print(f"\ninterrupted again ({signal.Signals(signum).name}): exiting without cleaning up", file=sys.stderr)
    import os

    os._exit(128 + signum)


_INTERRUPTED = threading.Event()
_SIGNAL = [int(signal.SIGINT)]  # the signal that set _INTERRUPTED


def _quiet_logs(dask_worker: Any = None) -> None:
    """An interrupted run is closing on purpose: what Dask, tornado and flowactors log in this process about the
    connections and workers going away is not news to the user (run on the workers too, `_quiet_workers`)."""
    import logging

    import structlog

    for logger in ("distributed", "tornado", "asyncio"):
        logging.getLogger(logger).setLevel(logging.CRITICAL + 1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def _quiet_workers(ctl: fa.Controller) -> None:
    """After an interrupt, before the controller closes: the workers stop logging too (their heartbeats and calls
    fail as the scheduler goes). A worker that is already gone is skipped."""
    if _INTERRUPTED.is_set():
        with contextlib.suppress(Exception):
            ctl.client.run(_quiet_logs, on_error="ignore")
