"""Tools and the environments that let the model call them, in the call formats of the model families (the episode
engine beside this module, agent.py, runs them).

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
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engines.rollout.agent import ToolCall

__all__ = ["Tool", "CompactFormat", "HermesFormat", "ToolEnvironment"]


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
        raise ValueError(
            "the policy's tokenizer has no chat template, so it does not render tool messages; use a "
            "model whose template takes tools (Qwen2.5, Hermes, SmolLM2 ...) or the compact format"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": call}, {"role": "tool", "content": out}],
        tokenize=False,
        add_generation_prompt=True,
    )
    if call not in text or out not in text:
        raise ValueError(
            "this tokenizer's chat template does not render tool messages; use a model whose template "
            "takes tools (Qwen2.5, Hermes, SmolLM2 ...)"
        )
    after_call = text[text.index(call) + len(call) :]
    return after_call[: after_call.index(out)], after_call[after_call.index(out) + len(out) :]


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
