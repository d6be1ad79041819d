"""Render a launch template: `python scripts/launch/render.py {slurm,jobset} [--set key=value ...] [-- overrides]`.

  slurm   scripts/launch/slurm.sbatch  (submit the output with `sbatch`)
  jobset  scripts/launch/jobset.yaml   (apply the output with `kubectl apply -f`)

Everything after `--` is passed to scripts/train.py (e.g. `--config.train.steps=10000`). `--list` prints the
parameters and their defaults. Output goes to stdout, or to `--out FILE` (never over an existing file unless
`--force`).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxllm.config.cli import UsageError, fail, parser  # noqa: E402

TEMPLATES = {"slurm": Path(__file__).with_name("slurm.sbatch"), "jobset": Path(__file__).with_name("jobset.yaml")}

# name -> (default, kind, meaning). Kinds are checked before anything is rendered.
PARAMS = {
    "name": ("jaxllm", "dns", "job name (SLURM job name; JobSet name and its headless service)"),
    "nodes": (2, "int", "nodes = processes, one per node"),
    "gpus_per_node": (8, "int", "GPUs per node, all used by that node's process"),
    "config": ("configs/pretrain.py", "str", "the training config file, relative to repo"),
    "workdir": ("runs/pretrain", "str", "run directory on storage every node sees (checkpoints live there)"),
    "repo": ("/workspace/jaxllm", "str", "the jaxllm checkout on the nodes (in the image, for jobset)"),
    "grace_s": (120, "int", "seconds between the stop signal and the kill (time to save a checkpoint)"),
    # slurm only
    "partition": ("gpu", "word", "SLURM partition"),
    "time": ("24:00:00", "slurm_time", "SLURM time limit"),
    "cpus_per_task": (32, "int", "CPU cores per node for the data workers"),
    "log_dir": ("logs", "str", "where SLURM writes the job's output"),
    "setup": ("source .venv/bin/activate", "shell", "shell line run before training (modules, venv)"),
    # jobset only
    "image": ("ghcr.io/your-org/jaxllm:latest", "str", "container image with jaxllm installed"),
    "port": (1234, "int", "coordinator port on pod 0 (the rendezvous uses port + 1)"),
    "max_restarts": (3, "int", "JobSet restarts after a failed pod"),
    "shared_pvc": ("jaxllm-shared", "dns", "PersistentVolumeClaim holding data and the workdir"),
    "shared_mount": ("/shared", "str", "where the shared volume is mounted"),
}
PATTERNS = {
    "dns": (r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", "lower-case letters, digits and '-', at most 40 characters"),
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
        if kind == "int":
            if not text.isdigit() or int(text) < 1:
                raise UsageError(f"--set {key}: expected a positive integer, got {text!r}")
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


def render(target: str, values: dict[str, str], train_args: list[str]) -> str:
    """The template of `target` with every `{{name}}` filled in (shell-quoted for slurm, JSON/YAML for jobset)."""
    if target not in TEMPLATES:
        raise UsageError(f"template {target!r}: expected one of {sorted(TEMPLATES)}")
    p = check_params(values)
    fields = {k: _quote(v, target) for k, v in p.items()}
    fields["setup"] = p["setup"]  # a shell line, inserted as written
    if target == "slurm":
        fields["train_args"] = " ".join(shlex.quote(a) for a in train_args)
    else:
        command = ["python", "scripts/train.py", "--config", p["config"], "--workdir", p["workdir"], *train_args]
        fields["train_command"] = json.dumps(command)
        fields["coordinator_address"] = json.dumps(f"{p['name']}-workers-0-0.{p['name']}:{p['port']}")
        fields["nodes_str"] = json.dumps(str(p["nodes"]))
        fields["rendezvous_port"] = str(p["port"] + 1)
    text = TEMPLATES[target].read_text()
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", text)) - set(fields))
    if missing:
        raise UsageError(f"{TEMPLATES[target]}: placeholders with no value: {missing}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: fields[m.group(1)], text)


def main(argv: list[str]) -> int:
    argv = list(argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = parser(__doc__.splitlines()[0])
    p.add_argument("target", choices=sorted(TEMPLATES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a template parameter")
    p.add_argument("--out", default=None, help="write here instead of stdout")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--list", action="store_true", help="print the parameters and their defaults")
    args = p.parse_args(argv)
    if args.list:
        for key, (default, _, meaning) in PARAMS.items():
            print(f"{key:14s} {str(default):32s} {meaning}")
        return 0
    try:
        values = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"--set {item}: expected KEY=VALUE")
            values[key] = value
        text = render(args.target, values, train_args)
        if args.out and Path(args.out).exists() and not args.force:
            raise UsageError(f"--out {args.out}: exists (pass --force to overwrite)")
    except UsageError as exc:
        fail(str(exc))
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
