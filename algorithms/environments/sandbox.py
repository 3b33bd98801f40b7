"""Code execution for tools: the model's programs run in a subprocess with CPU-time, memory and wall-clock limits,
no network (its own network namespace), in a temporary directory removed afterwards, its output truncated."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

__all__ = ["run_python", "NetworkIsolationError"]


class NetworkIsolationError(RuntimeError):
    """This machine cannot give a subprocess a network namespace of its own."""


_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


def _isolate(cpu_s: int, memory_bytes: int) -> None:
    """In the child, before exec: its own (empty) network namespace, CPU-time and address-space limits, a session
    of its own (so the whole group is killed on timeout)."""
    import ctypes
    import resource

    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWNET) != 0:  # root (or CAP_SYS_ADMIN); else a user namespace first
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
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


def run_python(code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0, max_output: int = 2000) -> str:
    """Run Python code and return what it printed (stdout, then stderr), truncated.

    Args:
        code: a Python program; print what should be returned.
    """
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
        try:
            out, _ = proc.communicate(timeout=wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise TimeoutError(f"the program ran past {wall_s:g} s of wall-clock time and was killed") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if proc.returncode == 97:
        raise NetworkIsolationError(
            "cannot give the program a network namespace of its own on this machine (no "
            "user namespaces and not root); code execution is refused rather than run "
            "with network access"
        )
    text = out.decode("utf-8", "replace")
    if proc.returncode < 0:
        import signal

        text += f"\n[killed by {signal.Signals(-proc.returncode).name}]"
    elif proc.returncode:
        text += f"\n[exit status {proc.returncode}]"
    return text if len(text) <= max_output else text[:max_output] + f"\n[... {len(text) - max_output} more characters]"
