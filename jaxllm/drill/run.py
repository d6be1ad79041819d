"""A whole drill: the plan from the command line, the reference run, the supervised job, the verdict."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from jaxllm.config.cli import UsageError, build_config
from jaxllm.drill.disk import DiskError, SmallDisk
from jaxllm.drill.job import LAUNCHERS, final_history, recorded_hot_updates, write_hot_updates
from jaxllm.drill.elastic import ElasticSupervisor
from jaxllm.drill.plan import (ANOMALY_KINDS, MULTI_PROCESS_KINDS, TIER_KINDS, Fault, anomaly_flags, hot_changes,
                              parse_faults, schedule)
from jaxllm.drill.report import compare_params, summarize
from jaxllm.drill.supervisor import DrillError, Supervisor
from jaxllm.runtime.preemption import CHECK_EVERY

# Config keys (sections or dotted keys) that may differ between the drilled run and its reference: where it
# runs and keeps checkpoints, and the injections that each start of the drilled job gets or not (the
# reference's are checked separately).
UNCOMPARED = ("workdir", "debug", "checkpoint.local_dir", "checkpoint.local_keep", "checkpoint.persist_every",
              "elastic.wait_s")
ELASTIC_UNCOMPARED = ("mesh", "optim.grad_accum")  # an elastic drill may end on the survivors' smaller mesh
ELASTIC_TOLERANCE = 1e-5  # relative: an elastic run's final parameters and losses against its reference


@dataclasses.dataclass(frozen=True)
class Drill:
    """A planned drill: the job's command line (a scripts/train.py run in `directory/run`), its faults, where
    the reference run is (`directory/reference` when the drill runs it itself) and the job's processes."""

    command: list[str]
    directory: Path
    counts: dict[str, int]
    faults: list[Fault]
    seed: int
    steps: int
    reference: Path
    run_reference: bool
    processes: int = 1
    local: Path | None = None  # the job's local checkpoint tier (checkpoint.local_dir), if it has one
    every: int = 1  # the job's checkpoint.every
    elastic_wait_s: float = 0.0  # the job's elastic.wait_s
    host_down_s: float = 0.0  # how long a host_down fault's host stays down
    launcher: str = "local"  # how each start's processes are started (jaxllm.drill.job.LAUNCHERS)

    @property
    def workdir(self) -> Path:
        return self.directory / "run"

    @property
    def elastic(self) -> bool:
        """Whether the job may go on with fewer processes (then it cannot end bit for bit)."""
        return "host_down" in self.counts and self.elastic_wait_s > 0


def plan_drill(train_script: str, config_path: str, overrides: list[tuple[str, str]], faults: str, seed: int,
               directory: str, reference: str | None = None, heartbeat_timeout: int = 20,
               host_down_s: float = 60.0, launcher: str = "local") -> Drill:
    """Check the command line and draw the faults. Raises FaultSpecError, ConfigError or UsageError (one-line
    messages naming the bad flag, key or entry) before anything runs.

    With peer and host_down faults the job (and the reference the drill runs) is 2 processes on this host, which
    stop within `heartbeat_timeout` seconds of losing a peer; a host_down fault's host stays down `host_down_s`
    seconds. `launcher`: "local" (subprocesses of this one) or "slurm" (one `srun` of the job's tasks a start)."""
    counts = parse_faults(faults)
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher: expected one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    cd = build_config(config_path, overrides)
    base = Path(directory)
    if base.exists() and any(base.iterdir()):
        raise UsageError(f"--workdir: {base} is not empty (a drill starts its job from scratch)")
    if any(kind in counts for kind in ANOMALY_KINDS) and cd.train.on_anomaly == "abort":
        raise UsageError("--faults: nan and spike need train.on_anomaly rollback or skip, not abort")
    if "diskfull" in counts and os.geteuid() != 0:
        raise UsageError(f"--faults: diskfull needs root to mount a tmpfs over the checkpoint directory (running as "
                         f"uid {os.geteuid()})")
    tiers = [kind for kind in TIER_KINDS if kind in counts]
    if tiers and not cd.checkpoint.local_dir:
        raise UsageError(f"--faults: {', '.join(tiers)} need a local checkpoint tier "
                         f"(--config.checkpoint.local_dir=DIR)")
    if reference is not None and not (Path(reference) / "checkpoints").is_dir():
        raise UsageError(f"--reference: {reference} holds no checkpoints directory")
    if "host_down" in counts and host_down_s <= 0:
        raise UsageError(f"--host_down_s: must be positive, got {host_down_s}")
    processes = 2 if any(kind in counts for kind in MULTI_PROCESS_KINDS) else 1
    plan = schedule(counts, seed, cd.train.steps, cd.checkpoint.every, cd.anomaly.min_history,
                    CHECK_EVERY if processes > 1 else 1)
    command = [sys.executable, train_script, "--config", config_path, "--workdir", str(base / "run"),
               *(["--heartbeat_timeout", str(heartbeat_timeout)] if processes > 1 else []),
               *(f"--config.{key}={value}" for key, value in overrides)]
    return Drill(command, base, counts, plan, seed, cd.train.steps,
                 Path(reference) if reference else base / "reference", reference is None, processes,
                 Path(cd.checkpoint.local_dir).absolute() if cd.checkpoint.local_dir else None,
                 cd.checkpoint.every, cd.elastic.wait_s, host_down_s, launcher)


def _config(workdir: Path) -> dict:
    return json.loads((workdir / "config.json").read_text())


def _compared(config: dict, skip: tuple = UNCOMPARED) -> dict:
    """{"section.key": value} of a run's config.json, less the sections and keys of `skip`."""
    flat = {f"{section}.{key}" if isinstance(values, dict) else section: value
            for section, values in config.items()
            for key, value in (values.items() if isinstance(values, dict) else [(None, values)])}
    return {k: v for k, v in flat.items() if k not in skip and k.split(".")[0] not in skip}


def check_reference(drill: Drill) -> None:
    """The reference ran the drilled job's config (apart from `UNCOMPARED`) with the drill's injections and hot
    updates (each applied at its step)."""
    skip = UNCOMPARED + (ELASTIC_UNCOMPARED if drill.elastic else ())
    ours, theirs = _compared(_config(drill.workdir), skip), _compared(_config(drill.reference), skip)
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            raise DrillError(f"--reference: {drill.reference} ran another config: {key} differs")
    want = {f"inject_{f.kind}_at_step": f.step for f in drill.faults if f.kind in ANOMALY_KINDS}
    got = {k: theirs.get("debug", {}).get(k, 0) for k in ("inject_nan_at_step", "inject_spike_at_step")}
    if any(got[k] != want.get(k, 0) for k in got):
        raise DrillError(f"--reference: {drill.reference} ran with injections {got}, the drill needs {want}")
    hot = lambda records: sorted((r["id"], r.get("lr_scale"), r["step"]) for r in records)
    want_hot = hot(dict(c, step=c["at_step"]) for c in hot_changes(drill.faults))
    try:
        got_hot = hot(recorded_hot_updates(drill.reference / "checkpoints", drill.steps))
    except FileNotFoundError:
        raise DrillError(f"--reference: {drill.reference} has no checkpoint of step {drill.steps}") from None
    if got_hot != want_hot:
        raise DrillError(f"--reference: {drill.reference} applied hot updates (id, lr_scale, step) {got_hot}, the "
                         f"drill needs {want_hot}")


def run_reference(drill: Drill, env: dict | None, timeout: float = 24 * 3600) -> None:
    """The uninterrupted job in `drill.reference`, with every injection of the drill fired once and its hot
    updates in its control.json from the start."""
    # The reference keeps its checkpoints on one tier: the drilled job's local tier is its own.
    command = [arg for arg in drill.command if not arg.startswith("--config.checkpoint.local_dir=")]
    command = [*command, *anomaly_flags(drill.faults, 0, 0)]
    command[command.index("--workdir") + 1] = str(drill.reference)
    write_hot_updates(drill.reference, hot_changes(drill.faults))
    process = LAUNCHERS[drill.launcher](command, drill.directory / "logs" / "reference.log", env, drill.processes)
    rc = process.wait(timeout=timeout)
    if rc != 0:
        raise DrillError(f"the reference run failed with {rc}; see {process.log_path}")


def run_drill(drill: Drill, env: dict | None = None, log=print) -> dict:
    """Run the reference (unless given), the drilled job under its faults, and return the drill's JSON object (a
    job that could not be driven to its last step is a failed drill, reported). Raises DrillError when the
    reference fails or differs, or the small filesystem of diskfull faults cannot be mounted."""
    if drill.run_reference:
        log(f"reference: the uninterrupted job in {drill.reference}")
        run_reference(drill, env)
    log(f"drill: {len(drill.faults)} faults on {drill.steps} steps (seed {drill.seed}) in {drill.workdir}, "
        f"logs in {drill.directory / 'logs'}")
    disk = None
    if "diskfull" in drill.counts:
        try:
            disk = SmallDisk(drill.workdir / "checkpoints")
        except DiskError as exc:
            raise DrillError(f"diskfull: {exc}") from None
    try:
        supervise = ElasticSupervisor if "host_down" in drill.counts else Supervisor
        extra = (dict(wait_s=drill.elastic_wait_s, down_s=drill.host_down_s, every=drill.every)
                 if "host_down" in drill.counts else {})
        run = supervise(drill.command, drill.workdir, drill.faults, drill.directory / "logs", env, disk,
                        drill.processes, local=drill.local, launcher=drill.launcher, **extra).run()
        check_reference(drill)
        history = final_history(drill.workdir / "metrics.jsonl")
        finished = run.finished and (drill.workdir / "checkpoints" / str(drill.steps)).is_dir()
        bitwise = compare_params(drill.workdir, drill.reference, drill.steps) if finished else None
    finally:
        if disk is not None:  # the run's checkpoints are copied off the tmpfs
            try:
                disk.close()
            except DiskError as exc:
                raise DrillError(f"diskfull: {exc}") from None
    # A run that went on with fewer devices reduced in another order: close, never bit for bit.
    return summarize(run, drill.counts, drill.seed, drill.steps, history,
                     final_history(drill.reference / "metrics.jsonl"), bitwise,
                     tolerance=ELASTIC_TOLERANCE if drill.elastic else 0.0)
