"""A run directory written by scripts/train.py, loaded into series: per-step records, held-out losses, the
per-layer diagnostic records, the anomaly incidents, the config and the summary.

Every field is optional except the step records' `step` and `loss`: runs of older versions lack the newer
fields, and a rule whose evidence is missing is skipped rather than guessed (jaxllm/diagnose/findings.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

DIAG_PREFIX = "diag/"


class RunDirError(ValueError):
    """A run directory that cannot be diagnosed: the message names the file and what was expected."""


@dataclasses.dataclass
class RunData:
    """One run's records. `steps[name]` is a float array aligned with `step` (NaN where a record lacks the
    field); `evals` is (steps, held-out losses); `diag[name]` is (steps, values) of one diagnostic series;
    `diag_text` holds the string-valued diagnostic fields as (step, name, value)."""

    root: Path
    config: dict
    summary: dict
    step: np.ndarray
    steps: dict[str, np.ndarray]
    evals: tuple[np.ndarray, np.ndarray]
    diag: dict[str, tuple[np.ndarray, np.ndarray]]
    diag_text: list[tuple[int, str, str]]
    incidents: list[dict]

    def series(self, name: str) -> np.ndarray | None:
        """The step field `name`, or None when no step record carries it (a NaN value counts: a non-finite step
        is evidence, not absence)."""
        return self.steps.get(name)

    def config_value(self, dotted: str, default=None):
        """A value of config.json by dotted path (`optim.clip_norm`), `default` when absent."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def layer_series(self, stat: str, prefix: str = DIAG_PREFIX) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{layer index: (steps, values)} of `<prefix><stat>/layer_<i>`: the diagnostic records (`diag/`, every
        diagnostics.every steps) or, under another prefix (`moe/`), fields of every step's record."""
        head = f"{prefix}{stat}/layer_"
        records = self.diag if prefix == DIAG_PREFIX else {name: (self.step, v) for name, v in self.steps.items()}
        return {int(name[len(head):]): series for name, series in records.items()
                if name.startswith(head) and name[len(head):].isdigit()}


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of `path`, one per line. A partial last line (a crash mid-write) is dropped; a bad line
    before it is a RunDirError naming the line."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise RunDirError(f"{path}:{number}: not a JSON object per line") from None
        if not isinstance(record, dict):
            raise RunDirError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return value if isinstance(value, dict) else {}


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def load_run(root: str | Path) -> RunData:
    """Load the run directory `root` (a RunDirError when it or its metrics.jsonl is missing or unreadable).

    A step logged more than once (a resume or rollback computed it again) keeps its last record: that is the
    update the run went on from.
    """
    root = Path(root)
    if not root.is_dir():
        raise RunDirError(f"{root}: no such run directory (expected the workdir of a scripts/train.py run)")
    metrics_path = root / "metrics.jsonl"
    if not metrics_path.is_file():
        raise RunDirError(f"{metrics_path}: missing (a run directory holds the metrics.jsonl that training wrote)")
    by_step: dict[int, dict] = {}
    evals: dict[int, float] = {}
    diag: dict[str, dict[int, float]] = {}
    diag_text = []
    for record in read_jsonl(metrics_path):
        step = _number(record.get("step"))
        if step is None:
            continue
        step = int(step)
        if "eval_loss" in record:
            evals[step] = float(record["eval_loss"])
        for name, value in record.items():
            if not name.startswith(DIAG_PREFIX):
                continue
            number = _number(value)
            if number is None:
                diag_text.append((step, name, str(value)))
            else:
                diag.setdefault(name, {})[step] = number
        if "loss" in record:
            by_step[step] = {k: v for k, v in record.items() if not k.startswith(DIAG_PREFIX)}
    if not by_step:
        raise RunDirError(f"{metrics_path}: no step records (lines with a `loss`)")
    incidents_path = root / "incidents.jsonl"
    return RunData(root=root, config=_read_json(root / "config.json"), summary=_read_json(root / "summary.json"),
                   step=np.array(sorted(by_step), dtype=np.int64), steps=_columns(by_step),
                   evals=_pairs(evals), diag={name: _pairs(values) for name, values in diag.items()},
                   diag_text=diag_text,
                   incidents=read_jsonl(incidents_path) if incidents_path.is_file() else [])


def _columns(by_step: dict[int, dict]) -> dict[str, np.ndarray]:
    """Numeric fields of the step records as arrays in step order (NaN where a record lacks one)."""
    order = sorted(by_step)
    names = {k for record in by_step.values() for k, v in record.items() if _number(v) is not None}
    return {name: np.array([_number(by_step[s].get(name)) if _number(by_step[s].get(name)) is not None else math.nan
                            for s in order], dtype=np.float64) for name in names}


def _pairs(values: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    order = sorted(values)
    return np.array(order, dtype=np.int64), np.array([values[s] for s in order], dtype=np.float64)
