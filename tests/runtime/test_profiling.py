"""flowactors.profiling: the busy-seconds arithmetic against hand-computed numbers, then `Controller.profile()` on
a real cluster (a block the workers fill, and one in which only the controller works)."""

from __future__ import annotations

import random
import time

import pytest

from flowactors.profiling import ComputeProfile, busy_seconds, compute_spans, union_spans


def test_busy_seconds_counts_overlaps_once_and_clips_to_the_window():
    assert busy_seconds([], 0.0, 10.0) == 0.0
    assert busy_seconds([(1.0, 3.0)], 0.0, 10.0) == 2.0
    assert busy_seconds([(1.0, 3.0), (2.0, 4.0)], 0.0, 10.0) == 3.0  # overlapping: [1, 4]
    assert busy_seconds([(1.0, 5.0), (2.0, 3.0)], 0.0, 10.0) == 4.0  # nested
    assert busy_seconds([(2.0, 4.0), (1.0, 3.0), (6.0, 7.0)], 0.0, 10.0) == 4.0  # unsorted, with a gap
    assert busy_seconds([(1.0, 2.0), (2.0, 3.0)], 0.0, 10.0) == 2.0  # touching
    assert busy_seconds([(-5.0, 1.0), (9.0, 15.0)], 0.0, 10.0) == 2.0  # straddling either end
    # spans wholly outside the window count nothing (a span after `stop` must not count negative)
    assert busy_seconds([(-5.0, -1.0), (12.0, 15.0), (4.0, 5.0)], 0.0, 10.0) == 1.0
    assert busy_seconds([(3.0, 3.0), (5.0, 4.0)], 0.0, 10.0) == 0.0  # empty and reversed spans
    assert busy_seconds([(0.0, 20.0)], 2.0, 2.0) == 0.0  # an empty window
    assert union_spans([(4.0, 6.0), (1.0, 2.0), (5.0, 8.0), (2.0, 3.0)], 0.0, 7.0) == [(1.0, 3.0), (4.0, 7.0)]


def test_busy_seconds_match_a_fine_grid():
    rng = random.Random(0)
    step = 0.01
    for _ in range(100):
        spans = [
            (a, a + rng.choice([0, 1, 2, 5, 30]) * step)
            for a in (rng.randrange(-100, 1100) * step for _ in range(rng.randrange(10)))
        ]
        lo, hi = rng.randrange(0, 500) * step, rng.randrange(500, 1000) * step
        cells = sum(any(a <= lo + (i + 0.5) * step < b for a, b in spans) for i in range(round((hi - lo) / step)))
        assert busy_seconds(spans, lo, hi) == pytest.approx(cells * step, abs=1e-9)


def test_compute_spans_take_only_compute_from_the_task_stream():
    tasks = [
        {
            "key": "a",
            "startstops": [
                {"action": "transfer", "start": 0.0, "stop": 1.0},
                {"action": "compute", "start": 1.0, "stop": 2.0},
            ],
        },
        {
            "key": "b",
            "startstops": [
                {"action": "disk-read", "start": 2.0, "stop": 3.0},
                {"action": "compute", "start": 1.5, "stop": 4.0},
            ],
        },
        {"key": "c"},
    ]
    assert compute_spans(tasks) == [(1.0, 2.0), (1.5, 4.0)]


def test_controller_share_is_the_unbusy_fraction_of_the_wall_time():
    assert ComputeProfile(wall_s=4.0, busy_s=3.0).controller_share == 0.25
    assert ComputeProfile(wall_s=4.0, busy_s=0.0).controller_share == 1.0
    assert ComputeProfile().controller_share == 0.0  # nothing measured


def test_controller_profile_on_a_cluster(controller4):
    ctl = controller4
    ctl.apply(time.sleep, 0.0, name="nap").result()  # a first call pays for imports on the worker
    with ctl.profile() as busy:
        ctl.apply(time.sleep, 0.6, name="nap").result()
    # the worker computed for the nap; the rest of the block (submitting, fetching) is the controller's
    assert 0.59 <= busy.busy_s <= busy.wall_s, busy
    assert busy.controller_share == pytest.approx(1 - busy.busy_s / busy.wall_s) and busy.controller_share < 1.0
    with ctl.profile() as idle:
        time.sleep(0.2)  # only the controller works
    assert idle.wall_s >= 0.2 and idle.busy_s == 0.0 and idle.controller_share == 1.0, idle
