"""Drawing one token: top-p keeps exactly the nucleus (the smallest set of most likely tokens holding top_p of the
probability; each token is kept when the tokens ranked above it hold less than top_p), and draws from it in
proportion. No model and no torch: the draw itself, on rows of known probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.sample import ALL_IDS, draw_tokens

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # ranked: id 1 (0.5), id 3 (0.3), id 2 (0.15), id 0 (0.05)
ROWS = 4000


def _draws(top_p: float, top_k: int = 0) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (ROWS, len(PROBS)))
    tokens, _ = draw_tokens(logits, jax.random.key(3), 1, jnp.float32(1.0), jnp.int32(top_k), jnp.float32(top_p),
                            jnp.int32(ALL_IDS), sampling=True)
    return np.asarray(tokens)


@pytest.mark.parametrize("top_p,nucleus", [
    (0.4, {1}),  # the first token is always kept
    (0.7, {1, 3}),  # 0.5 above id 3 is below 0.7; 0.8 above id 2 is not
    (0.79, {1, 3}),
    (0.81, {1, 3, 2}),
    (1.0, {1, 3, 2, 0}),
])
def test_top_p_keeps_exactly_the_nucleus_and_draws_in_proportion(top_p, nucleus):
    draws = _draws(top_p)
    assert set(np.unique(draws).tolist()) == nucleus
    kept = np.array(sorted(nucleus))
    expected = PROBS[kept] / PROBS[kept].sum()
    observed = np.array([(draws == i).mean() for i in kept])
    np.testing.assert_allclose(observed, expected, atol=4 * np.sqrt(0.25 / ROWS))  # 4 sigma at worst


def test_top_k_then_top_p():
    assert set(np.unique(_draws(0.81, top_k=2)).tolist()) == {1, 3}


def test_a_draw_without_top_k_or_top_p_skips_the_sort_and_keeps_the_distribution():
    """truncate=False (no top-k, no top-p) draws from the drawable ids directly: in proportion, never a padding id
    (here id 3 lies past vocab_limit=3), each with its log-probability under the whole softmax."""
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (ROWS, len(PROBS)))
    tokens, logps = draw_tokens(logits, jax.random.key(3), 1, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0),
                                jnp.int32(3), sampling=True, truncate=False)
    draws = np.asarray(tokens)
    assert set(np.unique(draws).tolist()) == {0, 1, 2}
    expected = PROBS[:3] / PROBS[:3].sum()
    observed = np.array([(draws == i).mean() for i in range(3)])
    np.testing.assert_allclose(observed, expected, atol=4 * np.sqrt(0.25 / ROWS))
    np.testing.assert_allclose(np.asarray(logps), np.log(PROBS[draws]), rtol=1e-5)
