"""GRPO's loss on the shared step (in process, tiny model): on one fixed rollout batch (sampling itself differs
across layouts) the first updates' losses agree on (8,1,1,1), (2,2,2,1) and 2 pipeline stages; the loss equals
jaxllm.objectives.losses.grpo_loss on the policy's own log-probs; the LoRA reference is bitwise the base."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.fine_tuning import GRPOConfig
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.objectives.losses import grpo_loss
from jaxllm.objectives.rollout import response_logps, sequence_layout
from jaxllm.model.reference import reference_model
from jaxllm.objectives.grpo import grpo_loss_fn
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.model.build import build_model

from layout_steps import first_updates

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,v_proj,o_proj,down_proj")
GRPO = GRPOConfig(beta=0.04, clip=0.2, loss_agg="dapo")
B, P, N = 8, 8, 8


def _rollout_batch(seed=0) -> dict[str, np.ndarray]:
    """A fixed batch of rollout rows: left-padded prompts of 2..8 tokens, responses of 1..8 tokens, sampler and
    reference log-probs near the model's, group advantages of 2 groups of 4."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (B, P + N)).astype(np.int32)
    start = rng.integers(0, P - 1, B).astype(np.int32)
    tokens[np.arange(P + N)[None, :] < start[:, None]] = 0
    lengths = rng.integers(1, N + 1, B)
    mask = (np.arange(N)[None, :] < lengths[:, None]).astype(np.float32)
    segment_ids, positions = (np.asarray(x) for x in sequence_layout(tokens, start))
    logps = -rng.uniform(3.0, 6.0, (B, N)).astype(np.float32) * mask  # near log(1/128) = -4.85
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "mask": mask,
            "old_logps": logps, "ref_logps": (logps + rng.normal(0, 0.1, (B, N)).astype(np.float32)) * mask,
            "advantages": rng.normal(0, 1, (B, 1)).astype(np.float32),
            "scores": rng.uniform(0, 1, (B, 1)).astype(np.float32), "stopped": np.ones((B, 1), np.float32)}


def _objective(pipeline=PipelineConfig()):
    policy = lm_objective(MODEL, F32, pipeline, lora=LORA)
    return dataclasses.replace(policy, loss_fn=functools.partial(grpo_loss_fn, grpo=GRPO))


@functools.cache
def _losses(layout):
    return first_updates(_objective, layout, _rollout_batch())


def test_first_updates_agree_across_layouts_and_stages():
    reference = _losses((8, 1, 1, 1))
    assert reference[-1] < reference[0]  # the adapters learn
    for layout in ((2, 2, 2, 1), (4, 1, 1, 2), MeshConfig(data=4, context=2)):
        np.testing.assert_allclose(_losses(layout), reference, rtol=1e-5, atol=1e-6, err_msg=str(layout))


def test_loss_is_grpo_loss_of_the_policy_logps_and_the_reference_is_the_base():
    graphdef, adapters, base = nnx.split(build_model(MODEL, F32, jax.random.key(0), lora=LORA), nnx.LoRAParam, ...)
    policy = nnx.merge(graphdef, jax.tree.map(lambda x: x + 0.05, adapters), base)  # adapters off zero
    batch = _rollout_batch()
    loss_sum, count, metrics = grpo_loss_fn(policy, batch, grpo=GRPO)
    logps = response_logps(policy, batch["tokens"], batch["segment_ids"], batch["positions"], P)
    want = grpo_loss(logps, batch["old_logps"], batch["ref_logps"], batch["advantages"], batch["mask"], beta=0.04)
    assert float(count) == batch["mask"].sum()  # dapo: a token mean over the whole batch
    np.testing.assert_allclose(float(loss_sum / count), float(want), rtol=1e-6)
    plain = lm_objective(MODEL, F32).graphdef
    reference = jax.tree.leaves(nnx.state(reference_model(policy, plain)))
    assert len(reference) == len(jax.tree.leaves(base))
    assert all(a is b for a, b in zip(reference, jax.tree.leaves(nnx.state(policy, nnx.Not(nnx.LoRAParam)))))
    for a, b in zip(reference, jax.tree.leaves(base)):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the reference is the base: the same arrays
    ref_logps = response_logps(reference_model(policy, plain), batch["tokens"], batch["segment_ids"],
                               batch["positions"], P)
    assert not np.allclose(ref_logps, logps)  # and not the policy


@pytest.mark.parametrize("agg, count", [("grpo", B), ("dr_grpo", B), ("bnpo", None)])
def test_aggregations_count_what_they_average(agg, count):
    policy = build_model(MODEL, F32, jax.random.key(0), lora=LORA)
    batch = _rollout_batch()
    cfg = dataclasses.replace(GRPO, loss_agg=agg)
    loss_sum, got, _ = grpo_loss_fn(policy, batch, grpo=cfg)
    logps = response_logps(policy, batch["tokens"], batch["segment_ids"], batch["positions"], P)
    want = grpo_loss(logps, batch["old_logps"], batch["ref_logps"], batch["advantages"], batch["mask"], beta=0.04,
                     loss_agg=agg, max_completion_length=N)
    assert float(got) == (batch["mask"].sum() if count is None else count)
    np.testing.assert_allclose(float(loss_sum / got), float(want), rtol=1e-6)


def test_reward_model_scores_each_rollout_row_at_its_last_response_token():
    """rm:<checkpoint> rewards: the left-padded rollout row scored at its last response token equals the reward
    model on that row's own tokens alone (no padding, positions from 0), at their last token."""
    from jaxllm.model.reward import RewardModel
    from jaxllm.objectives.rl import RewardModelScorer

    graphdef, variables = nnx.split(build_model(MODEL, F32, jax.random.key(3), model_class=RewardModel))
    batch = _rollout_batch(seed=1)
    got = RewardModelScorer(graphdef, variables)(batch["tokens"], batch["segment_ids"], batch["positions"],
                                                 batch["mask"], P)
    model = nnx.merge(graphdef, variables)
    for b in range(B):
        start, end = int(np.argmax(batch["segment_ids"][b])), P + int(batch["mask"][b].sum())
        alone = model(batch["tokens"][b:b + 1, start:end])[0, -1]
        np.testing.assert_allclose(got[b], float(alone), rtol=1e-5, atol=1e-6)
