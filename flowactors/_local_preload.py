"""The embedded cluster's worker processes leave Ctrl-C to the controller (a Dask preload module).

A terminal's Ctrl-C goes to every process of its foreground group: the controller and each worker process of the
embedded LocalCluster. Each worker would end on its own, with a KeyboardInterrupt traceback, while the controller
still talks to it. Here the workers ignore SIGINT, and the controller, which owns them, stops them as it unwinds
(`flowactors.cluster.start_local` loads this with `preload=`). Run before any task, on the worker's main thread.
It also gives torch the worker's thread count (`OMP_NUM_THREADS`), and refuses a worker forked from a server in which
an import touched CUDA (torch marks such a fork): its first CUDA call would fail far from the cause.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

__all__ = ["dask_setup"]


def dask_setup(worker: Any = None) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads, torch = os.environ.get("OMP_NUM_THREADS", ""), sys.modules.get("torch")
    if torch is not None and getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
        # SystemExit: Dask logs a preload's Exception and starts the worker anyway
        raise SystemExit(
            "this worker was forked from the embedded cluster's fork server (flowactors.cluster.fork_from_server) "
            "after an import there touched CUDA (a module named in `preload=`, at import time), and CUDA does not "
            "work in a process forked after that. Keep CUDA calls out of that module's import, or have the "
            "workers spawned: DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn"
        )
    # a worker forked from a server that imported torch (cluster.fork_from_server) has the thread count torch
    # read there: the one the cluster gives its workers is applied here
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
