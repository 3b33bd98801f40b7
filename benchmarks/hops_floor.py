"""The floor under a 2-rank no-op on this machine: the same hops as the direct path, in bare Python.

    python benchmarks/hops_floor.py [--json] [--calls 5000]

A controller process sends a small pickled message to two worker processes over Unix sockets; in each worker a
reader thread hands it to a task thread through a queue (`hand-off`, as the direct path's reader hands an item to
the Dask executor's thread) or answers it itself (`inline`); the reply is pickled and sent back, and the controller
waits for both in epoll. Per call: the median and mean wall time and the CPU every process of the machine spent
(`/proc/*/task/*/schedstat`). What flowactors adds above it is its own work per call (`dispatch.py` measures
that path; docs/benchmarks.md, Fan-out). Linux only (fork, epoll).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import queue
import select
import socket
import statistics
import threading
import time


def _machine_cpu_ns() -> int:
    total = 0
    for path in glob.glob("/proc/[0-9]*/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def _worker(sock: socket.socket, inline: bool) -> None:
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def task_thread() -> None:
        while (msg := tasks.get()) is not None:
            sock.sendall(pickle.dumps(("ok", msg[1], None)))

    if not inline:
        threading.Thread(target=task_thread, daemon=True).start()
    while data := sock.recv(65536):
        msg = pickle.loads(data)
        if inline:
            sock.sendall(pickle.dumps(("ok", msg[1], None)))
        else:
            tasks.put(msg)
    os._exit(0)


def measure(inline: bool, calls: int, warmup: int = 500) -> dict:
    socks, pids = [], []
    for _ in range(2):
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            mine.close()
            _worker(theirs, inline)
        theirs.close()
        socks.append(mine)
        pids.append(pid)
    by_fd = {s.fileno(): s for s in socks}
    poller = select.epoll()
    for s in socks:
        poller.register(s.fileno(), select.EPOLLIN)
    times, cpu0 = [], 0
    for i in range(warmup + calls):
        if i == warmup:
            cpu0 = _machine_cpu_ns()
        t0 = time.perf_counter()
        msg = pickle.dumps(("call", i, "echo.noop", ((), {})))
        for s in socks:
            s.sendall(msg)
        left = 2
        while left:
            for fd, _ in poller.poll():
                pickle.loads(by_fd[fd].recv(65536))
                left -= 1
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    cpu = _machine_cpu_ns() - cpu0
    poller.close()
    for s in socks:
        s.close()
    for pid in pids:
        os.waitpid(pid, 0)
    return {
        "case": "inline" if inline else "hand-off",
        "calls": calls,
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "mean_ms": round(statistics.mean(times) * 1e3, 3),
        "machine_cpu_ms": round(cpu / calls / 1e6, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--json", action="store_true", help="one JSON object per case, no table")
    args = ap.parse_args()
    rows = [measure(inline, args.calls) for inline in (False, True)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'case':<10} {'median ms':>10} {'mean ms':>9} {'machine CPU ms':>15}")
    for r in rows:
        print(f"{r['case']:<10} {r['median_ms']:>10.3f} {r['mean_ms']:>9.3f} {r['machine_cpu_ms']:>15.3f}")


if __name__ == "__main__":
    main()
