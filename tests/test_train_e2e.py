"""scripts/train.py end to end in a real process: data -> sharded train steps -> metrics, eval, sample."""

import json
import subprocess
from pathlib import Path

import pytest

from train_runs import train_command, train_env

ROOT = Path(__file__).resolve().parents[1]
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "step_time_s"}


@pytest.mark.smoke
def test_train_script_runs_and_writes_metrics(shakespeare_store, tmp_path):
    workdir = tmp_path / "run"
    cmd = train_command(shakespeare_store, workdir, "--config.train.steps=6", "--config.train.eval_every=3",
                        "--config.train.eval_batches=2", "--config.train.sample_tokens=8",
                        "--config.optim.grad_accum=2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for record in steps:
        assert METRIC_KEYS <= set(record), record
        assert record["tokens_per_sec"] > 0 and 0 < record["mfu"] < 1
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert steps[0]["lr"] < steps[-1]["lr"]  # warming up
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert "held-out loss" in proc.stdout and "greedy sample" in proc.stdout
    assert "attention xla" in proc.stdout  # auto resolves to the einsum path on CPU
    config = json.loads((workdir / "config.json").read_text())
    assert config["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1,  # one process:
                              "dcn_data": 1, "dcn_fsdp": 1, "dcn_tensor": 1, "dcn_stage": 1,  # nothing crosses
                              "dcn_expert": 1, "context": 1, "dcn_context": 1,
                              "sequence_parallel": False}  # hosts
