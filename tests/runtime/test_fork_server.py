"""The embedded cluster's workers fork from one server that imported the runtime and the preloaded modules once.

Run in a fresh interpreter: a process has one fork server, started by its first cluster with what was asked then,
and the test process has started its own long before.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    import dask
    import flowactors as fa
    from tests.runtime.workers import Reducer

    def probe():
        import torch
        return {"pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
                "probe": "probe_module" in sys.modules}

    if __name__ == "__main__":
        seen = []
        for _ in range(2):  # a second cluster of the same process forks from the same server
            with fa.Controller.local(2, dashboard=None, preload=["probe_module"]) as ctl:
                g = fa.ActorGroup(ctl, Reducer, name="g")
                assert g.all_reduce(1.0).result() == [3.0, 3.0]  # a torch.distributed group forms and runs
                seen.append([ctl.client.submit(probe, workers=[a], pure=False).result() for a in ctl.slots])
        print(json.dumps({"controller": os.getpid(), "seen": seen,
                          "method": dask.config.get("distributed.worker.multiprocessing-method")}))
    """
)


def test_workers_fork_from_one_server_that_imported_the_preload_once(tmp_path):
    imports = tmp_path / "imports"
    (tmp_path / "probe_module.py").write_text(f"import os\nopen({str(imports)!r}, 'a').write(f'{{os.getpid()}}\\n')\n")
    (tmp_path / "run.py").write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "OMP_NUM_THREADS": "4"}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["method"] == "forkserver"
    workers = [w for cluster in out["seen"] for w in cluster]
    assert len({w["pid"] for w in workers}) == 4  # two clusters of two new processes
    servers = {w["ppid"] for w in workers}
    assert len(servers) == 1 and out["controller"] not in servers  # one server, not the controller
    pids = imports.read_text().split()
    assert pids == [str(servers.pop())]  # the preload was imported once, in the server, by no worker
    assert all(w["probe"] for w in workers)  # and every worker has it
    # the controller's environment asked for 4 threads; the cluster gives each worker 1 (Dask's pre-spawn
    # environment, applied before the server starts and again by the worker's preload)
    assert [w["threads"] for w in workers] == [1] * 4


def test_a_method_chosen_in_dasks_configuration_is_kept():
    """`DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn` (or a YAML file) keeps Dask's spawned workers; without
    a choice the embedded cluster's start turns Dask's default into the fork server."""
    program = (
        "import dask\nfrom flowactors.cluster import fork_from_server\nfork_from_server()\n"
        "print(dask.config.get('distributed.worker.multiprocessing-method'))"
    )
    for chosen, expected in (("spawn", "spawn"), (None, "forkserver")):
        env = {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"}
        if chosen:
            env["DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"] = chosen
        proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == [expected], chosen


def test_a_preload_that_touched_cuda_in_the_server_fails_the_start_saying_so(tmp_path):
    """CUDA does not work in a process forked after CUDA was touched, and torch marks such a fork. A stand-in (this
    machine has no CUDA): the preloaded module makes every fork of the server look as torch marks one after CUDA was
    initialised there; the cluster's start then fails with the cause and the fix, not a worker's first CUDA call."""
    (tmp_path / "touches_cuda.py").write_text(
        "import os, torch\n"
        "# stand-in for a CUDA call at import: a fork of this process reads as torch's 'bad fork'\n"
        "os.register_at_fork(after_in_child=lambda: setattr(torch.cuda, '_is_in_bad_fork', lambda: True))\n"
    )
    program = (
        "import flowactors as fa\n"
        "if __name__ == '__main__':\n"
        "    with fa.Controller.local(1, dashboard=None, preload=['touches_cuda']):\n"
        "        pass\n"
    )
    (tmp_path / "run.py").write_text(program)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    env.pop("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", None)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode != 0
    assert "ClusterStartError" in proc.stderr, proc.stderr[-3000:]
    assert "touched CUDA" in proc.stderr and "MULTIPROCESSING_METHOD=spawn" in proc.stderr, proc.stderr[-3000:]
