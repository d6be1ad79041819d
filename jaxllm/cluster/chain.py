"""A chain of stages as dependent SLURM jobs (`scripts/pipeline.py --launcher slurm`): each stage one job that
starts only once the one before it completed successfully (`--dependency=afterok`), so a failed stage cancels the
rest (`--kill-on-invalid-dep=yes`) and a preempted training stage requeues and resumes (the shipped batch script).

A stage is a list of commands: one `scripts/train.py` command (a training job through scripts/launch/slurm.sbatch,
on the nodes and devices of the chain's `JobRequest`), or commands that are not training (data preparation), run in
order by a one-task batch script.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path

from jaxllm.cluster import slurm
from jaxllm.cluster.submit import JobRequest, command_script, submit


def _is_training(command: list[str]) -> bool:
    return len(command) > 1 and Path(command[1]).name == "train.py"


def _training_request(name: str, command: list[str], base: JobRequest, after: list[str]) -> JobRequest:
    """`base` running the train command `command`: python scripts/train.py --config C --workdir W args..."""
    if command[2] != "--config" or command[4] != "--workdir":
        raise ValueError(f"stage {name}: expected python scripts/train.py --config C --workdir W ..., got {command}")
    return dataclasses.replace(base, config=command[3], workdir=command[5], train_args=command[6:],
                               name=f"{base.name}-{name}", after=after)


def submit_chain(stages: list[tuple[str, list[list[str]]]], base: JobRequest) -> dict[str, str]:
    """Submit every stage as a job depending on the one before; {stage: job id}, in order."""
    jobs: dict[str, str] = {}
    for name, commands in stages:
        after = list(jobs.values())[-1:]
        training = [c for c in commands if _is_training(c)]
        if training and len(commands) > 1:
            raise ValueError(f"stage {name}: a training stage is one scripts/train.py command")
        if training:
            jobs[name] = submit(_training_request(name, training[0], base, after))
        else:
            request = dataclasses.replace(base, name=f"{base.name}-{name}", after=after)
            jobs[name] = submit(request, command_script(request, commands))
    return jobs


def _seconds(start: str, end: str) -> float:
    try:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:  # "Unknown" or "None": the job never ran
        return 0.0


def wait_chain(jobs: dict[str, str], timeout: float, on_end=lambda name, info: None) -> None:
    """Wait until every stage's job has ended (`slurm.wait`), reporting each to `on_end(stage, info)` with
    scontrol's fields at its end plus wall_s, its last run's start to end."""
    stage = {job_id: name for name, job_id in jobs.items()}

    def ended(job_id: str, info: dict) -> None:
        info["wall_s"] = _seconds(info.get("StartTime", ""), info.get("EndTime", ""))
        on_end(stage[job_id], info)

    slurm.wait(list(jobs.values()), timeout, on_end=ended)
