"""LoRA SFT as real `scripts/train.py` processes on a tiny pretrained base: bitwise resume after SIGTERM with
dropout on, checkpoints that hold adapters and a fingerprinted reference to the base (never a copy), a resume onto
a different base refused in one line, full fine-tuning at rank 0, task metrics in summary.json, and scripts/eval.py
--task on the LoRA checkpoint."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np

from train_runs import ROOT, assert_dry_run_plans_the_run, losses, preempt_at, run_sft, sft_command, train_env

from jaxllm.runs.checkpoint import Checkpointer, directory_bytes
from jaxllm.runs.loader import load_checkpoint

def _leaves(workdir):
    return [np.asarray(x) for x in jax.tree.leaves(load_checkpoint(str(workdir)).params)]


def test_lora_sft_resumes_bitwise_after_sigterm(bases, sft_task, lora_run, tmp_path):
    assert preempt_at(sft_command(bases[0], sft_task, tmp_path, "--config.train.steps=6"), tmp_path, 3) == 3
    again = run_sft(bases[0], sft_task, tmp_path, "--config.train.steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from checkpoint step 3" in again.stdout
    full, resumed = losses(lora_run), losses(tmp_path)
    assert sorted(resumed) == list(range(1, 7))
    assert all(resumed[s] == full[s] for s in range(4, 7)), (resumed, full)
    for a, b in zip(_leaves(tmp_path), _leaves(lora_run)):
        assert np.array_equal(a, b)


def test_lora_checkpoints_hold_adapters_and_a_reference_to_the_base(bases, lora_run):
    checkpoints = Checkpointer(lora_run / "checkpoints", log=lambda *_: None)
    meta = checkpoints.read_meta(6)
    checkpoints.close()
    base_step = bases[0] / "checkpoints" / "2"
    assert meta["base"]["kind"] == "jaxllm" and meta["base"]["path"] == str(base_step)
    assert len(meta["base"]["fingerprint"]) == 32
    # The state holds the adapters and their optimizer state only: far smaller than the base's checkpoint.
    state_bytes = directory_bytes(lora_run / "checkpoints" / "6" / "state")
    assert state_bytes < directory_bytes(base_step / "state") / 4
    loaded = load_checkpoint(str(lora_run))  # the adapters, on the base the metadata names
    base = load_checkpoint(str(bases[0]))
    frozen = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(loaded.params)
              if "lora" not in jax.tree_util.keystr(p)]
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(frozen, jax.tree.leaves(base.params)))
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["base"] == meta["base"]
    for which in ("base", "tuned"):
        assert set(summary["task"][which]) == {"all", "form", "title", "next_line"}
        assert {"examples", "exact_match", "bleu"} <= set(summary["task"][which]["all"])
        assert summary["task"][which]["all"]["examples"] == 4


def test_resume_onto_a_different_base_is_refused(bases, sft_task, lora_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(lora_run, workdir)
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    proc = run_sft(bases[1], sft_task, workdir, "--config.train.steps=8")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.restore_from:"), proc.stderr[-2000:]
    assert "is not the base this run's checkpoints were trained on" in lines[0]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before


def test_rank_0_fine_tunes_every_parameter(bases, sft_task, tmp_path):
    proc = run_sft(bases[0], sft_task, tmp_path, "--config.train.steps=2", "--config.lora.rank=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tuned, base = load_checkpoint(str(tmp_path)), load_checkpoint(str(bases[0]))
    assert jax.tree.structure(tuned.params) == jax.tree.structure(base.params)  # a whole model, no adapters
    changed = [not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(tuned.params), jax.tree.leaves(base.params))]
    assert all(changed)


def test_eval_task_on_the_lora_checkpoint(lora_run, sft_task):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), "--checkpoint", str(lora_run),
                           "--task", str(sft_task / "eval.jsonl")], capture_output=True, text=True, env=train_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["task"]
    assert result["scores"]["all"]["examples"] == 8
    assert {"form", "title", "next_line"} <= set(result["scores"])
    summary = json.loads((lora_run / "summary.json").read_text())["task"]
    # The run's own evaluation (8 devices) and this one (1 device) generate the same responses.
    assert [s["response"] for s in result["samples"]] == [s["response"] for s in summary["samples"]]


def test_bad_sft_settings_are_one_line_errors(bases, sft_task, tmp_path):
    for args, key in ((("--config.sft.train_file=/no/such.jsonl",), "sft.train_file"),
                      (("--config.sft.template=model",), "sft.template"),
                      (("--config.sft.overlong=wrap",), "sft.overlong")):
        proc = run_sft(bases[0], sft_task, tmp_path / key, *args, f"--config.data.path={tmp_path / key / 'data'}")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}:"), proc.stderr[-2000:]


def test_export_merged_and_adapter_only(bases, lora_run, tmp_path):
    from jaxllm.interop import hf
    from jaxllm.model.lora import merge

    export = [sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "export"]
    for args in (("--checkpoint", str(bases[0]), "--out", str(tmp_path / "base")),
                 ("--checkpoint", str(lora_run), "--out", str(tmp_path / "merged")),
                 ("--checkpoint", str(lora_run), "--out", str(tmp_path / "adapter"), "--adapter_only")):
        proc = subprocess.run([*export, *args], capture_output=True, text=True, env=train_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    tokens = np.arange(1, 17, dtype=np.int32)[None]
    tuned = np.asarray(load_checkpoint(str(lora_run)).model(tokens))
    np.testing.assert_allclose(np.asarray(hf.from_pretrained(tmp_path / "merged")(tokens)), tuned, atol=1e-4)
    adapted = hf.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(adapted(tokens)), tuned, atol=1e-5)
    np.testing.assert_allclose(np.asarray(merge(adapted)(tokens)), tuned, atol=1e-4)


def test_sft_from_a_hugging_face_base(bases, sft_task, lora_run, tmp_path):
    export = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "export", "--checkpoint",
                             str(bases[0]), "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                            env=train_env(), timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    # Its data prepared anew: the export's tokenizer is a tokenizer.json (jaxllm reads it before the
    # tokenizer.model beside it), another file to the data checks, with the same ids.
    proc = run_sft(tmp_path / "hf", sft_task, tmp_path / "run", "--config.train.steps=2",
                   f"--config.data.path={tmp_path / 'data'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"starting from the base model {tmp_path / 'hf'}" in proc.stdout
    from_hf = json.loads((tmp_path / "run" / "summary.json").read_text())
    from_run = json.loads((lora_run / "summary.json").read_text())
    # The same weights, imported, and the same tokens: the same fingerprint, the same held-out loss before training.
    assert from_hf["base"]["kind"] == "hf" and from_hf["base"]["fingerprint"] == from_run["base"]["fingerprint"]
    assert from_hf["initial_eval_loss"] == from_run["initial_eval_loss"]


def test_the_dry_run_plans_what_the_run_built(bases, sft_task, lora_run):
    assert_dry_run_plans_the_run(sft_command(bases[0], sft_task, lora_run, "--config.train.steps=6"), lora_run)
