"""PPO as real `scripts/train.py` processes on the tiny LoRA SFT run: rollouts, critic values and GAE inside the
training program, the ratio at 1 at each iteration's first update, every PPO metric in metrics.jsonl, an
adaptive KL coefficient carried across iterations, rollback of an injected NaN to a mid-iteration checkpoint,
bitwise resume after SIGTERM in the middle of an iteration's updates, and bad settings as one-line errors."""

import json

import numpy as np
import pytest

from train_runs import (NAN_AT_3, RL_ITERATION_STARTS, assert_rolled_back_at_3, assert_dry_run_plans_the_run,
                        assert_serves_the_tools, checkpoint_leaves, losses, metrics, preempt_at, process_logs,
                        rl_command, rollout_rows, run_command, start_processes)


# 16 prompts, one response each, 2 epochs of 2 minibatches of 8: 4 steps an iteration. target_kl adapts kl_coef.
SMALL = ("--config.train.batch_size=8", "--config.checkpoint.every=2", "--config.ppo.prompts_per_iteration=16",
         "--config.ppo.epochs=2", "--config.ppo.max_prompt_tokens=64", "--config.ppo.max_new_tokens=8",
         "--config.ppo.eval_prompts=8", "--config.ppo.reward=fn:single_line", "--config.ppo.target_kl=0.01",
         "--config.ppo.kl_horizon=16", "--config.ppo.missing_eos_penalty=0.5", "--config.ppo.kl_coef=0.05")
METRICS = ("policy_loss", "value_loss", "clip_fraction", "approx_kl", "entropy", "explained_variance", "score",
           "reward", "kl", "kl_coef", "response_length", "eos_rate", "rollout_s", "scoring_s",
           "tokens_per_sec")


def _command(base, prompts, workdir, *args):
    return rl_command("ppo", base, prompts, workdir, *SMALL, *args)


def _run(*command_args):
    return run_command(_command(*command_args))


@pytest.fixture(scope="module")
def ppo_run(lora_run, rl_prompts, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ppo")
    proc = _run(lora_run, rl_prompts, workdir, "--config.train.steps=6", *NAN_AT_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "critic: LoRA adapters and a value head on the policy's frozen base (shared, no second copy)" in proc.stdout
    finals = [line for line in proc.stdout.splitlines() if line.startswith("step      6/6")]
    assert finals, proc.stdout[-3000:]
    last = finals[-1]
    assert all(f" {name} " in last for name in ("score", "kl", "approx_kl", "value_loss")), last  # progress line
    return workdir


def test_each_iteration_starts_at_ratio_1_and_logs_every_ppo_metric(ppo_run):
    steps = {r["step"]: r for r in metrics(ppo_run) if "loss" in r}
    assert sorted(steps) == list(range(1, 7))
    assert all(name in r for r in steps.values() for name in METRICS), sorted(steps[1])
    for first in RL_ITERATION_STARTS:  # iterations 0 and 1's first minibatch: the policy is the one that sampled
        assert steps[first]["clip_fraction"] == 0.0 and steps[first]["approx_kl"] < 1e-9, steps[first]
        assert steps[first]["rollout_s"] > 0 and steps[first]["scoring_s"] > 0
        assert steps[first]["rollout_tokens_per_sec"] > 0
    assert min(steps[s]["approx_kl"] for s in (2, 3, 5, 6)) > 1e-7  # later minibatches follow updates
    # Iteration 0's policy is its reference (KL ~0, far below target_kl): the coefficient shrinks by the most
    # one update allows, 1 - 0.2 x 16 responses / kl_horizon 16.
    assert steps[1]["kl_coef"] == pytest.approx(0.05) and steps[4]["kl_coef"] == pytest.approx(0.04)
    for r in steps.values():
        assert 0.0 <= r["score"] <= 1.0 and 0.0 <= r["eos_rate"] <= 1.0 and 0 < r["response_length"] <= 8
        assert r["entropy"] > 0 and r["value_loss"] > 0
        # The per-response reward is the score less the KL penalty and, without an EOS, the penalty of 0.5.
        assert r["reward"] == pytest.approx(r["score"] - r["kl_coef"] * r["kl"] - 0.5 * (1 - r["eos_rate"]),
                                            abs=1e-5)
    summary = json.loads((ppo_run / "summary.json").read_text())
    assert {"reward", "kl", "eos_rate", "length"} <= set(summary["task"]["tuned"]["all"])
    # The policy (the actor-critic's decoder with its adapters) on the SFT task of its base, before and after.
    assert {"exact_match", "perplexity"} <= set(summary["sft_task"]["tuned"]["all"]) <= set(summary["sft_task"]["base"]["all"])


def test_resumes_bitwise_after_sigterm_mid_iteration(ppo_run, lora_run, rl_prompts, tmp_path):
    """Preempted after step 3 (iteration 0 has one minibatch left): the resumed run trains on the saved rollout,
    with the saved KL coefficient for iteration 1, and ends with the uninterrupted run's parameters (policy and
    critic adapters, critic head) and optimizer state, bit for bit."""
    assert preempt_at(_command(lora_run, rl_prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3), tmp_path, 3) == 3
    again = _run(lora_run, rl_prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from checkpoint step 3" in again.stdout
    full, resumed = losses(ppo_run), losses(tmp_path)
    assert all(resumed[s] == full[s] for s in range(1, 7)), (resumed, full)
    for a, b in zip(checkpoint_leaves(tmp_path), checkpoint_leaves(ppo_run)):
        assert np.array_equal(a, b)


def test_two_processes_sample_and_train_like_one(ppo_run, lora_run, rl_prompts, tmp_path):
    """ppo_run's job as 2 processes x 4 devices: the same rollouts, values, whitened advantages (over both
    processes' rows) and KL coefficient (from both processes' KL), so the same losses at every step within
    float32 summation order."""
    procs = start_processes(_command(lora_run, rl_prompts, tmp_path, "--config.train.steps=6", *NAN_AT_3), tmp_path)
    for proc, log in zip(procs, process_logs(procs, tmp_path)):
        assert proc.returncode == 0, log[-3000:]
    one, two = rollout_rows(ppo_run, 4), rollout_rows(tmp_path, 4)
    for name in ("tokens", "mask", "stopped", "scores"):
        assert np.array_equal(one[name], two[name]), name
    for name in ("old_logps", "ref_logps", "old_values", "advantages", "returns", "kl_coef"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-5, err_msg=name)
    expected, got = losses(ppo_run), losses(tmp_path)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        np.testing.assert_allclose(got[step], expected[step], rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
    kl_coef = lambda w: [r["kl_coef"] for r in metrics(w) if "loss" in r]
    assert kl_coef(tmp_path) == kl_coef(ppo_run) and len(set(kl_coef(ppo_run))) == 2  # adapted once, alike


def test_a_critic_starts_as_a_trained_reward_model(lora_run, rl_prompts, reward_checkpoint, tmp_path):
    """ppo.critic_init=rm:<checkpoint>: the critic is the reward model (its own frozen body and its head, the
    critic's adapters starting at zero), so iteration 0's values are that reward model's scores of the rows; the
    policy's base and reference are untouched (the ratio is 1 at the first update), and a resume loads the
    critic's body from the reward model again."""
    from jaxllm.runs.loader import load_checkpoint

    args = (f"--config.ppo.critic_init=rm:{reward_checkpoint}", "--config.ppo.epochs=1",
            "--config.ppo.prompts_per_iteration=8", "--config.checkpoint.every=1")  # an iteration a step
    proc = _run(lora_run, rl_prompts, tmp_path, "--config.train.steps=2", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"critic: the reward model {reward_checkpoint}" in proc.stdout
    rows = rollout_rows(tmp_path, 1)  # iteration 0's, scored by the critic as it started
    P = rows["tokens"].shape[1] - rows["mask"].shape[1]
    rm = load_checkpoint(str(reward_checkpoint)).model
    scores = np.asarray(rm(rows["tokens"], rows["segment_ids"], rows["positions"]))[:, P - 1:-1] * rows["mask"]
    np.testing.assert_allclose(rows["old_values"], scores, rtol=1e-4, atol=1e-4)
    assert np.abs(scores).max() > 1e-2  # a real reward model's scores, not a fresh head's zeros-ish output
    assert [r["approx_kl"] < 1e-9 for r in metrics(tmp_path) if "loss" in r] == [True, True]
    again = _run(lora_run, rl_prompts, tmp_path, "--config.train.steps=3", *args)
    assert again.returncode == 0 and "resuming from checkpoint step 2" in again.stdout, again.stderr[-3000:]
    bad = _run(lora_run, rl_prompts, tmp_path / "bad", "--config.train.steps=1", *args[1:],
               f"--config.ppo.critic_init=rm:{lora_run}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert f"ppo.critic_init: {lora_run} is not a reward model" in bad.stderr, bad.stderr[-2000:]


def test_full_fine_tuning_trains_a_critic_of_its_own(lora_run, rl_prompts, tmp_path):
    """lora.rank=0: policy and critic are two whole models, every weight trained; the critic's body starts as a
    copy of the base (a learning rate small enough that 5 steps leave it within 1e-4 of it, yet moved), and the
    reference (the base, frozen, on the rollout devices) is at iteration 0 the policy that sampled."""
    import jax
    from flax import nnx

    from jaxllm.model.actor_critic import VALUE
    from jaxllm.model.lora import merge
    from jaxllm.objectives.ppo import actor_critic_objective
    from jaxllm.parallel.mesh import single_device_mesh
    from jaxllm.runs.checkpoint import Checkpointer
    from jaxllm.runs.loader import load_checkpoint

    proc = _run(lora_run, rl_prompts, tmp_path, "--config.train.steps=5", "--config.lora.rank=0",
                "--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4", "--config.mesh.tensor=1",
                "--config.optim.lr=1e-5", "--config.checkpoint.keep=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "critic: a model of its own, every weight trained (full fine-tuning), from the base" in proc.stdout
    first = rollout_rows(tmp_path, 2)  # iteration 0's
    assert np.abs(first["ref_logps"] - first["old_logps"])[first["mask"] > 0].max() < 1e-5
    flat = lambda state: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
    base = flat(nnx.state(merge(load_checkpoint(str(lora_run)).model), nnx.Param))
    policy = load_checkpoint(str(tmp_path))
    assert any(not np.array_equal(v, base[p]) for p, v in flat(policy.params).items())  # the policy trained
    abstract = jax.eval_shape(lambda: nnx.state(actor_critic_objective(policy.model_cfg, policy.precision)
                                                .build_model(jax.random.key(0)), VALUE))
    source, mesh = Checkpointer(tmp_path / "checkpoints", keep=1000, log=lambda *_: None), single_device_mesh()
    with jax.set_mesh(mesh):
        critic = flat(source.restore_params(5, abstract, mesh))
    source.close()
    body = [p for p in critic if p[1:] in base]
    assert len(body) == len([p for p in base if p[0] != "lm_head"]) and ("value", "score") in critic, sorted(critic)
    for path in body:  # the base it started from, moved by training
        moved = np.abs(critic[path] - base[path[1:]]).max()
        assert 0 < moved < 1e-4, (path, moved)


def test_an_injected_nan_rolls_back(ppo_run):
    """The non-finite step 3 (mid-iteration) rolled back to the checkpoint of step 2, which holds the iteration's
    rollout, values and advantages: the replayed step 3 trains on them without a new rollout."""
    assert_rolled_back_at_3(ppo_run)
    assert {r["step"]: r for r in metrics(ppo_run) if "loss" in r}[3]["rollout_s"] == 0  # the replay's, not sampled


@pytest.mark.parametrize("setting, message", [
    ("--config.ppo.kl_estimator=k4", "ppo.kl_estimator: 'k4' is not one of"),
    ("--config.ppo.lam=1.5", "ppo.lam: must be in [0, 1]"),
    ("--config.ppo.prompts_per_iteration=12", "train.batch_size: 8 does not divide an iteration's 12 responses"),
    ("--config.lora.rank=0", "lora.rank: full fine-tuning PPO (lora.rank=0) keeps its frozen reference on the "
                             "rollout devices"),
    ("--config.ppo.critic_init=rm", "ppo.critic_init: expected \"\" (a fresh head on the policy's base) or rm:"),
    ("--config.ppo.critic_init=rm:/nonexistent", "ppo.critic_init: no reward-model checkpoint at /nonexistent"),
])
def test_bad_settings_are_one_line_errors(lora_run, rl_prompts, tmp_path, setting, message):
    proc = _run(lora_run, rl_prompts, tmp_path, "--config.train.steps=2", setting)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_the_checkpoint_serves_generate_eval_export_and_restore_from(ppo_run, tmp_path):
    """The run's checkpoint holds its policy's adapters and the critic only: it loads as the policy on its base,
    exports, and seeds another run."""
    assert_serves_the_tools(ppo_run, tmp_path)


def test_the_dry_run_plans_what_the_run_built(ppo_run, lora_run, rl_prompts):
    assert_dry_run_plans_the_run(_command(lora_run, rl_prompts, ppo_run, "--config.train.steps=6", *NAN_AT_3), ppo_run)
