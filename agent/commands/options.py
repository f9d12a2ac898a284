"""The one way every command declares a flag, reads its environment fallback and says what went wrong.

- `option(...)` / `switch(...)`: a flag whose default comes from its environment variable when that is set;
  `--help` shows the variable and the default. An environment value is checked like the flag's own value,
  and a bad one is a usage error that names both (exit 2). Booleans from the environment are true/false/1/0.
- `SettingError` (exit 2, a setting that cannot work) and `StartupFailure` (exit 1, a failure at start-up):
  `agent.cli` prints either as one line, `gpu-dra-agent <command>: <message>`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

SETTING_EXIT = 2
STARTUP_EXIT = 1
_TRUE, _FALSE = ("true", "1"), ("false", "0")


class SettingError(Exception):
    """A flag or environment value the command cannot work with; str() names the flag."""

    exit_code = SETTING_EXIT


class StartupFailure(Exception):
    """Settings are fine but starting failed (no NVML driver, API server refused, ...)."""

    exit_code = STARTUP_EXIT


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true, false, 1 or 0)")


def _describe(help_text: str, env: str | None, default: Any) -> str:
    notes = [f"env {env}"] if env else []
    if default not in (None, ""):
        shown = ("true" if default else "false") if isinstance(default, bool) else default
        notes.append(f"default {shown}")
    elif default == "":
        notes.append("default empty")
    return f"{help_text} ({'; '.join(notes)})" if notes else help_text


def _from_env(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str | None,
    *,
    convert: Callable[[str], Any],
    default: Any,
    choices: Sequence[Any] | None,
) -> Any:
    text = os.environ.get(env) if env else None
    if text is None or text == "":
        return default
    try:
        value = convert(text)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        why = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"{text!r} is not valid"
        parser.error(f"{env} (the environment's {flag}): {why}")
    if choices is not None and value not in choices:
        parser.error(f"{env} (the environment's {flag}): {text!r} is not one of {', '.join(map(str, choices))}")
    return value


def option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    env: str | None,
    help: str,
    default: Any = None,
    type: Callable[[str], Any] = str,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    required: bool = False,
) -> None:
    """A valued flag; its environment variable (when set and not empty) replaces the default."""
    value = _from_env(parser, flag, env, convert=type, default=default, choices=choices)
    parser.add_argument(
        flag,
        type=type,
        default=value,
        choices=choices,
        metavar=metavar,
        required=required and value is None,
        help=_describe(help, env, default),
    )


def switch(parser: argparse.ArgumentParser, flag: str, *, env: str | None, default: bool, help: str) -> None:
    """--flag / --no-flag; the environment's true/false/1/0 replaces the default, anything else is refused."""
    value = _from_env(parser, flag, env, convert=boolean, default=default, choices=None)
    parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=_describe(help, env, default))
