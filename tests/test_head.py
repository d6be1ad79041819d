"""The output head chunk by chunk (model.loss_chunk): the same losses, log-probs, entropies and gradients as the
whole head, sharded with the vocabulary over `tensor`, without the full [B, T, V] logits in memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.schema import MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.objectives.rollout import response_stats
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.parallel.host_rows import to_global
from jaxllm.model.head import next_token_loss
from jaxllm.model.build import build_model
from jaxllm.train.step import batch_sharding

MODEL = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
B, T = 8, 24
CHUNK = 10  # does not divide T: the last chunk is padded


def _mesh(shape):
    config = MeshConfig(*shape)
    return make_mesh(config, jax.devices()[:config.num_devices])


def _model(cfg: ModelConfig, mesh):
    """(graphdef, parameters sharded on `mesh`) of a model built from seed 0."""
    graphdef, params = nnx.split(build_model(cfg, F32, jax.random.key(0)))
    return graphdef, jax.device_put(params, sharding_tree(params, mesh))


def _grads(loss_of, graphdef, params, batch):
    """(loss, gradients) of `loss_of(model, batch)`, jitted on the active mesh."""
    return jax.jit(jax.value_and_grad(lambda p, b: loss_of(nnx.merge(graphdef, p), b)))(params, batch)


def _lm_loss(model, batch):
    loss_sum, count, _ = next_token_loss(model, batch)
    return loss_sum / count


def _rl_objective(model, batch):
    """Log-probs and entropies of the second half of each row as responses, combined so both carry gradient."""
    logps, entropy = response_stats(model, batch["tokens"], batch["segment_ids"], batch["positions"], T // 2,
                                    temperature=0.7, entropy=True)
    return jnp.mean(logps) + 0.3 * jnp.mean(entropy)


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 1), (2, 1, 4, 1)], ids=["1-device", "vocab-over-tensor-4"])
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("loss_of", [_lm_loss, _rl_objective], ids=["next-token", "rl-logps-entropy"])
def test_chunked_head_equals_the_whole_head(mesh_shape, tied, loss_of):
    mesh = _mesh(mesh_shape)
    whole = dataclasses.replace(MODEL, tie_embeddings=tied)
    with jax.set_mesh(mesh):
        batch = to_global(synthetic_batch(0, B, T, MODEL.vocab_size), batch_sharding(mesh), B)
        graphdef, params = _model(whole, mesh)
        chunked_graphdef, _ = _model(dataclasses.replace(whole, loss_chunk=CHUNK), mesh)
        loss, grads = _grads(loss_of, graphdef, params, batch)
        chunked_loss, chunked_grads = _grads(loss_of, chunked_graphdef, params, batch)
    _assert_close(chunked_loss, loss)
    _assert_close(chunked_grads, grads)
    assert float(jnp.abs(jax.tree.leaves(grads)[0]).max()) > 0


def test_chunked_head_never_holds_the_whole_logits():
    """Compiled temp bytes of loss + gradients on one device: the whole head's [B, T, V] float32 logits (and
    their gradient) dominate; chunked, only a [B, C, V] chunk's arrays are live."""
    cfg = dataclasses.replace(MODEL, vocab_size=8192, num_layers=1)
    mesh = _mesh((1, 1, 1, 1))
    temp = {}
    with jax.set_mesh(mesh):
        batch = to_global(synthetic_batch(0, 2, 256, cfg.vocab_size), batch_sharding(mesh), 2)
        for chunk in (0, 16):
            graphdef, params = _model(dataclasses.replace(cfg, loss_chunk=chunk), mesh)
            step = jax.jit(jax.value_and_grad(lambda p, b: _lm_loss(nnx.merge(graphdef, p), b)))
            temp[chunk] = step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = 2 * 256 * cfg.vocab_size * 4
    assert temp[0] > 2 * logits_bytes, temp  # the whole head's logits and their gradient are there ...
    assert temp[16] < logits_bytes, temp  # ... chunked, a few [B, 16, V] arrays and parameter-sized ones
