"""Prompt datasets from files: JSONL or Parquet rows turned into (prompt, demonstration, row values) examples.

What a row may hold, as users of verl / OpenRLHF / TRL write them:

- `prompt`: the prompt text, used as is; or a list of chat messages (verl's layout), rendered like `messages`.
- `messages`: chat messages (`[{"role": "user", "content": ...}, ...]`), rendered with the policy tokenizer's chat
  template and the generation prompt appended. A trailing assistant message is the demonstration.
- `response` (or `completion`): a demonstration for the supervised warm start.
- anything else scalar (numbers, strings, booleans): per-row values a rule reward reads (e.g. a `target`).

Every problem is a `ConfigError` naming the file, the row and the fix, raised on the controller before any worker
starts: a missing or unreadable file, an unknown format, an empty dataset, a row without a prompt, a chat template
the tokenizer lacks. Parquet needs pyarrow (a dependency).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from algorithms.run.errors import ConfigError

__all__ = ["Example", "Pair", "load_examples", "load_pairs"]

Example = tuple[str, str | None, dict[str, Any]]
"""(prompt text, demonstration or None, per-row values)."""

_RESPONSE_KEYS = ("response", "completion")

Pair = tuple[str, str, str, dict[str, Any]]
"""(prompt text, chosen response, rejected response, per-row values such as safety labels)."""


def load_examples(paths: Sequence[str], tokenizer: Any, setting: str = "train_files") -> list[Example]:
    """Every row of every file in `paths`, as examples; `setting` names the option in error messages."""
    examples: list[Example] = []
    for path in map(Path, paths):
        for i, row in enumerate(_rows(path, setting)):
            examples.append(_example(row, tokenizer, f"{setting}: row {i} of {path}"))
    if not examples:
        raise ConfigError(f"{setting}={','.join(paths)} holds no rows; give a file with at least one prompt")
    return examples


def _rows(path: Path, setting: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{setting}: {path} does not exist (or is not a file)")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".json", ".jsonl.gz"):
        import gzip

        opener = gzip.open if suffix.endswith(".gz") else open
        rows = []
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"{setting}: line {n} of {path} is not JSON ({e.msg}); a JSONL file holds one "
                        f"JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ConfigError(
                        f"{setting}: line {n} of {path} is a {type(row).__name__}, not an object with a prompt column"
                    )
                rows.append(row)
        return rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError("Parquet datasets need pyarrow: pip install pyarrow") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise ConfigError(f"{setting}: {path} is not a readable Parquet file ({e})") from None
    raise ConfigError(f"{setting}: {path} has an unknown format; use .jsonl (one JSON object per line) or .parquet")


def _example(row: dict[str, Any], tokenizer: Any, where: str) -> Example:
    prompt, response = row.get("prompt"), next((row[k] for k in _RESPONSE_KEYS if row.get(k) is not None), None)
    messages = prompt if isinstance(prompt, list) else row.get("messages")
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(messages, list) and messages:
        if messages[-1].get("role") == "assistant":  # the demonstration of a chat row
            response = response if response is not None else messages[-1].get("content")
            messages = messages[:-1]
        text = _render(messages, tokenizer, where)
    else:
        raise ConfigError(
            f"{where} has neither a `prompt` (text or chat messages) nor a `messages` column; its "
            f"columns: {sorted(row)}"
        )
    if not text.strip():
        raise ConfigError(f"{where} has an empty prompt")
    values = {
        k: v
        for k, v in row.items()
        if k not in ("prompt", "messages", *_RESPONSE_KEYS) and isinstance(v, (int, float, str, bool))
    }
    return text, (str(response) if response is not None else None), values


def _render(messages: list[Any], tokenizer: Any, where: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{where} holds chat messages, but the policy's tokenizer has no chat template; use a "
            f"model folder whose tokenizer_config.json has one (or model.tokenizer=DIR), or give the "
            f"prompt as text in a `prompt` column"
        )
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ConfigError(f"{where}: chat messages must be objects with `role` and `content`, got {messages!r:.200}")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def load_pairs(paths: Sequence[str], tokenizer: Any, setting: str = "train_files") -> list[Pair]:
    """Preference pairs: a prompt (as in `load_examples`) with `chosen` and `rejected` responses (text, or the
    final assistant message of a chat); other scalar columns (e.g. `chosen_safe`) become row values."""
    pairs: list[Pair] = []
    for path in map(Path, paths):
        for i, row in enumerate(_rows(path, setting)):
            where = f"{setting}: row {i} of {path}"
            answers = []
            for key in ("chosen", "rejected"):
                value = row.get(key)
                if isinstance(value, list) and value and isinstance(value[-1], dict):
                    value = value[-1].get("content")  # a chat: its final (assistant) message
                if not isinstance(value, str):
                    raise ConfigError(
                        f"{where} has no `{key}` response (text); preference pairs need `chosen` and "
                        f"`rejected`; its columns: {sorted(row)}"
                    )
                answers.append(value)
            prompt, _, values = _example(
                {k: v for k, v in row.items() if k not in ("chosen", "rejected")}, tokenizer, where
            )
            pairs.append((prompt, answers[0], answers[1], values))
    if not pairs:
        raise ConfigError(f"{setting}={','.join(paths)} holds no pairs; give a file with at least one")
    return pairs
