"""Cluster operations on a real SLURM (tests/conftest.py's `slurm_cluster`: one node, 8 CPUs, partitions low < normal
< high by PriorityTier): the shipped batch script as a 2-task job against one process, preemption by signal with
requeue and bitwise resume, priority order and refusals of scripts/submit.py, a dependent pipeline chain and a
sweep. Every job is a real `sbatch` of scripts/launch/slurm.sbatch running scripts/train.py."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from train_runs import RESUME, ROOT, TINY, losses, run_drill, train_env

from jaxllm.cluster import slurm

SUBMIT = [sys.executable, str(ROOT / "scripts" / "submit.py")]
TWO_TASKS = ["--tasks_per_node", "2", "--cpu_devices", "4"]  # one node, 2 processes x 4 CPU devices: all 8 CPUs
JOB_TIMEOUT = 300


def submit(store, workdir, *args: str) -> str:
    """scripts/submit.py of the tiny resume job (tests/train_runs.py's RESUME, 8 steps) as 2 tasks; its job id."""
    proc = subprocess.run([*SUBMIT, "--config", str(ROOT / "configs" / "pretrain.py"), "--workdir", str(workdir),
                           "--log_dir", str(Path(workdir).parent / "logs"), "--name", Path(workdir).name, *TWO_TASKS,
                           f"--config.data.path={store}", *TINY, *RESUME, "--config.train.steps=8", *args],
                          capture_output=True, text=True, env=train_env(4), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def job_log(workdir, job_id) -> str:
    return (Path(workdir).parent / "logs" / f"{Path(workdir).name}-{job_id}.out").read_text()


def finished(workdir, job_id) -> str:
    """Wait for the job to end; its log (asserting it completed)."""
    states = slurm.wait([job_id], timeout=JOB_TIMEOUT)
    log = job_log(workdir, job_id)
    assert states[job_id] == "COMPLETED", (states, log[-3000:])
    return log


@pytest.fixture(scope="module")
def two_task_job(slurm_cluster, shakespeare_store, tmp_path_factory):
    """The resume tests' 8-step job as one sbatch job of 2 tasks on the local cluster."""
    workdir = tmp_path_factory.mktemp("slurm") / "two"
    job_id = submit(shakespeare_store, workdir)
    return workdir, finished(workdir, job_id)


def test_two_task_batch_job_trains_like_one_process(two_task_job, uninterrupted):
    workdir, log = two_task_job
    one, two = losses(uninterrupted), losses(workdir)
    assert sorted(two) == sorted(one) == list(range(1, 9))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5)
    # Two JAX processes of 4 CPU devices, joined from SLURM's variables (no coordinator flags in the script).
    assert "process 0 of 2: 4 local devices, reading batch rows block 0 of 2" in log
    assert "process 1 of 2: 4 local devices, reading batch rows block 1 of 2" in log


def test_a_lost_host_shrinks_the_job_onto_the_survivor_and_it_grows_back(two_task_job, shakespeare_store, tmp_path):
    """Elastic recovery (elastic.wait_s) under SLURM: the drill's agent runs each start as one `srun` of the job's
    tasks. It kills one task of the 2-task job at step 5 and keeps its host down longer than the job waits for it,
    so the job restarts as 1 task of 4 devices: the mesh's data axis halved and gradient accumulation doubled. The
    host comes back during that start, and at the next checkpoint the job grows back to 2 tasks. It ends within
    1e-5 relative of the uninterrupted 2-task job (the reductions ran in another order), every step's data seen
    once, in order. Its checkpoints go through a local tier both tasks share (task 0 copies them on)."""
    reference, _ = two_task_job
    result = run_drill(shakespeare_store, reference, tmp_path / "drill", "host_down:1", *RESUME,
                       "--config.train.steps=8", "--config.elastic.wait_s=1", "--host_down_s=3", "--launcher=slurm",
                       f"--config.checkpoint.local_dir={tmp_path}/local", seed=5)
    (lost,) = result["events"]
    # 3 starts (2 tasks, 1, 2 again), plus one per unplanned exit: JAX's coordination service has been seen to
    # abort in its teardown after the last step (a gRPC check at exit), which the drill restarts like any crash.
    assert lost["recovered"] and lost["step"] == 5 and result["starts"] - len(result["unplanned_exits"]) == 3, lost
    assert "restarted on 1 of 2 processes" in lost["detail"] and "grew back to 2 processes" in lost["detail"], lost
    logs = tmp_path / "drill" / "logs"
    assert "process 1 of 2: 4 local devices" in (logs / "start-1.p1.log").read_text()  # joined from SLURM's variables
    shrunk = (logs / "start-2.log").read_text()
    assert "elastic: 4 devices of the mesh's 8: mesh 2x2x1x1x2x1 -> 1x2x1x1x2x1" in shrunk, shrunk[-3000:]
    assert "optim.grad_accum 1 -> 2 (global batch" in shrunk and "checkpoints on two tiers" in shrunk
    assert result["max_relative_difference"] <= 1e-5 and result["losses_equal"] and result["passed"]
    assert result["data_indices"] == 8 and result["data_seen_twice"] == 0 and result["data_in_order"]
    assert result["data_offsets"] == [0]
    persistent = sorted(int(p.name) for p in (tmp_path / "drill" / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert persistent[-1] == 8


def test_signalled_job_saves_requeues_and_resumes_bitwise(two_task_job, shakespeare_store):
    reference, _ = two_task_job
    workdir = reference.parent / "preempted"
    job_id = submit(shakespeare_store, workdir, "--config.debug.hold_at_step=4")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not ((workdir / "metrics.jsonl").exists() and 4 in losses(workdir)):
        assert time.monotonic() < deadline and slurm.state(job_id) in ("PENDING", "RUNNING"), slurm.job(job_id)
        time.sleep(0.5)
    slurm.cancel(job_id, signal="TERM")  # what SLURM's preemption or the time-limit signal does to the tasks
    log = finished(workdir, job_id)
    assert slurm.job(job_id)["Restarts"] == "1", slurm.job(job_id)
    assert "preempted: saved step 4, exiting" in log and "training saved and stopped on a signal: requeueing" in log
    assert "(restart 1)" in log and "resuming from checkpoint step 4" in log
    resumed, uninterrupted = losses(workdir), losses(reference)
    assert resumed == uninterrupted  # bitwise: the same 2-process job, stopped and requeued at step 4


def _submit_status() -> str:
    proc = subprocess.run([*SUBMIT, "--status"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("priority_by", ["partition", "nice"])
def test_high_priority_job_submitted_last_starts_first(slurm_cluster, shakespeare_store, tmp_path, priority_by):
    blocker = slurm.sbatch("#!/bin/bash\nsleep 600\n", ["--cpus-per-task=8", "--output=/dev/null",
                                                         "--job-name=blocker"])
    jobs = []
    try:
        slurm.wait([blocker], timeout=60, until={"RUNNING"})  # the node's 8 CPUs are taken
        how = ["--priority_by", priority_by, "--partition", "normal"]
        for priority in ("low", "high"):
            jobs.append(submit(shakespeare_store, tmp_path / priority, "--priority", priority, *how))
        low, high = jobs
        # The columns end "position start" (one word each); a pending job's reason may be several words
        # ("Nodes required for job" while a job of a higher partition waits).
        positions = {line.split()[0]: line.split()[-2] for line in _submit_status().splitlines()[1:]}
        assert (positions[high], positions[low]) == ("1", "2"), _submit_status()
        slurm.cancel(blocker)
        slurm.wait([high], timeout=60, until={"RUNNING"})
        assert slurm.state(low) == "PENDING"  # the node has room for one of them: the later, higher one got it
        assert slurm.job(low)["Reason"] in ("Resources", "Priority"), slurm.job(low)
    finally:
        for job_id in (blocker, *jobs):
            slurm.cancel(job_id)


@pytest.mark.parametrize("args, reason", [
    (["--nodes", "2"], "it needs 2 node(s) with 8 CPUs and 0 GPUs each; partition 'normal' has 1 such node(s)"),
    (["--cpu_devices", "16"], "it needs 1 node(s) with 32 CPUs"),
    (["--priority_by", "nice", "--partition", "nowhere"], "no partition 'nowhere'"),
])
def test_job_that_can_never_run_is_refused_at_submission(slurm_cluster, shakespeare_store, tmp_path, args, reason):
    before = slurm.queue()
    proc = subprocess.run([*SUBMIT, "--config", str(ROOT / "configs" / "pretrain.py"), "--workdir",
                           str(tmp_path / "w"), *TWO_TASKS, f"--config.data.path={shakespeare_store}", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: the job can never run (") and reason in line, line
    assert {r["job_id"] for r in slurm.queue()} <= {r["job_id"] for r in before}  # nothing was submitted


def test_pipeline_chain_runs_as_dependent_jobs_and_reports_like_the_local_one(slurm_cluster, tmp_path, capsys):
    out = tmp_path / "chain"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pipeline.py"), "--launcher", "slurm", "--until",
                           "pretrain", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, env=train_env(8), timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    jobs = dict(pair.split() for pair in proc.stdout.split("submitted: ")[1].splitlines()[0].split(", "))
    prepare, pretrain = (slurm.job(jobs[name]) for name in ("prepare", "pretrain"))
    assert prepare["JobState"] == pretrain["JobState"] == "COMPLETED"
    assert pretrain["StartTime"] >= prepare["EndTime"]  # in order (that afterok holds: the next test)
    rows = __import__("json").loads((out / "pipeline.json").read_text())
    summary = __import__("json").loads((out / "pretrain" / "summary.json").read_text())
    assert [r["stage"] for r in rows] == ["prepare", "pretrain"]
    assert rows[1]["result"] == (f"held-out loss {summary['initial_eval_loss']:.3f} -> "
                                 f"{summary['final_eval_loss']:.3f}")
    # The table is the local launcher's (scripts/pipeline.py prints both with one function).
    pipeline = __import__("runpy").run_path(str(ROOT / "scripts" / "pipeline.py"))
    capsys.readouterr()
    pipeline["print_table"](rows)
    assert proc.stdout.endswith(capsys.readouterr().out)


def test_failed_stage_cancels_the_rest_of_the_chain(slurm_cluster, tmp_path):
    out = tmp_path / "chain"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pipeline.py"), "--launcher", "slurm", "--until",
                           "sft", "--out", str(out), "--corpus", str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True, env=train_env(8), timeout=JOB_TIMEOUT)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: stage prepare failed (job ") and "exit code 2" in line, line
    assert line.endswith("later stages: pretrain CANCELLED, sft CANCELLED"), line
    assert not (out / "pretrain").exists() and not (out / "pipeline.json").exists()


SWEEP_SPACE = '[params."optim.lr"]\nlow = 3e-3\nhigh = 1e-2\nlog = true\n'
# Trials of one process on one CPU device each (a mesh of 1), evaluated every 2 of their 8 steps.
TRIAL = (*TINY, "--config.train.steps=8", "--config.train.eval_every=2", "--config.checkpoint.every=2",
         "--config.optim.warmup_steps=2", "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=1")


def test_sweep_prunes_a_planted_trial_resumes_after_its_worker_is_killed_and_its_best_config_reproduces(
        slurm_cluster, shakespeare_store, tmp_path):
    import json

    import optuna

    (tmp_path / "space.toml").write_text(SWEEP_SPACE)
    study = tmp_path / "study"

    def sweep(trials: int, *args: str) -> list[str]:
        return [sys.executable, str(ROOT / "scripts" / "sweep.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
                "--space", str(tmp_path / "space.toml"), "--study", str(study), "--trials", str(trials),
                "--sampler", "random", "--launcher", "slurm", "--cpu_devices", "1", "--heartbeat_s", "1",
                "--poll_s", "0.5", "--prune_startup", "2", f"--config.data.path={shakespeare_store}", *TRIAL, *args]

    first = subprocess.run(sweep(2, "--parallel", "2"), capture_output=True, text=True, env=train_env(1),
                           timeout=JOB_TIMEOUT)
    assert first.returncode == 0, (first.stdout[-2000:], first.stderr[-3000:])
    # Grown to 4 with a planted learning rate 300x the space's top, pruned at its first held-out loss, then the
    # space's top (ahead of the median: never pruned here). The worker is killed as soon as it submitted that trial.
    worker = subprocess.Popen(sweep(4, "--enqueue", "optim.lr=3.0", "--enqueue", "optim.lr=0.01"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(1))
    lines = []
    while not lines or not lines[-1].startswith("trial 3 started"):
        lines.append(worker.stdout.readline())
        assert lines[-1], (lines, worker.stderr.read()[-3000:])
    worker.kill()
    worker.wait()
    assert lines[-2].startswith("trial 2 pruned at step 2") and "{'optim.lr': 3.0}" in lines[-2], lines
    resumed = subprocess.run(sweep(4), capture_output=True, text=True, env=train_env(1), timeout=JOB_TIMEOUT)
    assert resumed.returncode == 0, (resumed.stdout[-2000:], resumed.stderr[-3000:])
    # The killed worker's trial went stale and was queued again: trial 4 followed its job (running, or done by
    # then) instead of submitting another, and the run trained each step once.
    assert f"trial 4 started: {{'optim.lr': 0.01}} in {study / 'trials' / '0003'}" in resumed.stdout, resumed.stdout
    trials = optuna.load_study(study_name="sweep", storage=f"sqlite:///{study / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL", "COMPLETE"]
    assert trials[4].params == trials[3].params and trials[4].user_attrs == trials[3].user_attrs  # workdir, job
    steps = [r["step"] for r in map(json.loads, (study / "trials" / "0003" / "metrics.jsonl").read_text().split("\n")
                                    [:-1]) if "loss" in r]
    assert steps == list(range(1, 9)), steps
    assert trials[4].value == json.loads((study / "trials" / "0003" / "summary.json").read_text())["final_eval_loss"]
    # Results: the table, the plots, and the best trial as a config file that reproduces its held-out loss.
    table = (study / "trials.csv").read_text().splitlines()
    assert table[0] == "trial,state,--config.optim.lr,held_out_loss,steps,pruned" and len(table) == 6
    assert (study / "importance.png").stat().st_size > 0 and (study / "history.png").stat().st_size > 0
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config",
                           str(study / "best_config.py"), "--workdir", str(tmp_path / "best")],
                          capture_output=True, text=True, env=train_env(1), timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reproduced = json.loads((tmp_path / "best" / "summary.json").read_text())["final_eval_loss"]
    assert reproduced == pytest.approx(best.value, rel=1e-6, abs=0)


def test_sweep_workers_submitted_as_a_job_array_share_one_study(slurm_cluster, shakespeare_store, tmp_path):
    import optuna

    (tmp_path / "space.toml").write_text(SWEEP_SPACE)
    study = tmp_path / "study"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), "--config",
                           str(ROOT / "configs" / "pretrain.py"), "--space", str(tmp_path / "space.toml"), "--study",
                           str(study), "--trials", "2", "--sampler", "random", "--pruner", "none", "--submit_workers",
                           "2", "--cpu_devices", "1", "--poll_s", "0.5", f"--config.data.path={shakespeare_store}",
                           *TRIAL], capture_output=True, text=True, env=train_env(1), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    array = proc.stdout.strip()
    workers = [f"{array}_0", f"{array}_1"]
    assert slurm.wait(workers, timeout=JOB_TIMEOUT) == dict.fromkeys(workers, "COMPLETED")
    trials = optuna.load_study(study_name="sweep", storage=f"sqlite:///{study / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert trials[0].params != trials[1].params  # the workers' samplers are seeded apart
    logs = "".join(p.read_text() for p in sorted((study / "logs").glob("sweep-*.out")))
    assert logs.count("trial 0 started") == logs.count("trial 1 started") == 1, logs[-3000:]
    assert (study / "best_config.py").exists()
