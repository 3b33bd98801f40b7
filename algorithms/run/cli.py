"""The command line of every algorithm program: flags, `key=value` settings, and what a mistake looks like.

`--help` lists every setting with its current (preset) value and the docstring written under its field, read from
the config dataclasses themselves (nested ones as `model.hidden_size`), so the help cannot drift from the code.
A user's mistake (a bad setting or value, sizes that do not divide, a missing file, no scheduler at `--address`, no
slots) prints one `error:` line and exits with status 2; `--debug` (or `log_level=debug`) shows the traceback.
Failures of the run itself (a remote exception, a hang) keep their full report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence

import flowactors as fa
from algorithms.run.config import PLACEMENTS, ConfigError, RunConfig
from algorithms.run.settings import apply_overrides, describe_settings, has_setting, short_forms
from flowactors import Controller

__all__ = ["parse_args", "settings_help", "user_errors", "open_controller", "USER_ERRORS", "EXIT_USAGE"]

EXIT_USAGE = 2
"""Exit status of a user's mistake (argparse's too)."""

_FLAGS: dict[str, dict] = {
    "steps": {"type": int, "help": "RL steps (= steps=N)"},
    "address": {"help": "Dask scheduler address (tcp://host:8786); default: embedded cluster"},
    "metrics_file": {"help": "write one JSON object per step to this file"},
    "cluster": {"choices": ["local", "slurm"], "help": "without --address: embedded (local) or Slurm jobs"},
    "placement": {"choices": list(PLACEMENTS)},
    "plan": {"help": "placement plan file (JSON/YAML) from python -m placement.automap --json"},
    "seed": {"type": int},
    "checkpoint_dir": {"help": "where checkpoints go (atomic, checksummed)"},
    "save_every": {"type": int, "help": "save a checkpoint every K steps"},
    "resume": {"help": "auto (newest complete checkpoint), never, or a checkpoint path"},
    "out": {"help": "the Hugging Face folder to write"},
}
"""Settings that also have a --flag (those a program's config has)."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    from flowactors.checkpoint import CheckpointError
    from flowactors.slurm import SlurmStartupError
    from placement.plan import PlanError

    return (
        ConfigError,
        PlanError,
        fa.PlacementError,
        fa.SchedulerUnreachableError,
        CheckpointError,
        SlurmStartupError,
        fa.ClusterStartError,
        FileNotFoundError,
    )


USER_ERRORS = _user_error_types()
"""What a user's input causes: reported as one line, not a traceback."""


def settings_help(cfg: RunConfig, width: int | None = None) -> str:
    """Every `key=value` setting of `cfg`: key=default, then its doc, wrapped to the terminal."""
    width = width or min(120, shutil.get_terminal_size((100, 20)).columns)
    rows = describe_settings(cfg)
    key_w = min(38, max(len(f"{k}={v}") for k, v, _ in rows) + 2)
    lines = ["settings (key=value, anywhere on the line; nested with dots; the preset's values shown):"]
    for key, value, doc in rows:
        head = f"  {key}={value}"
        body = textwrap.wrap(doc, max(30, width - key_w - 2), break_on_hyphens=False, break_long_words=False) or [""]
        if len(head) + 2 > key_w:
            lines.append(head)
            lines += [" " * key_w + b for b in body]
        else:
            lines.append(head.ljust(key_w) + body[0])
            lines += [" " * key_w + b for b in body[1:]]
    return "\n".join(lines)


def parse_args(
    argv: Sequence[str] | None,
    preset: Callable[[], RunConfig],
    description: str,
    defaults: Callable[[RunConfig], tuple[str, Sequence[str]]] | None = None,
) -> RunConfig:
    """`--steps N --address A --metrics-file F ...` plus `key=value` overrides onto the preset's dataclass, then
    `defaults(cfg)` (whose they are, and `key=value` settings a program derives from the parsed ones: its task's)
    where the command line did not give them.

    Raises ConfigError for a bad setting; argparse itself exits with status 2 on unknown flags."""
    cfg = preset()
    p = argparse.ArgumentParser(
        description=description, epilog=settings_help(cfg), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings, listed below (e.g. seed=1)")
    for name, kwargs in _FLAGS.items():  # the flags of the settings this program has
        if has_setting(cfg, name):
            p.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    p.add_argument("--debug", action="store_true", help="log every call and show tracebacks (= log_level=debug)")
    args = p.parse_intermixed_args(argv)
    flags = [f"{name}={value}" for name in _FLAGS if (value := getattr(args, name, None)) is not None]
    overrides = flags + list(args.overrides) + (["log_level=debug"] if args.debug else [])
    cfg = apply_overrides(cfg, overrides)
    if defaults is None:
        return cfg
    whose, settings = defaults(cfg)
    forms = short_forms(cfg)

    def keys(setting: str) -> set[str]:  # the dotted keys a `key=value` sets
        name = setting.split("=", 1)[0]
        return set(forms.get(name, (name,)))

    given = set().union(*map(keys, overrides))
    extra = [s for s in settings if has_setting(cfg, s.split("=", 1)[0]) and not given & keys(s)]
    if not extra:
        return cfg
    print(f"{whose}: {' '.join(extra)} (give them to change them)", file=sys.stderr)
    return apply_overrides(cfg, extra)


@contextlib.contextmanager
def user_errors(args: Sequence[str], cfg: Callable[[], RunConfig | None], program: str) -> Iterator[None]:
    """Turn a user's mistake into `error: ...` on stderr and exit status 2, unless the command line (`args`) or
    the parsed settings (`cfg()`, None before parsing) ask for debug output: then the traceback."""
    try:
        yield
    except USER_ERRORS as e:
        parsed = cfg()
        if {"--debug", "log_level=debug"} & set(args) or (parsed is not None and parsed.log_level.lower() == "debug"):
            raise
        print(f"{program}: error: {e}\n(--debug shows where it was raised)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def open_controller(cfg: RunConfig) -> Controller:
    """The cluster the settings name: a scheduler at `address`, Slurm jobs, or the embedded local cluster."""
    if cfg.address:
        return Controller.connect(cfg.address, call_timeout_s=cfg.call_timeout_s)
    if cfg.cluster == "slurm":
        from flowactors.slurm import open_slurm

        # the scheduler runs in this process, like the embedded cluster's: one dashboard setting for both
        return open_slurm(
            dataclasses.replace(cfg.slurm, dashboard_address=cfg.dashboard, secure=cfg.secure),
            call_timeout_s=cfg.call_timeout_s,
        )
    return Controller.local(
        cfg.n_slots,
        dashboard=cfg.dashboard,
        call_timeout_s=cfg.call_timeout_s,
        secure=cfg.secure,
        preload=("engines.preload",),  # torch, transformers and the model classes: imported once, not per worker
    )
