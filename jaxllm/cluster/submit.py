"""A training job for SLURM: what a user asks for (config, overrides, nodes, devices, time limit, priority class,
the jobs it waits for) rendered into the shipped batch script (scripts/launch/slurm.sbatch) and submitted.

Priority classes use what SLURM offers without an accounting database:
- `priority_by="partition"` (default): the class names a partition. Partitions over the same nodes with rising
  `PriorityTier` (low < normal < high, as scripts/launch/local_slurm.sh configures) make SLURM consider a higher
  class's pending jobs first, whatever their submission order.
- `priority_by="nice"`: one partition, and the class sets the job's `--nice` (high 0, normal 100, low 200): a
  larger nice value lowers a job's priority, and users may raise their own jobs' nice without an administrator.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from jaxllm.cluster import slurm
from jaxllm.cluster.templates import render
from jaxllm.config.cli import UsageError

PRIORITY_CLASSES = ("low", "normal", "high")
NICE = {"high": 0, "normal": 100, "low": 200}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class JobRequest:
    """One training job: `scripts/train.py --config <config> --workdir <workdir> <train_args>` on `nodes` nodes of
    `tasks_per_node` processes. `cpu_devices` > 0 makes it a CPU job (that many JAX devices and cores a task);
    otherwise each node asks for `gpus_per_node` GPUs (`--gres=gpu:N`)."""

    config: str
    workdir: str
    train_args: list[str] = field(default_factory=list)
    name: str = "jaxllm"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 8
    cpu_devices: int = 0
    cpus_per_task: int = 0  # 0: cpu_devices on a CPU job, 32 (data workers) on GPU nodes
    time: str = "24:00:00"
    priority: str = "normal"
    priority_by: str = "partition"
    partition: str = "gpu"  # the partition when priority_by="nice"
    after: list[str] = field(default_factory=list)  # job ids that must complete successfully first (afterok)
    log_dir: str = "logs"
    setup: str = f"source {ROOT / '.venv' / 'bin' / 'activate'}"
    grace_s: int = 120

    def describe(self) -> str:
        """The request in a few words, for messages."""
        devices = f"{self.cpu_devices} CPU devices" if self.cpu_devices else f"{self.gpus_per_node} GPUs a node"
        return (f"{self.nodes} node(s) x {self.tasks_per_node} task(s), {devices}, partition "
                f"{self.partition_name()}, time {self.time}")

    def partition_name(self) -> str:
        return self.priority if self.priority_by == "partition" else self.partition

    def cpus_a_task(self) -> int:
        return self.cpus_per_task or self.cpu_devices or 32

    def gpus_a_node(self) -> int:
        return 0 if self.cpu_devices else self.gpus_per_node


def add_request_arguments(p) -> None:
    """The job's shape and place as command-line flags (scripts/submit.py, scripts/pipeline.py --launcher slurm,
    scripts/sweep.py --launcher slurm); `request_from_args` reads them back."""
    p.add_argument("--name", default="jaxllm", help="job name (a chain's and a sweep's jobs add their stage or trial)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks_per_node", type=int, default=1)
    p.add_argument("--gpus_per_node", type=int, default=8, help="GPU nodes: --gres=gpu:N a node")
    p.add_argument("--cpu_devices", type=int, default=0, help="> 0: a CPU job with this many JAX devices a task")
    p.add_argument("--time", default="24:00:00", help="time limit (SLURM format)")
    p.add_argument("--priority", choices=PRIORITY_CLASSES, default="normal")
    p.add_argument("--priority_by", choices=("partition", "nice"), default="partition")
    p.add_argument("--partition", default="gpu", help="the partition under --priority_by nice")
    p.add_argument("--log_dir", default="logs", help="where SLURM writes each job's output (<name>-<job id>.out)")
    p.add_argument("--grace_s", type=int, default=120, help="seconds before the time limit to save and requeue")


def request_from_args(args, config: str, workdir: str, train_args: list[str]) -> JobRequest:
    """A JobRequest from `add_request_arguments`' flags; UsageError names a bad one."""
    for flag in ("nodes", "tasks_per_node"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}: expected a positive integer, got {getattr(args, flag)}")
    for flag in ("gpus_per_node", "cpu_devices"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag}: expected 0 or more, got {getattr(args, flag)}")
    return JobRequest(
        config=str(Path(config).resolve()), workdir=str(Path(workdir).resolve()), train_args=list(train_args),
        name=args.name, nodes=args.nodes, tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
        cpu_devices=args.cpu_devices, time=args.time, priority=args.priority, priority_by=args.priority_by,
        partition=args.partition, log_dir=str(Path(args.log_dir).resolve()), grace_s=args.grace_s)


def batch_script(request: JobRequest) -> str:
    """The shipped SLURM template rendered for `request` (scripts/launch/render.py's checks apply)."""
    values = {"name": request.name, "nodes": request.nodes, "ntasks_per_node": request.tasks_per_node,
              "gpus_per_node": request.gpus_a_node(),
              "cpu_devices": request.cpu_devices, "config": request.config, "workdir": request.workdir,
              "repo": str(ROOT), "time": request.time, "partition": request.partition_name(),
              "cpus_per_task": request.cpus_a_task(),
              "log_dir": str(Path(request.log_dir).resolve()), "setup": request.setup, "grace_s": request.grace_s}
    return render("slurm", {k: str(v) for k, v in values.items()}, request.train_args)


def command_script(request: JobRequest, commands: list[list[str]], cpus: int = 1, gpus: int = 0,
                   array: int = 0) -> str:
    """A one-task batch script running `commands` in order from the repository (stopping at the first failure) on
    `cpus` cores and `gpus` GPUs, in the request's partition and time limit; with `array` > 0, a job array of that
    many such tasks (output `<name>-<array id>_<index>.out`)."""
    output = f"{Path(request.log_dir).resolve()}/%x-" + ("%A_%a" if array else "%j") + ".out"
    lines = ["#!/bin/bash", f"#SBATCH --job-name={request.name}", "#SBATCH --ntasks=1",
             f"#SBATCH --cpus-per-task={cpus}", f"#SBATCH --partition={request.partition_name()}",
             f"#SBATCH --time={request.time}", f"#SBATCH --output={output}"]
    lines += [f"#SBATCH --gres=gpu:{gpus}"] if gpus else []
    lines += [f"#SBATCH --array=0-{array - 1}"] if array else []
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(ROOT))}", request.setup, *(shlex.join(c) for c in commands)]
    return "\n".join(lines) + "\n"


def sbatch_options(request: JobRequest) -> list[str]:
    """Options beside the script's own #SBATCH lines: the nice value of a priority class, the dependencies
    (`afterok`: a failed job cancels those waiting on it instead of leaving them pending forever)."""
    options = []
    if request.priority_by == "nice":
        options.append(f"--nice={NICE[request.priority]}")
    if request.after:
        options += [f"--dependency=afterok:{':'.join(request.after)}", "--kill-on-invalid-dep=yes"]
    return options


def never_fits(request: JobRequest) -> str | None:
    """Why `request` can never run on its partition as SLURM describes it (too few nodes with enough CPUs and
    GPUs for one node's tasks), or None. SLURM itself accepts such a job and leaves it pending unless the cluster
    sets EnforcePartLimits, so it is refused here."""
    kinds = slurm.partition_nodes(request.partition_name())
    if not kinds:
        return f"no partition {request.partition_name()!r} (sinfo lists none)"
    cpus, gpus = request.tasks_per_node * request.cpus_a_task(), request.gpus_a_node()
    usable = sum(count for count, node_cpus, node_gpus in kinds if node_cpus >= cpus and node_gpus >= gpus)
    if usable < request.nodes:
        largest = max(kinds, key=lambda k: (k[1], k[2]))
        return (f"it needs {request.nodes} node(s) with {cpus} CPUs and {gpus} GPUs each; partition "
                f"{request.partition_name()!r} has {usable} such node(s) (largest: {largest[1]} CPUs, "
                f"{largest[2]} GPUs)")
    return None


def submit(request: JobRequest, script: str | None = None) -> str:
    """Submit `request` as the shipped training script, or as `script` (a `command_script` of the same request);
    its job id. A job that can never fit, or one SLURM refuses (an unknown partition, a bad dependency), raises
    SlurmError with the reason and the request."""
    if request.priority not in PRIORITY_CLASSES:
        raise slurm.SlurmError(f"priority {request.priority!r}: expected one of {PRIORITY_CLASSES}")
    reason = never_fits(request)
    if reason:
        raise slurm.SlurmError(f"the job can never run ({request.describe()}): {reason}")
    Path(request.log_dir).mkdir(parents=True, exist_ok=True)  # SLURM does not create its output's directory
    try:
        return slurm.sbatch(script or batch_script(request), sbatch_options(request))
    except slurm.SlurmError as exc:
        raise slurm.SlurmError(f"SLURM refused the job ({request.describe()}): {exc}") from None
