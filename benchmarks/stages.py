"""What a benchmark's timeline calls a call: its stage, from the key the runtime gives it."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["stage_of"]


def stage_of(key: str, stages: Mapping[str, str]) -> str:
    """The stage letter of a call or task from its key (`group.method-rank-token` for calls, `name-token` for an
    apply): `stages[method]`, else "S" (scoring) for a `compute_*` method, else "a" (a task next to the data)."""
    name = key.rsplit("-", 2)[0] if key.count("-") >= 2 else key.rsplit("-", 1)[0]
    method = name.split(".")[-1]
    return stages.get(method, "S" if method.startswith("compute_") else "a")
