"""Command-line plumbing shared by the scripts: `--config FILE`, `--config.a.b=value` overrides, and the
one-line-error convention (message on stderr naming the key or file, exit code 2, no traceback)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Sequence

import ml_collections

from jaxllm.config.schema import AUTO_VALUES, Config, apply_preset
from jaxllm.config.typed_config import set_value

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


def apply_override(cd: ml_collections.ConfigDict, dotted: str, text: str) -> None:
    """Set `cd.<dotted> = text`, typed by `Config`'s field ("auto" where AUTO_VALUES allows it); unknown keys are
    errors (jaxllm/config/typed_config.py, the path the data-preparation config takes too)."""
    set_value(cd, dotted, text, Config, AUTO_VALUES)


def split_overrides(argv: Sequence[str], prefix: str = "--config.") -> tuple[list[str], list[tuple[str, str]]]:
    """Separate `<prefix>a.b=v` / `<prefix>a.b v` overrides from the other arguments: with "--config." the
    training scripts' `--config.optim.lr=3e-4`, with "--" prepare_data.py's `--clean.min_words=20` (any dotted
    `--section.field`). Returns the other arguments and the (key, text) pairs; an override without a value is a
    usage error reported here (scripts split their arguments before anything else)."""
    rest, overrides = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_value, value = arg.partition("=")
        if name.startswith(prefix) and "." in name[2:]:
            if not has_value:
                if i + 1 >= len(args):
                    fail(f"{arg}: missing value")
                value = args[i + 1]
                i += 1
            overrides.append((name[len(prefix):], value))
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
