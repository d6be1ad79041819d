"""A mixture of experts' auxiliary losses in every objective: the reward model, DPO, GRPO and PPO add the router
penalty of their trained forward to the gradient exactly as language modelling does (once per counted unit, so
the step's mean gains it once), report it in their metrics, and keep their own loss value."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.fine_tuning import GRPOConfig, PPOConfig
from jaxllm.config.presets import PRESETS
from jaxllm.config.schema import LoRAConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.preference import pack_pairs
from jaxllm.model.moe import router_losses, router_penalty
from jaxllm.objectives.dpo import dpo_loss_fn
from jaxllm.objectives.grpo import grpo_loss_fn
from jaxllm.objectives.ppo import actor_critic_objective, ppo_loss_fn
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.reward import reward_loss, reward_model_objective
from jaxllm.objectives.rollout import sequence_layout

F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
VOCAB, K, SEQ = 128, 2, 48
COEF, Z_COEF = 0.1, 0.01
ATTENTION_LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,k_proj,v_proj,o_proj")


def _moe(aux: float, z: float) -> ModelConfig:
    return ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=VOCAB, moe_aux_loss_coef=aux, moe_z_loss_coef=z))


def _pair_rows():
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(8):
        prompt = [2] + list(rng.integers(4, VOCAB, rng.integers(3, 8)))
        sides = []
        for _ in range(2):
            response = list(rng.integers(4, VOCAB, rng.integers(2, 9))) + [3]
            sides.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
        pairs.append(tuple(sides))
    return pack_pairs(pairs, SEQ, 0, K)[0]


def _rollout_rows(B=8, P=8, N=8):
    """Left-padded rollout rows with every field GRPO's and PPO's losses read."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, (B, P + N)).astype(np.int32)
    start = rng.integers(0, P - 1, B).astype(np.int32)
    tokens[np.arange(P + N)[None, :] < start[:, None]] = 0
    mask = (np.arange(N)[None, :] < rng.integers(1, N + 1, B)[:, None]).astype(np.float32)
    segment_ids, positions = (np.asarray(x) for x in sequence_layout(tokens, start))
    per_token = lambda scale: (rng.normal(0, scale, (B, N)) * mask).astype(np.float32)  # noqa: E731
    per_row = lambda: rng.uniform(0, 1, (B, 1)).astype(np.float32)  # noqa: E731
    logps = -rng.uniform(3.0, 6.0, (B, N)).astype(np.float32) * mask
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "mask": mask,
            "old_logps": logps, "ref_logps": logps + per_token(0.1), "advantages": per_token(1.0),
            "old_values": per_token(0.1), "returns": per_token(1.0), "scores": per_row(), "rewards": per_row(),
            "kl": per_row(), "kl_coef": np.full((B, 1), 0.05, np.float32), "stopped": np.ones((B, 1), np.float32)}


def _reward(model):
    return reward_model_objective(model, F32, pairs_per_row=K), _pair_rows()  # full fine-tuning: routers train


def _dpo(model):
    plain = lm_objective(model, F32).graphdef
    policy = lm_objective(model, F32, lora=ATTENTION_LORA)  # the routers frozen: the penalty trains the adapters
    return dataclasses.replace(policy, loss_fn=functools.partial(dpo_loss_fn, plain_graphdef=plain,
                                                                 pairs_per_row=K)), _pair_rows()


def _grpo(model):
    grpo = GRPOConfig(beta=0.04, clip=0.2, loss_agg="dapo")
    return (dataclasses.replace(lm_objective(model, F32), loss_fn=functools.partial(grpo_loss_fn, grpo=grpo)),
            _rollout_rows())


def _ppo(model):
    ppo = PPOConfig(clip=0.2, value_clip=0.2, vf_coef=0.1)
    objective = actor_critic_objective(model, F32, PipelineConfig(), ATTENTION_LORA)
    return dataclasses.replace(objective, loss_fn=functools.partial(ppo_loss_fn, ppo=ppo)), _rollout_rows()


def _trained_forward_router(model, batch):
    """The router sums of the policy's (or reward model's) trained forward of `batch`, recomputed apart."""
    forward = model.hidden_states_and_router
    return forward(batch["tokens"], batch["segment_ids"], batch["positions"])[1]


def _grads(make, aux: float, z: float):
    """(loss sum, count, metrics, gradients of the trainable variables, the model config, the batch) of one
    objective's loss_fn with moe_tiny's auxiliary coefficients `aux` and `z`."""
    objective, batch = make(_moe(aux, z))
    graphdef, trainable, frozen = objective.split(objective.build_model(jax.random.key(0)))
    if jax.tree.leaves(nnx.state(nnx.merge(graphdef, trainable, frozen), nnx.LoRAParam)):
        trainable = jax.tree.map(lambda x: x + 0.05, trainable)  # adapters off zero, so every path carries
    batch = jax.tree.map(jnp.asarray, batch)

    def loss(t):
        loss_sum, count, metrics = objective.loss_fn(nnx.merge(graphdef, t, frozen), batch)
        return loss_sum, (count, metrics)

    (loss_sum, (count, metrics)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)
    return loss_sum, count, metrics, grads, (graphdef, trainable, frozen), batch


@pytest.mark.parametrize("make", [_reward, _dpo, _grpo, _ppo], ids=["reward", "dpo", "grpo", "ppo"])
def test_each_objective_adds_the_router_penalty_of_its_trained_forward(make):
    plain_sum, plain_count, plain_metrics, plain_grads, _, _ = _grads(make, 0.0, 0.0)
    loss_sum, count, metrics, grads, (graphdef, trainable, frozen), batch = _grads(make, COEF, Z_COEF)
    np.testing.assert_allclose(float(loss_sum), float(plain_sum), rtol=1e-6)  # the reported loss is its own
    assert float(count) == float(plain_count)
    model = nnx.merge(graphdef, trainable, frozen)
    sums = _trained_forward_router(model, batch)
    aux, z = router_losses(sums, model.cfg.experts_per_token)
    np.testing.assert_allclose([float(metrics["moe_aux_loss"]), float(metrics["moe_z_loss"])],
                               [float(aux), float(z)], rtol=1e-5)
    assert "moe/expert_tokens_cv/layer_1" in metrics and "moe_aux_loss" in plain_metrics

    def penalty(t):
        m = nnx.merge(graphdef, t, frozen)
        return router_penalty(m.cfg, _trained_forward_router(m, batch))[0] * count

    want = jax.jit(jax.grad(penalty))(trainable)
    got = jax.tree.map(lambda a, b: a - b, grads, plain_grads)
    assert max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)) > 1e-6  # the penalty reaches them
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-6)
