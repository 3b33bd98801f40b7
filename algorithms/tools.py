"""Tools and the environments that let the model call them (multi-turn rollouts: engines.rollout.agent).

A `Tool` is a Python function with a JSON-schema description (transformers' `get_json_schema`, read from its type
hints and Google-style docstring: what a chat template's `tools=` renders for the model). A `ToolEnvironment` runs
one episode: it parses each model turn that ended with a call in the model family's call format, hands the calls to
the rollout (which runs them on a bounded pool, each under a timeout) and renders their outputs as the text the
model reads next. Bad calls are observations, never exceptions: a call that does not parse, an unknown tool, wrong
arguments.

Formats:
- `CompactFormat` (the character tokenizer of the tiny tasks, which has no brackets or quotes): `name:argument!`
  with one string argument; the model reads `=output.`.
- `HermesFormat` (Qwen2/2.5, Hermes, SmolLM2 and others whose chat templates take `tools=`): `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>`; the output is rendered as the chat template renders a `tool` message,
  followed by the next assistant header.

`run_python` is a code-execution tool: a subprocess with CPU-time, memory and wall-clock limits, no network (its own
network namespace), in a temporary directory removed afterwards, its output truncated.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engines.rollout.agent import ToolCall

__all__ = ["Tool", "CompactFormat", "HermesFormat", "ToolEnvironment", "run_python", "calculator", "small_calculator",
           "NetworkIsolationError"]


@dataclass(frozen=True)
class Tool:
    """A callable the model may use. `unsafe`: a use a Safe-RLHF cost may count (the tool works; its use is what
    the constraint limits)."""

    fn: Callable[..., Any]
    unsafe: bool = False
    name_: str | None = None

    @property
    def name(self) -> str:
        return self.name_ or self.fn.__name__

    @functools.cached_property
    def schema(self) -> dict[str, Any]:
        """The function's JSON schema, as chat templates take it (`tools=[...]`)."""
        from transformers.utils import get_json_schema

        schema = get_json_schema(self.fn)
        schema["function"]["name"] = self.name
        return schema


class CompactFormat:
    """`name:argument!` calls; the output comes back as `=output.` (module docstring)."""

    stop = ("!",)
    _CALL = re.compile(r"([a-z_]+):(.*)!\s*$", re.S)

    def parse(self, text: str, tools: dict[str, Tool]) -> list[ToolCall]:
        m = self._CALL.search(text)
        if m is None:
            return [ToolCall("?", error="bad call")]
        name, arg = m.group(1), m.group(2).strip()
        if name not in tools:
            return [ToolCall(name, error=f"no tool {name}")]
        return [_bind(tools[name], [arg], {})]

    def render(self, results: list[tuple[ToolCall, str | None, str | None]], tokenizer: Any) -> str:
        return "".join(f"={_plain(out if err is None else 'error ' + err)}." for _, out, err in results)


def _plain(text: str) -> str:
    """Text the character vocabulary can spell (lower case, its punctuation), at most 32 characters."""
    keep = "".join(c for c in str(text).lower() if c.isalnum() or c in " :=+-*/,?")
    return keep[:32]


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls (several may follow each other in one
    turn); each output is rendered as the tokenizer's chat template renders a `tool` message, then the next
    assistant turn's header."""

    stop = ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str, tools: dict[str, Tool]) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body)
                name, args = call["name"], call.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError("arguments is not an object")
            except (ValueError, KeyError, TypeError) as e:
                calls.append(ToolCall("?", error=f"the call is not JSON with a name and arguments ({e})"))
                continue
            if name not in tools:
                calls.append(ToolCall(str(name), error=f"unknown tool {name!r}; tools: {sorted(tools)}"))
                continue
            calls.append(_bind(tools[name], [], args))
        return calls or [ToolCall("?", error="no <tool_call>...</tool_call> found")]

    def render(self, results: list[tuple[ToolCall, str | None, str | None]], tokenizer: Any) -> str:
        prefix, suffix = _tool_message_frame(tokenizer)
        return "".join(f"{prefix}{out if err is None else 'error: ' + err}{suffix}" for _, out, err in results)


@functools.lru_cache(maxsize=8)
def _tool_message_frame(tokenizer: Any) -> tuple[str, str]:
    """What the chat template writes before and after a tool message's content, after an assistant turn (the
    text between the end of the call and the content; after it, through the next assistant header)."""
    call, out = "\x00CALL\x00", "\x00OUT\x00"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the policy's tokenizer has no chat template, so it does not render tool messages; use a "
                         "model whose template takes tools (Qwen2.5, Hermes, SmolLM2 ...) or the compact format")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "u"},
                                          {"role": "assistant", "content": call},
                                          {"role": "tool", "content": out}],
                                         tokenize=False, add_generation_prompt=True)
    if call not in text or out not in text:
        raise ValueError("this tokenizer's chat template does not render tool messages; use a model whose template "
                         "takes tools (Qwen2.5, Hermes, SmolLM2 ...)")
    after_call = text[text.index(call) + len(call):]
    return after_call[:after_call.index(out)], after_call[after_call.index(out) + len(out):]


def _bind(tool: Tool, args: list[Any], kwargs: dict[str, Any]) -> ToolCall:
    import inspect

    try:
        inspect.signature(tool.fn).bind(*args, **kwargs)
    except TypeError as e:
        return ToolCall(tool.name, error=f"bad arguments for {tool.name}: {e}")
    return ToolCall(tool.name, run=functools.partial(tool.fn, *args, **kwargs))


class ToolEnvironment:
    """One episode in which the model may call `tools` in `fmt` (engines.rollout.agent.Environment)."""

    def __init__(self, tools: Sequence[Tool], fmt: CompactFormat | HermesFormat, tokenizer: Any = None) -> None:
        self.tools, self.fmt, self.tokenizer = {t.name: t for t in tools}, fmt, tokenizer
        self.stop = fmt.stop
        self.prompt, self.row = "", {}

    def reset(self, prompt: str, row: dict[str, Any]) -> None:
        self.prompt, self.row = prompt, row

    def step(self, text: str) -> list[ToolCall]:
        return self.fmt.parse(text, self.tools)

    def observe(self, results: list[tuple[ToolCall, str | None, str | None]]) -> str:
        return self.fmt.render(results, self.tokenizer)


# -- tools -----------------------------------------------------------------------------------------------------------

_ARITH = re.compile(r"^\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """Evaluate one arithmetic operation on two integers.

    Args:
        expression: two integers and one of + - * /, such as 23*47.
    """
    m = _ARITH.match(expression)
    if m is None:
        raise ValueError(f"not a b op: {expression}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op == "/":
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return f"{a / b:g}"
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def small_calculator(expression: str) -> str:
    """Evaluate one arithmetic operation on two integers below 50.

    Args:
        expression: two integers below 50 and one of + - * /, such as 23*47.
    """
    m = _ARITH.match(expression)
    if m is not None and max(abs(int(m.group(1))), abs(int(m.group(3)))) >= 50:
        raise ValueError("big")
    return calculator(expression)


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
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            try:
                with open(path, "w") as f:
                    f.write(text)
            except OSError:
                pass
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))


def run_python(code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0,
               max_output: int = 2000) -> str:
    """Run Python code and return what it printed (stdout, then stderr), truncated.

    Args:
        code: a Python program; print what should be returned.
    """
    with tempfile.TemporaryDirectory(prefix="flowactors-exec-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=functools.partial(_isolate, cpu_s, memory_mb << 20))
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
        raise NetworkIsolationError("cannot give the program a network namespace of its own on this machine (no "
                                    "user namespaces and not root); code execution is refused rather than run "
                                    "with network access")
    text = out.decode("utf-8", "replace")
    if proc.returncode < 0:
        import signal

        text += f"\n[killed by {signal.Signals(-proc.returncode).name}]"
    elif proc.returncode:
        text += f"\n[exit status {proc.returncode}]"
    return text if len(text) <= max_output else text[:max_output] + f"\n[... {len(text) - max_output} more characters]"
