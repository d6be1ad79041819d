"""The faults of a drill: the `--faults kind:count,...` spec and the schedule drawn from a seed.

Every fault lands after the job has logged the loss of a step drawn uniformly from the run's steps, and (for the
process faults) after a further random fraction of a step time, so that kills also land inside async saves.

- `kill9`: SIGKILL.
- `sigterm`: SIGTERM, which the job answers by saving the step it is at and exiting 0 (jaxllm/runtime/preemption.py).
- `corrupt`: the job is stopped with SIGTERM (so its newest committed checkpoint is the one it would resume),
  then one file of that checkpoint, listed in its checksum manifest, is truncated or deleted while it is down.
- `diskfull`: the checkpoint directory is a small tmpfs (jaxllm/drill/disk.py, root only); the fault limits it
  to what it holds, so the job's next save finds no space and the job must stop with an error (exit 1); once it
  is down the space comes back and it restarts.
- `peer`: SIGKILL to one process of a 2-process job (the whole drill then runs the job, and its reference, as
  2 processes on this host); the other must stop on its own with an error naming the dead process
  (jaxllm/runtime/peer_watch.py), then both restart.
- `local_wipe` (a job with `checkpoint.local_dir`): SIGKILL, then the local checkpoint tier is deleted while the
  job is down, as when its node is replaced; the restart must resume the newest step on the persistent tier.
- `slow_persistent` (a job with `checkpoint.local_dir`): SIGKILL, and from the restart on the persistent tier is
  throttled to SLOW_PERSISTENT_MB_S (`debug.slow_persistent_mb_s`), so its copies fall behind the saves; the
  job must resume the newest step on either tier and end bitwise like its reference.
- `host_down` (a 2-process job): SIGKILL to one process, whose host then stays down for the drill's
  `--host_down_s`; the other stops on its own (as for `peer`). With `elastic.wait_s` > 0 the job restarts on
  the survivor once that wait is over and the host is still down, and grows back to every process at the
  first checkpoint after the host returns (jaxllm/drill/elastic.py); with 0 it waits for the host (stop-and-wait).
- `nan`, `spike`: the loop's own injections (`debug.inject_nan_at_step`, `debug.inject_spike_at_step`), at most
  one of each per run; the job handles them in process per `train.on_anomaly` (rollback by default).
- `hotlr`: a hot update (jaxllm/train/control.py) that halves the LR scale at the drawn step, written to the job's
  control.json as it starts, with `at_step` so that it lands on that step exactly (from outside, the drill cannot
  tell which step a running job has reached, so a change written mid-run could land a step late). Every restart
  before the step must apply it there again, every restart after it must find it in its checkpoint; the
  reference gets the same change.
"""

from __future__ import annotations

import dataclasses
import random

PROCESS_KINDS = ("kill9", "sigterm", "corrupt", "diskfull", "peer", "local_wipe", "slow_persistent",
                 "host_down")
MULTI_PROCESS_KINDS = ("peer", "host_down")  # need a job of several processes
TIER_KINDS = ("local_wipe", "slow_persistent")  # need a job with a local checkpoint tier
SLOW_PERSISTENT_MB_S = 1.0  # the throttled persistent tier of slow_persistent faults
ANOMALY_KINDS = ("nan", "spike")
HOT_KINDS = ("hotlr",)
STOPPED_BY_SIGTERM = ("sigterm", "corrupt")
KINDS = PROCESS_KINDS + ANOMALY_KINDS + HOT_KINDS
HOT_LR_SCALE = 0.5  # what a hotlr change multiplies the LR scale by
# The loop injects at most one non-finite loss and one spike per run (one debug.inject_*_at_step each).
MAX_PER_RUN = {"nan": 1, "spike": 1}


class FaultSpecError(ValueError):
    """A bad `--faults` spec; the message names the bad entry."""


def parse_faults(spec: str) -> dict[str, int]:
    """`"kill9:20,sigterm:2"` -> {"kill9": 20, "sigterm": 2}, in the order given; a kind may appear once."""
    counts: dict[str, int] = {}
    for entry in spec.split(","):
        entry = entry.strip()
        kind, sep, count = entry.partition(":")
        if not sep:
            raise FaultSpecError(f"--faults: {entry!r} is not kind:count")
        if kind not in KINDS:
            raise FaultSpecError(f"--faults: {entry!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not count.isdigit() or int(count) < 1:
            raise FaultSpecError(f"--faults: {entry!r}: count must be a positive integer")
        if kind in counts:
            raise FaultSpecError(f"--faults: {entry!r}: {kind} given twice")
        if int(count) > MAX_PER_RUN.get(kind, int(count)):
            raise FaultSpecError(f"--faults: {entry!r}: the job injects at most {MAX_PER_RUN[kind]} {kind} per run")
        counts[kind] = int(count)
    return counts


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: its kind, the step after whose logged loss it lands, and its random draws.

    `delay`: the fraction of a step time waited after that (process faults). `damage` and `pick` (corrupt): delete
    or truncate the file at fraction `pick` of the sorted manifest, keeping a fraction `pick` of its bytes;
    `pick` (peer, host_down): the process killed is the one at fraction `pick` of the job's processes."""

    index: int
    kind: str
    step: int
    delay: float = 0.0
    damage: str = ""
    pick: float = 0.0


def schedule(counts: dict[str, int], seed: int, steps: int, every: int, min_history: int,
             stop_every: int = 1) -> list[Fault]:
    """The faults of `counts` on a run of `steps` steps saved every `every`, drawn from `seed`: process faults
    sorted by step, then the anomaly faults at distinct steps after the first checkpoint (so that each one
    rolls back and is counted in the checkpoints' rollbacks, see `anomaly_flags`) and not where their rollback
    would find another checkpoint than the reference's (`_rollbacks_past_a_stop`), a spike only once
    `min_history` healthy steps are known, then the hot updates (drawn last, so that adding them leaves the
    other faults of a seed where they were). `stop_every`: a SIGTERM stops the job at the next multiple of it (a
    multi-process job's processes agree every jaxllm.runtime.preemption.CHECK_EVERY steps): sigterm and corrupt faults
    land early enough for the job to stop before its last step."""
    rng = random.Random(seed)
    last = steps - 2  # the job must still be running when the fault lands (one step later at most)
    # the signal may reach the job just after a multiple's check: two multiples before the last step
    last_stop = ((steps - 1) // stop_every - 1) * stop_every - 1 if stop_every > 1 else last
    lows = {"nan": every + 1, "spike": max(every + 1, min_history + 2)}
    for kind in counts:
        low, high = lows.get(kind, 1), last_stop if kind in STOPPED_BY_SIGTERM else last
        if high < low:
            raise FaultSpecError(f"--faults: {kind} needs more than {steps} train.steps")
    process = []
    for kind in PROCESS_KINDS:
        for _ in range(counts.get(kind, 0)):
            high = last_stop if kind in STOPPED_BY_SIGTERM else last
            process.append((rng.randint(1, high), kind, rng.random(), rng.choice(("truncate", "delete")),
                            rng.random()))
    process.sort(key=lambda draw: draw[0])
    faults = [Fault(i, kind, step, delay, damage if kind == "corrupt" else "",
                    pick if kind in ("corrupt", *MULTI_PROCESS_KINDS) else 0.0)
              for i, (step, kind, delay, damage, pick) in enumerate(process)]
    taken = set(_rollbacks_past_a_stop(faults, every, stop_every, last))
    for kind in ANOMALY_KINDS:
        for _ in range(counts.get(kind, 0)):
            choices = [s for s in range(lows[kind], last + 1) if s not in taken]
            if not choices:
                raise FaultSpecError(f"--faults: no step of {steps} train.steps is left for {kind} (each anomaly "
                                     f"needs its own, away from the sigterm and corrupt stops)")
            step = rng.choice(choices)
            taken.add(step)
            faults.append(Fault(len(faults), kind, step))
    for _ in range(counts.get("hotlr", 0)):
        faults.append(Fault(len(faults), "hotlr", rng.randint(1, last)))
    return faults


def _rollbacks_past_a_stop(faults: list[Fault], every: int, stop_every: int, last: int) -> list[int]:
    """The steps an anomaly must not land on: those whose rollback could find other checkpoints than the
    reference's. The reference run, never stopped, rolls an anomaly at step s back to the checkpoint of step
    every * floor((s - 1) / every); a drilled job stopped by SIGTERM in between also holds the checkpoint of the
    step it stopped at (a few steps after the fault's, a multiple of `stop_every`), so it rolls back to that one
    and skips other data. A `corrupt` fault's stop checkpoint is quarantined, but when the stop fell on a
    periodic step that checkpoint is gone too: its window is banned alike."""
    banned = []
    for fault in faults:
        if fault.kind not in STOPPED_BY_SIGTERM:
            continue
        saved_by = fault.step + 2 * stop_every + 1  # the latest step the stop can save (seen: 2 after it)
        banned += [s for s in range(fault.step + 1, last + 1) if every * ((s - 1) // every) <= saved_by]
    return banned


def hot_change_id(fault: Fault) -> str:
    """The control.json id of a hotlr fault."""
    return f"drill-{fault.kind}-{fault.index}"


def hot_changes(faults: list[Fault]) -> list[dict]:
    """The control.json changes of the plan's hot updates (jaxllm/train/control.py's format), for the drilled
    job and its reference alike."""
    return [{"id": hot_change_id(f), "lr_scale": HOT_LR_SCALE, "at_step": f.step}
            for f in faults if f.kind in HOT_KINDS]


def anomaly_flags(faults: list[Fault], resume_step: int, rollbacks: int) -> list[str]:
    """The `--config.debug.inject_*_at_step` flags of a start that resumes `resume_step` (0: a fresh start),
    whose checkpoint records `rollbacks` rollbacks.

    The reference run fires every anomaly once. A checkpoint saved after the j-th anomaly's rollback records j
    rollbacks, so a start injects exactly the anomalies its checkpoint has not seen yet that lie ahead of it;
    the rolled-back state and data offset then match the reference's bit for bit.
    """
    anomalies = sorted((f for f in faults if f.kind in ANOMALY_KINDS), key=lambda f: f.step)
    return [f"--config.debug.inject_{f.kind}_at_step={f.step}"
            for j, f in enumerate(anomalies) if j >= rollbacks and f.step > resume_step]
