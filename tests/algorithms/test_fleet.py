"""An elastic rollout fleet (algorithms/rollout/fleet.py) on real clusters: replicas on pool workers that join a
running job (weights from a peer, none from the trainer) and leave it (SIGKILL: unfinished groups requeued; a
graceful retire: only unfinished ones), every step's batch full and every prompt group trained once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from distributed import Client

import flowactors as fa
from algorithms.grpo import main as grpo
from algorithms.rollout.fleet import RESOURCE, Autoscale
from engines.rollout.partial import PROMPT_UID
from flowactors.cluster import resize_pool
from tests.algorithms.kill import slot_cluster

FLEET = [
    "dashboard=none",
    "sft_steps=10",
    "prompts_per_step=8",
    "async_staleness=1",
    "partial_rollout=true",
]


def _steps(path) -> list[dict]:
    """The steps written so far (a line still being written is left for the next read)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]


def _exact(history: list[dict], prompts_per_step: int = 8) -> None:
    """Full batches, nothing trained twice, nothing lost, at every step."""
    assert all(r["async/trained_groups"] == prompts_per_step for r in history), [
        r["async/trained_groups"] for r in history
    ]
    assert all(r["async/duplicates"] == 0 and r["async/lost"] == 0 for r in history)


def _run_under_operator(operator, argv: list[str], metrics, settle=None) -> list[dict]:
    """A GRPO run (`argv`) on a cluster of two slot workers that `operator(cluster, client, over)` changes from a
    thread of its own until `over` is set; `settle()` runs after the program, before the cluster goes."""
    cluster = slot_cluster(2)
    client = Client(cluster)
    over = threading.Event()
    thread = threading.Thread(target=operator, args=(cluster, client, over), daemon=True)
    thread.start()
    try:
        history = grpo([*argv, "--address", cluster.scheduler_address, f"metrics_file={metrics}"])
        if settle is not None:
            settle()
    finally:
        over.set()
        thread.join()
        client.close()
        cluster.close()
    return history


def _transport(monkeypatch, direct: bool) -> None:
    """The program's controller uses the direct path (`direct`) or Dask tasks, whatever its cluster."""
    import flowactors.controller as controller

    chosen = controller.open_transport
    monkeypatch.setattr(
        controller, "open_transport", lambda client, embedded, _, push: chosen(client, embedded, direct, push)
    )


def _pool_of(client) -> list[str]:
    return [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if RESOURCE in w["resources"]]


@pytest.mark.e2e  # a whole program's run with a cluster changing under it: CI's second tier
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_a_replica_joins_at_one_step_and_one_is_killed_at_a_later_one_and_every_group_trains_once(
    tmp_path, monkeypatch, direct
):
    """Two trainer slots and one pool worker; after step 2 the cluster gains a pool worker (Dask's own scale, as an
    operator or a jobqueue would), which becomes a replica with a peer's weights; after it has served a step, the
    other replica's worker is SIGKILLed (its nanny then brings a new worker, which joins again). The run never
    stops: 60 steps, each with its 8 groups, each group trained once. On the direct path and on Dask's."""
    _transport(monkeypatch, direct)
    metrics = tmp_path / "m.jsonl"
    events: dict[str, int] = {}

    def operator(cluster, client, over) -> None:
        resize_pool(cluster, RESOURCE, 1)
        while not over.is_set():
            done = _steps(metrics)
            if "grown" not in events and len(done) >= 2:
                resize_pool(cluster, RESOURCE, 2)
                events["grown"] = len(done)
            if "grown" in events and "killed" not in events and done and done[-1].get("fleet/joined", 0) >= 1:
                if len(done) >= events["grown"] + 2:
                    pool = _pool_of(client)
                    pids = client.run(os.getpid, workers=pool)
                    first = min(pool, key=lambda a: cluster.scheduler_info["workers"][a]["name"])
                    os.kill(pids[first], signal.SIGKILL)
                    events["killed"] = len(done)
            time.sleep(0.05)

    history = _run_under_operator(operator, ["--steps", "60", *FLEET, "async_replicas=1:3"], metrics)
    assert "grown" in events and "killed" in events, f"the run ended before the fleet changed: {events}"
    assert [r["step"] for r in history] == list(range(60))
    _exact(history)
    last = history[-1]
    assert last["fleet/joined"] >= 1 and last["fleet/left"] >= 1
    assert last["fleet/requeued"] >= 1  # the killed replica held groups (its share of the surplus)
    joins = [r for r in history if "fleet/join_peer_bytes" in r]
    assert joins, "no join reported what it fetched"
    for r in joins:  # a join loads a peer's weights: the whole model, and nothing from the trainer
        assert r["fleet/join_trainer_bytes"] == 0
        # (Dask's transfer log sizes a state dict from a sample of its tensors: there, only that it came)
        assert r["fleet/join_peer_bytes"] >= (history[0]["async/sync_bytes"] if direct else 1)
    sizes = [r["fleet/replicas"] for r in history]
    assert max(sizes) >= 2 and sizes[0] == 1


@pytest.mark.e2e  # a whole program's run with a cluster changing under it: CI's second tier
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_a_replica_whose_worker_is_told_to_stop_leaves_gracefully_and_the_worker_ends_at_once(
    tmp_path, monkeypatch, direct
):
    """SIGTERM on a replica's worker (a scale-down, a preemption notice, a Slurm job at its time limit): the worker
    announces it and keeps serving; the fleet takes back what the replica finished, requeues only the rest and
    retires the worker, well before the worker's grace would end it. 12 steps, each with its 8 groups, each group
    trained once. On the direct path and on Dask's (a TLS cluster's)."""
    _transport(monkeypatch, direct)
    metrics = tmp_path / "m.jsonl"
    events: dict = {}

    def operator(cluster, client, over) -> None:
        resize_pool(cluster, RESOURCE, 2)
        while not over.is_set():
            done = _steps(metrics)
            if "signalled" not in events and len(done) >= 3 and done[-1].get("fleet/replicas") == 2:
                pool = _pool_of(client)
                pid = client.run(os.getpid, workers=pool[:1])[pool[0]]
                os.kill(pid, signal.SIGTERM)
                events.update(signalled=len(done), pid=pid, at=time.monotonic())
            if "pid" in events and "ended_s" not in events:
                try:
                    os.kill(events["pid"], 0)
                except ProcessLookupError:
                    events["ended_s"] = time.monotonic() - events["at"]
            time.sleep(0.05)

    def settle() -> None:  # the worker's end, if the run ended first
        deadline = time.monotonic() + 20
        while "signalled" in events and "ended_s" not in events and time.monotonic() < deadline:
            time.sleep(0.1)

    history = _run_under_operator(operator, ["--steps", "12", *FLEET, "async_replicas=2:2"], metrics, settle)
    assert "signalled" in events, f"the run ended before the signal: {events}"
    assert [r["step"] for r in history] == list(range(12))
    _exact(history)
    last = history[-1]
    assert last["fleet/retired"] == 1 and last["fleet/left"] == 1  # a graceful leave, not a loss
    assert events.get("ended_s", 99.0) < fa.controller.LEAVE_GRACE_S / 2  # retired, not ended by its grace
    assert [r["fleet/replicas"] for r in history][-1] == 1


@pytest.mark.e2e  # a whole program's run: CI's second tier
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask"])
def test_a_weight_sync_costs_the_trainer_two_copies_and_goes_on_replica_to_replica(monkeypatch, direct):
    """Three replicas, RELAY_FANOUT = 2: the trainer sends each version to the first two replicas, the first passes
    it on to the third, worker to worker; every step's batch full. On the direct path and on Dask's (the one a TLS
    cluster keeps: there the bytes are what Dask's transfer logs count)."""
    from algorithms.rollout.fleet import RELAY_FANOUT, FleetRollouts

    _transport(monkeypatch, direct)

    assert RELAY_FANOUT == 2
    seen: list = []
    sync_metrics = FleetRollouts.sync_metrics

    def measured(self, i):
        loads = self._syncs.get(max(i, self._first_version))
        if loads is not None and i >= 1:
            trainer = set(self.actor.addresses)
            self.ctl.wait([c for _, c in loads.calls])
            seen.append([(r.address, self.ctl.fetched_bytes(c)) for r, c in loads.calls])
            seen[-1].append(trainer)
        return sync_metrics(self, i)

    monkeypatch.setattr(FleetRollouts, "sync_metrics", measured)
    history = grpo(["--steps", "5", *FLEET, "async_replicas=3:3"])
    _exact(history, 8)
    assert seen, "no sync was measured"
    model = history[0]["async/sync_bytes"] / 3  # every replica received the whole model
    # the bytes on the direct path are what was sent; on Dask's, its estimate (of a dict of more than 10 tensors,
    # from a sample of 10 of them), so there only where they came from is checked
    size = (lambda n: n == pytest.approx(model, rel=0.05)) if direct else (lambda n: n > 0)
    for *loads, trainer in seen:
        assert len(loads) == 3
        (first, from_first), (_, from_second), (_, from_third) = loads
        for sizes in (from_first, from_second):  # the trainer's copies
            assert set(sizes) <= trainer and size(sum(sizes.values()))
        assert set(from_third) == {first} and size(from_third[first])  # relayed


def test_the_dashboard_charts_the_fleet_over_time(no_cluster):
    from algorithms.grpo import GRPO, GRPOConfig
    from algorithms.run.loop import charted_metrics

    fleet = GRPOConfig()
    fleet.async_rl.replicas = "1:2"
    plain = GRPO(GRPOConfig())
    assert charted_metrics(GRPO(fleet)) == (
        *plain.key_metrics,
        "fleet/replicas",
        "fleet/joined",
        "fleet/left",
        "fleet/requeued",
    )
    assert charted_metrics(plain) == plain.key_metrics


def test_the_autoscaler_grows_on_waits_and_retires_after_calm_steps(no_cluster):
    scale = Autoscale(1, 3, grow_wait_s=0.5, calm_steps=2)
    assert scale.decide(size=0, waited_s=0.0, spare_groups=0, step_groups=8, joining=False) == 1  # below MIN
    assert scale.decide(size=1, waited_s=2.0, spare_groups=0, step_groups=8, joining=True) == 0  # one at a time
    assert scale.decide(size=1, waited_s=2.0, spare_groups=0, step_groups=8, joining=False) == 1
    assert scale.decide(size=3, waited_s=2.0, spare_groups=0, step_groups=8, joining=False) == 0  # at MAX
    assert scale.decide(size=2, waited_s=0.0, spare_groups=8, step_groups=8, joining=False) == 0  # calm 1
    assert scale.decide(size=2, waited_s=0.0, spare_groups=8, step_groups=8, joining=False) == -1  # calm 2
    assert scale.decide(size=2, waited_s=0.0, spare_groups=8, step_groups=8, joining=False) == 0  # counted anew
    assert scale.decide(size=1, waited_s=0.0, spare_groups=9, step_groups=8, joining=False) == 0
    assert scale.decide(size=1, waited_s=0.0, spare_groups=9, step_groups=8, joining=False) == 0  # at MIN


@pytest.mark.parametrize(
    "argv, message",
    [
        (["async_replicas=2:1"], r"async_rl.replicas is MIN:MAX replicas .* 1 <= MIN <= MAX"),
        (["async_replicas=x"], r"async_rl.replicas is MIN:MAX"),
        (["async_staleness=1", "async_replicas=2"], r"add async_staleness=1 partial_rollout=true"),
        (
            ["async_staleness=1", "partial_rollout=true", "async_deterministic=true", "async_replicas=2"],
            r"and not async_deterministic=true",
        ),
        (["async_staleness=1", "partial_rollout=true", "async_replicas=1:2", "rollout_tp=2"], r"set rollout_tp=0"),
    ],
)
def test_bad_fleet_settings_are_one_line_before_the_cluster_starts(capsys, no_cluster, argv, message):
    import re

    with pytest.raises(SystemExit) as e:
        grpo(["dashboard=none", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_a_graceful_retire_requeues_only_unfinished_groups_and_a_resume_trains_every_group_once(tmp_path, monkeypatch):
    """Two replicas on the embedded cluster's pool (async_replicas=2:2; the fleet asks the cluster for them); after
    step 2 one retires gracefully (the autoscaler's scale-down, called here at a fixed step): every group it had
    finished is trained as it was, only its unfinished groups go back to the prompt stream, and the fleet, below
    MIN, asks the cluster for a new worker (tests/runtime/test_pool.py shows such a worker arriving). A checkpoint
    keeps the ledger, the finished groups waiting and the prompts of the groups the replicas held; the resumed run
    (its replicas new ones) requeues those, and across both runs every group drawn is trained once."""
    from algorithms.rollout.fleet import FleetRollouts

    seen: dict = {}
    take = FleetRollouts.take

    def take_and_retire(self, i):
        out = take(self, i)
        if i == 2:
            with self._owning():  # (the fleet's state, as the pipeline's own calls hold it)
                if self.inflight is not None:
                    self._collect()
                replica = self.fleet[-1]
                state = replica.group.partial_state().result()[0]  # a snapshot: groups only finish after it
                seen["finished"] = {u for u, group in state["groups"] if all(s["done"] for s in group)}
                seen["unfinished"] = {u for u, group in state["groups"] if not all(s["done"] for s in group)}
                seen["pending"] = {int(b[PROMPT_UID][0]) for b in replica.pending}
                before = {int(b[PROMPT_UID][0]) for b in self.buffer}
                self._retire(replica)
                seen["requeued"] = set(self.requeue)
                seen["buffered"] = {int(b[PROMPT_UID][0]) for b in self.buffer} - before
        if i == 3:
            seen["asked"] = len(fa.cluster.pool_workers(self.ctl.cluster, RESOURCE))
        return out

    monkeypatch.setattr(FleetRollouts, "take", take_and_retire)
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    first = grpo(["--steps", "4", *FLEET, "async_replicas=2:2", *ck])
    assert seen, "the retire did not run"
    assert seen["finished"] <= seen["buffered"]  # nothing it had finished was requeued ...
    assert not seen["requeued"] & seen["buffered"]
    assert seen["requeued"] <= seen["unfinished"] | seen["pending"]  # ... only what it had not
    assert seen["requeued"] | seen["buffered"] == seen["finished"] | seen["unfinished"] | seen["pending"]
    assert first[-1]["fleet/left"] == 1 and first[-1]["fleet/requeued"] == len(seen["requeued"])
    assert seen["asked"] == 2  # the fleet asked the cluster for a worker: back to MIN
    resumed = grpo(["--steps", "7", *FLEET, "async_replicas=2:2", *ck, "--resume", "auto"])
    assert [r["step"] for r in first + resumed] == list(range(7))
    _exact(first)
    _exact(resumed)
    assert resumed[0]["fleet/replicas"] == 2 and resumed[0]["async/sync_bytes"] > 0
