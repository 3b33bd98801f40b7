"""Isolated execution of untrusted programs: the model's code (`run_python`) and users' subprocess tools (`run`).

Agents run code the policy wrote, thousands of times a step, on the machines that hold the run's checkpoints and the
user's credentials, so each call runs in a sandbox built by bubblewrap (`bwrap`, the sandbox of Flatpak; packaged
by every distribution) in which, by construction:

- the filesystem is read-only and shows only the system's programs and libraries (/usr, /bin, /lib*, a few files
  of /etc), the interpreter's prefix (`sys.base_prefix` and the virtual environment, `sys.prefix`) and what the
  caller binds read-only; the home directory, the project, the checkpoints and the host's /tmp are not there. The
  one writable place is a fresh tmpfs /tmp of `scratch_mb`, the working directory, gone with the sandbox;
- every process lives in a PID namespace whose init is the sandbox's: when the program exits, or the wall clock
  runs out, that init dies and the kernel kills every process left in it (setsid, double forks, daemons);
- processes and threads are bounded by RLIMIT_NPROC counted for the sandbox alone: as an ordinary user in a user
  namespace of its own (the kernel counts per user namespace since Linux 5.14); as root (whom RLIMIT_NPROC does not
  bind) the program runs as a user id of its own, unused on the machine. CPU time and address space per process
  (RLIMIT_CPU, RLIMIT_AS), file size (RLIMIT_FSIZE), the wall clock; no network (an empty network namespace).

Without bwrap (or where it cannot create namespaces) every call is refused with `SandboxUnavailableError`, one line
naming what to install, rather than run with less isolation. docs/security.md says what holds on which path.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

__all__ = ["run", "run_python", "Result", "SandboxUnavailableError", "NetworkIsolationError"]


class NetworkIsolationError(RuntimeError):
    """This machine cannot isolate a program (the refusal type: code execution is refused rather than run
    without isolation)."""


class SandboxUnavailableError(NetworkIsolationError):
    """bubblewrap is not installed, or cannot create the sandbox's namespaces on this machine."""


@dataclass(frozen=True)
class Result:
    """What a sandboxed command did: its exit status (as a shell reports it: 128 + N when killed by signal N), its
    output (each stream's first `max_output_bytes`) and how many bytes of output were dropped past those."""

    returncode: int
    stdout: bytes
    stderr: bytes
    dropped: int = 0

    @property
    def signal(self) -> str | None:
        """The signal that killed the command (SIGKILL, SIGXCPU, ...), or None."""
        try:
            return signal.Signals(self.returncode - 128).name if self.returncode > 128 else None
        except ValueError:
            return None


_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},  # libraries' thread pools
}
_ROOT_UIDS = itertools.count()


def _as_root() -> bool:
    """Root of the machine (the initial user namespace), whom RLIMIT_NPROC does not bind; root in a container with
    a user namespace of its own is an ordinary user to the kernel."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


@functools.lru_cache(maxsize=1)
def _tools() -> tuple[str, str, str]:
    """bwrap, prlimit and setpriv (util-linux), or the one-line refusal."""
    found = [shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin") for name in ("bwrap", "prlimit", "setpriv")]
    if found[0] is None:
        raise SandboxUnavailableError(
            "code execution needs bubblewrap to isolate the program and it is not installed: install the package "
            "'bubblewrap' (apt-get install bubblewrap, dnf install bubblewrap); code is refused rather than run "
            "unisolated"
        )
    if None in found[1:]:
        raise SandboxUnavailableError("code execution needs prlimit and setpriv (the package util-linux) in /usr/bin")
    return found[0], found[1], found[2]  # type: ignore[return-value]


def _system(path: str) -> bool:
    return any(path == s or path.startswith(s + "/") for s in _SYSTEM)


def _prefixes() -> list[str]:
    """The interpreter's installation and virtual environment, bound exactly (not the home directory they may be
    in), both as named and as their symlinks resolve."""
    out: list[str] = []
    for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q not in out and not _system(q):
                out.append(q)
    return out


def _command(
    argv: Sequence[str],
    *,
    scratch: str,
    cpu_s: int,
    memory_mb: int,
    max_processes: int,
    scratch_mb: int,
    binds: Sequence[str],
    env: Mapping[str, str],
    files: list[tuple[int, str]],
    info_fd: int,
) -> list[str]:
    bwrap, prlimit, setpriv = _tools()
    root = _as_root()
    cmd = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
    cmd += ["--unshare-uts", "--unshare-cgroup-try", "--info-fd", str(info_fd), "--clearenv"]
    if root:  # no user namespace: setpriv drops to a user id of the sandbox's own (needs these two, then none)
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user", "--disable-userns"]
    for path in _SYSTEM:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(scratch_mb << 20), "--tmpfs", "/tmp"]
    mounts = [os.path.abspath(p) for p in (*_ETC, *_prefixes(), *binds)]
    parents = {
        str(a) for m in mounts for a in PurePosixPath(m).parents if not _system(str(a)) and str(a) not in ("/", "/tmp")
    }
    for path in sorted(parents):  # readable by the sandbox's user (bwrap would make them 0700)
        cmd += ["--perms", "0755", "--dir", path]
    for path in mounts:
        cmd += ["--ro-bind-try", path, path]
    cmd += ["--perms", "0777", "--dir", scratch]
    for fd, name in files:
        for parent in reversed(PurePosixPath(name).parents[:-1]):
            cmd += ["--perms", "0777", "--dir", f"{scratch}/{parent}"]
        cmd += ["--perms", "0666", "--file", str(fd), f"{scratch}/{name}"]
    for k, v in {**_ENV, "HOME": scratch, **env}.items():
        cmd += ["--setenv", k, v]
    cmd += ["--chdir", scratch, "--"]
    if root:
        uid = str(2_000_000_000 + (os.getpid() % 1_000_000) * 64 + next(_ROOT_UIDS) % 64)
        cmd += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    limits = [f"--cpu={cpu_s}:{cpu_s + 1}"]  # SIGXCPU at the soft limit, SIGKILL a second later
    limits += [f"--{k}={v}:{v}" for k, v in (("as", memory_mb << 20), ("nproc", max_processes), ("core", 0))]
    return [*cmd, prlimit, *limits, f"--fsize={scratch_mb << 20}", "--", *argv]


def _kill(proc: subprocess.Popen, info_r: int) -> None:
    """Kill the sandbox's init (the kernel then kills every process in its PID namespace, and its exit waits for
    them), then reap bwrap. The init is signalled through a pidfd, and only while it is still bwrap's child, so a
    reused pid is never signalled."""
    pidfd = None
    try:
        pid = json.loads(os.read(info_r, 65536).decode())["child-pid"]
        pidfd = os.pidfd_open(pid)
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid != proc.pid:
            raise ProcessLookupError(pid)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        proc.kill()  # no init (yet): --die-with-parent takes the rest
    finally:
        if pidfd is not None:
            os.close(pidfd)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _memfd(data: str | bytes) -> int:
    fd = os.memfd_create("flowactors-sandbox")
    os.write(fd, data.encode() if isinstance(data, str) else data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.lru_cache(maxsize=2)
def _probe(root: bool) -> None:
    """Once per process: can bwrap build the sandbox here (user namespaces allowed, new mounts and procfs)?"""
    info_r, info_w = os.pipe()
    try:
        cmd = _command(["true"], scratch="/tmp/probe", cpu_s=5, memory_mb=256, max_processes=8, scratch_mb=1,
                       binds=(), env={}, files=[], info_fd=info_w)  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, pass_fds=(info_w,), timeout=30)
    finally:
        os.close(info_r)
        os.close(info_w)
    if r.returncode != 0:
        why = (r.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise SandboxUnavailableError(
            f"bubblewrap cannot build the sandbox on this machine ({why}); it needs unprivileged user namespaces "
            "(or root) and bubblewrap >= 0.8; code is refused rather than run unisolated"
        )


def run(
    argv: Sequence[str],
    *,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    cpu_s: int = 2,
    memory_mb: int = 256,
    wall_s: float = 5.0,
    max_processes: int = 64,
    scratch_mb: int = 64,
    binds: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    max_output_bytes: int = 1 << 20,
) -> Result:
    """Run a command in the sandbox (module docstring) and return what it did; raise TimeoutError past `wall_s`.

    Args:
        argv: the command; programs are looked up in the sandbox's PATH (/usr/local/bin:/usr/bin:/bin).
        stdin: what the command reads on its standard input (none: it reads end of file).
        files: files written into its working directory first ({"main.c": source}; relative paths).
        cpu_s, memory_mb: CPU seconds and address space, per process.
        max_processes: processes and threads at once (as an ordinary user, bwrap's init counts too).
        scratch_mb: the size of the writable /tmp (the working directory is in it), and of any one file.
        binds: host paths the command may read (a toolchain outside /usr, a data set), read-only; as root the
            command runs as a user of its own, so it reads there only what any user may.
        env: environment variables besides the sandbox's few (PATH, HOME, TMPDIR, LANG).
        max_output_bytes: output kept per stream; the rest is read and dropped (counted in `Result.dropped`).
    """
    _probe(_as_root())
    missing = [p for p in binds if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"cannot show {missing} to the sandbox: no such path")
    scratch = f"/tmp/flowactors-exec-{os.urandom(4).hex()}"
    fds = [(_memfd(data), _check_name(name)) for name, data in (files or {}).items()]
    stdin_fd = _memfd(stdin) if stdin is not None else subprocess.DEVNULL
    info_r, info_w = os.pipe()
    os.set_blocking(info_r, False)
    try:
        cmd = _command(
            argv,
            scratch=scratch,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_processes=max_processes,
            scratch_mb=scratch_mb,
            binds=binds,
            env=env or {},
            files=fds,
            info_fd=info_w,
        )
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(info_w, *(fd for fd, _ in fds)),
            start_new_session=True,
        )
    finally:
        for fd in (info_w, *(fd for fd, _ in fds), *([stdin_fd] if stdin is not None else [])):
            os.close(fd)
    deadline = time.monotonic() + wall_s
    try:
        out = _collect(proc, deadline, max_output_bytes)
        if out is not None:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                out = None
        if out is None:
            _kill(proc, info_r)
            raise TimeoutError(f"the program ran past {wall_s:g} s of wall-clock time and was killed")
        return Result(proc.returncode, *out)
    finally:
        if proc.poll() is None:
            _kill(proc, info_r)
        os.close(info_r)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


def _check_name(name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"sandbox files are relative paths inside the working directory, got {name!r}")
    return str(p)


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, int] | None:
    """Read stdout and stderr to their end, keeping `cap` bytes of each; None when the deadline passes first."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
    dropped = 0
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = max(cap - len(buf), 0)
                buf += chunk[:room]
                dropped += max(len(chunk) - room, 0)
    stdout, stderr = bufs.values()
    return bytes(stdout), bytes(stderr), dropped


def run_python(code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0, max_output: int = 2000) -> str:
    """Run Python code in the sandbox and return what it printed (stdout, then stderr), truncated.

    Args:
        code: a Python program; print what should be returned.
    """
    r = run(
        [sys.executable, "-I", "-c", code],
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        wall_s=wall_s,
        max_output_bytes=max(4 * max_output, 1 << 16),
    )
    text = (r.stdout + r.stderr).decode("utf-8", "replace")
    if r.signal:
        text += f"\n[killed by {r.signal}]"
    elif r.returncode:
        text += f"\n[exit status {r.returncode}]"
    more = len(text) + r.dropped - max_output
    return text if more <= 0 else text[:max_output] + f"\n[... {more} more characters]"
