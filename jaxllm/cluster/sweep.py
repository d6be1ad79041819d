"""Hyperparameter sweeps with optuna (`scripts/sweep.py`): a search space over `--config.*` keys, trials that are
ordinary training runs (local processes or SLURM jobs through the shipped batch script), pruning from the held-out
losses a trial writes to its `metrics.jsonl`, and one study in an SQLite file that several workers share.

Why by hand around optuna rather than `study.optimize`: a trial here is another process (or a SLURM job) that
optuna cannot run; the worker asks optuna for parameters, starts the run, reports its held-out losses as they
appear, stops it when the pruner says so, and tells optuna the outcome (optuna's ask-and-tell interface). Workers
record optuna heartbeats for their trials: a trial whose worker died (killed, its node lost) goes stale, optuna's
RetryHeartbeatStaleTrialCallback queues it again with the same parameters, and the next worker takes it over in the same
run directory, so the training resumes from its checkpoints (or, as a SLURM job that kept running, is waited for
again) instead of starting over.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from jaxllm.cluster import slurm
from jaxllm.cluster.submit import ROOT, JobRequest, command_script, submit
from jaxllm.config.cli import UsageError
from jaxllm.drill.job import JsonlTail

STUDY_NAME = "sweep"
# The worker drives trials by ask-and-tell and records their heartbeats itself, which optuna warns about (it expects
# Study.optimize); its heartbeat and retry parts are marked experimental. Both are used as documented.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")  # --enqueue may go past the space
optuna.logging.set_verbosity(optuna.logging.WARNING)
PRUNERS = ("median", "halving", "none")
SAMPLERS = ("tpe", "random", "grid")


def load_space(path: str) -> dict[str, optuna.distributions.BaseDistribution]:
    """The search space of a TOML file: one table a `--config.*` key under `[params]`, with `choices = [...]`, or
    `low` and `high` (integers: an integer range) and optionally `log = true` or `step`. UsageError names a bad
    entry."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--space: no such file {path}")
    try:
        params = tomllib.loads(file.read_text()).get("params")
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--space: {path} is not TOML: {exc}") from None
    if not isinstance(params, dict) or not params:
        raise UsageError(f"--space: {path} has no [params.\"<config key>\"] tables")
    return {key: _distribution(path, key, spec) for key, spec in params.items()}


def _distribution(path: str, key: str, spec) -> optuna.distributions.BaseDistribution:
    where = f"--space: {path}: params.{key!r}"
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: expected a table with choices, or low and high")
    if "choices" in spec:
        if not isinstance(spec["choices"], list) or not spec["choices"]:
            raise UsageError(f"{where}: choices must be a non-empty list")
        return CategoricalDistribution(spec["choices"])
    unknown = set(spec) - {"low", "high", "log", "step"}
    if unknown or not {"low", "high"} <= set(spec):
        raise UsageError(f"{where}: expected low and high (and optionally log or step), got {sorted(spec)}")
    low, high, log, step = spec["low"], spec["high"], bool(spec.get("log", False)), spec.get("step")
    if not all(isinstance(v, (int, float)) for v in (low, high)) or not low < high:
        raise UsageError(f"{where}: expected numbers low < high, got {low!r}, {high!r}")
    try:
        if isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int)):
            return IntDistribution(low, high, log=log, step=step or 1)
        return FloatDistribution(float(low), float(high), log=log, step=step)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def record_base(study: optuna.Study, config: str, overrides: list[tuple[str, str]]) -> None:
    """A new study records its base config and fixed overrides; a worker joining it must bring the same."""
    if "config" not in study.user_attrs:
        study.set_user_attr("config", config)
        study.set_user_attr("overrides", [list(kv) for kv in overrides])
        return
    theirs = (study.user_attrs["config"], [tuple(kv) for kv in study.user_attrs["overrides"]])
    if theirs != (config, overrides):
        raise UsageError(f"--study: this study sweeps --config {theirs[0]} with {theirs[1]}, not --config {config} "
                         f"with {overrides}: use the same, or another --study")


def parse_enqueue(items: list[str], space: dict) -> list[dict]:
    """--enqueue values, typed by the search space's distributions."""
    out = []
    for item in items:
        params = {}
        for pair in item.split(","):
            key, sep, text = pair.partition("=")
            if not sep or key not in space:
                raise UsageError(f"--enqueue {item}: expected key=value pairs of the search space's keys "
                                 f"{sorted(space)}")
            choices = getattr(space[key], "choices", None)
            value = next((c for c in choices if str(c) == text), None) if choices else _number(text)
            if value is None:
                what = f"one of {list(choices)}" if choices else "a number"
                raise UsageError(f"--enqueue {item}: {key} must be {what}, got {text!r}")
            params[key] = int(value) if isinstance(space[key], IntDistribution) else value
        out.append(params)
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def make_sampler(name: str, space: dict, seed: int) -> optuna.samplers.BaseSampler:
    """TPE (the default), random, or a grid over every combination (each key needs choices or a step)."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    grid = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif dist.step is not None and not dist.log:
            count = round((dist.high - dist.low) / dist.step) + 1
            grid[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise UsageError(f"--sampler grid: params.{key!r} needs choices or a step (it is continuous)")
    return optuna.samplers.GridSampler(grid, seed=seed)


def make_pruner(name: str, startup_trials: int, warmup_steps: int) -> optuna.pruners.BasePruner:
    """median: stop a trial whose held-out loss is worse than the median of earlier trials' at the same step
    (after `startup_trials` finished trials and `warmup_steps`); halving: successive halving over the steps a
    trial has run; none."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_steps)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def open_study(study_dir: Path, sampler=None, pruner=None, heartbeat_s: int = 10) -> optuna.Study:
    """The study in `<study_dir>/study.db` (created if new), shared by every worker that opens it. A trial without a
    heartbeat for 3 x `heartbeat_s` seconds counts as failed and is queued again with its parameters."""
    study_dir.mkdir(parents=True, exist_ok=True)
    storage = RDBStorage(f"sqlite:///{study_dir / 'study.db'}", engine_kwargs={"connect_args": {"timeout": 60}},
                         heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
                         heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3))
    return optuna.create_study(study_name=STUDY_NAME, storage=storage, direction="minimize", sampler=sampler,
                               pruner=pruner, load_if_exists=True)


def trial_args(params: dict) -> list[str]:
    """A trial's parameters as scripts/train.py overrides."""
    return [f"--config.{key}={value}" for key, value in params.items()]


@dataclass
class Launcher:
    """Starts, polls and stops trial runs: local processes (`slurm=None`) or SLURM jobs shaped like `slurm`.
    A run is its training command's `--config <config> --workdir <workdir> <args>`."""

    config: str
    slurm: JobRequest | None = None
    cpu_devices: int = 0  # local runs: > 0 forces that many CPU devices
    fixed_args: list[str] = field(default_factory=list)  # the sweep's own overrides, before each trial's
    processes: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)  # local runs by handle

    def start(self, workdir: Path, params_args: list[str], name: str) -> str:
        """Start a run with the trial's overrides `params_args`; its handle (a SLURM job id, or a process id)."""
        args = [*self.fixed_args, *params_args]
        if self.slurm is not None:
            return submit(dataclasses.replace(self.slurm, config=self.config, workdir=str(workdir), train_args=args,
                                              name=name))
        env = dict(os.environ)
        if self.cpu_devices:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} "
                                                      f"--xla_force_host_platform_device_count={self.cpu_devices}")
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir.parent / f"{workdir.name}.log", "a") as log:
            proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), "--config", self.config,
                                     "--workdir", str(workdir), *args], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=ROOT, preexec_fn=_stop_with_parent)
        self.processes[str(proc.pid)] = proc
        return str(proc.pid)

    def state(self, handle: str) -> str:
        """running, ok (exited 0 / COMPLETED) or failed."""
        if self.slurm is not None:
            job_state = slurm.state(handle)
            if job_state not in slurm.FINAL_STATES:
                return "running"
            return "ok" if job_state == "COMPLETED" else "failed"
        code = self.processes[handle].poll()
        return "running" if code is None else ("ok" if code == 0 else "failed")

    def reusable(self, handle: str | None) -> bool:
        """Whether a run an earlier worker started can be followed on instead of started again: a SLURM job
        (jobs outlive their worker) still pending or running, or completed. Local runs stop with their worker."""
        if self.slurm is None or handle is None:
            return False
        job_state = slurm.state(handle)
        return job_state == "COMPLETED" or job_state not in slurm.FINAL_STATES

    def stop(self, handle: str) -> None:
        if self.slurm is not None:
            slurm.cancel(handle)
        else:
            self.processes[handle].kill()
            self.processes[handle].wait()


def _stop_with_parent() -> None:
    """In a local trial's process: SIGTERM when the worker that started it dies (Linux), so that the run saves a
    checkpoint and exits, and the worker that takes the trial over resumes it instead of racing it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def heartbeat(study: optuna.Study, trial: optuna.Trial) -> None:
    """Record that this worker still runs `trial`. (optuna records heartbeats only inside Study.optimize and has no
    public call for ask-and-tell; this is the one its optimize loop makes.)"""
    study._storage.record_heartbeat(trial._trial_id)


@dataclass
class Running:
    """A trial this worker runs: optuna's handle, its run directory and launcher handle, the steps reported, and
    the tail of its metrics.jsonl (read from the start: a taken-over run's earlier records count too)."""

    trial: optuna.Trial
    workdir: Path
    handle: str
    reported: set = field(default_factory=set)
    metrics: JsonlTail = None

    def __post_init__(self):
        self.metrics = JsonlTail(self.workdir / "metrics.jsonl")


def start_trial(study: optuna.Study, space: dict, launcher: Launcher, study_dir: Path, name: str) -> Running:
    """Ask for the next trial and start its run. A trial queued again after its worker died keeps the first
    attempt's run directory (its checkpoints) and follows that attempt's SLURM job if it still runs or completed;
    otherwise its new run resumes from those checkpoints."""
    trial = study.ask(space)
    heartbeat(study, trial)  # at once: a worker killed before its first heartbeat would leave a trial never stale
    trials = study.get_trials(deepcopy=False)
    first = RetryHeartbeatStaleTrialCallback.retry_history(trials[trial.number])
    origin = trials[first[0]] if first else None
    workdir = Path(origin.user_attrs["workdir"]) if origin else study_dir / "trials" / f"{trial.number:04d}"
    trial.set_user_attr("workdir", str(workdir))
    previous_job = origin.user_attrs.get("handle") if origin else None
    if launcher.reusable(previous_job):
        handle = previous_job
    else:
        handle = launcher.start(workdir, trial_args(trial.params), f"{name}-t{trial.number}")
    trial.set_user_attr("handle", handle)
    return Running(trial, workdir, handle)


def advance(study: optuna.Study, run: Running, launcher: Launcher, log=print) -> bool:
    """Report the run's new held-out losses, stop it if the pruner says so, or tell its outcome once it ended;
    True while it still runs."""
    heartbeat(study, run.trial)
    for record in run.metrics.poll():
        loss, step = record.get("eval_loss", math.nan), record["step"]
        if not math.isfinite(loss) or step in run.reported:  # a step replayed after a rollback counts once
            continue
        run.reported.add(step)
        run.trial.report(loss, step)
        if run.trial.should_prune():
            launcher.stop(run.handle)
            study.tell(run.trial, state=TrialState.PRUNED)
            log(f"trial {run.trial.number} pruned at step {step} (held-out loss {loss:.4f}) {run.trial.params}")
            return False
    status = launcher.state(run.handle)
    if status == "running":
        return True
    summary = run.workdir / "summary.json"
    result = json.loads(summary.read_text()) if summary.exists() else {}
    if status == "ok" and "preempted_at" not in result and math.isfinite(result.get("final_eval_loss", math.nan)):
        study.tell(run.trial, result["final_eval_loss"])
        log(f"trial {run.trial.number} done: held-out loss {result['final_eval_loss']:.4f} {run.trial.params}")
    else:
        study.tell(run.trial, state=TrialState.FAIL)
        log(f"trial {run.trial.number} failed (run {run.handle}, see {run.workdir}) {run.trial.params}")
    return False


def counts(study: optuna.Study) -> dict[TrialState, int]:
    out = dict.fromkeys(TrialState, 0)
    for t in study.get_trials(deepcopy=False):
        out[t.state] += 1
    return out


def run_worker(study: optuna.Study, space: dict, launcher: Launcher, study_dir: Path, trials: int, parallel: int = 1,
               name: str = "sweep", poll_s: float = 2.0, log=print) -> None:
    """Run trials of `study` until it holds `trials` finished ones (complete or pruned), at most `parallel` at a
    time from this worker. Other workers may share the study: this one also waits for theirs, and takes over any
    whose worker died (its heartbeat went stale)."""
    running: list[Running] = []
    while True:
        optuna.storages.fail_stale_trials(study)
        running = [run for run in running if advance(study, run, launcher, log)]
        by_state = counts(study)
        if by_state[TrialState.FAIL] >= trials:
            raise UsageError(f"{by_state[TrialState.FAIL]} trials failed: see the runs under {study_dir / 'trials'}")
        taken = by_state[TrialState.COMPLETE] + by_state[TrialState.PRUNED] + by_state[TrialState.RUNNING]
        while len(running) < parallel and (taken < trials or by_state[TrialState.WAITING]):
            run = start_trial(study, space, launcher, study_dir, name)
            log(f"trial {run.trial.number} started: {run.trial.params} in {run.workdir} (run {run.handle})")
            running.append(run)
            taken += 1
            by_state = counts(study)
        if not running and not by_state[TrialState.RUNNING] and not by_state[TrialState.WAITING]:
            return
        time.sleep(poll_s)


def submit_workers(request: JobRequest, command: list[str], workers: int, seed: int) -> str:
    """A SLURM job array of `workers` sweep workers, each running `command` (scripts/sweep.py with --launcher
    local) on an allocation of the request's devices, its sampler seeded apart from the others'; the array's job
    id. They share the study like any workers."""
    seeded = shlex.join(command) + f' --seed "$(({seed} + 1000 * SLURM_ARRAY_TASK_ID))"'
    script = command_script(request, [], cpus=request.cpus_a_task(), gpus=request.gpus_a_node(), array=workers)
    return submit(request, script + seeded + "\n")
