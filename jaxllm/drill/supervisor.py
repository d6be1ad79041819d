"""The supervisor: starts the job, lands each fault on it, and restarts it after each the way an operator or
SLURM `--requeue` would (the same command; it resumes from its newest committed checkpoint), until it finishes.

It watches the job only from outside, as an operator could: the job's log, metrics.jsonl, incidents.jsonl and
its checkpoint directory; and steers it as an operator would, through its control.json (hotlr faults).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from jaxllm.drill.damage import corrupt_checkpoint
from jaxllm.drill.disk import DiskError, SmallDisk
from jaxllm.drill.job import (LAUNCHERS, JsonlTail, Start, committed_steps, recorded_rollbacks, save_in_flight,
                             write_hot_updates)
from jaxllm.drill.plan import (HOT_KINDS, HOT_LR_SCALE, MULTI_PROCESS_KINDS, PROCESS_KINDS, SLOW_PERSISTENT_MB_S,
                              TIER_KINDS, Fault, anomaly_flags, hot_change_id, hot_changes)

PREEMPTED = re.compile(r"preempted: saved step (\d+)")
# The incident each injection must cause (jaxllm/train/anomaly.py), not one a healthy step may report by chance.
INCIDENT_KIND = {"nan": "nonfinite", "spike": "loss_spike"}


class DrillError(RuntimeError):
    """The drill could not go on (the job stalled or kept failing on its own); the message says why."""


@dataclasses.dataclass
class Outcome:
    """What became of one fault. `at_step`: the last step the job had logged (or saved, for SIGTERM) when it
    landed; `resumed`: the checkpoint step the restart resumed (anomalies: the step rolled back to);
    `expected_resume`: the newest committed checkpoint the drill left in place; `steps_lost`: steps computed
    again; `recover_s`: from the restart to its first new step logged (anomalies: from the incident);
    `applied_at`: hot updates: the steps the job logged applying it at (once per start that reached its step
    without it in the checkpoint it resumed)."""

    fault: Fault
    injected: bool = False
    at_step: int | None = None
    during_save: bool | None = None
    resumed: int | None = None
    expected_resume: int | None = None
    steps_lost: int | None = None
    recover_s: float | None = None
    recovered: bool = False
    corrupt_load: bool = False
    quarantined: bool | None = None
    detail: str = ""
    seen_at: float | None = None  # anomalies: when the drill saw the incident
    applied_at: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DrillRun:
    """The supervised job from its first start to its last exit; `error`: why the drill could not drive it to its
    last step (None: it could)."""

    outcomes: list[Outcome]
    starts: int
    unplanned_exits: list[str]
    wall_s: float
    finished: bool
    error: str | None = None


class Supervisor:
    """Runs `command` (a scripts/train.py command line whose workdir is `workdir`) under `faults`, each start
    logging to `logs/start-<n>.log`; `disk`: the small filesystem of the checkpoint directory (diskfull faults);
    `processes`: the job's processes (on this host; peer faults need several).
    `stall_timeout`: seconds without a new step (or without stopping after a fault) before the drill gives up."""

    MAX_UNPLANNED_EXITS = 3

    def __init__(self, command: list[str], workdir: Path, faults: list[Fault], logs: Path, env: dict | None = None,
                 disk: SmallDisk | None = None, processes: int = 1, stall_timeout: float = 600.0,
                 poll_s: float = 0.02, local: Path | None = None, launcher: str = "local"):
        if disk is None and any(f.kind == "diskfull" for f in faults):
            raise ValueError("diskfull faults need the checkpoint directory on a SmallDisk")
        if processes < 2 and any(f.kind in MULTI_PROCESS_KINDS for f in faults):
            raise ValueError("peer and host_down faults need a job of several processes")
        self.command, self.faults, self.logs, self.env, self.disk = command, faults, Path(logs), env, disk
        self.processes = processes
        if local is None and any(f.kind in TIER_KINDS for f in faults):
            raise ValueError("local_wipe and slow_persistent faults need a job with a local checkpoint tier")
        self.checkpoints = Path(workdir) / "checkpoints"
        self.local = local  # the local checkpoint tier (None: the job has one tier)
        self.launch = LAUNCHERS[launcher]  # each start's processes: local subprocesses, or one srun of tasks
        self.devices_per_process: int | None = None  # None: the environment's devices split among the processes
        self.throttled = False  # a slow_persistent fault has landed: every later start throttles the copies
        self.metrics = JsonlTail(Path(workdir) / "metrics.jsonl")
        self.incidents = JsonlTail(Path(workdir) / "incidents.jsonl")
        self.stall_timeout, self.poll_s = stall_timeout, poll_s
        self.outcomes = [Outcome(f) for f in faults]
        self.process: Start | None = None
        self.starts = 0
        self.unplanned: list[str] = []
        self.step_times: list[float] = []
        self.last_step: int | None = None  # the latest step the current process logged (None: none yet)
        self.first_record_at: float | None = None

    def run(self) -> DrillRun:
        """Start the job, land every process fault in step order, then wait for the job to finish. A job that
        stalls or keeps failing on its own ends the drill early (`DrillRun.error`)."""
        first_start = time.monotonic()
        finished, error = False, None
        try:
            self._write_hot_updates()
            self._start(resume=0)
            for outcome in self.outcomes:
                if outcome.fault.kind in PROCESS_KINDS:
                    self._land(outcome)
            finished = not self._wait_for(None)
            self._drain()
            self._settle_hot_updates()
        except (DrillError, DiskError) as exc:  # reported with everything seen until then, never a traceback
            error = str(exc)
        finally:  # never leave a job running behind a failed drill
            if self.process is not None and self.process.poll() is None:
                self.process.signal(signal.SIGKILL)
                self.process.wait(timeout=60)
        return DrillRun(self.outcomes, self.starts, self.unplanned, self.process.ended - first_start, finished,
                        error)

    # -- starting and watching -------------------------------------------------------------------------------

    def _start(self, resume: int) -> None:
        """Start the job as an operator would; only the loop's injections that the checkpoint it will resume has
        not seen are added (`plan.anomaly_flags`)."""
        # the persistent tier's copy when it has one: a verified copy (the local one may be the corrupted one)
        tier = self.checkpoints if resume in committed_steps(self.checkpoints) else self._read_first(resume)
        rollbacks = recorded_rollbacks(tier, resume) if resume else 0
        command = [*self.command, *anomaly_flags(self.faults, resume, rollbacks),
                   *([f"--config.debug.slow_persistent_mb_s={SLOW_PERSISTENT_MB_S}"] if self.throttled else [])]
        self.starts += 1
        self.process = self.launch(command, self.logs / f"start-{self.starts}.log", self.env, self._processes_now(),
                                   self.devices_per_process)
        self.last_step, self.first_record_at = None, None

    def _committed(self) -> list[int]:
        """Committed steps on either checkpoint tier."""
        local = committed_steps(self.local) if self.local is not None else []
        return sorted(set(committed_steps(self.checkpoints)) | set(local))

    def _restarted_after_planned_stop(self) -> bool:
        """Whether a job that exited 0 had stopped only because the supervisor asked it to (an elastic
        supervisor's growing back), and was restarted; never for this supervisor."""
        return False

    def _processes_now(self) -> int:
        """How many processes a start runs (an elastic supervisor starts fewer while a host is down)."""
        return self.processes

    def _newest_committed(self) -> int:
        steps = self._committed()
        return steps[-1] if steps else 0

    def _read_first(self, step: int) -> Path:
        """The tier a restore reads `step` from first: the local one when it holds it."""
        if self.local is not None and step in committed_steps(self.local):
            return self.local
        return self.checkpoints

    def _drain(self) -> None:
        """Read what the job logged since the last call: incidents first, then steps."""
        now = time.monotonic()
        for incident in self.incidents.poll():
            for outcome in self.outcomes:
                fault = outcome.fault
                if INCIDENT_KIND.get(fault.kind) == incident.get("kind") and fault.step == incident.get("step"):
                    self._anomaly_seen(outcome, incident, now)
                if (fault.kind in HOT_KINDS and incident.get("kind") == "hot_update"
                        and incident.get("action") == "applied" and incident.get("id") == hot_change_id(fault)):
                    outcome.applied_at.append(incident["step"])
        for record in self.metrics.poll():
            if "loss" not in record:
                continue
            if self.last_step is None:
                self.first_record_at = now
            else:  # a start's first step also waited for the first batch: not a step time
                self.step_times.append(record["step_time_s"])
            self.last_step = record["step"]
            for outcome in self.outcomes:
                if outcome.seen_at is not None and outcome.recover_s is None:
                    outcome.recover_s = now - outcome.seen_at

    @staticmethod
    def _anomaly_seen(outcome: Outcome, incident: dict, now: float) -> None:
        if outcome.injected:  # fired again after a restart from before its rollback: the same fault
            return
        action = str(incident.get("action", ""))
        restored = incident.get("restored_step")
        outcome.injected, outcome.at_step, outcome.seen_at = True, incident["step"], now
        outcome.resumed = restored
        outcome.steps_lost = incident["step"] - restored if restored is not None else 0
        outcome.recovered = action.startswith(("rollback", "skip"))
        outcome.detail = f"{incident.get('kind')}: {action}"

    def _write_hot_updates(self) -> None:
        """The hot updates into the job's control.json, before its first start (see jaxllm/drill/plan.py)."""
        if not write_hot_updates(self.checkpoints.parent, hot_changes(self.faults)):
            return
        for outcome in self.outcomes:
            if outcome.fault.kind in HOT_KINDS:
                outcome.injected, outcome.steps_lost = True, 0

    def _settle_hot_updates(self) -> None:
        """A hot update recovered when every start that applied it did so at its step (and one did)."""
        for outcome in (o for o in self.outcomes if o.fault.kind in HOT_KINDS):
            step = outcome.fault.step
            outcome.at_step = outcome.applied_at[0] if outcome.applied_at else None
            outcome.recovered = bool(outcome.applied_at) and set(outcome.applied_at) == {step}
            outcome.detail = (f"lr_scale x{HOT_LR_SCALE:g} at step {step}: applied at steps {outcome.applied_at}"
                              if outcome.applied_at else f"lr_scale x{HOT_LR_SCALE:g} at step {step}: never applied")

    def _wait_for(self, target: int | None) -> bool:
        """Wait until the current process logs a step >= `target` (True), or the job finishes (False); a job
        that exits on its own with an error is restarted (an unplanned exit)."""
        deadline = time.monotonic() + self.stall_timeout
        seen = self.last_step
        while True:
            self._drain()
            if target is not None and self.last_step is not None and self.last_step >= target:
                return True
            if self.last_step != seen:
                seen, deadline = self.last_step, time.monotonic() + self.stall_timeout
            rc = self.process.poll()
            if rc is not None:
                self._drain()
                if target is not None and self.last_step is not None and self.last_step >= target:
                    return True
                if rc == 0:
                    if self._restarted_after_planned_stop():
                        deadline = time.monotonic() + self.stall_timeout
                        continue
                    return False
                self._unplanned_exit(rc)
                deadline = time.monotonic() + self.stall_timeout
            elif time.monotonic() > deadline:
                self.process.signal(signal.SIGKILL)
                raise DrillError(f"no new step in {self.stall_timeout:.0f}s; see {self.process.log_path}")
            time.sleep(self.poll_s)

    def _unplanned_exit(self, rc: int) -> None:
        tail = (self.process.log().strip().splitlines() or [""])[-1]
        self.unplanned.append(f"start {self.starts} exited with {rc}: {tail}")
        if len(self.unplanned) > self.MAX_UNPLANNED_EXITS:
            raise DrillError(f"the job exited on its own {len(self.unplanned)} times; last: {self.unplanned[-1]}")
        self._start(self._newest_committed())

    def _corrupt(self, outcome: Outcome) -> tuple[int | None, int | None, Path]:
        """Damage the newest committed checkpoint on the tier a restore reads first, while the job is down:
        (the step the restart must not resume (None: none, or its persistent copy is intact), the step
        damaged, its tier)."""
        fault = outcome.fault
        damaged = self._newest_committed() or None
        if damaged is None:
            return None, None, self.checkpoints
        tier = self._read_first(damaged)
        outcome.detail = f"checkpoint {damaged}: " + corrupt_checkpoint(tier / str(damaged), fault.damage, fault.pick)
        intact_copy = tier != self.checkpoints and damaged in committed_steps(self.checkpoints)
        return (None if intact_copy else damaged), damaged, tier

    def _while_down(self, outcome: Outcome) -> None:
        """What a fault does while the job is down, before its restart: wipe its local tier (local_wipe), or
        throttle its persistent tier from the restart on (slow_persistent); the detail says where each tier
        stood. (An elastic supervisor also waits out a lost host here.)"""
        kind = outcome.fault.kind
        if kind not in TIER_KINDS:
            return
        local, persistent = committed_steps(self.local), committed_steps(self.checkpoints)
        where = (f"local tier at step {local[-1] if local else 0}, persistent tier at step "
                 f"{persistent[-1] if persistent else 0}")
        if kind == "local_wipe":
            shutil.rmtree(self.local, ignore_errors=True)
            outcome.detail = f"{where}: local tier deleted"
        else:
            self.throttled = True
            outcome.detail = f"{where}: persistent tier throttled to {SLOW_PERSISTENT_MB_S:g} MB/s from the restart on"

    def _step_time(self) -> float:
        recent = self.step_times[-10:]
        return statistics.median(recent) if recent else 0.1

    # -- landing a fault -------------------------------------------------------------------------------------

    def _land(self, outcome: Outcome) -> None:
        """Wait for the fault's step, then a random fraction of a step, land it, restart and check the resume."""
        fault = outcome.fault
        while True:
            if not self._wait_for(fault.step):
                outcome.detail = "the job finished before the fault landed"
                return
            time.sleep(fault.delay * self._step_time())
            rc = self.process.poll()
            if rc is None:
                break
            if rc == 0:
                outcome.detail = "the job finished before the fault landed"
                return
            self._unplanned_exit(rc)  # failed on its own meanwhile: restarted, and the fault waits for its step
        self._drain()
        outcome.at_step = self.last_step
        outcome.during_save = save_in_flight(self.local if self.local is not None else self.checkpoints)
        landed = time.monotonic()
        victim = min(int(fault.pick * self.processes), self.processes - 1)
        if fault.kind == "diskfull":
            outcome.detail = f"checkpoint filesystem limited to {self.disk.fill() >> 10} KiB"
        elif fault.kind in ("peer", "host_down"):
            self.process.signal(signal.SIGKILL, process=victim)
        else:
            killed = fault.kind in ("kill9", *TIER_KINDS)
            self.process.signal(signal.SIGKILL if killed else signal.SIGTERM)
        try:
            rc = self.process.wait(timeout=self.stall_timeout)
        except subprocess.TimeoutExpired:
            self.process.signal(signal.SIGKILL)
            raise DrillError(f"the job did not stop within {self.stall_timeout:.0f}s of a {fault.kind} fault; "
                             f"see {self.process.log_path}") from None
        finally:
            if fault.kind == "diskfull":
                self.disk.free()
        self._drain()
        outcome.at_step = self.last_step  # a full disk stops the job at its next save, steps later
        expected_rc = {"kill9": -signal.SIGKILL, "diskfull": 1, **dict.fromkeys(TIER_KINDS, -signal.SIGKILL)}.get(
            fault.kind, 0)
        stopped_as_expected = rc == expected_rc
        if fault.kind == "diskfull":
            errors = [line for line in self.process.log().splitlines() if line.startswith("error:")]
            outcome.detail += f"; the job stopped with {rc}: {errors[-1] if errors else 'no error line'}"
        elif fault.kind in ("peer", "host_down"):  # the killed one, and every other stopping on its own with an error
            codes = self.process.codes()
            others = [rc for i, rc in enumerate(codes) if i != victim]
            stopped_as_expected = codes[victim] == -signal.SIGKILL and all(rc not in (0, None) for rc in others)
            outcome.detail = (f"killed process {victim} of {len(codes)}; the others exited {others} after "
                              f"{self.process.ended - landed:.1f}s")
        elif not stopped_as_expected:
            outcome.detail = f"exited with {rc}, not {expected_rc}"
        if rc == 0 and not stopped_as_expected:  # it had finished before the fault landed: nothing to recover
            return
        outcome.injected = True
        if fault.kind in ("sigterm", "corrupt"):
            saved = PREEMPTED.search(self.process.log())
            outcome.at_step = int(saved.group(1)) if saved else self.last_step
        corrupted, damaged, damaged_tier = self._corrupt(outcome) if fault.kind == "corrupt" else (None, None, None)
        self._while_down(outcome)
        committed = [s for s in self._committed() if s != corrupted]
        outcome.expected_resume = committed[-1] if committed else 0
        self._start(outcome.expected_resume)
        started = self.process.started
        if self._wait_for(0):
            outcome.recover_s = self.first_record_at - started
        else:  # the restart exited 0 without a new step: right only if the fault had stopped it at its last step
            outcome.recover_s = self.process.ended - started
            outcome.detail += "; the restart had no step left to run"
        outcome.resumed = self.process.resumed_step()
        outcome.steps_lost = (outcome.at_step or 0) - outcome.resumed
        outcome.corrupt_load = corrupted is not None and outcome.resumed == corrupted
        if damaged:
            outcome.quarantined = damaged in self.process.quarantined(damaged_tier)
        outcome.recovered = (stopped_as_expected and outcome.resumed == outcome.expected_resume
                             and not outcome.corrupt_load and outcome.quarantined is not False)
