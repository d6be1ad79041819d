"""Hot updates: an operator steers a running job through `<workdir>/control.json`, applied at a step boundary.

The file holds one change or a list of them; each is an object with an `id` and one or more actions:

    {"id": "lr-1", "lr_scale": 0.5}
    [{"id": "lr-1", "lr_scale": 0.5}, {"id": "clip-1", "clip_norm": 0.25, "save": true}]

- `lr_scale` (> 0): multiplies the run's LR scale (`TrainState.lr_scale`, which every update is multiplied by);
- `clip_norm` (>= 0, 0: off): the new global-norm clipping threshold (a hyperparameter in the optimizer state);
- `save: true`: save a checkpoint at this boundary; `eval: true`: evaluate the held-out loss now;
- `stop: true`: save and stop cleanly, as on SIGTERM;
- `at_step` (an integer >= 1, optional): apply the change at the boundary after that step rather than the next one
  (read earlier, it waits; read later, it applies at once). A drill's or an operator's scheduled change lands on
  its step exactly, in every process and in every restart that reaches the step without it.

Neither value is a constant of the compiled step, so no change recompiles. Each id is applied once: the applied
changes are remembered in each checkpoint's metadata (`hot_updates`), so a resumed run keeps their effect (it is
in the restored state) and does not apply an id still in the file again. A rollback to a checkpoint older than a
change re-applies the change's `lr_scale` and `clip_norm` to the restored state (an operator's change outlives an
anomaly). A file that is not JSON, a change without an id, an unknown key or a bad value is rejected (logged once
by each process that reads it) and the run goes on unchanged. Write the file atomically (to a temporary name,
then rename: `write_control` does) so a half-written file is never read.

Only process 0 reads the file. With one process it is checked (one `stat`) at every step boundary; with several,
at the first boundary of each start and then every `check_every` steps (the preemption guard's cadence) process
0 broadcasts the new changes (at most `MAX_FILE_BYTES`) to every process in one collective, so all apply them at
the same step (each process logs what it applied). Every applied,
re-applied or rejected change is a line of `incidents.jsonl` (kind `hot_update`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import numpy as np

from jaxllm.optim.chain import current_clip_norm, with_clip_norm
from jax.experimental import multihost_utils

CONTROL_FILE = "control.json"
HOT_UPDATES = "hot_updates"  # the checkpoint metadata key of the applied changes
ACTIONS = ("lr_scale", "clip_norm", "save", "eval", "stop")
MAX_FILE_BYTES = 16384
MAX_ID_CHARS = 100
_SHARE_BYTES = 2 * MAX_FILE_BYTES  # re-encoded changes: numbers may print longer than they were written


class Rejected(ValueError):
    """A change (or the whole control file) that cannot be applied; the message says why."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One validated change of the control file (see the module docstring for the keys)."""

    id: str
    lr_scale: float | None = None
    clip_norm: float | None = None
    save: bool = False
    eval: bool = False
    stop: bool = False
    at_step: int | None = None

    def due(self, step: int) -> bool:
        """Whether the change applies at the boundary after `step`."""
        return self.at_step is None or self.at_step <= step

    def to_dict(self) -> dict:
        """The change as the file states it (no unset action)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v is not False}


def parse_change(item) -> Change:
    """One entry of the control file as a Change; Rejected names the first problem."""
    if not isinstance(item, dict):
        raise Rejected(f"a change is a JSON object, got {json.dumps(item)[:80]}")
    ident = item.get("id")
    if not isinstance(ident, str) or not ident or len(ident) > MAX_ID_CHARS:
        raise Rejected(f"a change needs an \"id\": a string of 1..{MAX_ID_CHARS} characters, got {ident!r}")
    unknown = sorted(set(item) - {"id", "at_step", *ACTIONS})
    if unknown:
        raise Rejected(f"unknown key {unknown[0]!r} (known: id, at_step, {', '.join(ACTIONS)})")
    if not set(item) & set(ACTIONS):
        raise Rejected(f"no action (one of {', '.join(ACTIONS)})")
    for key, low in (("lr_scale", "> 0"), ("clip_norm", ">= 0")):
        value = item.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
                value > 0 if key == "lr_scale" else value >= 0):
            raise Rejected(f"{key} must be a finite number {low}, got {json.dumps(value)}")
    for key in ("save", "eval", "stop"):
        if key in item and item[key] is not True:
            raise Rejected(f"{key} must be true, got {json.dumps(item[key])}")
    at_step = item.get("at_step")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 1):
        raise Rejected(f"at_step must be an integer >= 1, got {json.dumps(at_step)}")
    return Change(ident, *(float(item[k]) if k in item else None for k in ("lr_scale", "clip_norm")),
                  *(k in item for k in ("save", "eval", "stop")), at_step)


def parse_control(text: str) -> tuple[list[Change], list[dict]]:
    """(valid changes, rejections) of a control file's text; a rejection is {"reason", and "id" when known}."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return [], [{"reason": f"{CONTROL_FILE} is not valid JSON: {exc}"}]
    items = data if isinstance(data, list) else [data]
    changes, rejections = [], []
    for item in items:
        try:
            changes.append(parse_change(item))
        except Rejected as exc:
            ident = item.get("id") if isinstance(item, dict) else None
            rejections.append({"reason": str(exc), **({"id": ident} if isinstance(ident, str) else {})})
    return changes, rejections


def write_control(workdir: str | os.PathLike, changes: list[dict]) -> Path:
    """Write `changes` (dicts in the file format) as `<workdir>/control.json`, atomically (what an operator or
    a drill does to steer a run)."""
    path = Path(workdir) / CONTROL_FILE
    temporary = path.with_name(f".{CONTROL_FILE}.tmp")
    temporary.write_text(json.dumps(changes))
    temporary.replace(path)
    return path


def share(changes: list[Change]) -> list[Change]:
    """Process 0's `changes`, on every process: one collective that every process must call at the same step."""
    data = json.dumps([c.to_dict() for c in changes]).encode() if jax.process_index() == 0 else b""
    buffer = np.full(_SHARE_BYTES, ord(" "), np.uint8)  # JSON ignores the trailing spaces
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8)).decode()
    return [parse_change(item) for item in json.loads(received)]


@dataclasses.dataclass(frozen=True)
class Due:
    """The changes to apply at this step boundary, and the actions they ask for."""

    changes: tuple[Change, ...] = ()

    @property
    def save(self) -> bool:
        return any(c.save for c in self.changes)

    @property
    def eval(self) -> bool:
        return any(c.eval for c in self.changes)

    @property
    def stop(self) -> bool:
        return any(c.stop for c in self.changes)


class HotUpdates:
    """The control file of one run: `poll` at a step boundary for the changes due (every process, same steps),
    `apply` them to the state before that boundary's save, `after_rollback` to keep them across a rollback.
    `applied` (records {"id", "step", actions...}) goes into every checkpoint's metadata."""

    def __init__(self, workdir: str | os.PathLike, applied: list[dict], incidents, log=print, check_every: int = 10):
        self.path = Path(workdir) / CONTROL_FILE
        self.applied = [dict(r) for r in applied]
        self.incidents, self.log, self.check_every = incidents, log, check_every
        self._queue: list[Change] = []  # shared with every process, not applied yet (a rollback came between)
        self._known = {r["id"] for r in applied}  # ids applied or queued
        self._rejected: set[str] = set()  # rejections already logged, so each is logged once
        self._version: tuple | None = None  # (mtime, size) of the file last read
        self._polled = False  # whether this start has read the file yet

    def poll(self, step: int) -> Due:
        """The changes due after `step`: new ones in the file (read by process 0; with several processes
        shared at this start's first boundary, then every `check_every` steps), and any polled earlier but not
        yet applied (a rollback came between, or their `at_step` is this one)."""
        multi = jax.process_count() > 1
        # Every process polls at the same steps, so the first boundary of a start is one they agree on: a change
        # written while the job was down, or before its start, is read at once rather than up to 10 steps late.
        if not multi or step % self.check_every == 0 or not self._polled:
            self._polled = True
            new = self._read(step) if jax.process_index() == 0 else []
            if multi:
                new = share(new)
            self._queue += new
            self._known.update(c.id for c in new)
        return Due(tuple(c for c in self._queue if c.due(step)))

    def _read(self, step: int) -> list[Change]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if (stat.st_mtime_ns, stat.st_size) == self._version:
            return []
        self._version = (stat.st_mtime_ns, stat.st_size)
        if stat.st_size > MAX_FILE_BYTES:
            changes, rejections = [], [{"reason": f"{self.path} has {stat.st_size} bytes, over {MAX_FILE_BYTES}"}]
        else:
            try:
                changes, rejections = parse_control(self.path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                changes, rejections = [], [{"reason": f"cannot read {self.path}: {exc}"}]
        for rejection in rejections:
            key = json.dumps(rejection, sort_keys=True)
            if key not in self._rejected:
                self._rejected.add(key)
                self.incidents.write(dict(rejection, kind="hot_update", action="rejected", step=step))
                self.log(f"step {step}: hot update {rejection.get('id', '')} rejected: {rejection['reason']}")
        new = {}
        for change in changes:
            if change.id not in self._known and change.id not in new:
                new[change.id] = change
        return list(new.values())

    def apply(self, step: int, state, can_eval: bool = True):
        """`state` with the due changes' LR scale and clipping threshold (the save, eval and stop they ask for
        are the loop's); each is logged, written as an incident and added to `applied`."""
        for change in (c for c in self._queue if c.due(step)):
            state, effects = _set(state, change.lr_scale, change.clip_norm)
            actions = {k: True for k in ("save", "eval", "stop") if getattr(change, k)}
            if change.eval and not can_eval:
                actions["eval"] = "not done: this objective has no held-out batches"
            scheduled = {} if change.at_step is None else {"at_step": change.at_step}
            self.incidents.write(dict(kind="hot_update", action="applied", id=change.id, step=step,
                                      **scheduled, **effects, **actions))
            self.log(f"step {step}: hot update {change.id} applied: "
                     + ", ".join([f"{k} {old:g} -> {new:g}" for k, (old, new) in effects.items()] + list(actions))
                     + (f" (late: at_step {change.at_step})" if change.at_step not in (None, step) else ""))
            self.applied.append(dict(change.to_dict(), step=step))
        self._queue = [c for c in self._queue if not c.due(step)]
        return state

    def after_rollback(self, state, in_checkpoint: list[dict]):
        """`state` (just restored by a rollback) with the LR scale and clipping threshold of the applied changes
        that its checkpoint (whose metadata listed `in_checkpoint`) predates, re-applied in order."""
        have = {r["id"] for r in in_checkpoint}
        step = int(state.step)
        for record in self.applied:
            if record["id"] in have or (record.get("lr_scale") is None and record.get("clip_norm") is None):
                continue
            state, effects = _set(state, record.get("lr_scale"), record.get("clip_norm"))
            self.incidents.write(dict(kind="hot_update", action="reapplied", id=record["id"], step=step, **effects))
            self.log(f"step {step}: hot update {record['id']} re-applied after the rollback")
        return state


def _set(state, lr_scale: float | None, clip_norm: float | None):
    """(`state` with its LR scale multiplied by `lr_scale` and its clipping threshold set to `clip_norm`, each
    when given; {name: (old, new)})."""
    effects = {}
    if lr_scale is not None:
        old = float(state.lr_scale)
        effects["lr_scale"] = (old, old * lr_scale)
        state = state.replace(lr_scale=jax.device_put(np.float32(old * lr_scale), state.lr_scale.sharding))
    if clip_norm is not None:
        current = current_clip_norm(state.opt_state)
        effects["clip_norm"] = (float(current), clip_norm)
        value = jax.device_put(np.float32(clip_norm), current.sharding)
        state = state.replace(opt_state=with_clip_norm(state.opt_state, value))
    return state, effects
