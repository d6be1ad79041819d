"""Fault drills: a real training job (scripts/train.py subprocesses, real orbax checkpoints) hit by faults at
moments drawn from a seed, restarted after each the way an operator or SLURM `--requeue` would, and checked
against an uninterrupted reference run bit for bit.

`plan` parses `--faults` and draws the schedule, `job` runs and watches one process of the job, `damage`
corrupts a checkpoint, `disk` puts the checkpoints on a small filesystem (diskfull), `supervisor` lands the
faults and restarts the job, `report` compares with the reference and prints the table and the JSON line, `run`
ties them together. `scripts/drill.py` is the entry point.
"""
