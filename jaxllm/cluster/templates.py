"""Launch templates (`scripts/launch/slurm.sbatch`, `scripts/launch/jobset.yaml`) and their parameters: checked,
then rendered with every `{{name}}` filled in. `scripts/launch/render.py` prints them; `scripts/submit.py`,
`scripts/pipeline.py --launcher slurm` and `scripts/sweep.py` submit them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from jaxllm.config.cli import UsageError

# The templates ship in the repository beside their command-line renderer (scripts/launch/), where users read them.
LAUNCH_DIR = Path(__file__).resolve().parents[2] / "scripts" / "launch"
TEMPLATES = {"slurm": LAUNCH_DIR / "slurm.sbatch", "jobset": LAUNCH_DIR / "jobset.yaml"}

# name -> (default, kind, meaning). Kinds are checked before anything is rendered.
PARAMS = {
    "name": ("jaxllm", "dns", "job name (SLURM job name; JobSet name and its headless service)"),
    "nodes": (2, "int", "nodes (the job's processes: nodes x ntasks_per_node)"),
    "gpus_per_node": (8, "count", "GPUs per node, shared by its tasks (0: CPU nodes)"),
    "config": ("configs/pretrain.py", "str", "the training config file, relative to repo"),
    "workdir": ("runs/pretrain", "str", "run directory on storage every node sees (checkpoints live there)"),
    "repo": ("/workspace/jaxllm", "str", "the jaxllm checkout on the nodes (in the image, for jobset)"),
    "grace_s": (120, "int", "seconds between the stop signal and the kill (time to save a checkpoint)"),
    # slurm only
    "ntasks_per_node": (1, "int", "processes a node (1: one process drives all the node's devices)"),
    "cpu_devices": (0, "count", "> 0: a CPU job, each task running JAX on this many CPU devices"),
    "partition": ("gpu", "word", "SLURM partition"),
    "time": ("24:00:00", "slurm_time", "SLURM time limit"),
    "cpus_per_task": (32, "int", "CPU cores a task (its data workers; a CPU job's devices)"),
    "log_dir": ("logs", "str", "where SLURM writes the job's output"),
    "setup": ("source .venv/bin/activate", "shell", "shell line run before training (modules, venv)"),
    # jobset only
    "image": ("ghcr.io/your-org/jaxllm:latest", "str", "container image with jaxllm installed"),
    "port": (1234, "int", "coordinator port on pod 0 (the rendezvous uses port + 1)"),
    "max_restarts": (3, "int", "JobSet restarts after a failed pod"),
    "shared_pvc": ("jaxllm-shared", "dns", "PersistentVolumeClaim holding data and the workdir"),
    "shared_mount": ("/shared", "str", "where the shared volume is mounted"),
    "priority_class": ("", "dns_or_empty", "PriorityClass of the pods and Kueue priority class (empty: none)"),
    "queue": ("", "dns_or_empty", "Kueue LocalQueue that admits the JobSet (empty: no Kueue)"),
}
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by the signal would report

PATTERNS = {
    "dns": (r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", "lower-case letters, digits and '-', at most 40 characters"),
    "dns_or_empty": (r"([a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?)?", "empty, or lower-case letters, digits and '-'"),
    "word": (r"[A-Za-z0-9_.-]+", "letters, digits, '_', '.', '-'"),
    "slurm_time": (r"(\d+-)?\d{1,2}(:\d{2}){0,2}", "a SLURM time such as 24:00:00 or 2-00:00:00"),
}


def check_params(values: dict[str, str]) -> dict:
    """Typed parameters from `values` (strings) over the defaults; UsageError names the first bad one."""
    out = {k: default for k, (default, _, _) in PARAMS.items()}
    for key, text in values.items():
        if key not in PARAMS:
            raise UsageError(f"--set {key}: unknown parameter; expected one of {sorted(PARAMS)}")
        kind = PARAMS[key][1]
        if kind in ("int", "count"):
            smallest = 1 if kind == "int" else 0
            if not text.isdigit() or int(text) < smallest:
                what = "a positive integer" if smallest else "a whole number (0 or more)"
                raise UsageError(f"--set {key}: expected {what}, got {text!r}")
            out[key] = int(text)
        elif kind in PATTERNS:
            pattern, what = PATTERNS[kind]
            if not re.fullmatch(pattern, text):
                raise UsageError(f"--set {key}: expected {what}, got {text!r}")
            out[key] = text
        else:
            if not text or "\n" in text:
                raise UsageError(f"--set {key}: expected one non-empty line, got {text!r}")
            out[key] = text
    if out["port"] >= 65535:
        raise UsageError(f"--set port: {out['port']} leaves no room for the rendezvous port above it")
    return out


def _quote(value, target: str) -> str:
    if isinstance(value, int):
        return str(value)
    return shlex.quote(value) if target == "slurm" else json.dumps(value)


def _slurm_devices(p: dict) -> dict[str, str]:
    """The batch script's device request and environment: GPUs by `--gpus-per-node`, or (cpu_devices > 0) JAX on
    that many CPU devices a task, which also needs no GPU request."""
    if p["cpu_devices"]:
        flag = f"--xla_force_host_platform_device_count={p['cpu_devices']}"
        return {"gpu_directive": "# CPU nodes: no GPU request",
                "device_env": f'export JAX_PLATFORMS=cpu XLA_FLAGS="${{XLA_FLAGS:-}} {flag}"'}
    # --gres (not --gpus-per-node): every SLURM with GPUs configured as generic resources understands it.
    directive = f"#SBATCH --gres=gpu:{p['gpus_per_node']}" if p["gpus_per_node"] else "# no GPU request"
    return {"gpu_directive": directive, "device_env": ""}


def render(target: str, values: dict[str, str], train_args: list[str]) -> str:
    """The template of `target` with every `{{name}}` filled in (shell-quoted for slurm, JSON/YAML for jobset)."""
    if target not in TEMPLATES:
        raise UsageError(f"template {target!r}: expected one of {sorted(TEMPLATES)}")
    p = check_params(values)
    fields = {k: _quote(v, target) for k, v in p.items()}
    fields["setup"] = p["setup"]  # a shell line, inserted as written
    if target == "slurm":
        fields["train_args"] = " ".join(shlex.quote(a) for a in train_args)
        fields.update(_slurm_devices(p))
    else:
        # A preempted run saves and exits 143 (not 0, which would complete its pod's index): the Job replaces it.
        command = ["python", "scripts/train.py", "--config", p["config"], "--workdir", p["workdir"],
                   "--preempted_exit_code", str(PREEMPTED_EXIT_CODE), *train_args]
        fields["train_command"] = json.dumps(command)
        fields["coordinator_address"] = json.dumps(f"{p['name']}-workers-0-0.{p['name']}:{p['port']}")
        fields["nodes_str"] = json.dumps(str(p["nodes"]))
        fields["rendezvous_port"] = str(p["port"] + 1)
        fields["preempted_exit_code"] = str(PREEMPTED_EXIT_CODE)
        labels = {"kueue.x-k8s.io/queue-name": p["queue"], "kueue.x-k8s.io/priority-class": p["priority_class"]}
        fields["labels"] = json.dumps({k: v for k, v in labels.items() if v})
        fields["priority_class"] = json.dumps(p["priority_class"] or None)
    text = TEMPLATES[target].read_text()
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", text)) - set(fields))
    if missing:
        raise UsageError(f"{TEMPLATES[target]}: placeholders with no value: {missing}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fields[m.group(1)], text)
