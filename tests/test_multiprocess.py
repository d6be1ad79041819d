"""Multi-process training on localhost: real `scripts/train.py` processes (2 x 4 CPU devices, gloo collectives)
against one process with 8 devices, cross-process-count checkpoints, and start-up / peer-death failures."""

import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from train_runs import ROOT, TINY, free_port_pair, losses, metrics, run_drill, train_command, train_env

from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import MeshConfig, OptimConfig, validate
from jaxllm.drill.plan import hot_changes, parse_faults, schedule
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import learning_rate_schedule, make_optimizer
from jaxllm.runtime.preemption import CHECK_EVERY
from jaxllm.train.control import write_control
from jaxllm.objectives.pretrain import abstract_train_state

STEPS = 8  # the drill's peer fault lands on steps 1..6 and the job still has steps to run
RUN = ("--config.train.eval_every=1000", "--config.optim.warmup_steps=2", "--config.checkpoint.every=2",
       f"--config.train.steps={STEPS}")
# The drill of the killed-peer test, and its hot update (an LR change at a drawn step) that the 2-process run,
# its reference, and the 1-process run it is compared with get in their control.json before they start.
# Seed 5 kills process 1 at step 5 and halves the LR at step 6 (the restart resumes step 4: it must apply the
# change at step 6 again).
DRILL_FAULTS, DRILL_SEED = "peer:1,hotlr:1", 5
HOT = hot_changes(schedule(parse_faults(DRILL_FAULTS), DRILL_SEED, STEPS, 2, 20, CHECK_EVERY))


def launch(store, workdir, *args, processes=2, how="flags", extra_env=None):
    """Start `processes` training processes (4 devices each when several) on one workdir; logs go beside it."""
    port = free_port_pair()
    procs = []
    for i in range(processes):
        cmd = train_command(store, workdir, *RUN, *args)
        env = train_env(4 if processes > 1 else 8, **(extra_env or {}))
        if processes > 1 and how == "flags":
            cmd += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes),
                    "--process_id", str(i)]
        elif processes > 1 and how == "env":
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(i))
        elif processes > 1 and how == "slurm":  # what srun sets for one task per node on two nodes
            env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS=str(processes),
                       SLURM_STEP_NUM_NODES=str(processes), SLURM_PROCID=str(i), SLURM_LOCALID="0",
                       JAX_COORDINATOR_PORT=str(port))
        log = open(Path(f"{workdir}.p{i}.log"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True))
        log.close()
    return procs


def finish(procs, workdir, timeout=600) -> list[str]:
    """Wait for every process; their logs (asserting each exited 0)."""
    for p in procs:
        p.wait(timeout=timeout)
    logs = [Path(f"{workdir}.p{i}.log").read_text() for i in range(len(procs))]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs


@pytest.fixture(scope="module")
def lone_processes(shakespeare_store, tmp_path_factory):
    """Process 0 of 2 alone, and (on another port) process 1 of 2 alone, with --init_timeout=20.

    They spend their time waiting for a peer, so they are started first and wait while the other runs of this
    module work. Returns a function giving, per process, (process, stdout, stderr, seconds from start to exit).
    """
    base = tmp_path_factory.mktemp("lone")
    results: dict[int, tuple] = {}

    def run(alone: int) -> None:
        start = time.monotonic()
        cmd = train_command(shakespeare_store, base / f"w{alone}", "--coordinator_address",
                            f"127.0.0.1:{free_port_pair()}", "--num_processes", "2", "--process_id", str(alone),
                            "--init_timeout", "20")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(4))
        out, err = proc.communicate(timeout=180)
        results[alone] = (proc, out, err, time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(alone,), daemon=True) for alone in (0, 1)]
    for t in threads:
        t.start()

    def collect():
        for t in threads:
            t.join(timeout=200)
        assert sorted(results) == [0, 1], "a lone process did not finish"
        return [results[0], results[1]]

    return collect


@pytest.fixture(scope="module")
def runs(shakespeare_store, tmp_path_factory, lone_processes):
    """The same 8-step run twice from scratch, each with the drill's hot update in its control.json: 1 process
    x 8 devices and 2 processes x 4 devices."""
    base = tmp_path_factory.mktemp("mp")
    one, two = base / "one", base / "two"
    for workdir in (one, two):
        workdir.mkdir()
        write_control(workdir, HOT)
    logs_one = finish(launch(shakespeare_store, one, processes=1), one)
    # Launched the way SLURM does it (JAX detects the cluster from SLURM_* variables); the drill's peer test
    # launches with flags, the resume test with JAX_* variables.
    logs_two = finish(launch(shakespeare_store, two, processes=2, how="slurm"), two)
    return dict(one=one, two=two, logs_one=logs_one, logs_two=logs_two, base=base)


def test_two_processes_train_like_one(runs):
    one, two = losses(runs["one"]), losses(runs["two"])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))  # each step written once: by process 0 only
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5)
    evals_one = [r["eval_loss"] for r in metrics(runs["one"]) if "eval_loss" in r]
    evals_two = [r["eval_loss"] for r in metrics(runs["two"]) if "eval_loss" in r]
    np.testing.assert_allclose(evals_two, evals_one, rtol=1e-5)
    log0, log1 = runs["logs_two"]
    assert "process 0 of 2: 4 local devices, reading batch rows block 0 of 2" in log0
    assert "process 1 of 2: 4 local devices, reading batch rows block 1 of 2" in log1
    assert "process 0 of 1: 8 local devices, reading batch rows block 0 of 1" in runs["logs_one"][0]
    assert "held-out loss" in log0 and "held-out loss" not in log1  # progress is logged by process 0 only
    # The hot update, read by process 0 from control.json at the first step and shared: both processes apply it
    # at its step (each says so in its own log), and the LR of every later step is halved.
    (change,) = HOT
    applied = f"step {change['at_step']}: hot update {change['id']} applied: lr_scale 1 -> 0.5"
    assert log0.count("hot update") == log1.count("hot update") == 1, (log0[-3000:], log1[-3000:])
    assert applied in log0 and f"process 1: {applied}" in log1
    incidents = [json.loads(line) for line in (runs["two"] / "incidents.jsonl").read_text().splitlines()]
    assert [(r["action"], r["id"], r["step"]) for r in incidents if r["kind"] == "hot_update"] == [
        ("applied", change["id"], change["at_step"])]
    schedule_ = learning_rate_schedule(OptimConfig(**json.loads((runs["two"] / "config.json").read_text())["optim"]),
                                       STEPS)
    for record in (r for r in metrics(runs["two"]) if "lr" in r):
        scale = 0.5 if record["step"] > change["at_step"] else 1.0
        assert record["lr"] == pytest.approx(float(schedule_(record["step"] - 1)) * scale, rel=1e-6), record


def _restored_params(workdir, step, mesh):
    _, overrides = split_overrides([*TINY, *RUN])
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), overrides), 8)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract = abstract_train_state(cfg.model, cfg.precision, tx, cfg.anomaly.window)
    ckpt = Checkpointer(Path(workdir) / "checkpoints")
    try:
        state = ckpt.restore(step, abstract, mesh, items=("state",))["state"]
    finally:
        ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def test_checkpoint_written_by_two_processes_restores_in_one(runs):
    mesh = make_mesh(MeshConfig(8, 1, 1, 1))  # another layout than the writers' (2, 2, 2, 1) too
    from_two, from_one = _restored_params(runs["two"], STEPS, mesh), _restored_params(runs["one"], STEPS, mesh)
    assert len(from_two) == len(from_one) > 0
    for a, b in zip(from_two, from_one):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _wait_for_losses(workdir, count, procs, timeout=300):
    deadline = time.monotonic() + timeout
    while not ((workdir / "metrics.jsonl").exists() and len(losses(workdir)) >= count):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            Path(f"{workdir}.p0.log").read_text()[-3000:]
        time.sleep(0.2)


def test_checkpoint_written_by_one_process_resumes_in_two_and_sigterm_stops_both(runs, shakespeare_store):
    workdir = runs["base"] / "one_then_two"
    shutil.copytree(runs["one"] / "checkpoints", workdir / "checkpoints")
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))  # resume from step STEPS - 2
    procs = launch(shakespeare_store, workdir, "--config.train.steps=2000", processes=2, how="env")
    _wait_for_losses(workdir, 2, procs)
    # A preemption notice to one process only (say, one pod evicted): both must save the same step and exit 0.
    procs[1].send_signal(signal.SIGTERM)
    logs = finish(procs, workdir, timeout=300)
    resumed = STEPS - 2
    assert f"resuming from checkpoint step {resumed}" in logs[0]
    # The next step's loss is computed from the restored parameters (before any update under this run's longer
    # schedule).
    np.testing.assert_allclose(losses(workdir)[resumed + 1], losses(runs["one"])[resumed + 1], rtol=1e-5)
    stopped = int(logs[0].split("preempted: saved step ")[1].split(",")[0])
    assert stopped % 10 == 0 and stopped < 2000  # processes agree on stopping every 10 steps
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    assert max(losses(workdir)) == stopped


def test_missing_process_times_out_naming_it(lone_processes):
    results = lone_processes()
    for alone, (proc, _, err, elapsed) in enumerate(results):
        assert elapsed < 60, (alone, elapsed)
        assert proc.returncode == 1, err[-2000:]
        assert "Traceback" not in err
    (_, _, err0, _), (_, _, err1, _) = results
    assert "error: process 0: process 1 of 2 did not arrive within 20s" in err0, err0[-2000:]
    assert "error: process 1: process 0 (the coordinator" in err1 and "did not arrive within 20s" in err1, err1[-2000:]


def test_killed_peer_stops_the_survivor_and_the_job_resumes_bitwise(runs, shakespeare_store, tmp_path):
    """The drill's peer fault (scripts/drill.py): one process of the 2-process job SIGKILLed at a random moment;
    the survivor stops on its own, naming the dead process in its log, and the restarted job ends on the
    uninterrupted 2-process run's parameters and losses bit for bit. The drill's hot update (an LR change at its
    step, in the reference too) is applied at that step by every start that reaches it without it."""
    result = run_drill(shakespeare_store, runs["two"], tmp_path / "drill", DRILL_FAULTS, *RUN, seed=DRILL_SEED)
    peer, hot = result["events"]
    assert peer["recovered"] and result["bitwise_equal"] and result["losses_equal"] and result["starts"] == 2
    victim, survived_s = re.search(r"killed process (\d) of 2; the others exited \[-?[1-9]\d*\] after ([\d.]+)s",
                                   peer["detail"]).groups()
    assert float(survived_s) < 60, peer
    survivor_log = tmp_path / "drill" / "logs" / ("start-1.log" if victim == "1" else "start-1.p1.log")
    named = ("jaxllm: process 1 of 2 stopped responding" if victim == "1" else
             "jaxllm: process 0 (the coordinator) is unreachable")
    assert named in survivor_log.read_text(), survivor_log.read_text()[-3000:]
    (change,) = HOT
    assert hot["kind"] == "hotlr" and hot["recovered"] and hot["step"] == change["at_step"], hot
    assert hot["detail"].startswith(f"lr_scale x0.5 at step {change['at_step']}: applied at steps "
                                    f"[{change['at_step']}"), hot
