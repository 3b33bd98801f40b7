"""Group-call latency: flowactors against raw pinned Dask tasks (the floor of this design), in one run.

    python benchmarks/dispatch.py [--json] [--repeats 40]

Cases (2 ranks): `noop` (a call with no data on every rank, awaited), `split4MiB` (a 1024 x 512 int64 batch
split over the ranks and gathered back), `chain3` (three chained calls on the 4 MiB batch, only the last fetched;
`controller_bytes` counts batch bytes deserialized in the controller process, which also hosts the embedded
scheduler), `resplit` (the 4 MiB batch through a call on a one-rank group, whose output a 2-rank call splits: the
layouts differ, so the output cannot pass part for part). One JSON object per line, then a table.

`--verl-python PATH` adds verl 0.9.1's rows (`noop`, `split4MiB`: its Ray worker group of 2 CPU actors,
benchmarks/verl_peer.py) from that interpreter's environment, measured just before and just after the Dask rows
(the figure is the mean of the two medians, so drift of the machine's load affects both systems alike), and a
`vs verl` column. `scripts/verl_venv.sh` builds such an environment. `--compare-open` adds `fa-open` rows: the
same calls on an embedded cluster without the run's credentials (`secure=False`: plain TCP, as before issue 41),
measured before and after the secured rows, and a `vs open` column, the cost of TLS and the direct-path handshake.
`--compare-tcp` adds `fa-tcp` rows: the same calls with the direct path kept on TCP between the processes of this
host (`FLOWACTORS_LOCAL_SOCKETS=0`) instead of their Unix sockets, measured before and after, and a `vs tcp` column.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import flowactors as fa
from flowactors import ONE_TO_ALL, Batch, Worker, endpoint
from flowactors import serialization as ser


class Echo(Worker):
    @endpoint(protocol=ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @endpoint
    def touch(self, batch: Batch) -> Batch:
        return batch


def _noop() -> None:
    return None


def _touch(batch: Batch, _after=None) -> Batch:
    return batch


def _take(batch: Batch, parts: int, index: int) -> Batch:
    return batch.split(parts)[index]


def _timed(fn, repeats: int) -> tuple[list[float], int]:
    fn()  # warm-up
    ser.RECEIVED.reset()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return times, ser.RECEIVED.bytes // repeats


def _row(system: str, case: str, times: list[float], controller_bytes: int) -> dict:
    q = statistics.quantiles(times, n=10)
    return {
        "system": system,
        "case": case,
        "ranks": 2,
        "median_ms": round(statistics.median(times), 3),
        "p90_ms": round(q[-1], 3),
        "controller_bytes": controller_bytes,
    }


def batch4mib() -> Batch:
    return Batch({"x": torch.arange(1024 * 512, dtype=torch.int64).reshape(1024, 512)})


def run(repeats: int, secure: bool = True, only_flowactors: bool = False, system: str = "flowactors") -> list[dict]:
    """The rows of every case; `system` names the flowactors rows (a comparison's: fa-open, fa-tcp)."""
    from flowactors.transport.wire import LOCAL_SOCKETS_ENV

    if system == "fa-tcp":  # read where connections are made: here and in the workers this cluster starts
        os.environ[LOCAL_SOCKETS_ENV] = "0"
    try:
        return _run(repeats, secure, only_flowactors, system)
    finally:
        os.environ.pop(LOCAL_SOCKETS_ENV, None)


def _run(repeats: int, secure: bool, only_flowactors: bool, name: str) -> list[dict]:
    rows = []
    data = batch4mib()
    with fa.Controller.local(2, dashboard=None, secure=secure) as ctl:
        g = fa.ActorGroup(ctl, Echo, name="echo")
        solo = fa.ActorGroup(ctl, Echo, name="solo", slots=ctl.slots[:1])
        client, slots = ctl.client, ctl.slots

        def fa_chain3():
            f = g.touch(data)
            f = g.touch(f)
            f = g.touch(f)
            f.result()

        def raw_split():
            parts = data.split(2)
            futs = [
                client.submit(_touch, p, workers=[a], allow_other_workers=False, pure=False)
                for p, a in zip(parts, slots)
            ]
            Batch.concat(client.gather(futs))

        def raw_chain3():
            parts = data.split(2)
            futs = [
                client.submit(_touch, p, workers=[a], allow_other_workers=False, pure=False)
                for p, a in zip(parts, slots)
            ]
            for _ in range(2):
                futs = [
                    client.submit(_touch, f, workers=[a], allow_other_workers=False, pure=False)
                    for f, a in zip(futs, slots)
                ]
            Batch.concat(client.gather(futs))

        def raw_resplit():
            whole = client.submit(_touch, data, workers=[slots[0]], allow_other_workers=False, pure=False)
            futs = [
                client.submit(_take, whole, 2, i, workers=[a], allow_other_workers=False, pure=False)
                for i, a in enumerate(slots)
            ]
            Batch.concat(client.gather(futs))

        cases = {
            ("flowactors", "noop"): lambda: g.noop().result(),
            ("flowactors", "split4MiB"): lambda: g.touch(data).result(),
            ("flowactors", "chain3"): fa_chain3,
            ("flowactors", "resplit"): lambda: g.touch(solo.touch(data)).result(),
            ("dask-pinned", "noop"): lambda: client.gather(
                [client.submit(_noop, workers=[a], allow_other_workers=False, pure=False) for a in slots]
            ),
            ("dask-pinned", "split4MiB"): raw_split,
            ("dask-pinned", "chain3"): raw_chain3,
            ("dask-pinned", "resplit"): raw_resplit,
        }
        for (system, case), fn in cases.items():
            if only_flowactors and system != "flowactors":
                continue
            times, nbytes = _timed(fn, repeats)
            # the final gather legitimately brings the result; count only bytes beyond it
            result_bytes = data.nbytes if case != "noop" else 0
            rows.append(_row(name if system == "flowactors" else system, case, times, max(0, nbytes - result_bytes)))
    return rows


def verl_rows(python: str, repeats: int) -> list[dict] | None:
    """verl's rows from `python` (benchmarks/verl_peer.py), or None with the reason on stderr."""
    probe = subprocess.run([python, "-c", "import verl, ray"], capture_output=True, text=True)
    if probe.returncode:
        print(
            f"# verl not importable by {python}: no verl rows (scripts/verl_venv.sh builds an environment)",
            file=sys.stderr,
        )
        return None
    script = Path(__file__).resolve().parent / "verl_peer.py"
    out = subprocess.run(
        [python, str(script), "--repeats", str(repeats)],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        check=True,
        timeout=900,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object per line before the table")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--verl-python", default=None, help="interpreter of an environment with verl 0.9.1 installed")
    p.add_argument(
        "--compare-open",
        action="store_true",
        help="also flowactors on an embedded cluster without credentials (secure=False): the cost of TLS "
        "and the direct-path handshake, measured before and after the secured rows",
    )
    p.add_argument(
        "--compare-tcp",
        action="store_true",
        help="also flowactors with the direct path on TCP between this host's processes (not their Unix "
        "sockets), measured before and after the main rows",
    )
    args = p.parse_args(argv)
    before = verl_rows(args.verl_python, args.repeats) if args.verl_python else None
    compared = {"fa-open": args.compare_open, "fa-tcp": args.compare_tcp}
    settings = {"fa-open": {"secure": False}, "fa-tcp": {}}
    first = {
        name: run(args.repeats, only_flowactors=True, system=name, **settings[name])
        for name, on in compared.items()
        if on
    }
    rows = run(args.repeats)
    for name, opened in first.items():  # measured again after the main rows: the mean of the two medians
        again = run(args.repeats, only_flowactors=True, system=name, **settings[name])
        rows += [
            {**a, "median_ms": (a["median_ms"] + b["median_ms"]) / 2, "p90_ms": max(a["p90_ms"], b["p90_ms"])}
            for a, b in zip(opened, again)
        ]
    after = verl_rows(args.verl_python, args.repeats) if before else None
    verl = {}
    if before and after:
        for b, a in zip(before, after):
            verl[b["case"]] = {
                **b,
                "median_ms": (b["median_ms"] + a["median_ms"]) / 2,
                "p90_ms": max(b["p90_ms"], a["p90_ms"]),
            }
            print(
                f"# verl {b['case']}: median {b['median_ms']:.2f} ms before, {a['median_ms']:.2f} ms after the "
                f"Dask rows",
                file=sys.stderr,
            )
        rows += list(verl.values())
    elif not args.verl_python:
        print("# no --verl-python: no verl rows", file=sys.stderr)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    floor = {r["case"]: r["median_ms"] for r in rows if r["system"] == "dask-pinned"}
    unsecured = {r["case"]: r["median_ms"] for r in rows if r["system"] == "fa-open"}
    tcp = {r["case"]: r["median_ms"] for r in rows if r["system"] == "fa-tcp"}
    print(
        f"\n{'system':<12} {'case':<10} {'median ms':>10} {'p90 ms':>9} {'ctl bytes':>10} {'vs dask-pinned':>15} "
        f"{'vs verl':>8} {'vs open':>8} {'vs tcp':>7}"
    )
    for r in rows:
        ratio = f"{r['median_ms'] / floor[r['case']]:.2f}x" if r["case"] in floor else "-"
        vs_verl = f"{r['median_ms'] / verl[r['case']]['median_ms']:.2f}x" if r["case"] in verl else "-"
        ctl_bytes = "-" if r["controller_bytes"] is None else r["controller_bytes"]
        vs_open = (
            f"{r['median_ms'] / unsecured[r['case']]:.2f}x"
            if r["case"] in unsecured and r["system"] == "flowactors"
            else "-"
        )
        vs_tcp = f"{r['median_ms'] / tcp[r['case']]:.2f}x" if r["case"] in tcp and r["system"] == "flowactors" else "-"
        print(
            f"{r['system']:<12} {r['case']:<10} {r['median_ms']:>10.2f} {r['p90_ms']:>9.2f} "
            f"{ctl_bytes:>10} {ratio:>15} {vs_verl:>8} {vs_open:>8} {vs_tcp:>7}"
        )


if __name__ == "__main__":
    main()
