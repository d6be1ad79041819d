"""The reward model and DPO as real `scripts/train.py` processes on a slice of the shipped preference set: bitwise
resume after SIGTERM past a rollback on an injected NaN, per-kind reports, scripts/eval.py --reward agreeing with the
run's own report, the export loading in transformers, DPO from a LoRA SFT run (merged into the frozen base it
trains new adapters on), and bad settings as one-line errors."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from train_runs import (NAN_AT_3, ROOT, assert_dry_run_plans_the_run, assert_rolled_back_at_3, losses, metrics,
                        preempt_at, train_env)

from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.runs.loader import load_checkpoint

SMALL = ("--config.train.seq_len=256", "--config.train.batch_size=8", "--config.train.eval_batches=1",
         "--config.train.eval_every=1000", "--config.checkpoint.every=2", "--config.optim.warmup_steps=2",
         "--config.preference.pairs_per_row=1")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A slice of the shipped preference set (every kind)."""
    out = tmp_path_factory.mktemp("pairs")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_preference_set.py"), "--out", str(out)], check=True,
                   capture_output=True)
    for name, keep in (("train.jsonl", 96), ("eval.jsonl", 16)):
        lines = (out / name).read_text().splitlines()[:keep]
        (out / name).write_text("\n".join(lines) + "\n")
    return out


def _command(objective, base, pairs, workdir, *args):
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / f"{objective}.py"),
            "--workdir", str(workdir), f"--config.checkpoint.restore_from={base}",
            f"--config.preference.train_file={pairs / 'train.jsonl'}",
            f"--config.preference.eval_file={pairs / 'eval.jsonl'}", f"--config.data.path={pairs / 'prepared'}",
            *SMALL, *args]


def _run(*command_args, timeout=600):
    return subprocess.run(_command(*command_args), capture_output=True, text=True, env=train_env(), timeout=timeout)


# DPO trains fresh adapters (dropout on: the resume must replay its randomness) on the merged LoRA SFT run.
DPO = ("--config.lora.dropout=0.1",)


@pytest.fixture(scope="module")
def reward_run(bases, pairs, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reward")
    proc = _run("reward", bases[0], pairs, workdir, "--config.train.steps=6", *NAN_AT_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def dpo_run(lora_run, pairs, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dpo")
    proc = _run("dpo", lora_run, pairs, workdir, "--config.train.steps=6", *DPO, *NAN_AT_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def _leaves(workdir):
    return [np.asarray(x) for x in jax.tree.leaves(load_checkpoint(str(workdir)).params)]


@pytest.mark.parametrize("objective", ["reward", "dpo"])
def test_resumes_bitwise_after_sigterm(objective, request, bases, lora_run, pairs, tmp_path):
    base, extra = (bases[0], NAN_AT_3) if objective == "reward" else (lora_run, (*DPO, *NAN_AT_3))
    uninterrupted = request.getfixturevalue(f"{objective}_run")
    assert preempt_at(_command(objective, base, pairs, tmp_path, "--config.train.steps=6", *extra), tmp_path, 3) == 3
    again = _run(objective, base, pairs, tmp_path, "--config.train.steps=6", *extra)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from checkpoint step 3" in again.stdout
    full, resumed = losses(uninterrupted), losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(1, 7)), (resumed, full)
    for a, b in zip(_leaves(tmp_path), _leaves(uninterrupted)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("objective", ["reward", "dpo"])
def test_an_injected_nan_rolls_back(objective, request):
    assert_rolled_back_at_3(request.getfixturevalue(f"{objective}_run"))


def test_reward_run_reports_per_kind_and_eval_agrees(reward_run, pairs, tmp_path):
    summary = json.loads((reward_run / "summary.json").read_text())
    tuned = summary["task"]["tuned"]
    held_out = [json.loads(x) for x in (pairs / "prepared" / "eval_pairs.jsonl").read_text().splitlines()]
    assert set(tuned) == {"all", "length_matched"} | {p["kind"] for p in held_out}
    assert tuned["all"]["examples"] == len(held_out) >= 8
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), "--checkpoint", str(reward_run),
                           "--reward", str(pairs / "eval.jsonl")], capture_output=True, text=True, env=train_env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same pairs scored on 1 device by eval.py and on 8 by the run: the same accuracies.
    assert json.loads(proc.stdout)["reward"]["scores"] == tuned
    steps = [r for r in metrics(reward_run) if "loss" in r]
    assert {"accuracy", "margin", "reward_mean", "reward_std"} <= set(steps[0])


def test_reward_export_scores_in_transformers(reward_run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "export", "--checkpoint",
                           str(reward_run), "--out", str(tmp_path)], capture_output=True, text=True, env=train_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.config.pad_token_id == 0 and ref.config.num_labels == 1
    tokens = np.arange(2, 30, dtype=np.int32)[None]
    ours = np.asarray(load_checkpoint(str(reward_run)).model(tokens))[0, -1]
    with torch.no_grad():
        np.testing.assert_allclose(float(ref(torch.tensor(tokens, dtype=torch.long)).logits[0, 0]), ours, atol=1e-4)


def test_dpo_trains_new_adapters_on_the_merged_sft_model(dpo_run, lora_run):
    checkpoints = Checkpointer(dpo_run / "checkpoints", log=lambda *_: None)
    meta = checkpoints.read_meta(6)
    checkpoints.close()
    assert meta["base"]["kind"] == "jaxllm-lora" and meta["base"]["path"] == str(lora_run / "checkpoints" / "6")
    from jaxllm.model.lora import merge

    sft = merge(load_checkpoint(str(lora_run)).model)
    dpo = load_checkpoint(str(dpo_run))
    frozen = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(dpo.params)
              if "lora" not in jax.tree_util.keystr(p)}
    from flax import nnx

    merged = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(sft, nnx.Param))}
    assert frozen.keys() == merged.keys() and all(np.array_equal(frozen[k], merged[k]) for k in frozen)
    summary = json.loads((dpo_run / "summary.json").read_text())
    # The policy starts as its reference: every implicit reward margin is 0, so that accuracy is left out.
    assert "reward_accuracy" not in summary["task"]["base"]["all"] and "logp_accuracy" in summary["task"]["base"]["all"]
    assert {"reward_accuracy", "logp_accuracy"} <= set(summary["task"]["tuned"]["all"])
    # The base's SFT task, before and after: before, it is the SFT run's own end-of-run report (same examples,
    # the merged SFT model), and its held-out responses' perplexity is finite.
    sft_task = summary["sft_task"]
    sft_summary = json.loads((lora_run / "summary.json").read_text())
    assert sft_task["base"]["all"]["exact_match"] == sft_summary["task"]["tuned"]["all"]["exact_match"]
    assert sft_task["base"]["all"]["examples"] == sft_summary["task"]["tuned"]["all"]["examples"]
    assert all(1.0 < sft_task[side]["all"]["perplexity"] < 600 for side in ("base", "tuned")), sft_task
    steps = [r for r in metrics(dpo_run) if "loss" in r]
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "nll_loss"} <= set(steps[0])
    # Fresh adapters: policy == reference, so the DPO term is ln 2; configs/dpo.py adds rpo_alpha (1) x the NLL.
    assert steps[0]["loss"] - steps[0]["nll_loss"] == pytest.approx(np.log(2), rel=1e-4)


def test_bad_settings_are_one_line_errors(bases, pairs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a"}\nnot json\n')
    for objective, args, key in (("dpo", ("--config.lora.rank=0",), "dpo.reference"),
                                 ("reward", ("--config.preference.train_file=/no/such.jsonl",),
                                  "preference.train_file"),
                                 ("reward", (f"--config.preference.train_file={bad}",), "preference.train_file"),
                                 ("dpo", ("--config.dpo.loss=hinge",), "dpo.loss")):
        data = f"--config.data.path={tmp_path / 'data' / key}"
        proc = _run(objective, bases[0], pairs, tmp_path / key, *args, data)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}:"), proc.stderr[-2000:]
        # Nothing is left behind (no empty run directory, no data), and no line points at a file never written.
        assert not (tmp_path / key).exists() and not (tmp_path / "data").exists()
        assert "manifest.json" not in proc.stdout + proc.stderr, proc.stdout


def test_dpo_with_precomputed_reference_fine_tunes_everything(bases, pairs, tmp_path):
    proc = _run("dpo", bases[0], pairs, tmp_path / "run", "--config.train.steps=2", "--config.lora.rank=0",
                "--config.dpo.reference=precomputed", f"--config.data.path={tmp_path / 'data'}",
                "--config.dpo.rpo_alpha=0")  # the DPO term alone, to read the reference from the loss
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "computing reference log-probabilities" in proc.stdout
    (stored,) = (tmp_path / "data").glob("reference-*")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored.name == f"reference-{summary['base']['fingerprint']}"
    rows = len(np.load(tmp_path / "data" / "train" / "tokens.npy"))
    assert np.load(stored / "train.npy").shape == (rows, 1, 2)
    # Before the first update the policy is its reference: every pair's loss is log 2.
    assert summary["initial_eval_loss"] == pytest.approx(np.log(2), rel=1e-6)
    # ... and after an update it is not: the reference stayed where the base was (read from the stored sums).
    assert abs(summary["final_eval_loss"] - np.log(2)) > 1e-4
    tuned, base = load_checkpoint(str(tmp_path / "run")), load_checkpoint(str(bases[0]))
    assert jax.tree.structure(tuned.params) == jax.tree.structure(base.params)  # a whole model, no adapters


@pytest.mark.parametrize("objective", ["reward", "dpo"])
def test_the_dry_run_plans_what_the_run_built(objective, request, bases, lora_run, pairs):
    base, extra = (bases[0], NAN_AT_3) if objective == "reward" else (lora_run, (*DPO, *NAN_AT_3))
    run = request.getfixturevalue(f"{objective}_run")
    assert_dry_run_plans_the_run(_command(objective, base, pairs, run, "--config.train.steps=6", *extra), run)
