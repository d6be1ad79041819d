"""One start of a drilled job (one or several processes), and what the drill reads of the job while it runs:
its log, its metrics lines, its incidents and its checkpoint directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from jaxllm.runtime.distributed import free_port_pair

RESUMED = re.compile(r"resuming from checkpoint step (\d+)")
QUARANTINED = re.compile(r"/(\d+) is unreadable.*moved it to \S*corrupt-\1-\d+")
DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a checkpoint still being written


class Start:
    """One start of the job: `command` started now as `processes` processes on this host, process 0 logging to
    `log_path` (stdout and stderr) and process i > 0 beside it (`<name>.p<i>.log`).

    Several processes get a coordinator on a free local port, and the fake CPU devices of XLA_FLAGS
    (`--xla_force_host_platform_device_count`) split between them.
    """

    def __init__(self, command: list[str], log_path: Path, env: dict | None = None, processes: int = 1,
                 devices_per_process: int | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.ended: float | None = None
        self.procs: list[subprocess.Popen] = []
        port = free_port_pair() if processes > 1 else None
        for i in range(processes):
            cmd, path = list(command), self.log_path
            if processes > 1:
                cmd += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes),
                        "--process_id", str(i)]
                path = self.log_path if i == 0 else self.log_path.with_suffix(f".p{i}.log")
            with open(path, "w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                   env=split_devices(env, processes, devices_per_process)))

    def poll(self) -> int | None:
        """None while any process runs; then 0 when all exited 0, else process 0's status if it failed, else
        the first failed one's (negative: killed by that signal)."""
        codes = [p.poll() for p in self.procs]
        if any(rc is None for rc in codes):
            return None
        if self.ended is None:
            self.ended = time.monotonic()
        return next((rc for rc in codes if rc != 0), 0)

    def codes(self) -> list[int | None]:
        """Each process's exit status (None: still running)."""
        return [p.poll() for p in self.procs]

    def signal(self, signum: int, process: int | None = None) -> None:
        """Send `signum` to every process, or to `process` only."""
        for i, p in enumerate(self.procs):
            if (process is None or i == process) and p.poll() is None:
                p.send_signal(signum)

    def wait(self, timeout: float) -> int:
        """Wait (at most `timeout` seconds in all) for every process; `poll`'s status."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        return self.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def resumed_step(self) -> int:
        """The checkpoint step it resumed (0: it started fresh)."""
        found = RESUMED.search(self.log())
        return int(found.group(1)) if found else 0

    def quarantined(self, checkpoints: Path) -> list[int]:
        """Steps whose checkpoint it said it found unreadable and moved aside, and that lie in `checkpoints` as
        corrupt-<step>-* (the log line alone would pass a restore that deleted the checkpoint instead)."""
        said = [int(m.group(1)) for m in QUARANTINED.finditer(self.log())]
        return [step for step in said if any(checkpoints.glob(f"corrupt-{step}-*"))]


class SrunStart(Start):
    """One start of the job as one `srun` of `processes` tasks (SLURM's launcher): each task is a JAX process
    that joins the others from SLURM's variables, logging as `Start`'s processes do. Outside an allocation each
    start is a job of its own; inside one (a batch script running the drill), a job step of it.

    srun knows its tasks only as a whole, so each task's shell records its process id and exit status beside
    the logs (`<log>.tasks/`): a single task can be killed (a lost host) and each task's status read."""

    def __init__(self, command: list[str], log_path: Path, env: dict | None = None, processes: int = 1,
                 devices_per_process: int | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.tasks = self.log_path.with_suffix(".tasks")
        self.tasks.mkdir(exist_ok=True)
        self.processes = processes
        self.started, self.ended = time.monotonic(), None
        task_log = f'{self.log_path.with_suffix("")}.p$SLURM_PROCID.log'
        script = (f'log={shlex.quote(str(self.log_path))}; [ "$SLURM_PROCID" = 0 ] || log={task_log}; '
                  f'{shlex.join(command)} > "$log" 2>&1 & echo $! > {self.tasks}/pid.$SLURM_PROCID; '
                  f'wait $!; status=$?; echo $status > {self.tasks}/status.$SLURM_PROCID; exit $status')
        cpus = devices_per_process or 1
        srun = ["srun", f"--ntasks={processes}", "--nodes=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=0",
                f"--job-name={self.log_path.stem}", "bash", "-c", script]
        with open(self.log_path.with_suffix(".srun.log"), "w") as log:
            self.procs = [subprocess.Popen(srun, stdout=log, stderr=subprocess.STDOUT,
                                           env=split_devices(env, processes, devices_per_process))]

    def _task_file(self, kind: str, task: int) -> str | None:
        try:
            return (self.tasks / f"{kind}.{task}").read_text().strip()
        except FileNotFoundError:
            return None

    def codes(self) -> list[int | None]:
        """Each task's exit status as Popen gives it (negative: killed by that signal; None: running)."""
        codes = []
        for task in range(self.processes):
            status = self._task_file("status", task)
            code = None if status is None else int(status)
            codes.append(128 - code if code is not None and code > 128 else code)  # the shell's 128 + signal
        return codes

    def poll(self) -> int | None:
        if self.procs[0].poll() is None:
            return None
        if self.ended is None:
            self.ended = time.monotonic()
        codes = [self.procs[0].returncode if rc is None else rc for rc in self.codes()]
        return next((rc for rc in codes if rc != 0), 0)

    def signal(self, signum: int, process: int | None = None) -> None:
        for task in range(self.processes):
            pid = self._task_file("pid", task)
            if (process is None or task == process) and pid:
                try:
                    os.kill(int(pid), signum)
                except ProcessLookupError:
                    pass


LAUNCHERS = {"local": Start, "slurm": SrunStart}  # how the drill starts the job's processes (--launcher)


def split_devices(env: dict | None, processes: int, devices_per_process: int | None = None) -> dict | None:
    """`env` (None: this one's) with its fake CPU device count divided among `processes` processes, or set to
    `devices_per_process` each (a host's devices, whatever the number of hosts left)."""
    if processes == 1 and devices_per_process is None:
        return env
    env = dict(os.environ if env is None else env)
    flags = env.get("XLA_FLAGS", "")
    found = DEVICE_COUNT.search(flags)
    if found:
        per_process = devices_per_process or int(found.group(1)) // processes
        env["XLA_FLAGS"] = DEVICE_COUNT.sub(f"--xla_force_host_platform_device_count={per_process}", flags)
    return env


class JsonlTail:
    """The complete lines appended to a JSON-lines file since the last `poll` (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def committed_steps(checkpoints: Path) -> list[int]:
    """The committed checkpoint steps (orbax renames a step's directory to its number on commit)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def save_in_flight(checkpoints: Path) -> bool:
    """Whether a checkpoint is being written (orbax's temporary directory exists)."""
    return checkpoints.is_dir() and any(TMP_MARK in p.name for p in checkpoints.iterdir())


def recorded_rollbacks(checkpoints: Path, step: int) -> int:
    """The rollbacks a checkpoint's run metadata records (jaxllm/train/fit.py's `meta`; orbax keeps a JSON
    item as `<item>/metadata`)."""
    return int(json.loads((checkpoints / str(step) / "meta" / "metadata").read_text()).get("rollbacks", 0))


def recorded_hot_updates(checkpoints: Path, step: int) -> list[dict]:
    """The hot updates a checkpoint's run metadata lists as applied (jaxllm/train/control.py's records)."""
    return json.loads((checkpoints / str(step) / "meta" / "metadata").read_text()).get("hot_updates", [])


def write_hot_updates(workdir: Path, changes: list[dict]) -> bool:
    """The drill's hot updates (`plan.hot_changes`) into `workdir`'s control.json before a job starts there;
    whether there were any."""
    if not changes:
        return False
    from jaxllm.train.control import write_control  # imports JAX: only for drills that need it

    Path(workdir).mkdir(parents=True, exist_ok=True)
    write_control(workdir, changes)
    return True


def final_history(metrics_path: Path) -> dict[int, dict]:
    """The last logged record of each step (what a resumed or rolled-back run finally kept), by step."""
    history: dict[int, dict] = {}
    for record in JsonlTail(metrics_path).poll():
        if "loss" in record:
            history[record["step"]] = record
    return history
