"""Tiny verifiable tasks that a 2-layer model learns in minutes on a CPU, each with a shaped reward.

Found here: tiny models collapse on sparse 0/1 rewards (they learn the answer prior), so every reward gives
partial credit, and every run starts from a short supervised warm start on demonstrations (SFT → RLHF, as real
pipelines do). Rewards and costs are rule functions on decoded text, `fn(prompt, response, row) -> float`, and
picklable (module-level), so they run inside a `RuleRewardWorker`.

- `digit_sum` (Safe-RLHF's default): "sum 23:" → at most three digits adding up to 23. Reward: 1 − |sum − 23| / 5,
  floored at −1. Cost: the number of 9s. Half of the demonstrations use 9s ("995"), half avoid them where they can
  ("887"); sums above 24 need a 9 in three digits, so the constraint "expected cost ≤ threshold" genuinely
  conflicts with the reward: the policy must drop 9s where they are free and trade reward where they are not.
- `digit_sum_two` (Safe-RLHF with two constraints): digit_sum whose cost is two costs, the number of 9s and the
  number of 8s, with their own budgets (`cost_thresholds=0.3,0.4` unless given); a third of the demonstrations
  use 9s, a third 8s, a third 7s where they can: the policy must move to 7s where they are free and spend each
  budget where the target needs it.
- `add` (PPO, ReMax): "12+7=" → "19"; partial credit by digit distance.
- `reverse` (GRPO): "rev abc:" → "cba"; credit per matching position; success: the exact reversal.
- `tool_arith` (multi-turn, with a tool): "mul 23*47:" → a product of two 2-digit numbers, which the tiny model
  cannot compute; it may call `calc:23*47!`, read `=1081.` and answer `1081`. Half the demonstrations call the tool,
  half answer directly (wrongly, mostly): RL has to find that the tool pays. Reward: 1 for the exact product, partial
  credit by digits otherwise; success: the exact product.
- `tool_arith_safe`: the same with operands 10..59 and two tools: `calc` answers only for operands below 50 (64% of
  the prompts), `exec` always answers but is unsafe: the cost is its use. Reward alone would call `exec` everywhere; Safe-RLHF's
  constraint must keep its use under the threshold, using `calc` where it suffices. 30% of the demonstrations
  answer directly, 30% call `calc`, 40% `exec`.

- `tool_arith_chatml`: tool_arith for chat models with ChatML turns (SmolLM2, Qwen2, Hermes), the calculator's
  JSON schema in the system prompt, `<tool_call>` JSON calls (examples/tool_smollm2.py).

A multi-turn task's `environment` builds each episode's environment (engines.rollout.tools); its demonstrations are
segments (text, the model's own?), and its reward and cost read the episode's whole text after the prompt (the
model's turns and the tool outputs).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from algorithms.run.errors import ConfigError

__all__ = [
    "Task",
    "TASKS",
    "get_task",
    "digit_sum_reward",
    "digit_sum_cost",
    "add_reward",
    "reverse_reward",
    "tool_arith_reward",
    "tool_arith_success",
    "unsafe_tool_cost",
]

Demonstration = str | tuple[tuple[str, bool], ...]
"""A response, or a multi-turn episode as segments (text, written by the model?): tool outputs are False."""


@dataclass(frozen=True)
class Task:
    name: str
    make_example: Callable[[random.Random], tuple[str, Demonstration, dict[str, Any]]]
    """rng -> (prompt, demonstration, per-row values such as the target)."""
    reward: Callable[[str, str, dict[str, Any]], float]
    cost: Callable[[str, str, dict[str, Any]], float] | None = None
    max_new_tokens: int = 6
    """Response tokens (a multi-turn task's: the whole episode's after the prompt)."""
    environment: Callable[[Any], Any] | None = None
    """tokenizer -> a fresh episode environment (engines.rollout.agent.Environment): a multi-turn task."""
    success: Callable[[str, str, dict[str, Any]], bool] | None = None
    """Whether a response solved the prompt (reported as success_mean), where the reward is shaped."""
    max_turns: int = 3
    settings: tuple[tuple[str, str], ...] = ()
    """Run settings this task needs unless given on the command line (key, value), e.g. a longer warm start."""


def _digits(text: str) -> list[int]:
    return [int(c) for c in text if c.isdigit()]


# -- digit_sum ----------------------------------------------------------------------------------------------------


def _decompose(target: int, largest: int) -> list[int]:
    digits, rest = [], target
    while rest:
        digits.append(min(largest, rest))
        rest -= digits[-1]
    return digits


def _digit_sum_example(rng: random.Random) -> tuple[str, str, dict]:
    """Targets 5..27 in at most 3 digits; half the demonstrations use 9s, half avoid them where 3 digits allow
    (targets above 24 cannot be reached without a 9: that is the conflict)."""
    target = rng.randint(5, 27)
    digits = _decompose(target, 9)
    if rng.random() < 0.5 and len(_decompose(target, 8)) <= 3:
        digits = _decompose(target, 8)
    return f"sum {target}:", "".join(map(str, digits)), {"target": target}


def digit_sum_reward(prompt: str, response: str, row: dict) -> float:
    target = int(row["target"])
    ds = _digits(response)
    junk = sum(1 for c in response if not c.isdigit())
    return max(-1.0, 1.0 - abs(sum(ds) - target) / 5.0) - 0.2 * junk - (0.5 if not ds else 0.0)


def digit_sum_success(prompt: str, response: str, row: dict) -> bool:
    """Solved: digits only, summing to the target."""
    return response.isdigit() and sum(_digits(response)) == int(row["target"])


def digit_sum_cost(prompt: str, response: str, row: dict) -> float:
    return float(response.count("9"))


def _digit_sum_two_example(rng: random.Random) -> tuple[str, str, dict]:
    """digit_sum with a third of the demonstrations built from 9s, a third from 8s and a third from 7s, where three
    digits allow (targets above 21 need an 8 or a 9, above 24 a 9)."""
    target = rng.randint(5, 27)
    largest = rng.choice((9, 8, 7))
    while len(_decompose(target, largest)) > 3:
        largest += 1
    return f"sum {target}:", "".join(map(str, _decompose(target, largest))), {"target": target}


def digit_sum_two_costs(prompt: str, response: str, row: dict) -> tuple[float, float]:
    """Two constraints: the number of 9s and the number of 8s."""
    return float(response.count("9")), float(response.count("8"))


# -- add ----------------------------------------------------------------------------------------------------------


def _add_example(rng: random.Random) -> tuple[str, str, dict]:
    a, b = rng.randint(0, 19), rng.randint(0, 19)
    return f"{a}+{b}=", str(a + b), {"target": a + b}


def add_reward(prompt: str, response: str, row: dict) -> float:
    target = str(int(row["target"]))
    if not response or not response.isdigit():
        return -0.5
    score = 0.3 if len(response) == len(target) else 0.0
    score += sum(0.7 / len(target) for a, b in zip(response, target) if a == b)
    return score


# -- reverse ------------------------------------------------------------------------------------------------------


def _reverse_example(rng: random.Random) -> tuple[str, str, dict]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
    return f"rev {word}:", word[::-1], {"target": word[::-1]}


def reverse_reward(prompt: str, response: str, row: dict) -> float:
    target = str(row["target"])
    hits = sum(1 for a, b in zip(response, target) if a == b)
    return hits / len(target) - 0.25 * abs(len(response) - len(target))


def reverse_success(prompt: str, response: str, row: dict) -> bool:
    """Solved: the word reversed, exactly."""
    return response == str(row["target"])


# -- digits (the TRL comparison's workload) ------------------------------------------------------------------------


def _digits_example(rng: random.Random) -> tuple[str, str, dict]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"what is {a}+{b}? "[:16].ljust(16), str(a + b), {"target": a + b}


def digits_reward(prompt: str, response: str, row: dict) -> float:
    """Fraction of digits in the completion (the reward of the TRL baseline program)."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


# -- tool_arith, tool_arith_safe (multi-turn) ------------------------------------------------------------------


def _answer(response: str) -> str:
    """The final answer of an episode's text: what follows the last tool output (`=...`), or the whole text."""
    return response.rsplit(".", 1)[-1].strip() if "!" in response else response.strip()


def tool_arith_success(prompt: str, response: str, row: dict) -> bool:
    return _answer(response) == str(int(row["target"]))


def tool_arith_reward(prompt: str, response: str, row: dict) -> float:
    """1 for the exact product; else 0.3 for its length and up to 0.5 for digits in place; -0.5 for no number."""
    answer, target = _answer(response), str(int(row["target"]))
    if answer == target:
        return 1.0
    if not answer.isdigit():
        return -0.5
    return (0.3 if len(answer) == len(target) else 0.0) + 0.5 * sum(a == b for a, b in zip(answer, target)) / len(
        target
    )


def unsafe_tool_cost(prompt: str, response: str, row: dict) -> float:
    """The number of calls to the unsafe tool (`exec`)."""
    return float(response.count("exec:"))


def _tool_demo(name: str, a: int, b: int, output: str, answer: str) -> tuple[tuple[str, bool], ...]:
    return ((f"{name}:{a}*{b}!", True), (f"={output}.", False), (answer, True))


def _tool_arith_example(rng: random.Random) -> tuple[str, Demonstration, dict]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    answer = str(a * b)
    demo = _tool_demo("calc", a, b, answer, answer) if rng.random() < 0.5 else ((answer, True),)
    return f"mul {a}*{b}:", demo, {"target": a * b}


def _tool_arith_safe_example(rng: random.Random) -> tuple[str, Demonstration, dict]:

    a, b = rng.randint(10, 59), rng.randint(10, 59)
    answer, u = str(a * b), rng.random()
    if u < 0.3:
        demo: Demonstration = ((answer, True),)
    elif u < 0.6:
        try:
            demo = _tool_demo("calc", a, b, small_calculator(f"{a}*{b}"), answer)
        except ValueError as e:  # what the model reads when calc refuses: then it answers as best it can
            demo = _tool_demo("calc", a, b, f"error valueerror: {e}", answer)
    else:
        demo = _tool_demo("exec", a, b, answer, answer)
    return f"mul {a}*{b}:", demo, {"target": a * b}


_CHATML_TOOLS = """<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schema}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call><|im_end|>
<|im_start|>user
What is {a}*{b}?<|im_end|>
<|im_start|>assistant
"""


@functools.cache
def _calculator_schema() -> str:
    """The calculator's JSON schema as the system prompt shows it (read from its docstring once, not per prompt)."""
    import json

    from engines.rollout.tools import Tool

    return json.dumps(Tool(calculator).schema)


def _chatml_arith_example(rng: random.Random) -> tuple[str, Demonstration, dict]:
    """tool_arith for chat models with ChatML turns (SmolLM2, Qwen2, Hermes): the tool's schema in the system
    prompt as Hermes-style templates write it, calls as <tool_call> JSON, the output as a `tool` turn."""
    import json

    a, b = rng.randint(10, 99), rng.randint(10, 99)
    answer = f"The answer is {a * b}."
    prompt = _CHATML_TOOLS.format(schema=_calculator_schema(), a=a, b=b)
    if rng.random() < 0.5:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
        demo: Demonstration = (
            (f"<tool_call>\n{call}\n</tool_call>", True),
            (f"<|im_end|>\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n", False),
            (answer, True),
        )
    else:
        demo = ((answer, True),)
    return prompt, demo, {"target": a * b}


def _chat_answer(response: str) -> str:
    """The last number of a chat episode's final turn (after the last tool output), or of the whole response."""
    if "</tool_call>" in response:
        tail = response.rsplit("</tool_call>", 1)[-1]
        response = tail.rsplit("assistant\n", 1)[-1] if "assistant\n" in tail else ""
    numbers = re.findall(r"\d+", response)
    return numbers[-1] if numbers else ""


def chat_arith_success(prompt: str, response: str, row: dict) -> bool:
    return _chat_answer(response) == str(int(row["target"]))


def chat_arith_reward(prompt: str, response: str, row: dict) -> float:
    """tool_arith_reward on the last number of the final turn."""
    return tool_arith_reward(prompt, _chat_answer(response) or "-", row)


def _chatml_arith_env(tokenizer: Any) -> Any:
    from engines.rollout.tools import HermesFormat, Tool, ToolEnvironment

    return ToolEnvironment([Tool(calculator)], HermesFormat(), tokenizer)


def _tool_arith_env(tokenizer: Any) -> Any:
    from engines.rollout.tools import CompactFormat, Tool, ToolEnvironment

    return ToolEnvironment([Tool(calculator, name_="calc")], CompactFormat(), tokenizer)


def _tool_arith_safe_env(tokenizer: Any) -> Any:
    from engines.rollout.tools import CompactFormat, Tool, ToolEnvironment

    return ToolEnvironment(
        [Tool(small_calculator, name_="calc"), Tool(calculator, unsafe=True, name_="exec")], CompactFormat(), tokenizer
    )


TASKS = {
    "digit_sum": Task(
        "digit_sum", _digit_sum_example, digit_sum_reward, digit_sum_cost, max_new_tokens=4, success=digit_sum_success
    ),
    "digit_sum_two": Task(
        "digit_sum_two",
        _digit_sum_two_example,
        digit_sum_reward,
        digit_sum_two_costs,
        max_new_tokens=4,
        settings=(("cost_thresholds", "0.3,0.4"),),
    ),
    "add": Task("add", _add_example, add_reward, max_new_tokens=4),
    "reverse": Task("reverse", _reverse_example, reverse_reward, max_new_tokens=6, success=reverse_success),
    "digits": Task("digits", _digits_example, digits_reward, max_new_tokens=32),
    "tool_arith": Task(
        "tool_arith",
        _tool_arith_example,
        tool_arith_reward,
        max_new_tokens=24,
        environment=_tool_arith_env,
        success=tool_arith_success,
        settings=(("sft_steps", "300"), ("steps", "80")),
    ),
    "tool_arith_safe": Task(
        "tool_arith_safe",
        _tool_arith_safe_example,
        tool_arith_reward,
        unsafe_tool_cost,
        max_new_tokens=24,
        environment=_tool_arith_safe_env,
        success=tool_arith_success,
        # λ's step, either update: dual ascent's 0.2; PID's integral 0.3 (the cost keeps drifting up while the
        # reward still climbs, which an integral follows with an error of drift / k_i: docs/algorithms.md)
        settings=(("sft_steps", "300"), ("steps", "100"), ("lambda_lr", "0.2"), ("pid_ki", "0.3")),
    ),
    "tool_arith_chatml": Task(
        "tool_arith_chatml",
        _chatml_arith_example,
        chat_arith_reward,
        max_new_tokens=64,
        environment=_chatml_arith_env,
        success=chat_arith_success,
        max_turns=2,
    ),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}") from None


# -- the tasks' tools ------------------------------------------------------------------------------------------

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
