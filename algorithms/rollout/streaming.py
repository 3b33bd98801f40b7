"""Streaming partial rollouts (`partial_rollout=true async_rl.deterministic=false`): the replicas decode without
pause and each step's batch is formed from the first groups to finish, on any replica.

The deterministic pipeline (algorithms.rollout.asynchronous.RolloutPipeline) issues each step's rollout on a fixed
schedule: every replica decodes until its own share of the step's groups has finished, then waits for the next
call, and a new version reaches a replica only after the rollouts issued before it. Here instead every replica
runs a decode loop in a thread of its own (engines.rollout.decode_loop, `ActorWorker.stream_partial`), a segment
at a time over everything it holds; the controller polls the replicas for finished groups, keeps them in arrival
order, and gives each step the first `prompts_per_step` of them, then admits as many fresh groups to the replicas
that handed groups out. A weight sync is issued as soon as the trainer's update is, and lands on each replica
between two segments: a replica never waits for the schedule, and a replica with short responses contributes
more of a step's groups than one with long ones. The price: which version samples which segment, and which groups
a step trains on, depend on timing, so two runs differ (the deterministic mode's cost is measured in
benchmarks/async.py). What holds regardless: every token records its version and behaviour log-prob, the
per-token staleness bound masks older tokens, and the prompt ledger checks that every group is trained once
(`async/duplicates`, `async/lost`), across checkpoints and resumes too.
"""

from __future__ import annotations

from typing import Any

import torch

import flowactors as fa
from algorithms.rollout.asynchronous import (
    Generated,
    PromptLedger,
    RolloutPipeline,
    _batch,
    _plain,
    prompts_of,
)
from engines import GenerationSpec
from engines.fields import POLICY_VERSIONS, RESPONSE_MASK
from engines.rollout.partial import PROMPT_UID
from flowactors import Batch

__all__ = ["StreamingRollouts"]

POLL_WAIT_S = 0.2
"""How long a replica waits for a group to finish before answering a poll with none (the controller then polls
again): bounds both the controller's polling rate and how long a weight sync queued behind a poll waits."""


class StreamingRollouts(RolloutPipeline):
    """The rollout pipeline in streaming mode (see the module docstring); the same calls as RolloutPipeline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.rollout is not None and (self.rollout.layout.tp > 1 or self.rollout.layout.pp > 1):
            raise ValueError(
                "streaming partial rollouts need whole-copy replicas (rollout_tp=0): a generation TP group decodes "
                "in lockstep; set async_rl.deterministic=true for replicas with a generation layout"
            )
        self.replicas = self.rollout.world_size if self.rollout is not None else 0
        self._reset()

    def _reset(self) -> None:
        self.buffer: list[Batch] = []  # finished groups (one Batch each), in arrival order
        self.owed = [0] * self.replicas  # groups each replica handed out and has not been given back
        self.pending = [Batch() for _ in range(self.replicas)]  # fresh groups for each replica's next poll
        self.held: list[list[int]] = [[] for _ in range(self.replicas)]  # uids each replica held at the last poll
        self.inflight: fa.CallFuture | None = None
        self.version = 0
        self._metrics: dict[int, dict[str, float]] = {}

    # -- the calls ----------------------------------------------------------------------------------------------
    def start(self, step: int, state: dict[str, Any] | None = None) -> None:
        self.queue.clear()
        self._syncs.clear()
        self._reset()
        self._first_version = self.version = step
        self._sync_weights(step)
        if state is not None and "fleet" in state:
            raise ValueError(
                "this checkpoint holds an elastic fleet's rollouts (saved with async_rl.replicas); resume it with "
                "async_rl.replicas"
            )
        if state is not None and "partial" in state and "stream" not in state:
            raise ValueError(
                "this checkpoint holds deterministic partial rollouts (saved with async_rl.deterministic=true, or "
                "before streaming existed); resume it with async_deterministic=true"
            )
        if state is not None and "stream" in state:
            self.rollout.load_partial_state(state["partial"])
            self.ledger = PromptLedger.from_state(state["ledger"])
            self._next_uid = int(state["next_uid"])
            self.buffer = [_batch(b) for b in state["stream"]["buffer"]]
            self.owed = [int(n) for n in state["stream"]["owed"]]
        else:  # a step's groups and the surplus, shared evenly
            fresh = self._draw(self.batch[0] + self.surplus)
            self.owed = [len(fresh) for fresh in _shares(int(fresh["group"].max()) + 1, self.replicas)]
            self._admit(fresh)
        self._poll(0.0)  # starts every replica's decode loop

    def take(self, i: int) -> Generated:
        need = self.batch[0]
        if self.inflight is not None:  # the poll that admitted the last fresh groups: the held uids include them
            self._collect()
        while len(self.buffer) < need:
            if self.inflight is None:
                self._poll(POLL_WAIT_S)
            self._collect()
            if len(self.buffer) < need and not any(self.held):
                raise RuntimeError(
                    f"the rollout replicas hold nothing and {len(self.buffer)} finished groups are waiting, but "
                    f"step {i} needs {need}: the pipeline lost track of its prompts (a bug)"
                )
        taken, self.buffer = self.buffer[:need], self.buffer[need:]
        samples = Batch.concat(
            [Batch({**b.tensors, "group": torch.full_like(b["group"], g)}, b.rows, b.meta) for g, b in enumerate(taken)]
        )
        self._metrics[i] = self._ledger(samples)
        self._admit(self._draw(need))
        self._poll(0.0)  # the fresh groups reach the replicas now: they decode while the trainer trains
        greedy = self._greedy(prompts_of(samples)) if self.greedy_baseline else None
        mask = samples[RESPONSE_MASK].bool()
        oldest = int(samples[POLICY_VERSIONS][mask].min()) if mask.any() else self.version
        self._taken[i] = Generated(i, oldest, samples, greedy, self.bound)
        return self._taken[i]

    def _greedy(self, prompts: Batch) -> fa.CallFuture:
        """Whole greedy responses to `prompts` by the replicas' current version (ReMax's baseline)."""
        return self.rollout.generate_sequences(prompts, GenerationSpec(greedy=True))

    def after_update(self, i: int) -> None:
        """Step i's update is issued: sync version i + 1 at once (it lands between two segments)."""
        self.version = i + 1
        self._sync_weights(i + 1)

    def sync_metrics(self, i: int) -> dict[str, float]:
        out: dict[str, float] = {}
        done = max(i, self._first_version)  # synced before step i's update: finished by now
        if done in self._syncs:
            loads = self._syncs[done].result()
            out["async/sync_bytes"] = float(sum(r["bytes"] for r in loads))
            out["async/sync_s"] = max(r["seconds"] for r in loads)
        for v in [v for v in self._syncs if v <= done]:
            del self._syncs[v]
        self._taken.pop(i, None)
        out.update(self._metrics.pop(i, {}))
        return out

    def drain(self) -> None:
        if self.inflight is not None:
            self._collect()
        self.rollout.stop_streaming().result()

    def state_dict(self) -> dict[str, Any]:
        if self.inflight is not None:
            self._collect()
        return {
            "partial": self.rollout.partial_state().result(),  # each replica between two segments
            "ledger": self.ledger.state_dict(),
            "next_uid": self._next_uid,
            "stream": {"buffer": [_plain(b) for b in self.buffer], "owed": list(self.owed)},
            "staleness": self.staleness,
            "bound": self.bound,
            "in_flight": [],
        }

    # -- the replicas -------------------------------------------------------------------------------------------
    def _admit(self, prompts: Batch) -> None:
        """Give each fresh group to the replica that handed out the most groups not yet given back (so every replica
        keeps holding about as many as it started with)."""
        rows: list[list[int]] = [[] for _ in range(self.replicas)]
        groups = prompts["group"]
        for g in groups.unique().tolist():
            r = max(range(self.replicas), key=lambda k: (self.owed[k], -k))
            self.owed[r] -= 1
            rows[r] += (groups == g).nonzero().flatten().tolist()
        for r in range(self.replicas):
            if rows[r]:
                mine = prompts.take(rows[r])
                self.pending[r] = Batch.concat([self.pending[r], mine]) if len(self.pending[r]) else mine

    def _poll(self, wait_s: float) -> None:
        self.inflight = self.rollout.stream_partial(
            self.pending, [self.segment] * self.replicas, [wait_s] * self.replicas
        )
        self.pending = [Batch() for _ in range(self.replicas)]

    def _collect(self) -> None:
        """The finished groups of the poll in flight, into the buffer."""
        assert self.inflight is not None
        outs, self.inflight = self.inflight.result(), None
        for r, out in enumerate(outs):
            self.held[r] = [int(u) for u in out["held"]]
            samples = out["samples"]
            if not len(samples):
                continue
            groups = samples["group"]
            for g in groups.unique().tolist():
                self.buffer.append(samples.take((groups == g).nonzero().flatten().tolist()))
                self.owed[r] += 1

    def _ledger(self, samples: Batch) -> dict[str, float]:
        """Exactly once, checked at a step: the groups it trains that an earlier step had (duplicates), and the
        groups drawn so far that are neither trained, nor finished and waiting, nor held by a replica (lost)."""
        duplicates = self._train(samples)
        waiting = [int(b[PROMPT_UID][0]) for b in self.buffer]
        held = self._held_uids() + waiting
        return {
            "async/duplicates": float(duplicates),
            "async/lost": float(self.ledger.lost(self._next_uid, held)),
            "async/held_groups": float(len(held)),
            "async/trained_groups": float(samples[PROMPT_UID].unique().numel()),
        }

    def _held_uids(self) -> list[int]:
        """The groups the replicas hold (at their last poll)."""
        return [u for rank in self.held for u in rank]


def _shares(n: int, parts: int) -> list[range]:
    """n items shared out as evenly as parts allow (the first ones take one more)."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for p in range(parts):
        size = base + (p < extra)
        out.append(range(at, at + size))
        at += size
    return out
