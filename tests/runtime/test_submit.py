"""The Dask call path (`direct_calls=False`): one graph update per call, every rank's task sent at once, each
still pinned, ordered and prioritised."""

import pytest

import flowactors as fa
from flowactors.transport import ResultRecomputed
from flowactors.transport.tasks import PinnedTask, submit_pinned_tasks
from tests.runtime.workers import Reducer, nap


def _task_states(keys, dask_scheduler=None):
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks[key]
        out[key] = {
            "workers": sorted(ts.worker_restrictions or ()),
            "loose": ts.loose_restrictions,
            "priority": ts.priority,
            "deps": sorted(str(d.key) for d in ts.dependencies),
        }
    return out


def _graph_updates(ctl) -> int:
    return sum(
        1 for _, e in ctl.client.get_events(ctl.client.id) if isinstance(e, dict) and e.get("action") == "update-graph"
    )


@pytest.fixture(scope="module")
def controller4():
    """Calls through the scheduler, not the direct path (flowactors.transport.channel)."""
    ctl = fa.Controller.local(4, dashboard=None, collective_timeout_s=120, direct_calls=False)
    yield ctl
    ctl.close()


@pytest.fixture(scope="module")
def group(controller4):
    g = fa.ActorGroup(controller4, Reducer, name="submit_g")
    yield g
    g.close()


def test_a_call_is_one_graph_update_of_pinned_ordered_tasks(controller4, group):
    group.history().result()
    before = _graph_updates(controller4)
    first = group.record(1)
    second = group.record(2)
    assert second.result() == [2] * 4
    assert _graph_updates(controller4) - before == 2  # one per call, not one per rank
    keys = [f.key for f in first.futures + second.futures]
    states = controller4.client.run_on_scheduler(_task_states, keys)
    for call in (first, second):
        assert [k.rsplit("-", 2)[0] for k in (f.key for f in call.futures)] == ["submit_g.record"] * 4
        for rank, f in enumerate(call.futures):
            st = states[f.key]
            assert st["workers"] == [group.addresses[rank]] and st["loose"] is False
        assert len({states[f.key]["priority"][0] for f in call.futures}) == 1  # one place in the issue order
    # the later call ranks below the earlier one and, on each worker, depends on it
    assert states[second.futures[0].key]["priority"][0] > states[first.futures[0].key]["priority"][0]
    for f1, f2 in zip(first.futures, second.futures):
        assert states[f2.key]["deps"] == [f1.key]


def test_two_tasks_for_one_worker_in_one_submission_run_in_order(controller4, group):
    a = controller4.slots[0]
    futs = controller4.submit_pinned_all([(a, nap, (0.3,), {}, "submit.nap-0"), (a, nap, (0.0,), {}, "submit.nap-1")])
    assert controller4.client.gather(futs) == [0.3, 0.0]
    states = controller4.client.run_on_scheduler(_task_states, [f.key for f in futs])
    assert states["submit.nap-1"]["deps"] == ["submit.nap-0"]


def test_submit_pinned_tasks_refuses_repeated_keys(controller4):
    t = PinnedTask(controller4.slots[0], nap, "submit.same", (0.0,))
    with pytest.raises(ValueError, match="keys must be distinct"):
        submit_pinned_tasks(controller4.client, [t, t])


def _fails(_dep=None):
    raise ValueError("on purpose")


def test_the_failure_story_tells_a_tasks_state_its_blame_and_transitions(controller4):
    """What the controller reports where Dask fails a future without an error to raise (`failure_story`), here on
    a task that failed on purpose and one that depends on it."""
    from flowactors.transport.tasks import failure_story

    client = controller4.client
    bad = client.submit(_fails, key="story-bad", pure=False)
    after = client.submit(_fails, bad, key="story-after", pure=False)
    with pytest.raises(ValueError, match="on purpose"):
        client.gather([after])
    story = {s["key"]: s for s in client.run_on_scheduler(failure_story, ["story-bad", "story-after", "story-none"])}
    assert story["story-bad"]["state"] == "erred" and story["story-bad"]["blame"] == ("story-bad", "erred")
    assert any(t.startswith("processing->erred") for t in story["story-bad"]["transitions"])
    assert story["story-after"]["blame"] == ("story-bad", "erred")
    assert story["story-after"]["dependencies"] == [("story-bad", "erred")]
    assert story["story-none"] == {
        "key": "story-none",
        "state": "forgotten",
        "blame": None,
        "dependencies": [],
        "transitions": [],
    }


_RUNS: list[str] = []  # (in a worker process) what `_bump` ran there


def _bump(tag, _after=None) -> int:
    _RUNS.append(tag)
    return len(_RUNS)


def test_a_task_dask_runs_again_is_not_run_and_its_value_is_refused(controller4):
    """Every task of the Dask path runs under `tasks.once`: Dask asking a worker to run a task again (it recomputes
    a result lost with a worker, and every released task that result came from) gets a `Rerun` without the function
    running; a task given a `Rerun` as input raises; the controller refuses a `Rerun` as a call's value. (A
    controller of its own, `ident`, so that this one's issue numbers are untouched.)"""
    from flowactors.futures import CallFuture
    from flowactors.protocols import ONE_TO_ALL
    from flowactors.transport.tasks import Rerun, once

    client, a = controller4.client, controller4.slots[0]

    def run(key, seq, *args):
        return client.submit(once, "test-ident", seq, _bump, *args, key=key, workers=[a], pure=False)

    assert client.gather(run("rerun-1", 1, "one")) == 1
    assert client.gather(run("rerun-2", 2, "two")) == 2
    again = run("rerun-1-again", 1, "one")  # as Dask recomputing rerun-1: the same issue number on the same worker
    value = client.gather(again)
    assert type(value) is Rerun and value.key == "rerun-1-again"
    assert client.gather(run("rerun-3", 3, "three")) == 3  # ran: the count went on from 2
    with pytest.raises(RuntimeError, match="rerun-1-again, was lost with its worker"):
        client.gather(client.submit(once, "test-ident", None, _bump, [again], key="rerun-input", workers=[a]))
    call = CallFuture(controller4, [again], ONE_TO_ALL, None, "t", "bump", [a])
    with pytest.raises(ResultRecomputed, match="does not run an actor's call twice"):
        controller4.transport.resolve([call], None)


def test_a_call_that_meets_a_result_recomputed_after_a_death_is_lost_at_the_dead_worker():
    """On the Dask path a worker's death can reach a call as a recomputed result (Dask recomputes a lost result still
    wanted, and the released tasks it came from; `once` refuses them) before the scheduler's report of the death
    reaches the controller: the call then failed with the recompute's error, which the fleet does not take for a
    lost replica, and an elastic run ended (seen in the fleet's e2e test on the Dask transport). It is now the
    WorkerLostError of the worker that died."""
    import os
    import signal

    from flowactors.futures import CallFuture
    from flowactors.protocols import ONE_TO_ALL
    from flowactors.transport.tasks import once

    with fa.Controller.local(2, dashboard=None, direct_calls=False) as ctl:
        client, (a, b) = ctl.client, ctl.slots

        def run(key, seq):
            return client.submit(once, "test-ident", seq, _bump, "x", key=key, workers=[a], pure=False)

        client.gather(run("lost-1", 1))
        again = run("lost-1-again", 1)  # what Dask asks of `a` after a death: the task again
        call = CallFuture(ctl, [again], ONE_TO_ALL, None, "t", "bump", [a])
        os.kill(client.run(os.getpid, workers=[b])[b], signal.SIGKILL)
        with pytest.raises(fa.WorkerLostError, match=f"worker {b} died") as lost:
            ctl.resolve([call], None)
        assert isinstance(lost.value.__cause__, ResultRecomputed)
