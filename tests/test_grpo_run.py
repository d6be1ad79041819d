"""GRPO as real `scripts/train.py` processes on the tiny LoRA SFT run: rollouts inside the training program, the
ratio at 1 at each iteration's first update, bitwise resume after SIGTERM in the middle of an iteration's
updates (the rollout travels in the checkpoint), a reward that rises, and bad settings as one-line errors."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from train_runs import (NAN_AT_3, RL_ITERATION_STARTS, ROOT, assert_rolled_back_at_3, assert_dry_run_plans_the_run,
                        assert_serves_the_tools, checkpoint_leaves, losses, metrics, preempt_at, process_logs,
                        rl_command, rollout_rows, run_command, start_processes, train_command, train_env)

from jaxllm.objectives.reward_fns import single_line

# 4 prompts x 4 responses = 16 rows an iteration, 2 epochs of 2 minibatches of 8: 4 steps an iteration.
SMALL = ("--config.train.batch_size=8", "--config.checkpoint.every=2", "--config.grpo.prompts_per_iteration=4",
         "--config.grpo.num_generations=4", "--config.grpo.epochs=2", "--config.grpo.max_prompt_tokens=64",
         "--config.grpo.max_new_tokens=8", "--config.grpo.eval_prompts=8", "--config.grpo.reward=fn:single_line")


@pytest.fixture(scope="module")
def prompts(rl_prompts):
    return rl_prompts


def _command(base, prompts, workdir, *args):
    return rl_command("grpo", base, prompts, workdir, *SMALL, *args)


def _run(*command_args):
    return run_command(_command(*command_args))


@pytest.fixture(scope="module")
def grpo_run(lora_run, prompts, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpo")
    proc = _run(lora_run, prompts, workdir, "--config.train.steps=6", *NAN_AT_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_each_iteration_starts_at_ratio_1(grpo_run):
    steps = {r["step"]: r for r in metrics(grpo_run) if "loss" in r}
    assert sorted(steps) == list(range(1, 7))
    for first in RL_ITERATION_STARTS:  # iterations 0 and 1's first minibatch: the policy is the one that sampled
        assert steps[first]["clip_fraction"] == 0.0 and steps[first]["approx_kl"] < 1e-9, steps[first]
    assert min(steps[s]["approx_kl"] for s in (2, 3, 5, 6)) > 1e-7  # later minibatches follow updates
    for s, r in steps.items():  # rollouts are made (and timed) at an iteration's first step only
        sampled = r["rollout_s"] > 0 and r["scoring_s"] > 0 and r["rollout_tokens_per_sec"] > 0
        assert sampled == (s in RL_ITERATION_STARTS), r
        assert r["weight_sync_s"] == 0.0  # colocated: the sampler reads the trainer's own arrays
        # On-policy, the trainer's forward pass gives back what the KV-cache sampler recorded (float32).
        assert (s in RL_ITERATION_STARTS) == ("logp_mismatch_mean" in r)
        assert r.get("logp_mismatch_mean", 0) < 1e-6 and r.get("logp_mismatch_max", 0) < 1e-5, r
    for r in steps.values():
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["eos_rate"] <= 1.0 and 0 < r["response_length"] <= 8
        assert r["entropy"] > 0
    samples = [json.loads(x) for x in (grpo_run / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [0, 0, 0]  # grpo.samples_every=10: iteration 0 only
    assert all(s["reward"] == single_line(s["prompt"], s["response"]) for s in samples)
    summary = json.loads((grpo_run / "summary.json").read_text())
    assert summary["task"]["tuned"]["all"]["examples"] == 8 and "reward" in summary["task"]["base"]["all"]
    # On a LoRA SFT run: that run's task before and after (tests/test_preference_run.py checks it against the SFT
    # run's own report).
    assert {"exact_match", "perplexity"} <= set(summary["sft_task"]["tuned"]["all"]) <= set(summary["sft_task"]["base"]["all"])


def test_resumes_bitwise_after_sigterm_mid_iteration(grpo_run, lora_run, prompts, tmp_path):
    """Preempted after step 3 (iteration 0 has one minibatch left): the resumed run trains on the saved rollout
    and ends with the uninterrupted run's parameters, bit for bit."""
    assert preempt_at(_command(lora_run, prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3), tmp_path, 3) == 3
    again = _run(lora_run, prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from checkpoint step 3" in again.stdout
    full, resumed = losses(grpo_run), losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(1, 7)), (resumed, full)
    for a, b in zip(checkpoint_leaves(tmp_path), checkpoint_leaves(grpo_run)):
        assert np.array_equal(a, b)


# Rollouts on devices of their own across processes: each process gives 2 of its 4 devices to them.
SPLIT = ("--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4", "--config.mesh.tensor=1")


@pytest.fixture(scope="module")
def two_process_grpo(lora_run, prompts, tmp_path_factory):
    """grpo_run's job as 2 processes x 4 devices, 2 of each sampling (SPLIT): each process samples, scores and
    trains on its own block of rows; the weights reach the rollout devices through the hosts."""
    workdir = tmp_path_factory.mktemp("grpo2")
    procs = start_processes(_command(lora_run, prompts, workdir, "--config.train.steps=6", *NAN_AT_3, *SPLIT),
                            workdir)
    for proc, log in zip(procs, process_logs(procs, workdir)):
        assert proc.returncode == 0, log[-3000:]
    return workdir


def test_two_processes_sample_and_train_like_one(grpo_run, two_process_grpo):
    """Same seeds, same rollouts (iteration 1's rows, saved with checkpoint 4 by each process in its block) and
    the same losses at every step within float32 summation order, through the same rollback at step 3: 2
    processes with rollouts on devices of their own against 1 process with rollouts on the trainer's devices
    (PPO's 2-process test keeps them colocated)."""
    one, two = rollout_rows(grpo_run, 4), rollout_rows(two_process_grpo, 4)
    assert set(one) == set(two) and len(one["tokens"]) == 16
    for name in ("tokens", "mask", "segment_ids", "positions", "stopped", "scores", "advantages"):
        assert np.array_equal(one[name], two[name]), name
    for name in ("old_logps", "ref_logps"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6)
    expected, got = losses(grpo_run), losses(two_process_grpo)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        np.testing.assert_allclose(got[step], expected[step], rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
    assert_rolled_back_at_3(two_process_grpo)
    synced = [r["weight_sync_s"] for r in metrics(two_process_grpo) if "loss" in r and r["step"] in RL_ITERATION_STARTS]
    assert all(s > 0 for s in synced), synced
    # Each process makes the samples of its block; process 0 writes them all.
    assert (two_process_grpo / "samples.jsonl").read_text() == (grpo_run / "samples.jsonl").read_text()
    task = lambda w: json.loads((w / "summary.json").read_text())["task"]["tuned"]["all"]
    assert task(two_process_grpo)["reward"] == task(grpo_run)["reward"]


def test_a_process_killed_in_a_rollout_ends_the_job_and_it_resumes_bitwise(two_process_grpo, lora_run, prompts,
                                                                           tmp_path):
    """Process 1 SIGKILLs itself in iteration 1's rollout (step 4, after the rollback at 3): process 0, waiting
    for it in the rollout's collectives, stops on its own naming it; restarted, the job resumes from step 2
    (iteration 0's rows come back from the checkpoint, in two blocks) and ends on the uninterrupted 2-process
    run's parameters and losses, bit for bit."""
    command = _command(lora_run, prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3, *SPLIT)
    procs = start_processes([*command, "--config.debug.kill_in_rollout=1"], tmp_path)
    # The limit bounds the whole first run (compiles, three steps, the rollback) under a loaded CI machine, not only
    # the survivor's noticing: 300 s ran out on this 2-core machine with other jobs running beside the suite.
    survivor, _ = process_logs(procs, tmp_path)
    assert procs[1].returncode == -9 and procs[0].returncode != 0, survivor[-3000:]
    assert "jaxllm: process 1 of 2 stopped responding" in survivor, survivor[-3000:]
    assert "Traceback" not in survivor
    assert max(losses(tmp_path)) == 3  # killed in step 4's rollout
    procs = start_processes(command, tmp_path)
    logs = process_logs(procs, tmp_path)
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    assert "resuming from checkpoint step 2" in logs[0], logs[0][-3000:]
    full, resumed = losses(two_process_grpo), losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(1, 7)), (resumed, full)
    for a, b in zip(checkpoint_leaves(tmp_path), checkpoint_leaves(two_process_grpo)):
        assert np.array_equal(a, b)


ONE_STEP_OFF = ("--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4", "--config.mesh.tensor=1",
                "--config.rl.max_staleness=1", "--config.rl.tis_cap=2", "--config.checkpoint.keep=3",
                "--config.grpo.max_prompt_tokens=128")  # the prompts are all shorter than 64 tokens: no change


@pytest.fixture(scope="module")
def one_step_off(lora_run, prompts, tmp_path_factory):
    """grpo_run's job with 4 devices sampling, scoring and holding the reference, the other 4 training (mesh
    data=2, fsdp=2: the same 4 row shards, so the same minibatches), one step off: iteration 1's rows are
    sampled from iteration 0's starting weights while iteration 0 trains."""
    workdir = tmp_path_factory.mktemp("one_step_off")
    proc = _run(lora_run, prompts, workdir, "--config.train.steps=6", *NAN_AT_3, *ONE_STEP_OFF)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_rollouts_on_their_own_devices_one_step_off(grpo_run, one_step_off):
    """Iteration 0 is sampled on-policy on the rollout devices: the colocated run's rows and losses within
    float32. Iteration 1's rows come from the weights iteration 0 started with: the truncated importance weights
    of the behaviour policy move off 1 there (they are 1 within float32 at iteration 0), and the ratio's old
    log-probs are the trainer's at the iteration's start (approx_kl 0 at its first step). The weights reach the
    rollout devices at step 1 only (for iterations 0 and 1; the last iteration starts no rollout); the sampler's
    recorded log-probs are what the trainer computes with the same weights, both times."""
    on_policy, stale = rollout_rows(one_step_off, 2), rollout_rows(one_step_off, 4)
    # Bucketing: the rows are as long as the iteration's longest prompt (rounded up to 32 tokens) and the
    # responses, not the longest prompt the run allows (train.seq_len, what the run planned for).
    assert on_policy["tokens"].shape[1] == stale["tokens"].shape[1] == 64 + 8
    assert json.loads((one_step_off / "config.json").read_text())["train"]["seq_len"] == 128 + 8
    assert np.abs(on_policy["tis_weights"] - on_policy["mask"]).max() < 1e-5
    assert np.abs(stale["tis_weights"] - stale["mask"]).max() > 1e-4
    assert stale["tis_weights"].max() <= 2.0
    expected, got = losses(grpo_run), losses(one_step_off)
    for step in (1, 2, 3):
        np.testing.assert_allclose(got[step], expected[step], rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
    assert got[4] != pytest.approx(expected[4], rel=1e-3)  # iteration 1: other rows, other weights
    steps = {r["step"]: r for r in metrics(one_step_off) if "loss" in r}
    for s, r in steps.items():
        assert (r["weight_sync_s"] > 0) == (s == 1), r
        assert r.get("logp_mismatch_mean", 0) < 1e-6 and r.get("logp_mismatch_max", 0) < 1e-5, r
    for s in RL_ITERATION_STARTS:
        assert steps[s]["approx_kl"] < 1e-9 and "logp_mismatch_max" in steps[s]
    # Step 1 sampled iteration 0 itself; step 4 took iteration 1's rows sampled ahead (restored with checkpoint
    # 2 by the rollback: the rollout that made them ran before it).
    assert steps[1]["rollout_s"] > 0 and "rollout_wait_s" in steps[4]


def test_one_step_off_resumes_bitwise_with_a_rollout_in_flight(one_step_off, lora_run, prompts, tmp_path):
    """Checkpoint 2 was saved while iteration 1's rollout was in flight: it waited for it and saved it. Resumed
    from there (the later checkpoints removed), the run ends on the uninterrupted one's parameters and losses,
    bit for bit, through the same rollback at step 3."""
    workdir = tmp_path / "run"
    shutil.copytree(one_step_off, workdir)
    for step in (4, 6):
        shutil.rmtree(workdir / "checkpoints" / str(step))
    assert "ahead" in json.loads((workdir / "checkpoints" / "2" / "data" / "metadata").read_text())
    proc = _run(lora_run, prompts, workdir, "--config.train.steps=6", *NAN_AT_3, *ONE_STEP_OFF)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint step 2" in proc.stdout
    full, resumed = losses(one_step_off), losses(workdir)
    assert all(resumed[s] == full[s] for s in range(1, 7)), (resumed, full)
    for a, b in zip(checkpoint_leaves(workdir), checkpoint_leaves(one_step_off)):
        assert np.array_equal(a, b)


def test_full_fine_tuning_keeps_its_reference_on_the_rollout_devices(lora_run, prompts, tmp_path):
    """lora.rank=0: every weight trains, and the reference (the base, frozen) lives on the rollout devices only.
    At iteration 0 it is the policy that sampled (its log-probs equal the recorded ones); at iteration 1 the policy
    has moved and the reference has not."""
    proc = _run(lora_run, prompts, tmp_path, "--config.train.steps=6", "--config.lora.rank=0",
                "--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4", "--config.mesh.tensor=1",
                "--config.checkpoint.keep=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = rollout_rows(tmp_path, 2), rollout_rows(tmp_path, 6)
    gap = lambda rows: np.abs(rows["ref_logps"] - rows["old_logps"])[rows["mask"] > 0]
    assert gap(first).max() < 1e-5 and gap(second).max() > 1e-3, (gap(first).max(), gap(second).max())
    steps = {r["step"]: r for r in metrics(tmp_path) if "loss" in r}
    assert steps[1]["kl"] < 1e-7 < steps[5]["kl"]  # iterations start at steps 1 and 5 (no rollback here)
    assert len(checkpoint_leaves(tmp_path)) > 4  # the whole model trained and saved, not adapters


@pytest.mark.parametrize("setting, message", [
    ("--config.grpo.reward=fn:nope", "grpo.reward: no reward function 'nope'; registered:"),
    ("--config.grpo.reward=rm", "grpo.reward: expected fn:<name>"),
    ("--config.grpo.reward=rm:/nonexistent", "grpo.reward: no reward-model checkpoint at /nonexistent"),
    ("--config.grpo.num_generations=3", "train.batch_size: 8 does not divide an iteration's 12 responses"),
    ("--config.lora.rank=0", "lora.rank: full fine-tuning GRPO (lora.rank=0) keeps its frozen reference on the "
                             "rollout devices"),
    ("--config.grpo.train_file=/nonexistent.jsonl", "grpo.train_file: no such file"),
])
def test_bad_settings_are_one_line_errors(lora_run, prompts, tmp_path, setting, message):
    proc = _run(lora_run, prompts, tmp_path, "--config.train.steps=2", setting)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_resume_under_another_reward_is_refused_and_nothing_moves(grpo_run, lora_run, prompts, tmp_path):
    """The run's checkpoints were trained on fn:single_line: resumed with fn:ends_sentence the run would go on
    toward another goal (or, at its last step, report its policy under the new reward as trained on it)."""
    workdir = tmp_path / "run"
    shutil.copytree(grpo_run, workdir)
    before = sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
    proc = _run(lora_run, prompts, workdir, "--config.train.steps=6", "--config.grpo.reward=fn:ends_sentence")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "grpo.reward: this run's checkpoints" in proc.stderr and "fn:single_line, not fn:ends_sentence" in \
        proc.stderr, proc.stderr[-2000:]
    assert sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in workdir.rglob("*")) == before


def test_an_injected_nan_rolls_back(grpo_run):
    """The non-finite step 3 (mid-iteration) rolled back to the checkpoint of step 2, which holds the iteration's
    rollout: the replayed step 3 trains on it without a new rollout (test_each_iteration_starts_at_ratio_1)."""
    assert_rolled_back_at_3(grpo_run)


def test_a_reward_model_scores_the_rollouts(lora_run, prompts, reward_checkpoint, tmp_path):
    proc = _run(lora_run, prompts, tmp_path, "--config.train.steps=2", f"--config.grpo.reward=rm:{reward_checkpoint}",
                "--config.grpo.epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [s["reward"] for s in (json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines())]
    assert len(set(rewards)) == len(rewards) == 3 and all(np.isfinite(rewards))  # real-valued scores
    bad = _run(lora_run, prompts, tmp_path / "bad", "--config.train.steps=2", f"--config.grpo.reward=rm:{lora_run}")
    assert bad.returncode == 2 and "is not a reward model" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def trained_base(shakespeare_store, tmp_path_factory):
    """The tiny model pretrained for 60 steps: unlike the 2-step bases, whose output is near uniform, its head
    tells tokens apart, so a few policy-gradient updates can move the response distribution."""
    workdir = tmp_path_factory.mktemp("trained_base")
    proc = run_command(train_command(shakespeare_store, workdir, "--config.train.steps=60", "--config.optim.lr=3e-2",
                                     "--config.checkpoint.every=60", "--config.train.eval_every=1000"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_the_reward_rises(trained_base, prompts, tmp_path):
    """10 iterations of 16 prompts x 4 responses, rewarded by the vowel share of each response: the mean reward
    of the last 3 iterations clearly beats the first 2's (measured: 0.35 -> 0.52; iteration means vary by about
    0.02). Adapters on the attention and MLP outputs as well, so that a 60-step base can shift its logits."""
    command = _command(trained_base, prompts, tmp_path, "--config.train.steps=40", "--config.optim.lr=6e-2",
                       "--config.grpo.reward=fn:rl_test_rewards:vowel_fraction", "--config.grpo.beta=0",
                       "--config.grpo.prompts_per_iteration=16", "--config.train.batch_size=32",
                       "--config.lora.targets=q_proj,v_proj,o_proj,down_proj", "--config.checkpoint.every=100")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=train_env(PYTHONPATH=str(ROOT / "tests")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    by_iteration = [np.mean([r["reward"] for r in rows if 4 * i < r["step"] <= 4 * i + 4]) for i in range(10)]
    assert np.mean(by_iteration[-3:]) > np.mean(by_iteration[:2]) + 0.05, by_iteration


def test_the_checkpoint_serves_generate_eval_export_and_restore_from(grpo_run, tmp_path):
    """The run's checkpoint holds its policy's adapters only: it loads as the policy on its base,
    exports, and seeds another run."""
    assert_serves_the_tools(grpo_run, tmp_path)


@pytest.mark.parametrize("report, expected", [("--print_sharding", "PartitionSpec"), ("--print_memory", "largest of")])
def test_parameter_reports_of_a_run_with_rollout_devices_use_the_trainer_mesh(lora_run, prompts, tmp_path, report,
                                                                             expected):
    proc = run_command([*_command(lora_run, prompts, tmp_path / "w", *ONE_STEP_OFF), report])
    assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "w").exists()  # a report trains nothing


def test_the_dry_run_plans_what_the_run_built(grpo_run, lora_run, prompts):
    assert_dry_run_plans_the_run(_command(lora_run, prompts, grpo_run, "--config.train.steps=6", *NAN_AT_3), grpo_run)
