"""The code sandbox (algorithms/environments/sandbox.py): each outcome, with its negative control — the same program
run plainly, outside the sandbox, does what the sandbox prevents."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from algorithms.environments.sandbox import Result, SandboxUnavailableError, run, run_python

ROOT = Path(__file__).resolve().parents[2]


def _sandbox_works() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: the sandbox refuses (see test_without_bwrap_code_is_refused)"
    try:
        run(["true"])
    except SandboxUnavailableError as e:
        return str(e)
    return None


_WHY = _sandbox_works()
needs_bwrap = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def plain(code: str, **kw) -> subprocess.CompletedProcess:
    """The negative control: the same program in a plain subprocess."""
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30, **kw)


@needs_bwrap
def test_writing_outside_the_scratch_directory_fails_inside(tmp_path):
    checkpoints = tmp_path / "checkpoints"  # stands for the run's checkpoints
    checkpoints.mkdir()
    target = checkpoints / "model.pt"
    code = f"open({str(target)!r}, 'w').write('policy wrote this'); print('written')"
    out = run_python(code)
    assert "written" not in out and "Error" in out and not target.exists()
    assert "written" in run_python("open('here.txt', 'w').write('x'); print('written')")  # its scratch is writable
    assert plain(code).stdout.strip() == "written" and target.read_text() == "policy wrote this"


@needs_bwrap
def test_the_project_the_home_directory_and_tmp_are_not_visible(tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("token")
    project_file = ROOT / "pyproject.toml"
    for path in (secret, project_file):
        code = f"print(open({str(path)!r}).read()[:5])"
        out = run_python(code)
        assert "FileNotFoundError" in out, out
        assert plain(code).stdout.strip() == path.read_text()[:5]
    home = Path.home()
    code = f"import os; print(sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else [])"
    inside = set(eval(run_python(code)))
    # at most the way to the interpreter's prefix, when it lives in the home directory (~/.pyenv/...)
    allowed = {
        Path(p).relative_to(home).parts[0] for p in (sys.base_prefix, sys.prefix) if Path(p).is_relative_to(home)
    }
    assert inside <= allowed, inside
    outside = set(eval(plain(code).stdout))
    assert outside - allowed or not outside  # the control: the home directory has more than that outside


@needs_bwrap
def test_no_process_outlives_the_call(tmp_path):
    """A child that double-forks and calls setsid() to escape the call keeps writing a heartbeat outside; inside,
    it is gone when the call returns, whether the program ended or ran out of time."""
    beat = tmp_path / "heartbeat"
    marker = f"flowactors-daemon-{uuid.uuid4().hex}"
    child = (
        "import os, time\n"
        "for i in range(1200):\n"
        "    print('beat', flush=True)\n"
        "    open('local-beat', 'a').write('.')\n"
        "    try:\n"
        f"        open({str(beat)!r}, 'a').write(str(os.getpid()) + chr(10))\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.05)\n"
    )
    daemon = (
        "import os, sys, time\n"
        "if os.fork():\n"
        "    os.wait()\n"
        "    while not os.path.exists('local-beat'): time.sleep(0.01)\n"  # the daemon runs
        "    print('parent done', flush=True); sys.exit(0)\n"
        "os.setsid()\n"
        "if os.fork():\n"
        "    os._exit(0)\n"
        f"os.execv(sys.executable, [sys.executable, '-c', {child!r}, {marker!r}])\n"
    )

    def alive() -> list[int]:
        pids = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
        return pids

    t = time.monotonic()
    out = run_python(daemon, wall_s=50)
    assert (
        "beat" in out and "parent done" in out and time.monotonic() - t < 40
    )  # it did not wait for the daemon's 60 s either (the bounds leave room for a loaded machine)
    time.sleep(0.3)
    assert alive() == [] and not beat.exists()
    with pytest.raises(TimeoutError):
        run_python(daemon.replace("sys.exit(0)", "time.sleep(600)"), wall_s=5)
    assert alive() == []

    # the control: run plainly, the daemon survives the call and keeps writing
    subprocess.run([sys.executable, "-I", "-c", daemon], stdout=subprocess.DEVNULL, timeout=30, cwd=tmp_path)
    try:
        size = beat.stat().st_size
        time.sleep(0.5)
        assert beat.stat().st_size > size and alive()
    finally:
        for pid in alive():
            os.kill(pid, signal.SIGKILL)


BOMB = """
import os
r, w = os.pipe()
n = 0
for i in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(w); os.read(r, 1); os._exit(0)
    n += 1
print(n)
"""


@needs_bwrap
def test_processes_are_bounded(tmp_path):
    """At most `max_processes` at once, counted for this sandbox alone (as root too, whom RLIMIT_NPROC does not
    bind); the control: run plainly under the old limit (RLIMIT_NPROC 16), as root all 200 start."""
    started = int(run([sys.executable, "-I", "-c", BOMB], max_processes=16).stdout)
    assert 10 <= started < 16
    if os.geteuid() == 0:
        import resource

        old_limit = plain(BOMB, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NPROC, (16, 16)))
        assert int(old_limit.stdout) == 200


@needs_bwrap
def test_the_network_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    code = (
        f"import socket; s = socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {server.getsockname()[1]}));"
        "print('connected')"
    )
    try:
        assert "connected" not in run_python(code)
        assert plain(code).stdout.strip() == "connected"
    finally:
        server.close()


@needs_bwrap
def test_the_scratch_directory_is_private_and_removed():
    out = run_python("import os; open('out.txt', 'w').write('x'); print(os.getcwd()); print(os.listdir('/tmp'))")
    cwd, listing = out.splitlines()
    assert "flowactors-exec-" in cwd and not os.path.exists(cwd)
    # a fresh /tmp: nothing of the host's, nothing of other calls; only the way to the interpreter's own prefix
    # where it lives under /tmp (a virtual environment made there, as CI's is), which the sandbox binds read-only
    bound = {Path(p).parts[2] for p in {sys.prefix, sys.base_prefix} if Path(p).parts[1:2] == ("tmp",)}
    assert sorted(ast.literal_eval(listing)) == sorted({os.path.basename(cwd), *bound})


@needs_bwrap
def test_limits_and_output():
    assert "killed by SIGXCPU" in run_python("while True: pass", cpu_s=1, wall_s=120)  # wall: a loaded machine
    assert "MemoryError" in run_python("x = bytearray(2 * 1024 ** 3)", memory_mb=256)
    assert run_python("import sys; print('a'); print('b', file=sys.stderr); sys.exit(3)") == "a\nb\n\n[exit status 3]"
    with pytest.raises(TimeoutError, match="wall-clock"):
        run_python("import time; time.sleep(10)", wall_s=0.5)
    out = run_python("print('x' * 10_000_000)", max_output=100)  # more than is kept: read, dropped, counted
    assert out.startswith("x" * 100) and out.endswith("[... 9999901 more characters]")
    r = run(
        ["sh", "-c", "cat in.txt sub/b.txt -; echo err >&2"], files={"in.txt": "a\n", "sub/b.txt": "b\n"}, stdin="c"
    )
    assert r == Result(0, b"a\nb\nc", b"err\n") and r.signal is None
    with pytest.raises(ValueError, match="relative"):
        run(["true"], files={"../x": ""})


@needs_bwrap
def test_binds_are_read_only(tmp_path):
    (tmp_path / "data.txt").write_text("shown")
    tmp_path.chmod(0o755)  # as root the program runs as a user of its own: it reads what others may read
    r = run(["sh", "-c", f"cat {tmp_path}/data.txt; echo x > {tmp_path}/data.txt"], binds=[str(tmp_path)])
    assert (
        r.stdout == b"shown" and b"Read-only file system" in r.stderr and (tmp_path / "data.txt").read_text() == "shown"
    )
    with pytest.raises(FileNotFoundError, match="no such path"):
        run(["true"], binds=[str(tmp_path / "missing")])


def compile_and_run(source: str) -> str:
    """Compile and run a shell script of the model's (a user's own subprocess tool: a compiler, a shell ...).

    Args:
        source: the program.
    """
    r = run(["sh", "-c", "sh -n main.sh && sh main.sh"], files={"main.sh": source}, wall_s=5)
    return (r.stdout + r.stderr).decode() + (f"[exit status {r.returncode}]" if r.returncode else "")


@needs_bwrap
def test_a_users_subprocess_tool_gets_the_same_guarantees(tmp_path):
    from engines.rollout.agent import ToolCall, _Tools
    from engines.rollout.tools import Tool

    tool = Tool(compile_and_run)
    assert tool.schema["function"]["name"] == "compile_and_run"
    target = tmp_path / "escaped"
    calls = {
        "echo": "echo hello",
        "write": f"echo x > {target}",
        "read": f"cat {ROOT / 'pyproject.toml'}",
        "hang": "sleep 120",
    }
    pool = _Tools(2, 30.0)  # the sandbox's own wall clock (5 s) ends the hanging call first
    results = {k: pool.run(ToolCall(tool.name, run=lambda s=s: tool.fn(s))) for k, s in calls.items()}
    assert results["echo"][0] == "hello\n"
    assert "exit status" in results["write"][0] and not target.exists()
    assert "No such file" in results["read"][0]
    assert results["hang"][0] is None and results["hang"][1].startswith("TimeoutError")


def test_without_bwrap_code_is_refused(monkeypatch):
    from algorithms.environments import sandbox

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    sandbox._tools.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="install the package 'bubblewrap'"):
            run_python("print(1)")
    finally:
        sandbox._tools.cache_clear()
