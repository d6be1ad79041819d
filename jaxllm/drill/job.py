"""One process of a drilled job, and what the drill reads of the job while it runs: its log, its metrics lines,
its incidents and its checkpoint directory."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

RESUMED = re.compile(r"resuming from checkpoint step (\d+)")
QUARANTINED = re.compile(r"checkpoints/(\d+) is unreadable.*moved it to \S*corrupt-\1-\d+")
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a checkpoint still being written


class Process:
    """`command` started now, its stdout and stderr going to `log_path`."""

    def __init__(self, command: list[str], log_path: Path, env: dict | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.ended: float | None = None

    def poll(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.monotonic()
        return rc

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.poll()
        return rc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def resumed_step(self) -> int:
        """The checkpoint step it resumed (0: it started fresh)."""
        found = RESUMED.search(self.log())
        return int(found.group(1)) if found else 0

    def quarantined(self) -> list[int]:
        """Steps whose checkpoint it found unreadable and moved aside as corrupt-<step>-*."""
        return [int(m.group(1)) for m in QUARANTINED.finditer(self.log())]


class JsonlTail:
    """The complete lines appended to a JSON-lines file since the last `poll` (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def committed_steps(checkpoints: Path) -> list[int]:
    """The committed checkpoint steps (orbax renames a step's directory to its number on commit)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def save_in_flight(checkpoints: Path) -> bool:
    """Whether a checkpoint is being written (orbax's temporary directory exists)."""
    return checkpoints.is_dir() and any(TMP_MARK in p.name for p in checkpoints.iterdir())


def recorded_rollbacks(checkpoints: Path, step: int) -> int:
    """The rollbacks a checkpoint's run metadata records (jaxllm/train/loop.py's `meta`; orbax keeps a JSON
    item as `<item>/metadata`)."""
    return int(json.loads((checkpoints / str(step) / "meta" / "metadata").read_text()).get("rollbacks", 0))


def final_history(metrics_path: Path) -> dict[int, dict]:
    """The last logged record of each step (what a resumed or rolled-back run finally kept), by step."""
    history: dict[int, dict] = {}
    for record in JsonlTail(metrics_path).poll():
        if "loss" in record:
            history[record["step"]] = record
    return history
