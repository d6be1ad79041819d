"""Model semantics on one device: causality by gradient, packed-document isolation, attention variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import ModelConfig, PrecisionConfig
from jaxllm.model.transformer import Transformer, total_params
from jaxllm.train.state import build_model

F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
CFG = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, F32, jax.random.key(0))


def test_parameter_count_matches_formula(model):
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == total_params(CFG)
    tied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    tied_model = build_model(tied, F32, jax.random.key(0))
    assert not hasattr(tied_model, "lm_head")
    assert sum(x.size for x in jax.tree.leaves(nnx.state(tied_model))) == total_params(tied)


def test_causality_by_gradient(model):
    """d loss(position t) / d embedding(token at s) is zero for s > t and non-zero for s <= t."""
    T, t = 16, 6
    tokens = jnp.arange(T, dtype=jnp.int32)[None] + 10  # one distinct token per position
    graphdef, params = nnx.split(model)

    def logit_sum_at_t(params):
        return nnx.merge(graphdef, params)(tokens)[0, t].sum()

    grad_table = np.asarray(jax.grad(logit_sum_at_t)(params)["embed_tokens"]["embedding"][...])
    row_norms = np.abs(grad_table[np.asarray(tokens[0])]).sum(axis=-1)
    assert np.all(row_norms[t + 1:] == 0.0), row_norms
    assert np.all(row_norms[: t + 1] > 0.0), row_norms


def test_packed_documents_do_not_see_each_other(model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, CFG.vocab_size, (1, 20)).astype(np.int32)
    segments = np.array([[1] * 8 + [2] * 12], np.int32)
    positions = np.array([list(range(8)) + list(range(12))], np.int32)
    base = np.asarray(model(tokens, segments, positions))

    changed_second = tokens.copy()
    changed_second[0, 8:] = rng.integers(4, CFG.vocab_size, 12)
    out = np.asarray(model(changed_second, segments, positions))
    np.testing.assert_array_equal(out[0, :8], base[0, :8])
    assert not np.allclose(out[0, 8:], base[0, 8:])

    changed_first = tokens.copy()
    changed_first[0, :8] = rng.integers(4, CFG.vocab_size, 8)
    out = np.asarray(model(changed_first, segments, positions))
    np.testing.assert_allclose(out[0, 8:], base[0, 8:], rtol=1e-6, atol=1e-6)

    # A packed document behaves exactly as if it were alone in its own row.
    alone = np.asarray(model(tokens[:, 8:], None, positions[:, 8:]))
    np.testing.assert_allclose(alone[0], base[0, 8:], rtol=1e-5, atol=1e-5)


def test_dot_product_attention_matches_xla(model):
    tokens = np.random.default_rng(1).integers(4, CFG.vocab_size, (2, 12)).astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 7, [1] * 12], np.int32)
    positions = np.array([list(range(5)) + list(range(7)), list(range(12))], np.int32)
    other = build_model(ModelConfig(**{**CFG.__dict__, "attention": "dot_product"}), F32, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(other(tokens, segments, positions)),
                               np.asarray(model(tokens, segments, positions)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_give_identical_gradients(model, remat):
    tokens = np.random.default_rng(2).integers(4, CFG.vocab_size, (2, 8)).astype(np.int32)
    other = build_model(ModelConfig(**{**CFG.__dict__, "remat": remat}), F32, jax.random.key(0))

    def grads(m):
        graphdef, params = nnx.split(m)
        return jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).sum())(params)

    for got, want in zip(jax.tree.leaves(grads(other)), jax.tree.leaves(grads(model))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_policy_keeps_float32_params_and_logits():
    policy = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    m = build_model(CFG, policy, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m)))
    logits = m(np.ones((1, 4), np.int32))
    assert logits.dtype == jnp.float32
    reference = build_model(CFG, F32, jax.random.key(0))(np.ones((1, 4), np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), atol=5e-2)
