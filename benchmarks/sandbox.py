"""The code sandbox's per-call overhead: `run_python("print(1)")` in bubblewrap against the old rlimits-only path.

    python benchmarks/sandbox.py [--json] [--calls 20]

A tool call's latency is on the rollout's critical path (engines.rollout.agent), so the sandbox
(algorithms/environments/sandbox.py) should add little to it: goal <= 30 ms per call. Three paths run the same
program, interleaved call by call so that load from outside affects all alike; median and 90th percentile of
`--calls` calls after one warm-up each:

- `plain`: `python -I -c` in a subprocess, no isolation at all (the floor);
- `rlimits (old)`: the implementation before issue 50, kept here as `run_python_rlimits`: a subprocess with its own
  network namespace and rlimits, nothing else;
- `bwrap (new)`: `run_python`, the sandbox.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _isolate(cpu_s: int, memory_bytes: int) -> None:  # the old path's preexec, as it was
    import ctypes
    import resource

    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x40000000) != 0:
        if libc.unshare(0x10000000 | 0x40000000) != 0:
            os._exit(97)
        for path, text in (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"{uid} {uid} 1"),
            ("/proc/self/gid_map", f"{gid} {gid} 1"),
        ):
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError:
                pass
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))


def run_python_rlimits(code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0) -> str:
    """The code execution before issue 50 (a network namespace and rlimits only), for comparison."""
    with tempfile.TemporaryDirectory(prefix="flowactors-exec-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(_isolate, cpu_s, memory_mb << 20),
        )
        out, _ = proc.communicate(timeout=wall_s)
    return out.decode()


def plain(code: str) -> str:
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line per row before the table")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)

    from algorithms.environments.sandbox import _as_root, run_python

    paths = {"plain": plain, "rlimits (old)": run_python_rlimits, "bwrap (new)": run_python}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for name, fn in paths.items():
        assert fn("print(1)").strip() == "1", name  # warm-up, and each path works
    for _ in range(args.calls):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn("print(1)")
            times[name].append((time.perf_counter() - t) * 1000)
    rows = []
    for name, ts in times.items():
        ts.sort()
        rows.append({"path": name, "median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))]})
    old = rows[1]["median_ms"]
    for r in rows:
        r["added_vs_old_ms"] = r["median_ms"] - old
        r["as_root"] = _as_root()
        r["calls"] = args.calls
    if args.json:
        for r in rows:
            print(json.dumps(r))
    print(f"run_python('print(1)'), {args.calls} calls each, interleaved ({'root' if _as_root() else 'a user'})")
    print(f"{'path':<16}{'median ms':>11}{'p90 ms':>9}{'vs old ms':>11}")
    for r in rows:
        print(f"{r['path']:<16}{r['median_ms']:>11.1f}{r['p90_ms']:>9.1f}{r['added_vs_old_ms']:>+11.1f}")
    return rows


if __name__ == "__main__":
    main()
