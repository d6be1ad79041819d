"""XLA compiler flags carried by a config (`xla_flags`, see configs/gpu/) and put into the XLA_FLAGS variable.

XLA reads XLA_FLAGS once, when JAX starts its first backend (the first device use, not `import jax`); later
changes are silently ignored, and an unknown flag or an unreadable value ends the process. So the scripts call
`use_xla_flags` before anything touches a device: it checks the flags against the installed XLA in a throw-away
process (XLA parses its GPU flags on the CPU backend too), so that a flag a newer jaxlib dropped is a one-line
config error naming `xla_flags.<name>`, then writes them into XLA_FLAGS. The config's flags go first and the
user's own XLA_FLAGS after them: XLA keeps the last value of a repeated flag, so the environment wins.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Any, Mapping, MutableMapping

from jaxllm.config.schema import ConfigError

_PROBE = "import jax; jax.devices()"
# How XLA's flag parser words a rejection (jaxlib 0.10): (pattern with groups `name` and maybe `value`, reason).
_REJECTIONS = (
    (re.compile(r"Unknown flag in XLA_FLAGS: --(?P<name>\w+)"), "not a flag of the installed XLA"),
    (re.compile(r"Couldn't interpret value (?P<value>.*) for flag (?P<name>\w+)\."), "the installed XLA cannot read"),
    (re.compile(r"Illegal value for --(?P<name>\w+) '(?P<value>.*)'"), "the installed XLA cannot read"),
)


def flag_string(flags: Mapping[str, Any]) -> str:
    """`--name=value` for each flag (booleans as true/false), space-separated, in the mapping's order."""
    def text(value):
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    return " ".join(f"--{name}={text(value)}" for name, value in flags.items())


def check_xla_flags(flags: Mapping[str, Any]) -> None:
    """Raise ConfigError (key `xla_flags.<name>`) when the installed XLA rejects a flag name or its value."""
    if not flags:
        return
    env = dict(os.environ, XLA_FLAGS=flag_string(flags), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return
    jaxlib = f"jaxlib {importlib.metadata.version('jaxlib')}"
    for pattern, reason in _REJECTIONS:
        if found := pattern.search(proc.stderr):
            value = f" the value {found.group('value')!r}" if "value" in pattern.groupindex else ""
            raise ConfigError(f"xla_flags.{found.group('name')}", f"{reason}{value} ({jaxlib})")
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise ConfigError("xla_flags", f"the installed XLA ({jaxlib}) rejects {flag_string(flags)!r}: {last}")


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public spelling of this question

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


def apply_xla_flags(flags: Mapping[str, Any], environ: MutableMapping[str, str] = os.environ) -> str:
    """Put `flags` into XLA_FLAGS ahead of what `environ` holds and return the new value. Raises RuntimeError when
    JAX's backend is already running (XLA would ignore them)."""
    if not flags:
        return environ.get("XLA_FLAGS", "")
    if _backend_started():
        raise RuntimeError("xla_flags must be applied before JAX first uses a device; XLA has read XLA_FLAGS already")
    environ["XLA_FLAGS"] = f"{flag_string(flags)} {environ.get('XLA_FLAGS', '')}".strip()
    return environ["XLA_FLAGS"]


def use_xla_flags(flags: Mapping[str, Any]) -> None:
    """Check `flags` (a config's `xla_flags`) against the installed XLA, apply them, and print what XLA will read."""
    if not flags:
        return
    check_xla_flags(flags)
    print(f"xla_flags: {flag_string(flags)}\nXLA_FLAGS={apply_xla_flags(flags)}", flush=True)
