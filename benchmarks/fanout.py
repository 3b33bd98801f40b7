"""The single controller's cost per group call against the ranks it addresses: per-rank items against the tree.

    python benchmarks/fanout.py [--json] [--ranks 2,4,8,16,32] [--repeats 30] [--standins 256,1024]

Part 1, a real cluster: a Dask scheduler and one `dask worker --nthreads 1` process per rank (as many as the
largest `--ranks`), each its own process, so the controller's process holds nothing but the controller (the
embedded cluster would put the scheduler there too). For each size, three calls on a group of that many ranks:
`noop` (a ONE_TO_ALL call with no data, awaited), `split4MiB` (a 1024 x 512 int64 batch split over the ranks with
DP, each rank returning nothing, awaited) and `chain3` (three chained DP calls on that batch, only the last
awaited), each through both paths in the same run: `items` (one work item per rank, serialized and sent by the
controller and answered to it, the direct path before the tree: `transport.fans_out = False`) and `tree` (the call
serialized once and sent down a tree, `flowactors.transport.fanout`). Per call: the controller's CPU time
(`time.process_time` of its process over the repeats: every thread, the reply readers included) and the median wall
latency. Then the least-squares slope of CPU time per rank for each path and case.

Part 2, `--standins N[,N...]` (0: skipped): N light stand-in workers, named as such: the real direct-path server
(`flowactors.transport.server.listen`, the same `_serve`, sequencer, tree relay and reply gathering) on objects that
have what it needs of a Dask worker (an event loop, one task thread, an address), many to a process, no Dask and no
torch.distributed. The controller is a `DirectChannel` given their listeners. A no-op call and a DP split of the
4 MiB batch over all N, through the tree (and the no-op through per-rank items, fewer repeats), with the tree's
depth as the stand-ins saw it (the deepest level any item arrived at) against `fanout.depth(N)`; with two or more
sizes, the slope per rank there too (the transport's own, with fewer busy processes than part 1's one per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import flowactors as fa  # noqa: E402
from flowactors import DP, ONE_TO_ALL, Batch, Worker, endpoint  # noqa: E402
from flowactors.futures import new_token  # noqa: E402
from flowactors.transport import fanout as fo  # noqa: E402


class Echo(Worker):
    @endpoint(protocol=ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @endpoint(protocol=DP)
    def touch(self, batch: Batch) -> Batch:
        return batch

    @endpoint(protocol=DP)
    def take(self, batch: Batch) -> None:
        return None


def batch4mib() -> Batch:
    return Batch({"x": torch.arange(1024 * 512, dtype=torch.int64).reshape(1024, 512)})


def _measure(fn, repeats: int) -> tuple[float, float]:
    """(controller CPU ms per call, median wall ms per call) over `repeats` calls after two warm-ups."""
    fn()
    fn()
    walls = []
    cpu0 = time.process_time()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - t0) * 1000)
    cpu = (time.process_time() - cpu0) * 1000 / repeats
    return round(cpu, 4), round(statistics.median(walls), 4)


def _slope(points: list[tuple[int, float]]) -> float:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


# -- part 1: a real cluster ------------------------------------------------------------------------------------------


def _start_cluster(n: int, tmp: str) -> tuple[str, list[subprocess.Popen]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sched_file = os.path.join(tmp, "scheduler.json")
    procs = [
        subprocess.Popen(
            [
                "dask",
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                sched_file,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    deadline = time.monotonic() + 60
    while not os.path.exists(sched_file) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    address = json.load(open(sched_file))["address"]
    for i in range(n):
        procs.append(
            subprocess.Popen(
                ["dask", "worker", address, "--nthreads", "1", "--no-nanny", "--resources", "slot=1"]
                + ["--name", f"slot-{i:03d}", "--no-dashboard", "--memory-limit", "0", "--host", "127.0.0.1"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return address, procs


def cluster_rows(sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    data = batch4mib()
    with tempfile.TemporaryDirectory() as tmp:
        address, procs = _start_cluster(max(sizes), tmp)
        try:
            from distributed import Client

            probe = Client(address, set_as_default=False)
            probe.wait_for_workers(max(sizes), timeout=300)
            probe.close()
            with fa.Controller.connect(address, direct_calls=True) as ctl:
                for n in sizes:
                    g = fa.ActorGroup(ctl, Echo, name=f"echo{n}", slots=ctl.slots[:n])

                    def chain3(g=g):
                        f = g.touch(data)
                        f = g.touch(f)
                        g.take(f).result()

                    cases = {
                        "noop": lambda g=g: g.noop().result(),
                        "split4MiB": lambda g=g: g.take(data).result(),
                        "chain3": chain3,
                    }
                    for case, fn in cases.items():
                        for path in ("items", "tree"):
                            ctl.transport.fans_out = path == "tree"
                            cpu, wall = _measure(fn, repeats)
                            rows.append(
                                {
                                    "part": "cluster",
                                    "path": path,
                                    "case": case,
                                    "ranks": n,
                                    "cpu_ms": cpu,
                                    "wall_ms": wall,
                                }
                            )
                            print(json.dumps(rows[-1]), flush=True)
                    ctl.transport.fans_out = True
                    g.close()
        finally:
            for p in procs[::-1]:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
    return rows


# -- part 2: light stand-in workers ---------------------------------------------------------------------------------


class StandIn:
    """A LIGHT STAND-IN for a Dask worker (not one): what the direct-path server uses of a worker, nothing else."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = type("Loop", (), {"asyncio_loop": loop})()
        self.address = "tcp://127.0.0.1:0"

    def log_event(self, topic: str, msg: object) -> None:
        pass


def standin_main(count: int) -> None:
    """A process hosting `count` stand-ins: prints {address: (port, secret hex)}, then answers "levels" on stdin."""
    from flowactors.transport import server

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    table = {}
    for _ in range(count):
        w = StandIn(loop)
        listener = server.listen(w)[0]
        port = listener.getsockname()[1]
        w.address = f"tcp://127.0.0.1:{port}"
        # TCP only (no Unix socket): a cluster of 1,024 ranks spans hosts, so the controller reaches most by TCP
        table[w.address] = (port, w._flowactors_direct[1].hex())
    print(json.dumps(table), flush=True)
    for line in sys.stdin:
        if line.strip() == "levels":
            print(json.dumps(server.tree_levels()), flush=True)


def _noop_rank(*_: object) -> None:
    return None


def _take_rank(batch: Batch) -> int:
    return len(batch)


def standin_rows(n: int, repeats: int, per_process: int = 128) -> list[dict]:
    from flowactors.transport.channel import DirectChannel

    procs, table = [], {}
    for i in range(0, n, per_process):
        p = subprocess.Popen(
            [sys.executable, __file__, "--standin-host", str(min(per_process, n - i))],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
    try:
        for p in procs:
            table.update({a: (port, bytes.fromhex(s)) for a, (port, s) in json.loads(p.stdout.readline()).items()})
        addresses = sorted(table, key=lambda a: int(a.rsplit(":", 1)[1]))
        channel = DirectChannel(None, listeners=table)
        data = batch4mib()
        rows = []

        def call(fn, args, parts, tree=True):
            tok = new_token()
            ranks = [
                fo.Rank(a, f"standin.{fn.__name__}-{r}-{tok}", parts[r] if parts else -1)
                for r, a in enumerate(addresses)
            ]
            if tree:
                futs = channel.submit_fanout(fo.Fanout(fn, args, {}, ranks))
            else:
                futs = channel.submit(fo.expand(fo.Fanout(fn, args, {}, ranks)))
            if not channel.wait(futs, 120):
                raise TimeoutError("stand-in call did not finish")
            bad = [f for f in futs if f.status != "finished"]
            if bad:
                raise RuntimeError(f"{len(bad)} stand-in ranks failed: {bad[0].error}")
            return futs

        cases = [
            ("noop", "tree", lambda: call(_noop_rank, (), None), repeats),
            ("split4MiB", "tree", lambda: call(_take_rank, (fo.Split(data, n),), list(range(n))), repeats),
            ("noop", "items", lambda: call(_noop_rank, (), None, tree=False), max(3, repeats // 5)),
        ]
        for case, path, fn, reps in cases:
            cpu, wall = _measure(fn, reps)
            rows.append({"part": "standins", "path": path, "case": case, "ranks": n, "cpu_ms": cpu, "wall_ms": wall})
            print(json.dumps(rows[-1]), flush=True)
        levels: dict[int, int] = {}
        for p in procs:
            p.stdin.write("levels\n")
            p.stdin.flush()
            for k, v in json.loads(p.stdout.readline()).items():
                levels[int(k)] = levels.get(int(k), 0) + v
        rows.append(
            {
                "part": "standins",
                "ranks": n,
                "depth_seen": max(levels),
                "depth_expected": fo.depth(n),
                "items_by_level": levels,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        channel.close()
        return rows
    finally:
        for p in procs:
            p.stdin.close()
            p.terminate()
            p.wait(timeout=20)


# -- report ------------------------------------------------------------------------------------------------------


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for part in ("cluster", "standins"):
        for path in ("items", "tree"):
            for case in ("noop", "split4MiB", "chain3"):
                pts = [
                    (r["ranks"], r["cpu_ms"])
                    for r in rows
                    if r.get("part") == part and r.get("path") == path and r["case"] == case
                ]
                if len(pts) >= 2:
                    slope = round(_slope(pts), 5)
                    out.append({"summary": "cpu slope", "part": part, "path": path, "case": case, "ms_per_rank": slope})
    return out


def table(rows: list[dict]) -> str:
    lines = [
        f"{'part':9} {'case':10} {'ranks':>5}  {'items cpu ms':>12} {'tree cpu ms':>11} {'ratio':>6}  {'items wall':>10} {'tree wall':>9}"
    ]
    keyed = {(r["part"], r["case"], r["ranks"], r["path"]): r for r in rows if "path" in r}
    for part, case, n in sorted({(p, c, n) for p, c, n, _ in keyed}, key=lambda k: (k[0], k[1], k[2])):
        a, b = keyed.get((part, case, n, "items")), keyed.get((part, case, n, "tree"))
        ratio = f"{a['cpu_ms'] / b['cpu_ms']:.1f}x" if a and b and b["cpu_ms"] else "-"
        lines.append(
            f"{part:9} {case:10} {n:5d}  {a['cpu_ms'] if a else '-':>12} {b['cpu_ms'] if b else '-':>11} {ratio:>6}  "
            f"{a['wall_ms'] if a else '-':>10} {b['wall_ms'] if b else '-':>9}"
        )
    for s in summary(rows):
        lines.append(f"slope {s['part']:9} {s['path']:5} {s['case']:10} {s['ms_per_rank']:.4f} ms per rank")
    for r in rows:
        if "depth_seen" in r:
            lines.append(
                f"stand-ins: {r['ranks']} ranks, tree depth seen {r['depth_seen']} (expected {r['depth_expected']})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ranks", default="2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--standins", default="256,1024", help="stand-in worker counts (comma-separated; 0: none)")
    ap.add_argument("--standin-host", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.standin_host:
        standin_main(args.standin_host)
        return
    sizes = [int(x) for x in args.ranks.split(",") if x]
    rows = cluster_rows(sizes, args.repeats) if sizes else []
    for n in [int(x) for x in args.standins.split(",") if x]:
        if n:
            rows += standin_rows(n, args.repeats)
    if args.json:
        for s in summary(rows):
            print(json.dumps(s))
    print(table(rows))


if __name__ == "__main__":
    main()
