"""PPO's actor-critic and loss on the shared step (in process, tiny model): the critic shares the policy's base
arrays (no second copy) and equals a reward model built on that base; on one fixed rollout batch the first
updates' losses agree on (8,1,1,1), (2,2,2,1) and 2 pipeline stages; at an iteration's first update the ratio is
1 and the loss is the pure losses' sum; an approx-KL early stop leaves the state untouched; the per-token
rewards and the adaptive KL controller follow TRL's formulas."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.fine_tuning import PPOConfig
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, OptimConfig, PipelineConfig, PrecisionConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.model.actor_critic import VALUE
from jaxllm.model.reward import RewardModel
from jaxllm.optim.chain import make_optimizer
from jaxllm.objectives.losses import ppo_policy_loss, ppo_value_loss
from jaxllm.objectives.rollout import response_logps, sequence_layout
from jaxllm.model.reference import reference_model
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.ppo import actor_critic_objective, adapt_kl_coef, ppo_loss_fn, ppo_values, token_rewards
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.state import init_objective_state
from jaxllm.model.build import build_model
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

from layout_steps import first_updates

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,v_proj,o_proj,down_proj")
PPO = PPOConfig(clip=0.2, value_clip=0.2, vf_coef=0.1)
B, P, N = 8, 8, 8


def _rollout_batch(seed=0) -> dict[str, np.ndarray]:
    """A fixed batch of rollout rows: left-padded prompts, responses of 1..8 tokens, sampler log-probs near the
    model's, values, returns and whitened-looking advantages per token."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (B, P + N)).astype(np.int32)
    start = rng.integers(0, P - 1, B).astype(np.int32)
    tokens[np.arange(P + N)[None, :] < start[:, None]] = 0
    lengths = rng.integers(1, N + 1, B)
    mask = (np.arange(N)[None, :] < lengths[:, None]).astype(np.float32)
    segment_ids, positions = (np.asarray(x) for x in sequence_layout(tokens, start))
    per_token = lambda scale: (rng.normal(0, scale, (B, N)) * mask).astype(np.float32)
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "mask": mask,
            "old_logps": -rng.uniform(3.0, 6.0, (B, N)).astype(np.float32) * mask,
            "old_values": per_token(0.1), "returns": per_token(1.0), "advantages": per_token(1.0),
            "scores": rng.uniform(0, 1, (B, 1)).astype(np.float32), "rewards": rng.normal(0, 1, (B, 1)).astype(np.float32),
            "kl": rng.uniform(0, 1, (B, 1)).astype(np.float32), "kl_coef": np.full((B, 1), 0.05, np.float32),
            "stopped": np.ones((B, 1), np.float32)}


def _objective(pipeline=PipelineConfig(), ppo=PPO):
    return dataclasses.replace(actor_critic_objective(MODEL, F32, pipeline, LORA),
                               loss_fn=functools.partial(ppo_loss_fn, ppo=ppo))


def _flat(state) -> dict:
    return {path: variable for path, variable in nnx.to_flat_state(state)}


def test_the_critic_shares_the_policy_base_and_is_a_reward_model_on_it():
    objective = _objective()
    graphdef, trainable, frozen = objective.split(objective.build_model(jax.random.key(0)))
    plain = nnx.state(lm_objective(MODEL, F32).build_model(jax.random.key(0)))
    # The frozen tree is a plain LM's, path for path: the base is held once and loads as a base checkpoint.
    assert list(_flat(frozen)) == list(_flat(plain))
    assert sum(x.nbytes for x in jax.tree.leaves(frozen)) == sum(x.nbytes for x in jax.tree.leaves(plain))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x + 0.05, trainable), frozen)  # adapters off their zero start
    critic_own = nnx.Any(nnx.LoRAParam, nnx.PathContains("score"))
    critic_base = _flat(nnx.state(model.value, nnx.Not(critic_own)))
    base = _flat(frozen)
    assert list(critic_base) == [p for p in base if p != ("lm_head",)]
    for path, variable in critic_base.items():  # buffer identity: the critic's base arrays are the frozen ones
        assert variable.get_value() is base[path].get_value(), path
    reference = nnx.state(reference_model(model, lm_objective(MODEL, F32).graphdef))
    assert all(a is b for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(frozen)))  # the base, no copy
    # The critic computes what a reward model on the same base, with the critic's adapters and head, computes.
    reward_model = build_model(MODEL, F32, jax.random.key(1), lora=LORA, model_class=RewardModel)
    rm_graph, rm_state = nnx.split(reward_model)
    rm_flat = {**_flat(rm_state), **critic_base, **_flat(nnx.state(model.value, critic_own))}
    rm = nnx.merge(rm_graph, nnx.from_flat_state(rm_flat))
    batch = _rollout_batch()
    layout = batch["tokens"], batch["segment_ids"], batch["positions"]
    np.testing.assert_allclose(ppo_values(model, *layout, P), rm(*layout)[:, P - 1:-1], rtol=1e-6, atol=1e-6)
    # ... and the policy is the LoRA LM on the base with the policy's adapters, untouched by the critic.
    lm_graph = lm_objective(MODEL, F32, lora=LORA).graphdef
    lm = nnx.merge(lm_graph, nnx.state(model, nnx.Not(VALUE)))
    np.testing.assert_allclose(response_logps(model, *layout, P), response_logps(lm, *layout, P), rtol=1e-6)


def test_the_reference_and_value_passes_run_as_one_program():
    """`_scoring_pass` with PPO's value_fn gives what the two passes give apart: the reference's log-probs (the
    base, adapters off) and the critic's values, from one dispatch over the shared base arrays."""
    from jaxllm.objectives.rl import _scoring_pass

    objective = _objective()
    graphdef, trainable, frozen = objective.split(objective.build_model(jax.random.key(0)))
    variables = nnx.merge_state(jax.tree.map(lambda x: x + 0.05, trainable), frozen)
    model = nnx.merge(graphdef, variables)
    plain = lm_objective(MODEL, F32).graphdef
    reference = nnx.state(reference_model(model, plain))
    layout = _rollout_batch()["tokens"], _rollout_batch()["segment_ids"], _rollout_batch()["positions"]
    fused = _scoring_pass(graphdef, plain, variables, reference, *layout, prompt_len=P, temperature=1.0,
                          value_fn=ppo_values)
    np.testing.assert_allclose(fused["values"], ppo_values(model, *layout, P), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fused["ref_logps"], response_logps(nnx.merge(plain, reference), *layout, P),
                               rtol=1e-6, atol=1e-6)
    assert set(_scoring_pass(graphdef, plain, variables, reference, *layout, prompt_len=P, temperature=1.0)) == \
        {"ref_logps"}  # GRPO: no critic


@functools.cache
def _losses(layout):
    return first_updates(_objective, layout, _rollout_batch(), names=("loss", "value_loss"))


def test_first_updates_agree_across_layouts_and_stages():
    reference = _losses((8, 1, 1, 1))
    assert reference[-1][0] < reference[0][0] and reference[-1][1] != reference[0][1]  # both move
    for layout in ((2, 2, 2, 1), (4, 1, 1, 2), MeshConfig(data=4, context=2)):
        np.testing.assert_allclose(_losses(layout), reference, rtol=1e-5, atol=1e-6, err_msg=str(layout))


def test_the_actor_critic_trains_through_1f1b():
    """Two trained passes through one base: the explicit schedule runs the policy's, then the critic's, each with
    the other's output given, and their gradients add up to the unpipelined ones. Metrics are means over
    micro-batches: 2 accumulated x 2 pipelined against 4 accumulated, the same rows in each. (The gradient's norm
    too: AdamW's first steps barely see a gradient counted twice.)"""
    names = ("loss", "value_loss", "grad_norm")
    piped = first_updates(lambda pipeline: _objective(dataclasses.replace(pipeline, schedule="1f1b")),
                          (2, 1, 2, 2), _rollout_batch(), names=names)
    accumulated = first_updates(_objective, MeshConfig(data=2, tensor=2, context=2), _rollout_batch(), names=names,
                                grad_accum=4)
    np.testing.assert_allclose(piped, accumulated, rtol=1e-5, atol=1e-6)


def _policy_and_batch(ppo=PPO):
    """The fresh actor-critic with its adapters moved off zero, and a batch whose sampler log-probs are its own
    (an iteration's first minibatch)."""
    objective = _objective(ppo=ppo)
    model = objective.build_model(jax.random.key(0))
    nnx.update(model, jax.tree.map(lambda x: x + 0.05, nnx.state(model, nnx.LoRAParam)))
    batch = _rollout_batch()
    layout = batch["tokens"], batch["segment_ids"], batch["positions"]
    batch["old_logps"] = np.asarray(response_logps(model, *layout, P)) * batch["mask"]
    return objective, model, batch, layout


def test_at_an_iterations_first_update_the_ratio_is_1_and_the_loss_is_the_pure_losses_sum():
    ppo = dataclasses.replace(PPO, entropy_coef=0.01)
    _, model, batch, layout = _policy_and_batch(ppo)
    loss_sum, count, metrics = ppo_loss_fn(model, batch, ppo=ppo)
    mask = batch["mask"]
    assert float(count) == mask.sum()  # a token mean over the minibatch
    assert float(metrics["clip_fraction"]) == 0.0 and float(metrics["approx_kl"]) < 1e-12
    logps = response_logps(model, *layout, P)
    values = ppo_values(model, *layout, P)
    policy = ppo_policy_loss(logps, batch["old_logps"], batch["advantages"], mask, 0.2)[0]
    value = ppo_value_loss(values, batch["old_values"], batch["returns"], mask, 0.2)
    want = float(policy) + 0.1 * float(value) - 0.01 * float(metrics["entropy"])
    np.testing.assert_allclose(float(loss_sum / count), want, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["value_loss"]), float(value), rtol=1e-6)
    assert float(metrics["entropy"]) > 4.0  # a near-uniform tiny model: close to log 128 = 4.85


def test_an_update_past_max_approx_kl_is_skipped():
    """One compiled step, two minibatches: one sampled by a policy that has since moved (approx KL past the
    limit: parameters, optimizer state untouched), then one of the current policy's own (it updates)."""
    ppo = dataclasses.replace(PPO, max_approx_kl=1e-6)
    objective, model, batch, layout = _policy_and_batch(ppo)
    moved = dict(batch, old_logps=batch["old_logps"] - 0.1 * batch["mask"])
    mesh = make_mesh(MeshConfig(8, 1, 1, 1))
    tx = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10)
    leaves = lambda state: [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        before = leaves(state)
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh, frozen_shardings)
        state, skipped = step(state, to_global(moved, batch_sharding(mesh), B), frozen)
        assert float(skipped["approx_kl"]) > 1e-6 and int(state.step) == 1
        assert all(np.array_equal(a, b) for a, b in zip(before, leaves(state)))
        policy = nnx.merge(objective.graphdef, state.params, frozen)  # the step's policy, its sampler log-probs
        own = dict(batch, old_logps=np.asarray(response_logps(policy, *layout, P)) * batch["mask"])
        state, updated = step(state, to_global(own, batch_sharding(mesh), B), frozen)
        assert float(updated["approx_kl"]) < 1e-12
        assert any(not np.array_equal(a, b) for a, b in zip(before, leaves(state)))
    # Without a limit the loss has no veto metric: the step compiles as every other objective's.
    assert "skip_update" in skipped and "skip_update" not in jax.eval_shape(
        lambda: ppo_loss_fn(model, batch, ppo=PPO)[2])


def _trl_token_rewards(scores, stopped, kl, mask, kl_coef, penalty):
    """TRL's PPOTrainer.train (trl/trainer/ppo_trainer.py, last published) in NumPy: scores[~contain_eos] -=
    missing_eos_penalty; rewards = -kl_coef * kl; rewards[row, end] += scores, with the end at the response's
    last token (TRL puts it one slot later when there is room, where its value mask still reaches; here the
    issue's definition, the last token, is used)."""
    scores = scores - penalty * (stopped == 0)
    rewards = -kl_coef * kl * mask
    for row, length in enumerate(mask.sum(axis=1).astype(int)):
        rewards[row, length - 1] += scores[row]
    return rewards


def test_token_rewards_put_the_score_at_the_last_token_less_the_missing_eos_penalty():
    rng = np.random.default_rng(0)
    mask = (np.arange(N)[None, :] < rng.integers(1, N + 1, B)[:, None]).astype(np.float32)
    scores, stopped = rng.normal(0, 1, B), (rng.uniform(size=B) < 0.5).astype(np.float32)
    kl = rng.normal(0, 0.3, (B, N)).astype(np.float32)
    got = token_rewards(scores, stopped, kl, mask, 0.05, 1.5)
    np.testing.assert_allclose(got, _trl_token_rewards(scores, stopped, kl, mask, 0.05, 1.5), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.sum(axis=1), scores - 1.5 * (1 - stopped) - 0.05 * (kl * mask).sum(axis=1),
                               rtol=1e-5, atol=1e-6)


def test_the_adaptive_kl_controller_is_trls():
    """TRL's AdaptiveKLController.update (trl/trainer/utils.py, last published with PPO): proportional_error =
    clip(current / target - 1, -0.2, 0.2); value *= 1 + proportional_error * n_steps / horizon."""
    for current, target in ((3.0, 6.0), (6.5, 6.0), (60.0, 6.0)):
        want = 0.2 * (1 + np.clip(current / target - 1, -0.2, 0.2) * 512 / 10000)
        assert adapt_kl_coef(0.2, current, target, 10000, 512) == pytest.approx(want, rel=1e-12)
    assert adapt_kl_coef(0.2, 60.0, 6.0, 100, 100) == pytest.approx(0.24)  # above target: the penalty grows
