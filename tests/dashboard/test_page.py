"""The flowactors page on a real cluster's dashboard: data.json after real group calls, then a headless browser.

Two worker processes with the dashboard on 127.0.0.1; two colocated groups (`rt`, `scorer`) run three "steps"
of a small dataflow (rt.add_rank → scorer.scale_x → summarize, plus an rt.all_reduce collective) and publish
metrics the way the controller does. The program names the metrics to chart (two of the three it publishes) and
a colour for `scorer`, as `algorithms` does for its roles; `rt` gets a palette colour. Debian's chromium then renders /flowactors; the test reads the screenshot's
pixels (the role colours must be drawn) and the DOM after the page's JS ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import flowactors as fa
from flowactors import Batch
from flowactors.dashboard import STATE_COLORS, install_dashboard
from tests.dashboard.png import colour_counts, read_png
from tests.runtime.workers import Reducer

CHROMIUM = "/usr/bin/chromium"
STEPS = 3
CHARTED = ("kl", "reward_mean")  # cost_mean is published too, but not charted
SCORER_COLOR = "#3949ab"


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def page():
    ctl = fa.Controller.local(2, dashboard="127.0.0.1:0", collective_timeout_s=60)
    try:
        url = install_dashboard(ctl.client, metrics=CHARTED, role_colors={"scorer": SCORER_COLOR})
        assert install_dashboard(ctl.client) == url  # idempotent: the running plugin (and its settings) stays
        rt = fa.ActorGroup(ctl, Reducer, name="rt", args=(1.0,))
        scorer = fa.ActorGroup(ctl, Reducer, name="scorer", args=(10.0,))  # colocated: same two processes
        batch = Batch({"x": torch.arange(8.0)}, {"id": list(range(8))})
        for step in range(STEPS):
            ranked = rt.add_rank(batch)
            scored = scorer.scale_x(ranked)  # a future passed on: a data edge rt.add_rank → scorer.scale_x
            total = rt.all_reduce(float(step))
            rows = ctl.apply(len, scored, name="summarize")
            scorer.sleep(0.05).result()
            assert rows.result() == 8 and total.result() == [3.0 * step] * 2
            ctl.report_metrics(step, {"reward_mean": 0.2 + 0.1 * step, "kl": 0.01 * step, "cost_mean": 1.0 - step / 4})
        # Calls on the direct path (flowactors.transport.channel) reach the page when their workers report them (every
        # 0.2 s): read it once the last step's calls are all there, as the page's own polling would.
        deadline = time.monotonic() + 15
        while True:
            d = json.loads(_get(f"{url}/data.json")[1])
            nodes = d["graph"]["nodes"]
            if (
                d["step"] == STEPS - 1 and len(nodes) == 5 and all(n["done"] == n["n"] for n in nodes)
            ) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield ctl, url, d
    finally:
        ctl.close()


def test_data_json_has_the_steps_graph_slot_timelines_and_metrics(page):
    ctl, url, d = page
    assert url.startswith("http://127.0.0.1:") and url.endswith("/flowactors")
    assert d["step"] == STEPS - 1  # the latest step with calls (step 3 has none yet)
    nodes = {n["id"]: n for n in d["graph"]["nodes"]}
    assert set(nodes) == {"rt.add_rank", "scorer.scale_x", "rt.all_reduce", "summarize", "scorer.sleep"}
    for n in nodes.values():  # every call of the step finished: a task per rank (and a collect task if the
        assert n["done"] == n["n"] >= (1 if n["id"] == "summarize" else 2), n  # runtime uses one), or 1 helper
        assert n["state"] in ("memory", "released")
    assert (nodes["rt.add_rank"]["layer"], nodes["scorer.scale_x"]["layer"], nodes["summarize"]["layer"]) == (0, 1, 2)
    edges = {(e["source"], e["target"], e["kind"]) for e in d["graph"]["edges"]}
    assert {("rt.add_rank", "scorer.scale_x", "data"), ("scorer.scale_x", "summarize", "data")} <= edges
    assert any(kind == "order" for *_, kind in edges)  # the per-process `_after` chain
    assert nodes["scorer.sleep"]["seconds"] >= 0.1  # 50 ms on each of 2 ranks

    slots = d["slots"]
    assert [s["worker"] for s in slots] == ctl.slots and [s["name"] for s in slots] == ["0", "1"]
    for s in slots:
        assert s["busy_s"] >= STEPS * 0.05 and abs(s["busy_s"] + s["idle_s"] - d["window"]["seconds"]) < 1e-3
        assert {"rt", "scorer"} <= {seg[2] for seg in s["segments"]} and {"rt", "scorer"} <= set(s["by_role"])
        assert all(0 <= a <= b <= d["window"]["seconds"] + 1e-3 for a, b, *_ in s["segments"])
    sleeps = [t for t in d["stages"] if t["stage"] == "scorer.sleep"]
    assert [t["step"] for t in sleeps] == list(range(STEPS)) and all(t["busy_s"] >= 0.1 for t in sleeps)

    assert d["metrics"]["reward_mean"] == [[i, pytest.approx(0.2 + 0.1 * i)] for i in range(STEPS)]
    assert tuple(d["metrics"]) == CHARTED and d["last_metrics"]["cost_mean"] == 0.5
    assert {"rt", "scorer", "task"} <= set(d["roles"]) and d["roles"]["scorer"] == SCORER_COLOR
    assert len({d["roles"][r] for r in ("rt", "scorer", "task")}) == 3
    assert all(n["color"] == d["roles"][n["role"]] for n in nodes.values())


def test_page_is_self_contained(page):
    _, url, _ = page
    status, html = _get(url)
    assert status == 200 and "/flowactors/data.json" in html and "setInterval(refresh" in html
    assert "<script src" not in html and "<link" not in html and "cdn" not in html.lower()


def _chromium(url: str, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess:
    """One headless chromium run; `--virtual-time-budget` lets the page's fetch and rendering finish first."""
    profile = tmp_path / f"profile{len(list(tmp_path.iterdir()))}"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "--virtual-time-budget=4000",
        *mode,
        url,
    ]
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done


def test_page_renders_in_headless_chromium(page, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"chromium is not installed ({CHROMIUM}): `.ci/run` installs it, or: apt-get install chromium")
    _, url, d = page
    shot = tmp_path / "flowactors.png"
    _chromium(url, tmp_path, f"--screenshot={shot}")
    image = read_png(shot.read_bytes())
    assert image.shape[:2] == (900, 1280)
    colours = colour_counts(image)
    # Node boxes and timeline segments are filled with the role colours; finished nodes are outlined in the
    # "memory"/"released" state colours.
    for role in ("rt", "scorer", "task"):
        assert colours[d["roles"][role]] > 400, (role, d["roles"][role], colours.most_common(12))
    assert colours[STATE_COLORS["memory"]] + colours[STATE_COLORS["released"]] > 400
    assert colours["#263238"] > 20000  # the header bar

    dom = _chromium(url, tmp_path, "--dump-dom").stdout
    assert f"<title>flowactors · step {STEPS - 1}</title>" in dom
    for node in ("rt.add_rank", "scorer.scale_x", "rt.all_reduce", "summarize"):
        assert f'data-node="{node}"' in dom
    assert dom.count('class="seg"') >= 2 * 4 and "slot 0" in dom and "slot 1" in dom
    assert all(f'data-metric="{m}"' in dom for m in CHARTED) and 'data-metric="cost_mean"' not in dom
    assert 'data-role="scorer"' in dom and '<span id="status">updated ' in dom
    shutil.copy(shot, os.environ.get("FLOWACTORS_SCREENSHOT", tmp_path / "kept.png"))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "dask-tasks"])
def test_a_held_call_shows_processing_on_its_ranks_and_the_calls_behind_it_waiting(direct, tmp_path):
    """While a step runs: a call held on purpose (a 6 s sleep on both ranks) is processing on each rank, the call
    issued after it on the same processes is already in the step's graph, waiting; once the sleep has run past its
    usual time (0.05 s, learned from the previous step) it is marked slow, and its link gives the rank's stack;
    the page in a browser draws the ranks' states and the slow call's link."""
    ctl = fa.Controller.local(2, dashboard="127.0.0.1:0", collective_timeout_s=60, direct_calls=direct)
    try:
        url = install_dashboard(ctl.client)
        rt = fa.ActorGroup(ctl, Reducer, name="rt", args=(1.0,))
        for _ in range(3):
            rt.sleep(0.05).result()
        ctl.report_metrics(0, {"reward_mean": 0.0})  # what follows is step 1
        held = rt.sleep(6.0)
        behind = rt.add_rank(Batch({"x": torch.arange(4.0)}))
        seen: dict = {}
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not seen.get("slow"):
            d = json.loads(_get(f"{url}/data.json")[1])
            nodes = {n["id"]: n for n in d["graph"]["nodes"]}
            sleep, add = nodes.get("rt.sleep"), nodes.get("rt.add_rank")
            if d["step"] == 1 and sleep and add:
                if [r["state"] for r in sleep["ranks"]] == ["processing"] * 2 and add["state"] == "waiting":
                    seen.setdefault("live", (sleep, add, d["steps"]))
                if sleep["slow"]:
                    seen["slow"] = sleep
            time.sleep(0.1)
        assert "live" in seen, "the held call never showed as processing with the next call waiting"
        sleep, add, steps = seen["live"]
        assert {r["worker"] for r in sleep["ranks"]} == set(ctl.slots) and steps[-1] == 1
        assert [r["state"] for r in add["ranks"]] == ["waiting"] * 2 and add["done"] == 0
        assert ("rt.sleep", "rt.add_rank", "order") in {
            (e["source"], e["target"], e["kind"]) for e in d["graph"]["edges"]
        }
        assert "slow" in seen, "the held call was never marked slow"
        slow = seen["slow"]["slow"][0]
        assert slow["running_s"] > 1.0 and seen["slow"]["usual_s"] < 0.2
        stack = json.loads(_get(f"{url.removesuffix('/flowactors')}/flowactors/stack.json?key={slow['key']}")[1])
        assert stack["worker"] == slow["worker"] and any("sleep" in line for line in stack["stack"]), stack
        if Path(CHROMIUM).exists() and not held.done():
            dom = _chromium(url, tmp_path, "--dump-dom").stdout
            assert 'class="rank" data-state="processing"' in dom and 'class="rank" data-state="waiting"' in dom
            assert 'data-node="rt.sleep" data-state="processing" data-slow="2"' in dom
            assert 'class="slow-call"' in dom and "stack.json?key=" in dom
        held.result(), behind.result()
        # the finished step stays selectable while the next runs
        ctl.report_metrics(1, {"reward_mean": 0.0})
        rt.sleep(0.01).result()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            d1 = json.loads(_get(f"{url}/data.json?step=1")[1])
            if d1["step"] == 1 and all(n["done"] == n["n"] for n in d1["graph"]["nodes"]) and 2 in d1["steps"]:
                break
            time.sleep(0.1)
        assert d1["step"] == 1 and {n["id"] for n in d1["graph"]["nodes"]} == {"rt.sleep", "rt.add_rank"}
        assert all(n["late"] == 0 for n in d1["graph"]["nodes"])  # every call appeared before it finished
    finally:
        ctl.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e  # a whole program's run: CI's second tier (.ci/run)
def test_a_safe_rlhf_run_shows_each_step_live(tmp_path):
    """Polling data.json through a Safe-RLHF run (the default program, direct calls): calls are seen waiting and
    processing as well as done, and in every step's graph each call appeared before it finished (`late` 0)."""
    import sys

    port = _free_port()
    url = f"http://127.0.0.1:{port}/flowactors"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [
            sys.executable,
            "algorithms/safe_rlhf.py",
            "--steps",
            "8",
            "sft_steps=5",
            f"dashboard=127.0.0.1:{port}",
            "--metrics-file",
            str(tmp_path / "m.jsonl"),
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    states, graphs = set(), {}
    try:
        while proc.poll() is None:
            try:
                d = json.loads(_get(f"{url}/data.json")[1])
            except OSError:  # not serving yet, or closing
                time.sleep(0.1)
                continue
            states |= {r["state"] for n in d["graph"]["nodes"] for r in n["ranks"]}
            for s in d["steps"][:-1]:  # steps before the newest have been issued whole
                if s not in graphs and s >= 1:
                    graphs[s] = json.loads(_get(f"{url}/data.json?step={s}")[1])["graph"]
            time.sleep(0.05)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert {"waiting", "processing", "memory"} <= states, states
    assert len(graphs) >= 3, sorted(graphs)
    for s, g in graphs.items():
        ids = {n["id"] for n in g["nodes"]}
        assert {
            "actor.generate_sequences",
            "actor.update_actor",
            "critic.update_critic",
            "cost_critic.update_critic",
        } <= ids, (s, ids)
        assert [n["id"] for n in g["nodes"] if n["late"]] == [], s
