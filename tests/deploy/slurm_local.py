"""A real, private, single-node Slurm (munged + slurmctld + slurmd) under one folder, for tests and for trying
`flowactors.slurm` on one machine.

Follows the single-node recipe in the shared notes: Debian's slurm-wlm and munge packages, all configuration,
state, sockets and logs under `DIR`, and `gpus` fake GPUs backed by character devices (/dev/null, /dev/zero, ...)
so that `--gres=gpu:N` is scheduled and Slurm sets CUDA_VISIBLE_DEVICES in the job. The daemons run in the
foreground as children of this process (`-D` / `-F`), so they are stopped by their PIDs, never by name; the PIDs are
also written to `DIR/pids.json` so that `stop DIR` from another process can end them. Ports are chosen free, so a
second instance (or a forgotten one) does not collide.

    python -m tests.deploy.slurm_local start /tmp/slurm     # prints `export SLURM_CONF=...`
    python -m tests.deploy.slurm_local stop /tmp/slurm      # scancels every job, then stops the three daemons

Needs root (slurmd runs jobs as their submitter and must be able to become it) and the packages installed. It never
installs them, since tests must not change the machine they run on: `.ci/run` installs them (a user: `apt-get install
slurm-wlm munge`), and `require_installed()` only says what is missing. Any failure raises `SlurmUnavailable` with
the reason (and the tail of the daemon logs), which the test turns into a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalSlurm", "SlurmUnavailable", "require_installed"]

_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
_FAKE_GPU_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed here or its daemons did not come up; the message says why."""


INSTALL_HINT = "`.ci/run` installs them, or: apt-get install slurm-wlm munge"


def require_installed() -> None:
    """Raise `SlurmUnavailable` naming the Slurm and munge programs that are not installed, and how to get them."""
    missing = [b for b in _BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        raise SlurmUnavailable(f"Slurm programs not installed ({', '.join(missing)}); {INSTALL_HINT}")


def _which(name: str) -> str:
    found = shutil.which(name) or (str(Path("/usr/sbin", name)) if Path("/usr/sbin", name).exists() else None)
    if found is None:
        raise SlurmUnavailable(f"{name} not found; {INSTALL_HINT}")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mb() -> int:
    """What slurmd will measure, less a margin: a node configured above it would be drained ("Low RealMemory")."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(int(line.split()[1]) / 1024 * 0.9)
    return 1024


@dataclass
class LocalSlurm:
    """One node named after `hostname -s`, partition `debug`, `gpus` fake GPUs. Use `start()` / `stop()`."""

    root: Path
    gpus: int = 2
    partition: str = "debug"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        if not 0 <= self.gpus <= len(_FAKE_GPU_FILES):
            raise ValueError(f"gpus must be between 0 and {len(_FAKE_GPU_FILES)}, got {self.gpus}")

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What sbatch, squeue and scancel (and so dask-jobqueue) need to reach this Slurm."""
        return {"SLURM_CONF": str(self.conf)}

    # -- start ------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        require_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("a private slurmd must run as root (it becomes the job's user)")
        self.root.mkdir(parents=True, exist_ok=True)
        for d in ("state", "spool"):
            (self.root / d).mkdir(exist_ok=True)
        self._write_config()
        try:
            self._spawn(
                "munged",
                [
                    _which("munged"),
                    "-F",
                    "--force",
                    f"--key-file={self.root / 'munge.key'}",
                    f"--socket={self.root / 'munge.socket.2'}",
                    f"--pid-file={self.root / 'munged.pid'}",
                    f"--log-file={self.root / 'munged.log'}",
                    f"--seed-file={self.root / 'munge.seed'}",
                ],
            )
            self._wait_for(lambda: (self.root / "munge.socket.2").exists(), 10, "munged did not create its socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)])
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
            self._wait_for(self._node_idle, timeout_s, "the node did not become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=flowactors",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r}/munge.socket.2",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/slurmctld.log",
                    f"SlurmdLogFile={r}/slurmd.log",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SchedulerType=sched/backfill",
                    "GresTypes=gpu",
                    # more CPUs than the machine's 2, so that a rollout fleet's jobs run beside the trainer's
                    "SlurmdParameters=config_overrides",
                    f"NodeName={host} NodeAddr=127.0.0.1 CPUs={max(8, os.cpu_count() or 1)} RealMemory={_real_memory_mb()}{gres} "
                    "State=UNKNOWN",
                    f"PartitionName={self.partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
                    "",
                ]
            )
        )
        (r / "gres.conf").write_text(
            "".join(f"NodeName={host} Name=gpu File={f}\n" for f in _FAKE_GPU_FILES[: self.gpus])
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        (self.root / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                why = f"exited {dead}" if dead else f"timed out after {timeout_s:.0f} s"
                raise SlurmUnavailable(f"{what} ({why})\n{self.logs_tail()}")
            time.sleep(0.3)

    def _node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-o", "%T"], check=False)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    # -- use --------------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env})
        if check and out.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")
        return out

    def job_ids(self) -> list[str]:
        out = self.run(["squeue", "-h", "-o", "%i"], check=False)
        return out.stdout.split() if out.returncode == 0 else []

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out", "slurmd.out"):
            p = self.root / name
            if p.exists() and p.stat().st_size:
                tail = p.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {p}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """scancel every job, wait for them to end, then stop slurmd, slurmctld and munged by PID.

        Returns the ids of the jobs that were still there (leftovers)."""
        leftovers: list[str] = []
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            leftovers = self.job_ids()
            if leftovers:
                self.run(["scancel", *leftovers], check=False)
                deadline = time.monotonic() + timeout_s
                while self.job_ids() and time.monotonic() < deadline:
                    time.sleep(0.3)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        (self.root / "pids.json").unlink(missing_ok=True)
        return leftovers


def _stop_by_pid_file(root: Path) -> None:
    """`stop` from another process: scancel the jobs, then SIGTERM the PIDs this helper recorded."""
    pids = json.loads((root / "pids.json").read_text())
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout.split()
    if jobs:
        subprocess.run(["scancel", *jobs], env=env, check=False)
        time.sleep(3)
    for name in ("slurmd", "slurmctld", "munged"):
        if name in pids:
            try:
                os.kill(pids[name], signal.SIGTERM)
            except ProcessLookupError:
                pass
    (root / "pids.json").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("start", "stop"):
        print("usage: python -m tests.deploy.slurm_local start|stop DIR", file=sys.stderr)
        return 2
    root = Path(args[1]).resolve()
    if args[0] == "stop":
        _stop_by_pid_file(root)
        return 0
    slurm = LocalSlurm(root).start()
    # the daemons were started in their own sessions, so they outlive this command
    slurm.procs.clear()
    print(f"export SLURM_CONF={slurm.conf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
