"""The gradient-accumulation carry stays split like the parameters under fsdp (no replicated float32 gradients)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.sharding import spec_tree
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.state import abstract_objective_state, state_shardings
from jaxllm.train.step import BATCH_KEYS, batch_sharding, jit_train_step, make_train_step

# Parameters large next to the activations of 32 rows of 8 tokens, so replicated gradients would show.
MODEL = ModelConfig(vocab_size=512, dim=512, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=64, mlp_dim=2048)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
ACCUM = 4


@pytest.fixture(scope="module")
def fsdp8():
    """(objective, optimizer, mesh, abstract sharded state, abstract batch) on an fsdp=8 mesh."""
    mesh = make_mesh(MeshConfig(1, 8, 1, 1))
    objective, tx = lm_objective(MODEL, F32), make_optimizer(OptimConfig(warmup_steps=0), 10)
    abstract = abstract_objective_state(objective, tx)[0]
    shardings = state_shardings(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch = {k: jax.ShapeDtypeStruct((32, 8), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=batch_sharding(mesh)) for k in BATCH_KEYS}
    return objective, tx, mesh, state, batch


def test_carry_is_constrained_to_the_parameter_layout(fsdp8):
    objective, tx, mesh, state, batch = fsdp8
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(make_train_step(objective, tx, ACCUM))(state, batch).jaxpr
        expected = jax.tree.leaves(spec_tree(state.params, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert any(spec != PartitionSpec() for spec in expected)  # fsdp splits parameters
    producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == ACCUM)
    first = scan.params["num_consts"]
    init = scan.invars[first:first + len(expected)]
    body = scan.params["jaxpr"].jaxpr
    body_producer = {out: eqn for eqn in body.eqns for out in eqn.outvars}
    carries = (("init", init, producer), ("body", body.outvars[:len(expected)], body_producer))
    for where, variables, producers in carries:
        specs = [producers[v].params["sharding"].spec if producers[v].primitive.name == "sharding_constraint"
                 else None for v in variables]
        assert specs == expected, f"accumulation carry ({where}) not constrained to the parameter layout"


def test_accumulation_holds_no_replicated_float32_gradients(fsdp8):
    """Four micro-batches cost less extra temporary memory than one replicated float32 copy of the gradients.

    (The step's temporaries are above that copy even without accumulation: the layer scan's backward pass holds
    each device's unreduced weight gradients before reduce-scattering them. The difference is the carry's.)
    """
    objective, tx, mesh, state, batch = fsdp8
    grads_f32 = sum(x.size * 4 for x in jax.tree.leaves(state.params))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    with jax.set_mesh(mesh):
        temp = {accum: jit_train_step(make_train_step(objective, tx, accum), shardings, mesh).lower(state, batch)
                .compile().memory_analysis().temp_size_in_bytes for accum in (1, ACCUM)}
    print(f"temp bytes per device: accum 1 {temp[1]}, accum {ACCUM} {temp[ACCUM]}; float32 gradients {grads_f32}")
    assert temp[ACCUM] - temp[1] < grads_f32 / 2
