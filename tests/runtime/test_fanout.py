"""A group call described once and sent down a tree (flowactors.transport.fanout, the direct path's channel and
server): the tree's shape, the parts each node hands on, the issue order across connections, and a relay's death."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import flowactors as fa
from flowactors import DP, MESH, Batch, Layout
from flowactors.transport import fanout as fo
from flowactors.transport import server
from tests.runtime.workers import Reducer


def _tree(n: int) -> tuple[dict[int, tuple[int, int]], dict[int, list[int]]]:
    """rank -> (start, stop) of its subtree, and rank -> its children, built the way the controller and the nodes
    cut it."""
    span: dict[int, tuple[int, int]] = {}
    children: dict[int, list[int]] = {}

    def build(start: int, stop: int) -> None:
        span[start] = (start, stop)
        children[start] = [start + 1 + a for a, _ in fo.subtrees(stop - start - 1, fo.FANOUT)]
        for a, b in fo.subtrees(stop - start - 1, fo.FANOUT):
            build(start + 1 + a, start + 1 + b)

    for a, b in fo.subtrees(n, fo.ROOTS):
        build(a, b)
    return span, children


@pytest.mark.parametrize("n", [1, 2, 3, 9, 17, 64, 100, 1024])
def test_every_rank_is_in_one_subtree_and_subtree_of_finds_it(n):
    span, children = _tree(n)
    assert sorted(span) == list(range(n))
    assert all(fo.subtree_of(n, i) == span[i] for i in range(n))
    assert all(len(c) <= fo.FANOUT for c in children.values())
    assert sum(len(c) for c in children.values()) == n - min(n, fo.ROOTS)  # every rank but the roots has a parent
    assert len(fo.subtrees(n, fo.ROOTS)) == min(n, fo.ROOTS)


def test_the_depth_of_a_tree_of_1024_ranks_is_4():
    assert [fo.depth(n) for n in (1, 2, 3, 4, 18, 1024)] == [1, 1, 2, 2, 2, 4]


def _batch(rows: int) -> Batch:
    return Batch({"x": torch.arange(rows * 3).reshape(rows, 3)}, {"id": list(range(rows))})


@pytest.mark.parametrize("protocol, layout", [(DP, Layout(dp=8)), (MESH, Layout(pp=2, dp=2, tp=2))])
def test_parts_trimmed_down_a_tree_equal_the_protocols_split(protocol, layout):
    """Each rank's inputs, resolved from the inputs trimmed at every level on its way, are what the protocol's
    own split hands it."""
    b, other = _batch(16), {"k": 3}
    dest = protocol.destinations(layout)
    n = max(dest) + 1
    call = fo.Fanout(
        min,
        ((fo.Split(b, n), 7), {"o": other}),
        {},
        [fo.Rank(f"w{r}", f"k-{r}", dest[r]) for r in range(layout.world_size)],
    )
    want = protocol.split((b, 7), {"o": other}, layout)
    for r, (_, fn, args, _, _) in enumerate(fo.expand(call)):  # args: the call's (args, kwargs), resolved
        assert fn is min and args[0][0].equals(want[r][0][0]) and args[0][1] == 7 and args[1] == want[r][1]
    for r in range(layout.world_size):  # the same through two trims (a root's subtree, then a child's)
        lo, hi = min(dest[: r + 1]), max(dest[r:])
        once = fo.trim(call.args, lo, hi)
        twice = fo.trim(once, dest[r], dest[r])
        assert fo.resolve(twice, dest[r])[0][0].equals(want[r][0][0])


def test_parts_are_handed_out_by_index():
    parts = fo.Parts(["a", "b", "c", "d"])
    trimmed = fo.trim((parts, 1), 1, 2)
    assert trimmed[0].values == ["b", "c"] and trimmed[0].first == 1
    assert fo.resolve(trimmed, 2) == ("c", 1)


def test_the_sequencer_runs_each_controllers_items_in_issue_order_and_skips_what_it_gave_up():
    seq, ran = server._Sequencer(), []

    def item(name: str):
        return lambda previous: ran.append((name, previous))

    seq.offer("c", 2, "k2", item("k2"))  # early: held
    seq.offer("c", 1, "k1", item("k1"))
    assert ran == []
    seq.offer("c", 0, "k0", item("k0"))
    assert ran == [("k0", None), ("k1", "k0"), ("k2", "k1")]
    seq.offer("other", 0, "o0", item("o0"))  # another controller: its own numbers
    seq.skip("c", [3])  # its relay died: number 3 never comes
    seq.offer("c", 4, "k4", item("k4"))
    seq.offer("c", 3, "k3", item("k3"))  # it came after all: dropped, not run out of order
    assert [name for name, _ in ran] == ["k0", "k1", "k2", "o0", "k4"]


# -- on a real cluster: 4 ranks, so 2 roots each relaying to one more ----------------------------------------------


def test_a_dp_call_down_the_tree_hands_each_rank_its_part_and_relays_it(controller4):
    ctl = controller4
    assert ctl.transport.fans_out
    g = fa.ActorGroup(ctl, Reducer, name="fan_dp")
    try:
        before = ctl.client.run(server.tree_levels)
        data = Batch({"x": torch.arange(16).reshape(8, 2)}, {"id": list(range(8))})
        out = g.add_rank(data).result()
        assert torch.equal(out["x"], data["x"] + 1) and out.rows["id"] == list(range(8))
        assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        chained = g.scale_x(g.add_rank(data)).result()  # part for part, down the tree again
        assert torch.equal(chained["x"], (data["x"] + 1) * 2) and chained["rank"].tolist() == out["rank"].tolist()
        after = ctl.client.run(server.tree_levels)
        relayed = sum(after[a].get(2, 0) - before[a].get(2, 0) for a in after)
        assert relayed == 2 * 3  # three calls, two ranks each reached through a relay
        with pytest.raises(ValueError, match="cannot be split into 4 equal parts.*data-parallel size 4"):
            g.add_rank(Batch({"x": torch.zeros(6, 2)}))
    finally:
        g.close()


def test_tree_calls_and_single_items_keep_each_workers_issue_order(controller4):
    """Calls down the tree (some ranks reached through a relay) and per-rank items (sent to every rank by the
    controller) interleaved under load: every rank records them in the order issued."""
    ctl = controller4
    g = fa.ActorGroup(ctl, Reducer, name="fan_order")
    try:
        futures = []
        for i in range(40):
            ctl.transport.fans_out = i % 3 != 0
            futures.append(g.record(i))
        ctl.transport.fans_out = True
        ctl.wait(futures)
        assert g.history().result() == [list(range(40))] * 4
    finally:
        ctl.transport.fans_out = True
        g.close()


def test_a_relay_killed_mid_call_fails_the_call_naming_it_and_the_rest_recovers():
    """Rank 0 is a root relaying to rank 1: killing it loses the call at rank 0 (its role and rank named), also
    for rank 1, whose item came through it; after recovery the group is rebuilt and calls run again."""
    ctl = fa.Controller.local(4, dashboard=None, collective_timeout_s=30)
    try:
        g = fa.ActorGroup(ctl, Reducer, name="relay")
        pids = g.pid().result()
        pending = g.sleep(4.0)  # down the tree: rank 1's item via rank 0
        queued = g.record(1)
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        for f in (pending, queued):
            with pytest.raises(fa.WorkerLostError, match=r"hosted relay rank 0"):
                f.result(timeout=20)
        assert time.monotonic() - t0 < 10
        ctl.recover(wait_s=60, min_slots=4)
        g = fa.ActorGroup(ctl, Reducer, name="relay")
        assert g.all_reduce(1.0).result(timeout=60) == [10.0] * 4
    finally:
        ctl.close()


def test_a_hang_down_the_tree_reports_every_rank(controller4):
    """Rank 1 (reached through rank 0) straggles, the others wait in the collective: the hang report has every
    rank's place, through the tree as on the direct calls."""
    g = fa.ActorGroup(controller4, Reducer, name="fan_hang")
    try:
        with pytest.raises(fa.HangError) as info:
            g.straggle(5.0).result(timeout=1.5)
        report = info.value.report
        for r in range(4):
            assert f"fan_hang rank {r}" in report
        assert report.count("all_reduce") >= 1 and ("sleep" in report or "straggle" in report)
        assert g.straggle(0.0).result(timeout=60) == [4.0] * 4
    finally:
        g.close()


def test_inputs_without_markers_keep_their_own_containers():
    """Resolving a rank's part rebuilds only what holds a marker: an OrderedDict or a list subclass argument next
    to a split batch reaches the rank as the very object the caller passed."""
    from collections import OrderedDict

    class Rows(list):
        pass

    ordered, rows = OrderedDict(b=1, a=2), Rows([1, 2])
    args = (fo.Split(_batch(4), 2), ordered, rows)
    got = fo.resolve(args, 1)
    assert got[1] is ordered and got[2] is rows and len(got[0]) == 2
    assert fo.map_leaves((ordered, [rows]), fo.Parts, lambda m: m) == (ordered, [rows])


def test_a_groups_word_on_markers_agrees_with_walking_its_inputs(controller4):
    """A group says whether a call's inputs hold markers (the tree then skips walking them); for every kind of
    call it must say what the walk finds: one_to_all, rank_zero, DP on a batch, DP on a future
    (left to the walk)."""
    ctl = controller4
    g = fa.ActorGroup(ctl, Reducer, name="fan_marks")
    seen: list[tuple[bool | None, bool]] = []
    submit = ctl.transport.submit_fanout

    def check(call, step):
        seen.append((call.marked, fo.has_parts((call.args, call.kwargs))))
        return submit(call, step)

    ctl.transport.submit_fanout = check
    try:
        data = Batch({"x": torch.arange(16).reshape(8, 2)}, {"id": list(range(8))})
        assert len(set(g.all_reduce(1.0).result())) == 1
        assert g.fail_on(-1).result() == 0
        out = g.scale_x(g.add_rank(data)).result()
        assert torch.equal(out["x"], (data["x"] + 1) * 2)
        assert g.total_rows(data).result()["total"].tolist() == [8] * 8
        assert g.fail_rows(data, -1).result()["x"].shape == (8, 2)
    finally:
        ctl.transport.submit_fanout = submit
        g.close()
    assert len(seen) == 6 and {m for m, _ in seen} == {False, True, None}
    assert all(marked is None or marked == walked for marked, walked in seen), seen
