"""RL rollouts: the log-probabilities the sampler records equal a full forward pass of the same policy over the
sampled sequences (float32, within 1e-5), on one device and sharded; so at an iteration's first update the
PPO ratio is 1 and nothing is clipped. Stopped rows are masked after their stop token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.schema import MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.objectives.losses import ppo_policy_loss
from jaxllm.objectives.rollout import response_logps, rollout, sequence_layout
from jaxllm.model.sample import left_pad
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.model.build import build_model

F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
CFG = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  init_std=0.2)  # peaked enough that rows stop at different steps
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [9, 9], [3, 1, 4, 1, 5], [2] * 7,
           [100, 101], [77]]
STOP = 3
TEMPERATURE = 0.7
NEW = 20


@pytest.fixture(scope="module")
def policy():
    return nnx.split(build_model(CFG, F32, jax.random.key(0)))


SEED = 4  # a draw whose rows end at five different lengths (the ragged case the checks below need)


def _roll(graphdef, params, seed=SEED):
    tokens_BP, start_B = left_pad(PROMPTS)
    return rollout(graphdef, params, tokens_BP, start_B, max_new_tokens=NEW, temperature=TEMPERATURE,
                   stop_ids=(STOP,), key=jax.random.key(seed))


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len"))
def _forward_logps(graphdef, params, tokens, start, *, prompt_len):
    return response_logps(nnx.merge(graphdef, params), tokens, *sequence_layout(tokens, start), prompt_len,
                          TEMPERATURE)


def _check_agrees(graphdef, params, out):
    logps = _forward_logps(graphdef, params, out.tokens, out.start, prompt_len=out.prompt_len)
    mask = np.asarray(out.mask, bool)
    np.testing.assert_allclose(np.asarray(logps)[mask], np.asarray(out.logps)[mask], rtol=0, atol=1e-5)
    return logps


def test_rollout_logps_equal_a_full_forward_pass(policy):
    graphdef, params = policy
    out = _roll(graphdef, params)
    mask = np.asarray(out.mask)
    lengths = mask.sum(axis=1)
    assert mask.sum() > 40 and len(set(lengths.tolist())) > 2, lengths  # ragged rows, real work compared
    logps = _check_agrees(graphdef, params, out)
    # At the first update of an iteration the policy is the sampler: ratio 1, nothing clipped, no approx KL.
    advantages = jax.random.normal(jax.random.key(1), mask.shape)
    loss, clip_fraction, approx_kl = ppo_policy_loss(logps, out.logps, advantages, out.mask)
    assert float(clip_fraction) == 0.0 and float(approx_kl) < 1e-10
    np.testing.assert_allclose(float(loss), -float(jnp.sum(advantages * out.mask) / out.mask.sum()), atol=1e-5)


def test_rows_end_at_their_stop_token(policy):
    graphdef, params = policy
    out = _roll(graphdef, params)
    P, mask, stopped = out.prompt_len, np.asarray(out.mask), np.asarray(out.stopped)
    response = np.asarray(out.tokens)[:, P:]
    assert stopped[: len(PROMPTS)].any() and not stopped[: len(PROMPTS)].all()  # both kinds of row
    for row, m, s in zip(response, mask, stopped):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any() and not row[n:].any()  # a prefix; zeros after it
        assert (STOP in row[:n]) == s and (not s or row[n - 1] == STOP)  # the stop token is the last one kept
        assert n == NEW or s  # a row that did not stop used every token it was allowed
    assert not np.asarray(out.logps)[mask == 0].any()


def test_sampling_is_seeded(policy):
    graphdef, params = policy
    first, again, other = _roll(graphdef, params), _roll(graphdef, params), _roll(graphdef, params, SEED + 1)
    assert np.array_equal(first.tokens, again.tokens) and np.array_equal(first.logps, again.logps)
    assert not np.array_equal(first.tokens, other.tokens)


def test_sharded_rollout_logps_equal_its_forward_pass(policy):
    """On the (2,2,2,1) mesh, from sharded parameter arrays in place (no copy)."""
    graphdef, params = policy
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, sharding_tree(params, mesh))
        out = _roll(graphdef, sharded)
        _check_agrees(graphdef, sharded, out)


# ---------------------------------------------------------------------------------------------- continuous batching

def _roll_slots(graphdef, params, slots, temperature=TEMPERATURE):
    tokens_BP, start_B = left_pad(PROMPTS)
    return rollout(graphdef, params, tokens_BP, start_B, max_new_tokens=NEW, temperature=temperature,
                   stop_ids=(STOP,), key=jax.random.key(SEED), slots=slots)


def test_continuous_batching_samples_the_same_responses_through_any_number_of_slots(policy):
    """Rows refilled as responses end (jaxllm.model.continuous): each token's key is its prompt's and index's, so
    1, 3, all 8 or more cache rows give the same ragged responses, and their recorded log-probabilities equal a full
    forward pass. Greedy, they are the plain decoder's responses."""
    graphdef, params = policy
    every = _roll_slots(graphdef, params, len(PROMPTS))
    lengths = np.asarray(every.mask).sum(axis=1)
    assert len(set(lengths.tolist())) > 2, lengths  # ragged: slots free up at different steps
    # One slot: every prompt in turn, its ring cache (64 positions) wrapped over again; 16: one for each prompt.
    for slots in (1, 3, 16):
        out = _roll_slots(graphdef, params, slots)
        assert np.array_equal(out.tokens, every.tokens) and np.array_equal(out.mask, every.mask), slots
        np.testing.assert_allclose(out.logps, every.logps, rtol=0, atol=1e-5)
        _check_agrees(graphdef, params, out)
    plain, refilled = (_roll_slots(graphdef, params, slots, temperature=0.0) for slots in (0, 3))
    assert np.array_equal(refilled.tokens, plain.tokens[:, : refilled.tokens.shape[1]])
    np.testing.assert_allclose(refilled.logps, plain.logps[:, :NEW], rtol=0, atol=1e-5)


def test_continuous_batching_sharded(policy):
    """Slots split over the batch axes of the (2,2,2,1) mesh: the same responses as one device's."""
    graphdef, params = policy
    single = _roll_slots(graphdef, params, 4)
    with jax.set_mesh(make_mesh(MeshConfig(2, 2, 2, 1))):
        sharded = jax.device_put(params, sharding_tree(params, make_mesh(MeshConfig(2, 2, 2, 1))))
        out = _roll_slots(graphdef, sharded, 4)
        _check_agrees(graphdef, sharded, out)
    assert np.array_equal(out.tokens, single.tokens)
