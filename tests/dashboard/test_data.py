"""The dashboard's pure data functions and the plugin's bookkeeping, against hand-computed numbers (no cluster)."""

import math
import pickle
from types import SimpleNamespace

import pytest

from flowactors.dashboard import (
    DEFAULT_METRIC_LIMIT,
    PALETTE,
    FlowactorsDashboard,
    Interval,
    TaskRecord,
    aggregate_graph,
    install_dashboard,
    metric_series,
    node_of,
    role_color,
    role_of,
    slot_usage,
    snapshot,
    stage_idle,
)
from flowactors.dashboard.aggregate import is_slow

H = "0123456789abcdef"


def k(prefix: str, rank: int | None = None, token: str = H) -> str:
    return f"{prefix}-{rank}-{token}" if rank is not None else f"{prefix}-{token}"


def test_keys_map_to_call_nodes_and_roles():
    assert node_of(k("actor.generate_sequences", 0)) == "actor.generate_sequences"
    assert node_of(k("actor.generate_sequences.collect")) == "actor.generate_sequences"
    assert node_of(k("ppo_advantages")) == "ppo_advantages"
    assert node_of(("tuple-key", 3)) == "tuple-key"
    assert role_of("critic.compute_values") == "critic" and role_of("join") == "task"


def test_role_colours_come_from_the_caller_the_runtime_or_the_palette():
    # the runtime's own pseudo-roles have their colours; the caller's colours win for its roles
    assert (role_color("task"), role_color("world")) == ("#8c8c8c", "#5f6b73")
    fixed = {"actor": "#010203", "critic": PALETTE[0], "ref": PALETTE[1]}
    assert role_color("actor", fixed) == "#010203" and role_color("critic", fixed) == PALETTE[0]
    assert role_color("task", fixed) == "#8c8c8c"
    # other roles: a palette colour by a stable hash of the name, never one the caller fixed
    assert role_color("rt") == role_color("rt") in PALETTE and role_color("actor") in PALETTE
    names = [f"group{i}" for i in range(200)]
    assert {role_color(n, fixed) for n in names} == set(PALETTE) - set(fixed.values())
    # a caller who took the whole palette: roles still get palette colours
    assert role_color("rt", {f"r{i}": c for i, c in enumerate(PALETTE)}) in PALETTE


def ppo_like_step() -> list[TaskRecord]:
    """generate → (ref, reward) → join → update, with the controller's `_after` chain per process."""
    gen = [k("actor.generate_sequences", r) for r in (0, 1)]
    gen_c = k("actor.generate_sequences.collect")
    ref = [k("ref.compute_ref_log_prob", r) for r in (0, 1)]
    ref_c = k("ref.compute_ref_log_prob.collect")
    rew = [k("reward.compute_reward", r) for r in (0, 1)]
    rew_c = k("reward.compute_reward.collect")
    join = k("join")
    upd = [k("actor.update_actor", r) for r in (0, 1)]
    earlier = [k("actor.update_actor", r, "f" * 16) for r in (0, 1)]  # the previous step: not in this graph
    return [
        *(TaskRecord(gen[r], "released", (earlier[r],), (earlier[r],), done=True) for r in (0, 1)),
        TaskRecord(gen_c, "memory", tuple(gen), done=True),
        *(TaskRecord(ref[r], "memory", (gen_c, gen[r]), (gen[r],), done=True) for r in (0, 1)),
        TaskRecord(ref_c, "memory", tuple(ref), done=True),
        TaskRecord(rew[0], "memory", (gen_c, ref[0]), (ref[0],), done=True),
        TaskRecord(rew[1], "erred", (gen_c, ref[1]), (ref[1],)),
        TaskRecord(rew_c, "waiting", tuple(rew)),
        TaskRecord(join, "waiting", (gen_c, ref_c, rew_c)),
        TaskRecord(upd[0], "processing", (join, rew[0]), (rew[0],)),
        TaskRecord(upd[1], "waiting", (join, rew[1]), (rew[1],)),
    ]


def test_graph_aggregates_tasks_into_calls_with_data_and_order_edges():
    g = aggregate_graph(ppo_like_step(), {"actor.generate_sequences": 1.25})
    nodes = {n["id"]: n for n in g["nodes"]}
    assert list(nodes) == [
        "actor.generate_sequences",
        "ref.compute_ref_log_prob",
        "reward.compute_reward",
        "join",
        "actor.update_actor",
    ]
    # (layer, row): the scorers share a column because only data edges decide columns
    assert {n: (v["layer"], v["row"]) for n, v in nodes.items()} == {
        "actor.generate_sequences": (0, 0),
        "ref.compute_ref_log_prob": (1, 0),
        "reward.compute_reward": (1, 1),
        "join": (2, 0),
        "actor.update_actor": (3, 0),
    }
    assert (g["layers"], g["rows"]) == (4, 2)
    gen, rew, upd = nodes["actor.generate_sequences"], nodes["reward.compute_reward"], nodes["actor.update_actor"]
    assert gen["counts"] == {"memory": 1, "released": 2} and (gen["n"], gen["done"]) == (3, 3)
    assert gen["state"] == "memory" and gen["seconds"] == 1.25 and gen["role"] == "actor"
    assert gen["method"] == "generate_sequences" and gen["color"] == role_color("actor")
    mine = {"actor": "#010203"}
    coloured = {n["id"]: n["color"] for n in aggregate_graph(ppo_like_step(), role_colors=mine)["nodes"]}
    assert coloured["actor.update_actor"] == coloured["actor.generate_sequences"] == "#010203"
    assert coloured["join"] == role_color("task") and coloured["ref.compute_ref_log_prob"] == role_color("ref", mine)
    assert rew["state"] == "erred" and rew["counts"] == {"erred": 1, "memory": 1, "waiting": 1} and rew["done"] == 1
    assert upd["state"] == "processing" and nodes["join"]["state"] == "waiting" and nodes["join"]["role"] == "task"
    edges = {(e["source"], e["target"], e["kind"]): e["n"] for e in g["edges"]}
    assert edges == {
        # each rank task of the consumer depends on the producer's collect task
        ("actor.generate_sequences", "ref.compute_ref_log_prob", "data"): 2,
        ("actor.generate_sequences", "reward.compute_reward", "data"): 2,
        ("ref.compute_ref_log_prob", "reward.compute_reward", "order"): 2,  # same process, issued after
        ("actor.generate_sequences", "join", "data"): 1,
        ("ref.compute_ref_log_prob", "join", "data"): 1,
        ("reward.compute_reward", "join", "data"): 1,
        ("join", "actor.update_actor", "data"): 2,
        ("reward.compute_reward", "actor.update_actor", "order"): 2,
    }  # no self edges (rank → its collect), no edge from the previous step, order under data dropped


def test_graph_of_repeated_calls_is_cyclic_by_prefix_but_still_laid_out():
    a1, b1, a2 = k("m.a", 0, "1" * 16), k("m.b", 0, "2" * 16), k("m.a", 0, "3" * 16)
    g = aggregate_graph([TaskRecord(a1), TaskRecord(b1, deps=(a1,)), TaskRecord(a2, deps=(b1,))])
    assert [(n["id"], n["layer"]) for n in g["nodes"]] == [("m.a", 0), ("m.b", 1)]
    assert {(e["source"], e["target"]) for e in g["edges"]} == {("m.a", "m.b"), ("m.b", "m.a")}
    assert aggregate_graph([]) == {"nodes": [], "edges": [], "layers": 0, "rows": 0}


def test_graph_layout_does_not_depend_on_the_order_tasks_were_reported():
    """The scheduler handles graph updates concurrently: a consumer's tasks can reach the plugin first."""
    forward = aggregate_graph(ppo_like_step())
    backward = aggregate_graph(list(reversed(ppo_like_step())))
    assert {n["id"]: n["layer"] for n in backward["nodes"]} == {n["id"]: n["layer"] for n in forward["nodes"]}
    assert [n["id"] for n in backward["nodes"]][0] == "actor.generate_sequences"
    assert backward["layers"] == forward["layers"] == 4


def test_slot_usage_busy_idle_and_segments():
    ivs = [
        Interval("A", "actor.generate_sequences", 9.0, 11.0),  # clipped to [10, 11]
        Interval("A", "actor.generate_sequences", 12.0, 14.0),
        Interval("A", "ref.compute_ref_log_prob", 13.5, 15.0),  # overlaps the previous one: union, not sum
        Interval("A", "join", 16.0, 16.5),
        Interval("A", "join", 16.504, 17.0),  # 4 ms after the previous join: one segment
        Interval("B", "critic.update_critic", 19.0, 25.0),  # clipped to [19, 20]
        Interval("Z", "actor.generate_sequences", 10.0, 20.0),  # not a slot: ignored
        Interval("C", "actor.generate_sequences", 1.0, 2.0),  # before the window
    ]
    a, b, c = slot_usage(ivs, ["A", "B", "C"], 10.0, 20.0)
    # busy: 1 + [12, 15] + 0.5 + 0.496 (the 4 ms gap is idle, even though the timeline merges it)
    assert (a["worker"], a["busy_s"], a["idle_s"], a["busy_frac"]) == ("A", 4.996, 5.004, 0.4996)
    assert a["by_role"] == {"actor": 3.0, "ref": 1.5, "task": 0.996}
    assert a["segments"] == [
        [0.0, 1.0, "actor", "actor.generate_sequences"],
        [2.0, 4.0, "actor", "actor.generate_sequences"],
        [3.5, 5.0, "ref", "ref.compute_ref_log_prob"],
        [6.0, 7.0, "task", "join"],
    ]
    assert (b["busy_s"], b["idle_s"], b["segments"]) == (1.0, 9.0, [[9.0, 10.0, "critic", "critic.update_critic"]])
    assert (c["busy_s"], c["idle_s"], c["segments"], c["by_role"]) == (0.0, 10.0, [], {})
    many = [Interval("A", f"r.m{i % 2}", 10 + i * 0.01, 10 + i * 0.01 + 0.001) for i in range(50)]
    assert len(slot_usage(many, ["A"], 10.0, 20.0, max_segments=7)[0]["segments"]) == 7


def test_stage_idle_per_step_against_hand_computed_numbers():
    ivs = [
        Interval("A", "actor.generate_sequences", 0.0, 4.0, step=0),
        Interval("B", "actor.generate_sequences", 0.0, 2.0, step=0),
        Interval("B", "ref.compute_ref_log_prob", 3.0, 5.0, step=0),
        Interval("A", "actor.generate_sequences", 6.0, 7.0, step=1),
    ]
    got = {(s["stage"], s["step"]): s for s in stage_idle(ivs, ["A", "B"], 0.0, 10.0)}
    gen0, ref0, gen1 = (
        got[("actor.generate_sequences", 0)],
        got[("ref.compute_ref_log_prob", 0)],
        got[("actor.generate_sequences", 1)],
    )
    # generate, step 0: span [0, 4]; A busy 4, B busy [0,2]+[3,4] = 3 -> 1 idle slot-second of 8
    assert (gen0["span_s"], gen0["busy_s"], gen0["idle_s"], gen0["idle_frac"]) == (4.0, 6.0, 1.0, 0.125)
    # ref, step 0: span [3, 5]; A busy [3, 4] -> idle 1; B busy all along -> idle 0
    assert (ref0["span_s"], ref0["busy_s"], ref0["idle_s"], ref0["idle_frac"]) == (2.0, 2.0, 1.0, 0.25)
    # generate, step 1: only slot A works, slot B idles the whole span
    assert (gen1["span_s"], gen1["busy_s"], gen1["idle_s"], gen1["idle_frac"]) == (1.0, 1.0, 1.0, 0.5)
    assert [s["start"] for s in stage_idle(ivs, ["A", "B"], 0.0, 10.0)] == [0.0, 3.0, 6.0]
    assert [(s["stage"], s["step"]) for s in stage_idle(ivs, ["A", "B"], 0.0, 10.0, max_stages=2)] == [
        ("ref.compute_ref_log_prob", 0),
        ("actor.generate_sequences", 1),
    ]
    # clipped to the window: generate step 0 seen over [2, 10] only
    late = {(s["stage"], s["step"]): s for s in stage_idle(ivs, ["A", "B"], 2.0, 10.0)}
    assert late[("actor.generate_sequences", 0)]["span_s"] == 2.0


def test_metric_series_keeps_present_keys_and_latest_value_per_step():
    events = [
        (0.0, {"step": 0, "reward_mean": 0.1, "kl": 0.0}),
        (1.0, "not a dict"),
        (2.0, {"step": 1, "reward_mean": 0.2, "kl": math.nan, "cost_mean": True}),
        (3.0, {"step": 1, "reward_mean": 0.25}),
        (4.0, {"reward_mean": 9.0}),
    ]
    # no keys named: every numeric metric (not bools, NaNs, strings or the step itself), in order of appearance
    assert metric_series(events) == {"reward_mean": [[0, 0.1], [1, 0.25]], "kl": [[0, 0.0]]}
    # named keys: those present, in the caller's order
    assert metric_series(events, ["kl", "reward_mean"]) == {"kl": [[0, 0.0]], "reward_mean": [[0, 0.1], [1, 0.25]]}
    assert list(metric_series(events, ["missing", "kl"])) == ["kl"]
    many = [(0.0, {"step": 0, **{f"m{i}": float(i) for i in range(20)}}), (1.0, {"step": 1, "late": 1.0, "m0": 5.0})]
    assert list(metric_series(many)) == [f"m{i}" for i in range(DEFAULT_METRIC_LIMIT)]
    assert metric_series(many)["m0"] == [[0, 0.0], [1, 5.0]]
    assert list(metric_series(many, limit=2)) == ["m0", "m1"]
    assert metric_series(many, ["late", "m19"]) == {"late": [[1, 1.0]], "m19": [[0, 19.0]]}  # no limit on named keys


def test_snapshot_composes_graph_slots_stages_and_metrics():
    ivs = [
        Interval("A", "rt.all_reduce", 1.0, 2.0, step=3),
        Interval("B", "rt.all_reduce", 1.0, 1.5, step=3),
        Interval("A", "rt.all_reduce", 0.0, 0.5, step=2),
    ]
    d = snapshot(
        now=5.0,
        step=3,
        tasks=[TaskRecord(k("rt.all_reduce", 0), "memory", done=True)],
        intervals=ivs,
        slots=["A", "B"],
        slot_names={"A": "0"},
        window_start=1.0,
        events=[(0.0, {"step": 2, "reward_mean": 1.0, "note": "x"})],
    )
    assert d["step"] == 3 and d["window"] == {"start": 1.0, "stop": 5.0, "seconds": 4.0}
    assert d["graph"]["nodes"][0]["seconds"] == 1.5  # this step's compute only
    assert [(s["name"], s["busy_s"]) for s in d["slots"]] == [("0", 1.0), ("1", 0.5)]
    assert d["roles"] == {"rt": role_color("rt")} and d["metrics"] == {"reward_mean": [[2, 1.0]]}
    assert d["last_metrics"] == {"step": 2, "reward_mean": 1.0}
    assert [(s["stage"], s["step"], s["idle_s"]) for s in d["stages"]] == [("rt.all_reduce", 3, 0.5)]
    mine = snapshot(
        now=5.0,
        step=3,
        tasks=[TaskRecord(k("rt.all_reduce", 0), "memory", done=True)],
        intervals=ivs,
        slots=["A", "B"],
        window_start=1.0,
        events=[(0.0, {"step": 2, "reward_mean": 1.0, "kl": 0.5})],
        metric_keys=("kl",),
        role_colors={"rt": "#010203"},
    )
    assert mine["roles"] == {"rt": "#010203"} and mine["graph"]["nodes"][0]["color"] == "#010203"
    assert mine["metrics"] == {"kl": [[2, 0.5]]}


def _fake_scheduler(tasks: dict) -> SimpleNamespace:
    return SimpleNamespace(tasks=tasks, workers={}, get_events=lambda topic: [])


def _ts(state: str, deps=(), after=None, data=()) -> SimpleNamespace:
    """A scheduler task state: `after` the keys of its `_after` argument, `data` those of its positional input."""
    spec = SimpleNamespace(
        args=(SimpleNamespace(dependencies=frozenset(data)),),
        kwargs={"_after": SimpleNamespace(dependencies=frozenset(after or ()))},
    )
    return SimpleNamespace(state=state, dependencies=[SimpleNamespace(key=d) for d in deps], run_spec=spec)


def test_plugin_tags_tasks_with_the_step_and_forgets_old_steps():
    p = FlowactorsDashboard(keep_steps=2)
    a, b = k("rt.x", 0), k("rt.y", 0)
    c = k("rt.z", 0)
    sched = _fake_scheduler(
        {
            a: _ts("waiting"),
            b: _ts("waiting", deps=(a,), after=(a,)),
            c: _ts("waiting", deps=(b,), after=(b,), data=(b,)),
        }
    )
    p.update_graph(sched, tasks=[a, b, c])
    assert p._steps[0][b].order_deps == (a,) and p._steps[0][b].deps == (a,)
    # rank r's part of the previous call on its own process: a data edge, though it is the `_after` key too
    assert p._steps[0][c].order_deps == () and p._steps[0][c].deps == (b,)
    p.transition(a, "waiting", "processing", stimulus_id="s")
    p.transition(
        a,
        "processing",
        "memory",
        stimulus_id="s",
        worker="W",
        startstops=[
            {"action": "transfer", "start": 0.0, "stop": 0.5},
            {"action": "compute", "start": 1.0, "stop": 2.0},
        ],
    )
    p.transition(a, "memory", "forgotten", stimulus_id="s")
    assert (p._steps[0][a].state, p._steps[0][a].done) == ("released", True)
    assert list(p._intervals) == [Interval("W", "rt.x", 1.0, 2.0, 0)]
    for step in range(3):  # metrics of step i: later tasks belong to step i + 1
        p.log_event("flowactors.metrics", {"step": step, "reward_mean": 0.0})
        key = k("rt.x", 0, f"{step:016x}")
        sched.tasks[key] = _ts("waiting")
        p.update_graph(sched, tasks=[key])
    assert list(p._steps) == [2, 3] and a not in p._key_step
    p.log_event("flowactors.step", {"step": 10})
    assert p.step == 10
    clone = pickle.loads(pickle.dumps(p))  # only the settings travel to the scheduler
    assert (clone.keep_steps, clone.step, len(clone._intervals), dict(clone._steps)) == (2, 0, 0, {})
    with pytest.raises(ValueError, match="window_s"):
        FlowactorsDashboard(window_s=0)
    with pytest.raises(TypeError, match=r"\('kl',\)"):
        FlowactorsDashboard(metrics="kl")


def test_plugin_gives_roles_the_free_palette_colours_in_the_order_they_appear():
    p = FlowactorsDashboard(metrics=("kl",), role_colors={"b": PALETTE[0], "x": "#010203"})
    keys = [k("world.init", 0), k("b.m", 0), k("c.m", 0), k("join"), k("a.m", 0), k("c.n", 1)]
    sched = _fake_scheduler({key: _ts("waiting") for key in keys})
    p.update_graph(sched, tasks=keys)
    # the caller's and the runtime's colours stay; c then a take the first palette colours the caller left free
    assert p._colors == {
        "task": "#8c8c8c",
        "world": "#5f6b73",
        "b": PALETTE[0],
        "x": "#010203",
        "c": PALETTE[1],
        "a": PALETTE[2],
    }
    clone = pickle.loads(pickle.dumps(p))  # the settings travel; the colours handed out restart with the plugin
    assert (clone.metrics, clone.role_colors) == (("kl",), {"b": PALETTE[0], "x": "#010203"})
    assert clone._colors == {"task": "#8c8c8c", "world": "#5f6b73", "b": PALETTE[0], "x": "#010203"}
    for i in range(len(PALETTE) + 3):  # more roles than colours: the rest share palette colours by hash
        p._color_role(f"extra{i}")
    assert len(p._colors) == 6 + len(PALETTE) + 3 and set(p._colors.values()) >= set(PALETTE)


def test_install_dashboard_refuses_a_scheduler_without_dashboard():
    class NoDashboard:
        @property
        def dashboard_link(self):
            raise KeyError("dashboard")

        def register_plugin(self, plugin):
            raise AssertionError("must not register")

    with pytest.raises(RuntimeError, match="no dashboard"):
        install_dashboard(NoDashboard())

    registered = []
    client = SimpleNamespace(dashboard_link="http://127.0.0.1:8787/status", register_plugin=registered.append)
    assert install_dashboard(client) == "http://127.0.0.1:8787/flowactors"
    assert isinstance(registered[0], FlowactorsDashboard)
    assert (registered[0].metrics, registered[0].role_colors) == (None, {})  # neutral defaults: chart everything
    install_dashboard(client, metrics=["kl", "loss"], role_colors={"learner": "#010203"})
    assert (registered[1].metrics, registered[1].role_colors) == (("kl", "loss"), {"learner": "#010203"})
    with pytest.raises(ValueError, match="both a plugin and metrics"):
        install_dashboard(client, FlowactorsDashboard(), metrics=["kl"])


def test_busy_seconds_between_any_bounds_match_a_direct_sum():
    import random

    from flowactors.dashboard import Busy, covered_length, union_of

    rng = random.Random(0)
    for _ in range(200):
        spans = union_of(
            [(a, a + rng.uniform(0, 2)) for a in (rng.uniform(0, 20) for _ in range(rng.randrange(8)))], 0.0, 30.0
        )
        lo = rng.uniform(-1, 25)
        hi = lo + rng.uniform(0, 10)
        assert Busy(spans).between(lo, hi) == pytest.approx(covered_length(union_of(spans, lo, hi)), abs=1e-9)


def test_direct_calls_are_waiting_when_issued_processing_when_started_and_done_when_they_end():
    """The direct path's three reports of one item: the controller's as it sends it, then its worker's when it
    starts and when it ends; whichever arrives first makes the record, and none moves a record back."""
    p = FlowactorsDashboard()
    p.scheduler = _fake_scheduler({})
    a0, a1, b0 = k("actor.gen", 0), k("actor.gen", 1), k("critic.values", 0)
    p.log_event(
        "flowactors.issued",
        {
            "calls": [
                {"key": a0, "worker": "W0", "deps": [], "step": 3, "order": None},
                {"key": a1, "worker": "W1", "deps": [], "step": 3, "order": None},
                {"key": b0, "worker": "W0", "deps": [a0, a1], "step": 3, "order": a0},
            ]
        },
    )
    recs = p._steps[3]
    assert [recs[x].state for x in (a0, a1, b0)] == ["waiting"] * 3 and not any(r.late for r in recs.values())
    assert recs[b0].deps == (a0, a1) and recs[b0].order_deps == ()  # a0 is data too: no separate order edge
    p.log_event(
        "flowactors.calls",
        {
            "worker": "W0",
            "calls": [
                {"key": a0, "deps": [], "order": None, "state": "waiting", "step": 3},
                {"key": a0, "state": "processing", "start": 10.0, "step": 3},
            ],
        },
    )
    assert (recs[a0].state, recs[a0].started, recs[a0].worker) == ("processing", 10.0, "W0")
    p.log_event(
        "flowactors.calls",
        {
            "worker": "W0",
            "calls": [{"key": a0, "deps": [], "order": None, "start": 10.0, "stop": 12.0, "ok": True, "step": 3}],
        },
    )
    p.log_event(
        "flowactors.calls",
        {
            "worker": "W0",
            "calls": [  # a late copy of an earlier report
                {"key": a0, "state": "processing", "start": 10.0, "step": 3}
            ],
        },
    )
    assert (recs[a0].state, recs[a0].done) == ("memory", True)
    assert list(p._intervals) == [Interval("W0", "actor.gen", 10.0, 12.0, 3)] and p._usual["actor.gen"] == 2.0
    # a worker's end report before the controller's issue report: recorded finished, and counted as late
    c0 = k("reward.score", 0)
    p.log_event(
        "flowactors.calls",
        {
            "worker": "W1",
            "calls": [{"key": c0, "deps": [], "order": None, "start": 1.0, "stop": 1.5, "ok": False, "step": 3}],
        },
    )
    p.log_event("flowactors.issued", {"calls": [{"key": c0, "worker": "W1", "deps": [], "step": 3}]})
    assert (recs[c0].state, recs[c0].late) == ("erred", True)
    c1 = k("reward.score", 1)  # one that ended well, its end its only report (a worker's flush sends only that)
    p.log_event(
        "flowactors.calls",
        {
            "worker": "W1",
            "calls": [{"key": c1, "deps": [], "order": None, "start": 1.0, "stop": 1.5, "ok": True, "step": 3}],
        },
    )
    assert (recs[c1].state, recs[c1].done) == ("memory", True)
    g = {n["id"]: n for n in aggregate_graph(recs.values(), now=11.0)["nodes"]}
    assert g["actor.gen"]["state"] == "waiting" and g["actor.gen"]["counts"] == {"memory": 1, "waiting": 1}
    assert [r["state"] for r in g["actor.gen"]["ranks"]] == ["memory", "waiting"]
    assert (g["reward.score"]["late"], g["actor.gen"]["late"]) == (2, 0)


def test_calls_keep_the_step_that_issued_them_and_kept_steps_stay_in_order():
    """The asynchronous pipeline issues a later step's calls early: each stays in its own step's graph."""
    p = FlowactorsDashboard(keep_steps=3)
    p.scheduler = _fake_scheduler({})
    for step in (6, 5, 7, 8):  # step 5's first call arrives after step 6's
        p.log_event(
            "flowactors.issued", {"calls": [{"key": k("actor.gen", 0, f"{step:016x}"), "worker": "W", "step": step}]}
        )
    assert list(p._steps) == [6, 7, 8]  # 5 was kept, then dropped as the oldest once 8 came
    p.log_event("flowactors.issued", {"calls": [{"key": k("actor.gen", 1, H), "worker": "W", "step": 2}]})
    assert 2 not in p._steps  # older than every kept step: dropped at once


def test_a_call_running_past_its_usual_time_is_marked_slow():
    assert not is_slow(2.9, 1.0) and is_slow(3.1, 1.0)  # 3 x usual
    assert not is_slow(1.05, 0.1) and is_slow(1.2, 0.1)  # usual + 1 s for short calls
    assert not is_slow(1000.0, None)  # nothing to compare with yet
    recs = [TaskRecord(k("actor.update", r), "processing", worker=f"W{r}", started=100.0 - 4.0 * r) for r in (0, 1)]
    node = aggregate_graph(recs, now=100.0, usual={"actor.update": 1.0})["nodes"][0]
    assert [t["running_s"] for t in node["ranks"]] == [0.0, 4.0]
    assert [t["key"] for t in node["slow"]] == [k("actor.update", 1)] and node["usual_s"] == 1.0


def test_a_calls_one_report_for_all_its_ranks_records_what_a_report_per_rank_would():
    """The controller reports a fan-out once, a list per field (flowactors.transport.channel); the plugin's
    records are those of one report per rank: keys, workers, order edges, shared and per-part dependencies."""
    a = [k("actor.gen", r) for r in range(3)]
    b = [k("critic.values", r) for r in range(3)]
    per_rank = [
        {"key": b[r], "worker": f"W{r}", "deps": [a[0], a[r]] if r else [a[0]], "step": 5, "order": a[r], "at": 1.0}
        for r in range(3)
    ]
    one = {
        "fanout": True,
        "keys": b,
        "workers": ["W0", "W1", "W2"],
        "orders": a,
        "deps": [a[0]],
        "deps_each": [[a[0]], [a[0], a[1]], [a[0], a[2]]],
        "step": 5,
        "at": 1.0,
    }
    shared = dict(one, deps_each=None, orders=[None, None, None])
    seen = []
    for calls in ([*per_rank], [one], [shared]):
        p = FlowactorsDashboard()
        p.scheduler = _fake_scheduler({})
        p.log_event("flowactors.issued", {"calls": calls})
        seen.append({x: (r.state, r.deps, r.order_deps, r.worker) for x, r in p._steps[5].items()})
    assert seen[0] == seen[1] and len(seen[0]) == 3
    assert seen[0][b[1]] == ("waiting", (a[0], a[1]), (), "W1")  # its order edge is a data edge too
    assert seen[0][b[2]] == ("waiting", (a[0], a[2]), (), "W2")
    assert seen[2][b[2]] == ("waiting", (a[0],), (), "W2")  # no part of its own: the shared dependencies only
