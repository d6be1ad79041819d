"""Corrupting a committed checkpoint while its job is down, as a bad disk or a half-copied directory would."""

from __future__ import annotations

import json
from pathlib import Path

from jaxllm.runs.checksums import MANIFEST


def corrupt_checkpoint(step_dir: Path, damage: str, pick: float) -> str:
    """Delete (`damage="delete"`) or truncate (`"truncate"`) one file of `step_dir` and say which.

    The file is one its checksum manifest lists (the data a restore reads), the one at fraction `pick` of the
    sorted list; a truncated file keeps a fraction `pick` of its bytes (at least one byte fewer). An empty file
    is deleted instead.
    """
    listed = sorted(json.loads((step_dir / MANIFEST).read_text())["files"])
    name = listed[min(int(pick * len(listed)), len(listed) - 1)]
    path = step_dir / name
    size = path.stat().st_size
    if damage == "truncate" and size > 0:
        keep = min(int(pick * size), size - 1)
        with open(path, "r+b") as f:
            f.truncate(keep)
        return f"truncated {name} to {keep} of {size} bytes"
    if damage not in ("truncate", "delete"):
        raise ValueError(f"unknown damage {damage!r}")
    path.unlink()
    return f"deleted {name} ({size} bytes)"
