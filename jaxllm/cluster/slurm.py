"""SLURM's own commands as jaxllm's cluster tools use them: submit a batch script, read a job and the queue back,
signal or cancel a job. Everything goes through SLURM's command-line tools (sbatch, squeue, scontrol, scancel) on
PATH; `SLURM_CONF` in the environment names a cluster other than the machine's own (scripts/launch/local_slurm.sh
prints the one it starts)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Sequence

# States a job does not leave by itself (a requeued job goes back to PENDING first).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", "GONE"})


class SlurmError(Exception):
    """A SLURM command refused or failed: one line, SLURM's own reason."""


def _run(command: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} not found: SLURM's client commands are not installed on this machine")
    return subprocess.run(list(command), input=stdin, capture_output=True, text=True, timeout=60)


def _reason(proc: subprocess.CompletedProcess) -> str:
    """The last line SLURM printed on a failure, without its `sbatch: error:` prefix."""
    lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit code {proc.returncode}"
    return re.sub(r"^\w+: error: (Batch job submission failed: )?", "", last).strip()


def sbatch(script: str, options: Sequence[str] = ()) -> str:
    """Submit the batch script `script` (its text) with extra sbatch `options` (they override its #SBATCH lines);
    returns the job id. A job SLURM refuses (one that can never fit, an unknown partition) raises SlurmError."""
    proc = _run(["sbatch", "--parsable", *options], stdin=script)
    if proc.returncode:
        raise SlurmError(_reason(proc))
    return proc.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str] | None:
    """`scontrol show job`'s fields of `job_id` (JobState, Reason, RestartCnt, StartTime, ExitCode, ...), or None
    once SLURM no longer knows the job (MinJobAge after it ended)."""
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if proc.returncode:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(_reason(proc))
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def state(job_id: str) -> str:
    """The job's state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; GONE once SLURM forgot it)."""
    info = job(job_id)
    return "GONE" if info is None else info["JobState"]


def wait(job_ids: Sequence[str], timeout: float, poll_s: float = 2.0, until=FINAL_STATES,
         on_end=lambda job_id, info: None) -> dict[str, str]:
    """Poll until every job's state is in `until` (by default a final one); their states. Each job's fields are
    handed to `on_end(job_id, info)` when first seen there (SLURM forgets ended jobs after MinJobAge). A requeued
    job is waited for through its restart. SlurmError on `timeout` seconds, naming the jobs still going."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while True:
        for job_id in job_ids:
            if states.get(job_id) in until:
                continue
            info = job(job_id) or {"JobState": "GONE"}
            states[job_id] = info["JobState"]
            if states[job_id] in until:
                on_end(job_id, info)
        if all(s in until for s in states.values()):
            return states
        if time.monotonic() > deadline:
            going = {j: s for j, s in states.items() if s not in until}
            raise SlurmError(f"jobs still not done after {timeout:.0f} s: {going}")
        time.sleep(poll_s)


def cancel(job_id: str, signal: str | None = None) -> None:
    """Cancel the job, or with `signal` (e.g. "TERM") only signal its tasks: jaxllm's training then saves, exits,
    and its batch script requeues it."""
    proc = _run(["scancel", *([f"--signal={signal}"] if signal else []), str(job_id)])
    if proc.returncode:
        raise SlurmError(_reason(proc))


def partition_tiers() -> dict[str, int]:
    """Each partition's PriorityTier: SLURM considers pending jobs of a higher tier first."""
    proc = _run(["scontrol", "show", "partition", "-o"])
    if proc.returncode:
        raise SlurmError(_reason(proc))
    tiers = {}
    for line in proc.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" in fields:
            tiers[fields["PartitionName"]] = int(fields.get("PriorityTier", "1"))
    return tiers


def partition_nodes(partition: str) -> list[tuple[int, int, int]]:
    """(nodes, CPUs a node, GPUs a node) of each kind of node in `partition` (sinfo); empty if there is no such
    partition."""
    proc = _run(["sinfo", "-h", "-p", partition, "-o", "%D|%c|%G"])
    if proc.returncode:
        raise SlurmError(_reason(proc))
    kinds = []
    for line in proc.stdout.split():
        count, cpus, gres = line.split("|")
        gpus = re.search(r"gpu(?::[\w-]+)?:(\d+)", gres)
        kinds.append((int(count), int(cpus.rstrip("+")), int(gpus.group(1)) if gpus else 0))
    return kinds


QUEUE_FIELDS = ("job_id", "name", "partition", "state", "reason", "priority", "submit_time", "start_time")


def queue() -> list[dict]:
    """The jobs SLURM holds, in the order it will consider them: running ones first, then pending ones by partition
    tier, priority and submission (what the main scheduler does without accounting storage). A pending job's
    `position` counts from 1."""
    proc = _run(["squeue", "-h", "-o", "%i|%j|%P|%T|%r|%Q|%V|%S"])
    if proc.returncode:
        raise SlurmError(_reason(proc))
    rows = [dict(zip(QUEUE_FIELDS, line.split("|"))) for line in proc.stdout.splitlines() if line.strip()]
    tiers = partition_tiers()
    running = [r for r in rows if r["state"] != "PENDING"]
    pending = sorted((r for r in rows if r["state"] == "PENDING"),
                     key=lambda r: (-tiers.get(r["partition"], 1), -int(r["priority"] or 0), r["submit_time"]))
    for position, row in enumerate(pending, 1):
        row["position"] = position
    return running + pending
