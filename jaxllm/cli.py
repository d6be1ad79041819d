"""Command-line plumbing shared by the scripts: `--config FILE`, `--config.a.b=value` overrides, and the
one-line-error convention (message on stderr naming the key or file, exit code 2, no traceback)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path
from typing import Sequence

import ml_collections

from jaxllm.config import AUTO_VALUES, ConfigError, apply_preset

USAGE_ERROR = 2


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


def fail(message: str) -> None:
    """Print `error: message` and exit with the usage-error code."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Import `path` and call its `get_config()`."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config: no such file {path}")
    spec = importlib.util.spec_from_file_location(f"jaxllm_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a user's config file: report it, do not dump a traceback
        raise UsageError(f"--config: {path} failed to load: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config: {path} defines no get_config()")
    return module.get_config()


def _parse_value(key: str, text: str, current):
    """Parse `text` as the type of the value it replaces ("auto" where AUTO_VALUES allows it)."""
    if text == "auto" and key in AUTO_VALUES:
        return AUTO_VALUES[key]
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(key, f"expected true/false, got {text!r}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(key, f"expected an integer, got {text!r}") from None
            if not value.is_integer():
                raise ConfigError(key, f"expected an integer, got {text!r}") from None
            return int(value)
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {text!r}") from None
    if isinstance(current, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_override(cd: ml_collections.ConfigDict, dotted: str, text: str) -> None:
    """Set `cd.<dotted> = text` (parsed to the field's type); unknown keys are errors."""
    parts = dotted.split(".")
    node = cd
    for i, part in enumerate(parts[:-1]):
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ConfigError(".".join(parts[: i + 1]), "unknown section")
        node = node[part]
    leaf = parts[-1]
    if leaf not in node:
        raise ConfigError(dotted, f"unknown key; expected one of {sorted(node.keys())}")
    with node.unlocked():
        node[leaf] = _parse_value(dotted, text, node[leaf])


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Separate `--config.a.b=v` / `--config.a.b v` overrides from the other arguments."""
    rest, overrides = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--config."):
            body = arg[len("--config."):]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(args):
                    raise UsageError(f"{arg}: missing value")
                key, value = body, args[i + 1]
                i += 1
            overrides.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def build_config(config_path: str, overrides: list[tuple[str, str]], workdir: str | None = None):
    """Load a config file and apply overrides; a `model.preset` override is applied first so that explicit
    `model.*` overrides refine the preset rather than being replaced by it."""
    cd = load_config_file(config_path)
    for key, value in overrides:
        if key == "model.preset" and value:
            apply_preset(cd, value)
    for key, value in overrides:
        if key != "model.preset":
            apply_override(cd, key, value)
    if workdir is not None:
        with cd.unlocked():
            cd.workdir = workdir
    return cd


def parser(description: str) -> argparse.ArgumentParser:
    """An argparse parser whose usage errors follow the one-line, exit-2 convention."""

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse's default prints usage; we print one line
            fail(message)

    p = _Parser(description=description)
    return p
