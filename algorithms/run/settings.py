"""How settings are read: `key=value` overrides (dotted, or a section's short form) onto config dataclasses, their
checks, and their documentation, read from where each field is declared.

A config is a tree of dataclasses (sections). Each section checks its own fields in `__post_init__` and may name
the interval each number must lie in (`ranges`, a class attribute); a class may name short forms
(`short_forms`: a name kept from before the settings had sections → the dotted key, or keys, it sets).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Any

from algorithms.run.errors import ConfigError

__all__ = [
    "apply_overrides",
    "validate",
    "check_numbers",
    "describe_settings",
    "field_docs",
    "short_forms",
    "has_setting",
]


def short_forms(cfg: Any) -> dict[str, tuple[str, ...]]:
    """The short forms `cfg` takes, each with the dotted keys it sets that exist on `cfg` (a short form of a
    section the program does not have, such as the critic's, sets only the others)."""
    forms = getattr(type(cfg), "short_forms", {})
    out = {}
    for name, keys in forms.items():
        present = tuple(k for k in ((keys,) if isinstance(keys, str) else keys) if _exists(cfg, k))
        if present:
            out[name] = present
    return out


def has_setting(cfg: Any, key: str) -> bool:
    """Whether `key` (dotted, or a short form) names a setting of `cfg`."""
    return key in short_forms(cfg) or _exists(cfg, key)


def _settings(cfg: Any) -> list[dataclasses.Field]:
    """The fields of a section that are settings (not those marked `metadata={"setting": False}`, which the
    program fills in: a tool episode's environment, say)."""
    return [f for f in dataclasses.fields(cfg) if f.metadata.get("setting", True)]


def _exists(cfg: Any, key: str) -> bool:
    obj = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in _settings(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def check_numbers(
    cfg: Any, prefix: str = "", given: dict[str, str] | None = None, names: dict[str, str] | None = None
) -> None:
    """Refuse a numeric setting that is nan, infinite or outside its section's `ranges`, naming it (by its short
    form where it has one: what users type) and the interval, before anything starts; nested sections (`model.`,
    `fusion.`, `slurm.` ...) are walked too. A section may give the ranges of a section of another package inside
    it with dotted names (`slurm.x`)."""
    if names is None:
        names = {key: short for short, keys in short_forms(cfg).items() for key in keys}
    ranges: dict[str, str] = {**getattr(type(cfg), "ranges", {}), **(given or {})}
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner = {k.split(".", 1)[1]: v for k, v in ranges.items() if k.startswith(f.name + ".")}
            check_numbers(value, name + ".", inner, names)
            continue
        name = names.get(name, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        interval = ranges.get(f.name)
        if not math.isfinite(value):
            raise ConfigError(
                f"{name}={value} is not a finite number; give one" + (f" in {interval}" if interval else "")
            )
        if interval is None:
            continue
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if not (above and below):
            raise ConfigError(f"{name}={value} is outside {interval}; give a number in {interval}")


def _coerce(value: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value.lower() in ("none", "null"):
            return None
        return _coerce(value, args[0])
    if tp is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected a boolean, got {value!r}")
    if tp in (int, float, str):
        return tp(value)
    if origin is list and not value.lstrip().startswith("["):  # a,b,c as well as ["a", "b", "c"]
        return [x for x in value.split(",") if x]
    if origin is tuple:
        return tuple(json.loads(value if value.lstrip().startswith("[") else f"[{value}]"))
    return json.loads(value)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """`key=value` (dotted, or a short form) onto a config dataclass, then validate it and its sections.

    Every mistake is a `ConfigError` naming the setting: unknown keys (with the closest known one), values of the
    wrong type, and values the sections' own checks reject."""
    forms = short_forms(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item!r} is not a key=value setting (e.g. steps=10); --help lists them all")
        key, value = item.split("=", 1)
        for target in forms.get(key, (key,)):
            obj, name = _resolve(cfg, target)
            if dataclasses.is_dataclass(getattr(obj, name)):
                raise ConfigError(
                    f"{key} is a group of settings, not one; set its fields ({key}.FIELD=VALUE, listed by --help)"
                )
            hints = typing.get_type_hints(type(obj))
            try:
                setattr(obj, name, _coerce(value, hints[name]))
            except ValueError as e:
                raise ConfigError(f"bad value for {key}: {e}") from None
    check_numbers(cfg)  # first: a section's own check may not say which number was wrong as clearly
    validate(cfg)
    return cfg


def validate(cfg: Any, prefix: str = "") -> None:
    """Run the `__post_init__` checks of every section of `cfg`, innermost first, then of `cfg` itself (after
    fields were set); a section's own ValueError becomes a ConfigError naming the section."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{prefix}{f.name}.")
    post = getattr(cfg, "__post_init__", None)
    if post is None:
        return
    try:
        post()
    except ConfigError:
        raise
    except ValueError as e:  # a section of another package (ModelConfig, OptimConfig, SlurmSettings)
        raise ConfigError(f"{prefix.rstrip('.')}: {e}" if prefix else str(e)) from None


def _resolve(cfg: Any, key: str) -> tuple[Any, str]:
    """The dataclass holding dotted `key` and the field's name in it."""
    obj, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        names = [f.name for f in _settings(obj)]
        if part not in names:
            prefix = ".".join(parts[:depth])
            known = [f"{prefix}.{n}" if prefix else n for n in names]
            candidates = names if prefix else names + list(short_forms(cfg))
            close = difflib.get_close_matches(part, candidates, n=1)
            if close:
                raise ConfigError(
                    f"unknown setting {key!r}; did you mean {prefix + '.' if prefix else ''}{close[0]}? "
                    f"(--help lists every setting)"
                )
            raise ConfigError(f"unknown setting {key!r}; {type(obj).__name__} has: {', '.join(sorted(known))}")
        if depth == len(parts) - 1:
            return obj, part
        child = getattr(obj, part)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(
                f"{'.'.join(parts[: depth + 1])} has no settings inside it; set it as a whole "
                f"({'.'.join(parts[: depth + 1])}=VALUE)"
            )
        obj = child
    raise AssertionError("unreachable")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and its bases), read from the source: the one place
    a setting is documented is where it is declared."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_settings(
    cfg: Any, prefix: str = "", forms: dict[str, tuple[str, ...]] | None = None
) -> list[tuple[str, str, str]]:
    """(dotted key, current value, doc) of every setting of `cfg`, sections flattened; the doc starts with the
    setting's short form, where it has one."""
    forms = short_forms(cfg) if forms is None else forms
    docs = field_docs(type(cfg))
    out: list[tuple[str, str, str]] = []
    for f in _settings(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += describe_settings(value, f"{prefix}{f.name}.", forms)
        else:
            shown = json.dumps(value) if isinstance(value, (list, dict)) else "none" if value is None else str(value)
            key = prefix + f.name
            short = next((k for k, v in forms.items() if key in v), None)
            note = ""
            if short:
                others = [k for k in forms[short] if k != key]
                note = f"(short form: {short}=" + (f", which sets {', '.join(others)} too" if others else "") + ") "
            out.append((key, shown, note + docs.get(f.name, "")))
    return out
