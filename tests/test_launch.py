"""Launch templates: rendered SLURM batch script and Kubernetes JobSet are well-formed, wired for multi-process
start-up, and their training command is one scripts/train.py accepts."""

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from train_runs import ROOT, train_env

RENDER = [sys.executable, str(ROOT / "scripts" / "launch" / "render.py")]
OVERRIDES = ["--config.train.steps=1000", "--config.train.sample_prompt=To be, or not"]


def _render(*args):
    proc = subprocess.run([*RENDER, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _dry_run(train_args):
    """scripts/train.py --dry_run on the rendered command line (the same flags, parsed by the real script)."""
    assert train_args[:2] == ["python", "scripts/train.py"], train_args
    args = [a if a != "configs/pretrain.py" else str(ROOT / "configs" / "pretrain.py") for a in train_args[2:]]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args, "--dry_run"],
                          capture_output=True, text=True, env=train_env(8), timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The plan is of configs/pretrain.py's model and mesh, so the rendered flags reached the real parser intact.
    # Hand count (L4 D256 N4/K2 H64 F768 V512, untied): embedding and head, per layer q/k/v/o + SwiGLU + 2 norms.
    per_layer = 256 * (4 + 2 + 2) * 64 + 4 * 64 * 256 + 3 * 256 * 768 + 2 * 256
    assert f"{2 * 512 * 256 + 4 * per_layer + 256:,} parameters" in proc.stdout, proc.stdout
    assert "mesh data=2 x fsdp=2 x expert=1 x context=1 x tensor=2 x stage=1 (8 devices)" in proc.stdout
    assert re.search(r"^H100 80 GB .*: fits", proc.stdout, flags=re.M), proc.stdout


def test_slurm_template_renders_to_a_valid_batch_script(tmp_path):
    text = _render("slurm", "--set", "nodes=16", "--set", "gpus_per_node=4", "--set", "name=pretrain-1b",
                   "--set", "time=2-00:00:00", "--", *OVERRIDES)
    assert "{{" not in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert directives["nodes"] == "16" and directives["gres"] == "gpu:4"
    assert directives["ntasks-per-node"] == "1"  # one process per node, all its GPUs
    assert directives["job-name"] == "pretrain-1b" and directives["time"] == "2-00:00:00"
    assert "requeue" in directives and directives["signal"].startswith("B:USR1@")
    assert "scontrol requeue" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.rstrip(" &"))
    assert "--kill-on-bad-exit=1" in words
    train = words[words.index("python"):]
    assert train[-2:] == OVERRIDES  # quoted overrides survive the shell
    assert "--coordinator_address" not in train  # under SLURM the processes find each other
    _dry_run(train)


def test_jobset_template_renders_to_a_wired_manifest():
    text = _render("jobset", "--set", "nodes=4", "--set", "name=pre", "--set", "port=2222",
                   "--set", "image=registry.local/jaxllm:1", "--", *OVERRIDES)
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["metadata"]["name"] == "pre" and doc["spec"]["network"]["subdomain"] == "pre"
    (job,) = doc["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == 4 and spec["completionMode"] == "Indexed"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    # pod 0 of replicated job `workers`, through the JobSet's headless service
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == f"pre-{job['name']}-0-0.pre:2222"
    assert env["JAX_NUM_PROCESSES"]["value"] == "4"
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert {p["containerPort"] for p in container["ports"]} == {2222, 2223}  # coordinator and rendezvous
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "registry.local/jaxllm:1"
    assert container["command"][-2:] == OVERRIDES
    _dry_run(container["command"])
    # No priority asked: no PriorityClass, no Kueue labels. A preempted run's exit code replaces its pod.
    assert spec["template"]["spec"]["priorityClassName"] is None and doc["metadata"]["labels"] == {}
    code = int(container["command"][container["command"].index("--preempted_exit_code") + 1])
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "train", "operator": "In", "values": [code]}} in rules
    assert code == 143 and {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules


def test_jobset_carries_the_priority_class_to_the_scheduler_and_kueue():
    doc = yaml.safe_load(_render("jobset", "--set", "priority_class=high", "--set", "queue=team-a"))
    assert doc["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a",
                                         "kueue.x-k8s.io/priority-class": "high"}
    (job,) = doc["spec"]["replicatedJobs"]
    assert job["template"]["spec"]["template"]["spec"]["priorityClassName"] == "high"


def test_slurm_template_for_cpu_tasks_asks_for_no_gpu_and_forces_cpu_devices():
    text = _render("slurm", "--set", "ntasks_per_node=2", "--set", "cpu_devices=4")
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert directives["ntasks-per-node"] == "2" and "gres" not in directives and "gpus-per-node" not in directives
    assert 'XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"' in text
    assert "JAX_PLATFORMS=cpu" in text


@pytest.mark.parametrize("args, message", [
    (["slurm", "--set", "nodes=0"], "--set nodes: expected a positive integer"),
    (["jobset", "--set", "name=Bad_Name"], "--set name: expected lower-case"),
    (["slurm", "--set", "colour=red"], "--set colour: unknown parameter"),
    (["slurm", "--set", "time=forever"], "--set time: expected a SLURM time"),
    (["k8s"], "invalid choice"),
])
def test_bad_template_parameters_are_one_line_errors(args, message):
    proc = subprocess.run([*RENDER, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_render_never_overwrites_without_force(tmp_path):
    out = tmp_path / "job.sbatch"
    out.write_text("precious")
    proc = subprocess.run([*RENDER, "slurm", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert out.read_text() == "precious"
    _render("slurm", "--out", str(out), "--force")
    assert out.read_text().startswith("#!/bin/bash")
