"""An elastic rollout fleet (`async_rl.replicas=MIN:MAX`): rollout replicas that join and leave a running job.

Each replica is a one-rank group of its own (`fa.ActorGroup(own_world=True)`) on a pool worker, a Dask worker that
carries the `rollout` resource and no slot: the trainer's groups keep every slot and never change. Workers arrive
and go as Dask brings them (`cluster.scale`, a jobqueue's `adapt`, `dask worker --resources rollout=1` against an
`--address` cluster, a node preempted); on the embedded cluster the fleet asks for them itself (`Autoscale`).

- **Join**: a worker that arrives is built into a replica in the background (its model loads while the run goes
  on), then takes the current weights from a peer replica, not from the trainer (`peer.policy_weights()` chained
  into its `load_policy`, worker to worker), and from then on fresh prompt groups and every later version.
- **Leave**: a replica whose worker dies loses only what it held unfinished: those prompt groups, kept by the
  controller until they come back finished, go back to the prompt stream (to the replicas holding least) and are
  generated again under the same ledger ids. A graceful retire (the autoscaler's scale-down) first collects what
  the replica finished, then requeues only its unfinished groups, then closes the worker.
- **Exactly once**: the streaming pipeline's ledger (`async/duplicates`, `async/lost`), with the groups waiting to
  be requeued counted as held; metrics `fleet/replicas`, `fleet/joined`, `fleet/left`, `fleet/requeued`,
  `fleet/join_s` (a worker's arrival to its first finished group, the replica's own clock from its first call) and `fleet/join_trainer_bytes` (what a join fetched from
  the trainer's workers: 0).

Weight syncs go over the workers' transport (`policy_weights` into `load_policy`), not over the sharded sync's
process group: that is a collective formed over fixed ranks, which a replica that dies mid-sync would leave
hanging. They go down a tree: the trainer sends `RELAY_FANOUT` copies, replicas pass them on.
docs/asynchronous.md#an-elastic-fleet.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import flowactors as fa
from algorithms.rollout.asynchronous import _batch, _plain
from algorithms.rollout.streaming import StreamingRollouts
from engines import GenerationSpec
from engines.rollout.partial import PROMPT_UID
from flowactors import Batch

__all__ = ["Autoscale", "FleetRollouts", "RESOURCE"]

RESOURCE = "rollout"
"""The Dask resource a pool worker carries to be a rollout replica (`dask worker --resources rollout=1`)."""
PRELOAD = ("engines.preload",)
"""What the pool workers the fleet asks for import before they register (engines/preload.py)."""
CHECK_S = 0.5
"""How often the fleet asks the scheduler for arrivals (a worker that died is reported at once, by its calls)."""
JOIN_CHECK_S = 0.005
"""How often the controller, waiting for polls while a replica builds, looks whether they finished (it waits with
the fleet's lock released, so the replica joins meanwhile)."""
RELAY_FANOUT = 2
"""How many replicas the trainer sends a weight sync to, and each of those passes it on to (a tree)."""
WAIT_S = 600.0
"""How long a step waits for a replica when the fleet has none, before the run fails."""


@dataclass
class Replica:
    group: fa.ActorGroup
    address: str
    arrived: float
    assigned: dict[int, None] = field(default_factory=dict)  # uids admitted and not handed back finished, in order
    pending: list[Batch] = field(default_factory=list)  # fresh groups for its next poll
    polled: bool = False
    join_load: fa.CallFuture | None = None  # its load of a peer's weights, until measured
    first_poll: float | None = None  # when its first poll was issued


class _Loads:
    """One version's `load_policy` calls on the replicas, read like one call's result (the lost ones left out, and
    those of replicas that left since: their results are not asked for, a retired worker's are gone with it)."""

    def __init__(self, calls: list[tuple[Replica, fa.CallFuture]], fleet: list[Replica]) -> None:
        self.calls, self.fleet = calls, fleet

    def result(self) -> list[dict]:
        out = []
        for replica, c in self.calls:
            if replica not in self.fleet:
                continue
            try:
                out += c.result()
            except fa.WorkerLostError:
                pass
        return out or [{"bytes": 0.0, "seconds": 0.0}]


class Autoscale:
    """The embedded cluster's scaling rule: grow the fleet by one (up to MAX) after a step that waited for
    rollouts longer than `grow_wait_s`; retire one (down to MIN) after `calm_steps` steps in a row that found a
    whole further step's groups already finished. One change at a time: nothing while a join is under way."""

    def __init__(self, low: int, high: int, grow_wait_s: float = 0.5, calm_steps: int = 3) -> None:
        self.low, self.high, self.grow_wait_s, self.calm_steps = low, high, grow_wait_s, calm_steps
        self.calm = 0

    def decide(self, size: int, waited_s: float, spare_groups: int, step_groups: int, joining: bool) -> int:
        """+1, -1 or 0 replicas, after a step that waited `waited_s` for its groups and left `spare_groups` finished
        groups waiting."""
        self.calm = self.calm + 1 if spare_groups >= step_groups and waited_s == 0 else 0
        if joining:
            return 0
        if size < self.low:
            return 1
        if waited_s > self.grow_wait_s and size < self.high:
            self.calm = 0
            return 1
        if self.calm >= self.calm_steps and size > self.low:
            self.calm = 0
            return -1
        return 0


def _locked(method: Callable) -> Callable:
    """A pipeline call made under the fleet's lock: a replica that finished building joins from the builder's
    thread (under the same lock) whenever the controller is not inside one, e.g. while the trainer trains."""

    @functools.wraps(method)
    def run(self: FleetRollouts, *args: Any, **kwargs: Any) -> Any:
        with self._owning():
            if self._join_error is not None:
                error, self._join_error = self._join_error, None
                raise error
            return method(self, *args, **kwargs)

    return run


class FleetRollouts(StreamingRollouts):
    """Streaming partial rollouts over an elastic fleet (see the module docstring); the pipeline's calls."""

    def __init__(
        self,
        *args: Any,
        make_replica: Callable[[str, str], fa.ActorGroup],
        bounds: tuple[int, int],
        **kwargs: Any,
    ) -> None:
        """`make_replica(name, address)`: a replica group on a pool worker; `bounds`: (MIN, MAX) replicas."""
        super().__init__(*args, **kwargs)
        self.make_replica, self.bounds = make_replica, bounds
        self.scaler = Autoscale(*bounds) if hasattr(self.ctl.cluster, "worker_spec") else None
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="fleet-join")
        self.fleet: list[Replica] = []
        self._building: dict[str, tuple[float, Future, bool]] = {}  # address -> (arrived, build, at the start)
        self._lock = threading.Lock()  # the fleet's state: the pipeline's calls and a join from the builder's thread
        self._holder: int | None = None  # the thread that holds it
        self._join_error: BaseException | None = None  # a join's failure that is the run's (a trainer worker lost)
        self._closing = False
        self._seen_dead: set[str] = set()
        self._names = 0
        self._checked = 0.0
        self._counts = {"joined": 0, "left": 0, "retired": 0, "requeued": 0}  # retired: left gracefully
        self._join_s: list[float] = []
        self._join_bytes: list[tuple[float, float]] = []
        self._build_s: list[float] = []
        self._waited = 0.0
        self._empty_since: float | None = None
        self._started: float | None = None
        self._startup_s: float | None = None
        self.prompts: dict[int, Batch] = {}  # every group admitted and not handed back finished, by uid
        self.requeue: list[int] = []  # uids waiting for a replica

    @contextmanager
    def _owning(self) -> Iterator[None]:
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    # -- the pipeline's calls ---------------------------------------------------------------------------------------
    @_locked
    def start(self, step: int, state: dict[str, Any] | None = None) -> None:
        if state is not None and "fleet" not in state:
            raise ValueError(
                "this checkpoint holds rollouts of fixed replicas (saved without async_rl.replicas); resume it "
                "without async_rl.replicas, with the same placement"
            )
        self.queue.clear()
        self._syncs.clear()
        self._reset()
        self.inflight = None
        self.prompts, self.requeue = {}, []
        self._first_version = self.version = step
        self._started = time.perf_counter()  # the run's start-up of its replicas, from here to their first samples
        if self.scaler is not None:
            self._resize(self.bounds[0])
        deadline = time.monotonic() + WAIT_S
        while len(self.fleet) < self.bounds[0]:  # the first MIN replicas, built at once
            self._arrivals(first=True)
            self._settle_first()
            if time.monotonic() > deadline:
                raise RuntimeError(self._none_message())
            if len(self.fleet) < self.bounds[0]:
                time.sleep(0.2)
        self._sync_weights(step)
        if state is not None:
            self.ledger_from(state)
        else:
            self._admit(self._draw(self.batch[0] + self.surplus))
        self._poll(0.0)

    def ledger_from(self, state: dict[str, Any]) -> None:
        """A checkpoint's fleet state: the ledger, the finished groups waiting, and every group the replicas held,
        requeued (the replicas at a resume are whichever workers are there: unfinished sequences start over)."""
        from algorithms.rollout.asynchronous import PromptLedger

        self.ledger = PromptLedger.from_state(state["ledger"])
        self._next_uid = int(state["next_uid"])
        self.buffer = [_batch(b) for b in state["fleet"]["buffer"]]
        held = [_batch(b) for b in state["fleet"]["held"]]
        for b in held:
            self.prompts[int(b[PROMPT_UID][0])] = b
        self._admit(Batch.concat(held) if held else Batch())

    @_locked
    def take(self, i: int):
        t0 = time.perf_counter()
        self._waited = 0.0
        ready_before = len(self.buffer)
        out = super().take(i)
        if ready_before < self.batch[0]:
            self._waited = time.perf_counter() - t0
        metrics = self._metrics.setdefault(i, {})
        metrics.update(self._fleet_metrics())
        if self.scaler is not None:
            change = self.scaler.decide(
                len(self.fleet), self._waited, len(self.buffer), self.batch[0], bool(self._building)
            )
            if change > 0:
                self._resize(len(self.fleet) + len(self._building) + 1)
            elif change < 0:
                self._retire(min(self.fleet, key=lambda r: (len(r.assigned), -self.fleet.index(r))))
        return out

    @_locked
    def after_update(self, i: int) -> None:
        self.version = i + 1
        self._sync_weights(i + 1)

    @_locked
    def sync_metrics(self, i: int) -> dict[str, float]:
        return super().sync_metrics(i)

    def drain(self) -> None:
        with self._owning():
            self._closing = True  # a build that finishes from here on is closed, not joined
            if self.inflight is not None:
                self._collect()
            for r in list(self.fleet):
                try:
                    r.group.stop_streaming().result()
                except fa.WorkerLostError:
                    pass
        self._builder.shutdown(wait=True, cancel_futures=True)  # (outside the lock, which a finished build takes)

    @_locked
    def state_dict(self) -> dict[str, Any]:
        if self.inflight is not None:
            self._collect()
        return {
            "ledger": self.ledger.state_dict(),
            "next_uid": self._next_uid,
            "fleet": {
                "buffer": [_plain(b) for b in self.buffer],
                "held": [_plain(self.prompts[u]) for u in sorted(self.prompts)],
            },
            "staleness": self.staleness,
            "bound": self.bound,
            "in_flight": [],
        }

    def _resize(self, n: int) -> None:
        self.ctl.resize_pool(RESOURCE, n, PRELOAD)

    # -- joins ------------------------------------------------------------------------------------------------------
    def _arrivals(self, first: bool = False) -> None:
        """Start building a replica on every pool worker that arrived (up to MAX, joins included): in the
        background, where it joins the fleet as soon as it is built (`first`: the run's start, which waits for its
        builds, `_settle_first`)."""
        self._checked = time.monotonic()
        known = {r.address for r in self.fleet} | set(self._building)
        for address in self.ctl.workers_with(RESOURCE):
            if address in known or address in self._seen_dead or address in self.ctl.leaving:
                continue
            if len(self.fleet) + len(self._building) >= self.bounds[1]:
                break
            self._names += 1
            name, arrived = f"rollout-{self._names}", time.perf_counter()
            job = self.make_replica if first else functools.partial(self._build_and_join, arrived=arrived)
            self._building[address] = (arrived, self._builder.submit(job, name, address), first)

    def _built(self, address: str, build: Callable[[], fa.ActorGroup]) -> fa.ActorGroup | None:
        """The group `build` makes on `address`, or None (said why) where it could not be built."""
        try:
            return build()
        except (fa.WorkerLostError, fa.RemoteError, fa.PlacementError, fa.HangError) as e:
            self._seen_dead.add(address)
            if address in self.ctl.lost_workers:
                self.ctl.forget_lost(address)
            print(f"[fleet] a replica on {address} could not be built: {e}", file=sys.stderr)
            return None

    def _settle_first(self) -> None:
        """The run's start: its builds, waited for, join the fleet (its first sync brings them the trainer's
        weights)."""
        for address, (arrived, build, first) in list(self._building.items()):
            if not first:  # a join from before (a restart): it joins by itself
                continue
            del self._building[address]
            group = self._built(address, build.result)
            if group is not None:
                self._build_s.append(time.perf_counter() - arrived)
                self.fleet.append(Replica(group, address, arrived))

    def _build_and_join(self, name: str, address: str, arrived: float) -> None:
        """The builder's thread: build a replica on a worker that joined mid-run, then, under the fleet's lock (at
        once unless a pipeline call is running), give it a peer's weights and its share of groups, and poll it if
        polls are in flight: it starts decoding now, not at the next step."""
        group = self._built(address, lambda: self.make_replica(name, address))
        with self._owning():
            self._building.pop(address, None)
            if group is None:
                return
            if self._closing:
                group.close(wait=False)
                return
            try:
                self._join(Replica(group, address, arrived))
            except BaseException as e:  # the run's failure (a trainer worker lost): raised at the next call
                self._join_error = e

    def _join(self, replica: Replica) -> None:
        self._build_s.append(time.perf_counter() - replica.arrived)
        if not self._load_weights(replica):
            return
        self.fleet.append(replica)
        self._top_up()
        self._counts["joined"] += 1
        print(f"[fleet] a replica joined on {replica.address} ({len(self.fleet)} now)", file=sys.stderr)
        if self.inflight is not None:
            self._issue_poll(replica, 0.0, self.inflight)

    def _load_weights(self, replica: Replica) -> bool:
        """A joining replica takes the current weights from a peer (it has every version issued so far, in order),
        or the trainer's where no peer is left; False when the joiner itself was lost meanwhile."""
        while True:
            peer = self.fleet[0] if self.fleet else None
            source = peer.group.policy_weights if peer is not None else self.actor.policy_weights
            try:
                load = replica.group.load_policy(source(), self.version)
            except fa.WorkerLostError as e:
                if peer is None and e.address != replica.address:
                    raise  # a trainer worker: the run recovers from it
                if e.address == replica.address:
                    self._seen_dead.add(replica.address)
                    replica.group.close(wait=False)
                    if replica.address in self.ctl.lost_workers:
                        self.ctl.forget_lost(replica.address)
                    return False
                self._lose(peer)  # the peer died: the next one
                continue
            if peer is not None:
                replica.join_load = load
            return True

    def _joined_at(self, r: Replica, seconds: float) -> None:
        """`r` generated its first samples `seconds` after its worker arrived (the replica's own clock from its
        first call, so the controller's once-a-step collection does not count)."""
        self._join_s.append(seconds)
        if self._started is not None:  # the first replica of a start: the whole start-up, asked to ready
            self._startup_s = r.arrived - self._started + seconds
            self._started = None

    def _top_up(self) -> None:
        """A replica that joins gets its share of groups at once (fresh ones, drawn now), as far as the fleet holds
        less than a share per replica: a fleet that grows holds more, so that every replica has work (the share:
        what each of the first MIN replicas started with)."""
        share = -(-(self.batch[0] + self.surplus) // self.bounds[0])
        extra = min(share, share * len(self.fleet) - len(self._held_uids()))
        if extra > 0:
            self._admit(self._draw(extra))

    def _measure_join(self, replica: Replica) -> None:
        """What the join's weight load fetched, from the trainer's workers and from peers."""
        call, replica.join_load = replica.join_load, None
        if call is None:
            return
        sizes = self.ctl.fetched_bytes(call)
        trainer = set(self.actor.addresses)
        self._join_bytes.append(
            (
                float(sum(n for a, n in sizes.items() if a in trainer)),
                float(sum(n for a, n in sizes.items() if a not in trainer)),
            )
        )

    # -- leaves -----------------------------------------------------------------------------------------------------
    def _lose(self, replica: Replica) -> None:
        """A replica's worker died: its unfinished groups go back to the prompt stream."""
        if replica not in self.fleet:
            return
        self.fleet.remove(replica)
        self._seen_dead.add(replica.address)
        replica.group.close(wait=False)
        try:
            self.ctl.forget_lost(replica.address)
        except fa.PlacementError:
            pass
        self._counts["left"] += 1
        self._requeue(list(replica.assigned))
        print(
            f"[fleet] the replica on {replica.address} was lost; {len(replica.assigned)} groups requeued",
            file=sys.stderr,
        )

    def _retire(self, replica: Replica) -> None:
        """A graceful leave: collect what it finished, requeue only the rest, close its worker."""
        if self.inflight is not None:
            self._collect()
        if replica not in self.fleet:  # lost meanwhile
            return
        self.fleet.remove(replica)
        try:
            out = replica.group.hand_back().result()[0]
            self._take_finished(replica, out["samples"])
            self._counts["retired"] += 1
        except fa.WorkerLostError:
            pass
        self._counts["left"] += 1
        self._requeue(list(replica.assigned))
        replica.group.close(wait=False)
        self._seen_dead.add(replica.address)
        self.ctl.retire_worker(replica.address)

    def _requeue(self, uids: list[int]) -> None:
        self._counts["requeued"] += len(uids)
        self.requeue += uids

    # -- the streaming pipeline's replica calls ---------------------------------------------------------------------
    def _admit(self, prompts: Batch) -> None:
        """Each fresh group to the replica holding fewest; none there: they wait for one."""
        if not len(prompts):
            return
        groups = prompts["group"]
        for g in groups.unique().tolist():
            rows = prompts.take((groups == g).nonzero().flatten().tolist())
            uid = int(rows[PROMPT_UID][0])
            self.prompts[uid] = rows
            self._give(uid)

    def _give(self, uid: int) -> None:
        if not self.fleet:
            self.requeue.append(uid)
            return
        r = min(self.fleet, key=lambda r: (len(r.assigned), self.fleet.index(r)))
        r.assigned[uid] = None
        r.pending.append(self.prompts[uid])

    def _poll(self, wait_s: float) -> None:
        if time.monotonic() - self._checked > CHECK_S:
            self._arrivals()
        leaving = set(self.ctl.leaving)
        for r in [r for r in self.fleet if r.address in leaving]:  # told to stop (SIGTERM): a graceful leave
            print(f"[fleet] the replica on {r.address} was told to stop; retiring it", file=sys.stderr)
            self._retire(r)
        waiting, self.requeue = self.requeue, []
        for uid in waiting:
            self._give(uid)
        calls: dict = {}
        for r in list(self.fleet):
            self._issue_poll(r, wait_s, calls)
        if not calls:  # no replica: wait for one (asking the cluster for MIN again, where the fleet can)
            now = time.monotonic()
            if self._empty_since is None:
                self._empty_since = now
                if self.scaler is not None and not self._building:
                    self._resize(self.bounds[0])
            elif now - self._empty_since > WAIT_S:
                raise RuntimeError(self._none_message())
            time.sleep(min(wait_s, 0.2) or 0.05)
        else:
            self._empty_since = None
        self.inflight = calls  # type: ignore[assignment]

    def _issue_poll(self, r: Replica, wait_s: float, calls: dict) -> None:
        """Poll `r` (its fresh groups with it) into `calls`; a replica lost is lost here."""
        fresh = _regroup(r.pending)
        try:
            calls[r.address] = (r, r.group.stream_partial([fresh], [self.segment], [wait_s]))
        except fa.WorkerLostError:
            self._lose(r)
            return
        r.pending = []
        if r.first_poll is None:
            r.first_poll = time.perf_counter()

    def _await_polls(self) -> None:
        """While a replica builds, wait for the polls in flight with the fleet's lock released, so that the replica
        joins meanwhile (the controller may wait here for a whole segment); else `_collect` blocks on them."""
        me = threading.get_ident()
        while self._building and self._holder == me and self.inflight:
            if all(call.done() for _, call in self.inflight.values()):
                return
            self._holder = None
            self._lock.release()
            try:
                time.sleep(JOIN_CHECK_S)
            finally:
                self._lock.acquire()
                self._holder = me

    def _collect(self) -> None:
        self._await_polls()
        calls, self.inflight = self.inflight or {}, None
        for r, call in calls.values():
            try:
                out = call.result()[0]
            except fa.WorkerLostError:
                self._lose(r)
                continue
            if r not in self.fleet:  # lost after this poll was issued (a sync to it failed): its groups, these
                continue  # finished ones too, are requeued already; taking them as well would train them twice
            if not r.polled and out.get("first_ready_s") is not None:  # its first group finished: joined
                r.polled = True
                self._joined_at(r, r.first_poll - r.arrived + out["first_ready_s"])
            self._take_finished(r, out["samples"])
            if r.join_load is not None:
                self._measure_join(r)
        self.held = [list(r.assigned) for r in self.fleet] + [list(self.requeue)]

    def _take_finished(self, r: Replica, samples: Batch) -> None:
        if not len(samples):
            return
        groups = samples["group"]
        for g in groups.unique().tolist():
            group = samples.take((groups == g).nonzero().flatten().tolist())
            uid = int(group[PROMPT_UID][0])
            r.assigned.pop(uid, None)
            self.prompts.pop(uid, None)
            self.buffer.append(group)

    def _held_uids(self) -> list[int]:
        return [u for r in self.fleet for u in r.assigned] + list(self.requeue)

    def _sync_weights(self, version: int) -> None:
        """Version `version` to every replica down a tree: the trainer sends it to the first `RELAY_FANOUT`
        replicas; each replica that loaded it passes it on to `RELAY_FANOUT` more (its `policy_weights`, issued after
        its load, into theirs, worker to worker). The trainer's cost of a sync is then at most `RELAY_FANOUT` copies
        whatever the fleet's size (a fleet that small has no relay); a replica further down waits one load per
        level. A relay lost at submission is passed over (its children take the trainer's copy); one lost in flight
        leaves its subtree a version behind until the next sync, which brings every replica the newest."""
        if not self.fleet:
            return  # a replica that joins takes the weights then
        weights = self.actor.policy_weights()
        fleet = list(self.fleet)
        calls, sources = [], []  # sources[k]: what the k-th replica passes on (the trainer's copy where it cannot)
        for k, r in enumerate(fleet):
            source = sources[k // RELAY_FANOUT - 1] if k >= RELAY_FANOUT else weights
            try:
                calls.append((r, r.group.load_policy(source, version)))
                relays = RELAY_FANOUT * (k + 1) < len(fleet)  # it has replicas below it
                sources.append(r.group.policy_weights() if relays else weights)
            except fa.WorkerLostError:
                self._lose(r)
                sources.append(weights)
        self._syncs[version] = _Loads(calls, self.fleet)  # type: ignore[assignment]

    def _greedy(self, prompts: Batch) -> Any:
        """ReMax's greedy baseline from the first replica (a lost one: from the next)."""
        while self.fleet:
            try:
                return self.fleet[0].group.generate_sequences(prompts, GenerationSpec(greedy=True)).result()
            except fa.WorkerLostError:
                self._lose(self.fleet[0])
        raise RuntimeError(self._none_message())

    # -- metrics ----------------------------------------------------------------------------------------------------
    def _fleet_metrics(self) -> dict[str, float]:
        out = {f"fleet/{k}": float(v) for k, v in self._counts.items()}
        out["fleet/replicas"] = float(len(self.fleet))
        out["fleet/waited_s"] = self._waited
        if self._startup_s is not None:
            out["fleet/startup_s"], self._startup_s = self._startup_s, None
        if self._join_s:
            out["fleet/join_s"] = self._join_s.pop()
            self._join_s.clear()
        if self._build_s:  # of that: the replica's construction (its model built on the worker)
            out["fleet/join_build_s"] = self._build_s.pop()
            self._build_s.clear()
        if self._join_bytes:
            out["fleet/join_trainer_bytes"] = sum(t for t, _ in self._join_bytes)
            out["fleet/join_peer_bytes"] = sum(p for _, p in self._join_bytes)
            self._join_bytes.clear()
        return out

    def _none_message(self) -> str:
        return (
            f"the rollout fleet has no replica: no pool worker with the {RESOURCE!r} resource is live (start one: "
            f"`dask worker --nthreads 1 --resources {RESOURCE}=1 SCHEDULER`, or let the embedded cluster start them)"
        )


def _regroup(parts: list[Batch]) -> Batch:
    """Groups given one by one, as one batch whose `group` numbers them from 0 in order (a rank's admission)."""
    if not parts:
        return Batch()
    return Batch.concat(
        [Batch({**b.tensors, "group": torch.full_like(b["group"], g)}, b.rows, b.meta) for g, b in enumerate(parts)]
    )
