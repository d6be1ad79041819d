"""The two expert exchanges of jaxllm/parallel/experts.py on one mixture-of-experts layer: the gather gives one
device's outputs, router sums and gradients, and the ragged all-to-all of the picks (`model.moe_exchange=ragged`;
on XLA:CPU an all-gather stands in for `jax.lax.ragged_all_to_all`) the gather's. Free of torch, so the Python
3.12 smoke run (current JAX) runs it too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.config.schema import MeshConfig
from jaxllm.model.moe import MoEMLP
from jaxllm.parallel.experts import ragged_all_to_all
from jaxllm.parallel.mesh import make_mesh

D, F, E, K = 16, 12, 8, 2
ROWS = ("data", "fsdp", "expert")  # the batch axes (jaxllm.parallel.sharding.RULES)


@pytest.mark.smoke
def test_the_ragged_all_to_all_stand_in_follows_jax_s_documented_example():
    """On XLA:CPU, which lacks `jax.lax.ragged_all_to_all`, the stand-in gives the op's result: the example of
    jax's docstring, on 2 devices."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    operand, output = np.array([[1, 2, 2], [3, 4, 0]], np.float32), np.zeros((2, 4), np.float32)
    offsets_and_sizes = [np.array(a, np.int32) for a in ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]],
                                                         [[1, 1], [2, 1]])]
    exchange = jax.jit(jax.shard_map(lambda *a: ragged_all_to_all(*(x[0] for x in a), axis_name="x")[None],
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    placed = [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (operand, output, *offsets_and_sizes)]
    np.testing.assert_array_equal(exchange(*placed), [[1, 3, 0, 0], [2, 2, 4, 0]])


def _layer_and_gradients(moe: MoEMLP, x_BTD, weights_BTD, mesh=None):
    """(the layer's outputs, its router sums, the gradients of a weighted sum of the outputs for the input and
    every parameter) on `mesh`, or on one device."""
    def loss(moe, x_BTD):
        out_BTD, sums = moe(x_BTD)
        return jnp.sum(out_BTD * weights_BTD), (out_BTD, sums)

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        (params, x_grad), (out, sums) = grad(moe, x_BTD)
    else:
        with jax.set_mesh(mesh):
            (params, x_grad), (out, sums) = grad(moe, jax.device_put(x_BTD, NamedSharding(mesh, P(ROWS))))
    return out, sums, x_grad, nnx.state(params, nnx.Param)


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.max(np.abs(b))), rtol=0)


@pytest.mark.smoke
@pytest.mark.parametrize("layout", [MeshConfig(1, 1, 1, expert=8), MeshConfig(1, 2, 2, expert=2),
                                    MeshConfig(1, 1, 2, expert=2, context=2)],
                         ids=["expert 8", "fsdp x tensor x expert", "tensor x expert x context"])
def test_both_exchanges_give_the_one_device_outputs_and_gradients(layout):
    """Tokens routed unevenly (a skewed router: some experts get many picks, some few) on 16 rows a layer, split
    over every layout's expert group: the gather exchange's outputs, router sums and gradients within 1e-5 of one
    device's, and the ragged exchange's of the gather's."""
    rng = np.random.default_rng(3)
    x_BTD, weights_BTD = (jnp.asarray(rng.normal(size=(16, 4, D)).astype(np.float32)) for _ in range(2))
    with nnx.use_eager_sharding(False):
        moe = MoEMLP(D, F, E, K, renormalize=True, activation="silu", init_std=0.5, out_std=0.3, dtype=jnp.float32,
                     rngs=nnx.Rngs(1), exchange="gather")
    skew_DE = 10 * rng.normal(size=(D, 1)).astype(np.float32) * np.linspace(-1, 1, E, dtype=np.float32)
    moe.router[...] = moe.router[...] + skew_DE
    one_device = _layer_and_gradients(moe, x_BTD, weights_BTD)
    mesh = make_mesh(layout)
    gathered = _layer_and_gradients(moe, x_BTD, weights_BTD, mesh)
    moe.exchange = "ragged"
    ragged = _layer_and_gradients(moe, x_BTD, weights_BTD, mesh)
    picks = np.asarray(one_device[1].picks).sum(0)
    assert picks.min() < picks.mean() / 2 < picks.max() / 2  # uneven groups, as the exchange must handle
    _assert_close(gathered, one_device)
    _assert_close(ragged, gathered)


@pytest.mark.parametrize("dispatch,layout", [
    ("dropless", MeshConfig(8)), pytest.param("ragged", MeshConfig(1, 2, expert=4), marks=pytest.mark.smoke),
    ("capacity", MeshConfig(2, 1, expert=2, context=2)), ("dropless", MeshConfig(1, 1, 2, expert=4))],
                         ids=["data 8", "fsdp x expert ragged", "capacity data x expert x context", "tensor x expert"])
def test_int8_experts_give_one_device_s_outputs_and_gradients(dispatch, layout):
    """`precision.quant=int8` on the experts (jaxllm.model.quant.expert_ragged_dot): each device quantises only its
    share of the rows, yet the outputs and gradients equal one device's, as the scales are per row, per expert
    and channel, and the weight gradients' taken over the whole batch (measured within 1e-7 relative; the bound
    1e-3 leaves room for a few values that a last-bit difference rounds to the next level on another CPU, and
    scales taken per device were 6e-3 off). (The gather exchange with the rows split over `expert`: capacity's
    case.) Under `tensor`, which splits the down projection's inputs and so makes its scales per shard, within
    int8's error of one device's, and the input's gradient added up over `tensor`. (int8 against float, and
    that the model's experts run int8 dots: tests/test_quant.py.)"""
    rng = np.random.default_rng(4)
    x_BTD, weights_BTD = (jnp.asarray(rng.normal(size=(16, 4, D)).astype(np.float32)) for _ in range(2))
    with nnx.use_eager_sharding(False):
        moe = MoEMLP(D, F, E, K, renormalize=True, activation="silu", init_std=0.5, out_std=0.3, dtype=jnp.float32,
                     rngs=nnx.Rngs(1), exchange="ragged" if dispatch == "ragged" else "gather", quant="int8",
                     dispatch="capacity" if dispatch == "capacity" else "dropless", capacity_factor=8.0)
    one_device = _layer_and_gradients(moe, x_BTD, weights_BTD)
    on_mesh = _layer_and_gradients(moe, x_BTD, weights_BTD, make_mesh(layout))
    same_within = 1e-3 if layout.tensor == 1 else 0.05
    for got, want in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(one_device)):
        assert np.linalg.norm(got - want) <= same_within * np.linalg.norm(want)
