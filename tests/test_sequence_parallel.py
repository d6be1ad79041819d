"""Sequence parallelism (mesh.sequence_parallel): same losses and gradients as the plain tensor-parallel layout,
a residual stream that is really split along the sequence over `tensor`, every objective's model honouring the
flag, decoding unchanged, and the config check."""

import re

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxllm.parallel import sharding
from jaxllm.plan.activation_memory import step_temp_bytes
from jaxllm.config.schema import (ConfigError, LoRAConfig, MeshConfig, ModelConfig, PipelineConfig, PrecisionConfig,
                           default_config_dict, validate)
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.lora import merge
from jaxllm.parallel.mesh import make_mesh
from jaxllm.model.sample import generate
from jaxllm.objectives.ppo import actor_critic_objective
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.reward import reward_model_objective
from jaxllm.model.build import build_model
from jaxllm.model.head import next_token_loss
from jaxllm.train.step import batch_sharding, grads_and_loss

# tensor=4 divides heads, kv heads and MLP; remat full and a chunked head are the paths SP changes most.
MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, mlp_dim=128,
                    remat="full", loss_chunk=16)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="q_proj,o_proj")
B, T = 4, 32
BATCH = synthetic_batch(3, B, T, MODEL.vocab_size)  # packed rows: several documents and padding per row
LAYOUT = (1, 2, 4, 1)  # (data, fsdp, tensor, stage)


@pytest.fixture(scope="module")
def params():
    return nnx.state(build_model(MODEL, F32, jax.random.key(0)))


def _placed(params, mesh):
    placed = jax.device_put(params, sharding.sharding_tree(params, mesh))
    return placed, {k: jax.device_put(v, batch_sharding(mesh)) for k, v in BATCH.items()}


def _grads(params, sequence_parallel, layout=LAYOUT, pipeline=PipelineConfig()):
    """(gradients, loss, compiled step) of one batch on `layout`, with or without sequence parallelism."""
    mesh = make_mesh(MeshConfig(*layout))
    graphdef = lm_objective(MODEL, F32, pipeline, sequence_parallel=sequence_parallel).graphdef
    with jax.set_mesh(mesh):
        placed, batch = _placed(params, mesh)
        compiled = jax.jit(lambda p, b: grads_and_loss(graphdef, p, b, 1, loss_fn=next_token_loss)[:2]).lower(placed, batch).compile()
        grads, loss = compiled(placed, batch)
    return jax.device_get(grads), float(loss), compiled


@pytest.fixture(scope="module")
def steps(params):
    return {sp: _grads(params, sp) for sp in (False, True)}


def _assert_same(got, want):
    grads, loss, _ = got
    ref_grads, ref_loss, _ = want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert sum(float(np.abs(g).sum()) for g in jax.tree.leaves(ref_grads)) > 0
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        scale = np.max(np.abs(ref)) + 1e-12
        np.testing.assert_allclose(g / scale, ref / scale, rtol=0, atol=1e-5)


def test_loss_and_gradients_equal_the_plain_layout(steps):
    _assert_same(steps[True], steps[False])


def test_residual_stream_is_split_along_the_sequence(steps, params):
    """The final hidden states come out split over `tensor` along T; the compiled step gathers the residual
    stream along T (before the column-parallel projections) and needs fewer temporary bytes under remat full,
    where the scan keeps only each layer's (now split) input."""
    mesh = make_mesh(MeshConfig(*LAYOUT))
    with jax.set_mesh(mesh):
        placed, batch = _placed(params, mesh)
        for sp, seq in ((False, None), (True, "tensor")):
            graphdef = lm_objective(MODEL, F32, sequence_parallel=sp).graphdef
            hidden = jax.jit(lambda p, tokens: nnx.merge(graphdef, p).hidden_states(tokens))
            spec = hidden.lower(placed, batch["tokens"]).compile().output_shardings.spec
            assert tuple(spec) + (None,) * (3 - len(spec)) == ("fsdp", seq, None), sp
    rows, D = B // 2, MODEL.dim  # rows per device: the batch is split over fsdp=2
    gathered = {sp: len(re.findall(rf"f32\[{rows},{T},{D}\][^\n]*all-gather\([^\n]*dimensions={{1}}",
                                   step.as_text())) for sp, (_, _, step) in steps.items()}
    assert gathered[False] == 0 and gathered[True] >= 2 * MODEL.num_layers, gathered
    temp = {sp: step.memory_analysis().temp_size_in_bytes for sp, (_, _, step) in steps.items()}
    assert temp[True] < 0.85 * temp[False], temp


def test_pipeline_with_sequence_parallelism_equals_the_plain_layout(params, steps):
    """Two stages carrying the split residual stream between them (pipelined == sequential is test_pipeline's)."""
    _assert_same(_grads(params, True, (1, 1, 4, 2), PipelineConfig(microbatches=2)), steps[False])


def test_sampling_with_sequence_parallelism_is_unchanged(params):
    """Decoding (prefill of a whole prompt, then T = 1 steps that the mesh cannot split) gives the same tokens."""
    mesh = make_mesh(MeshConfig(*LAYOUT))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4]]
    with jax.set_mesh(mesh):
        placed, _ = _placed(params, mesh)
        out = {sp: generate((lm_objective(MODEL, F32, sequence_parallel=sp).graphdef, placed), prompts,
                            max_new_tokens=4) for sp in (False, True)}
    assert out[True] == out[False] and all(len(o) == 4 for o in out[True])


@pytest.mark.parametrize("objective", [
    lambda sp: lm_objective(MODEL, F32, lora=LORA, sequence_parallel=sp),
    lambda sp: reward_model_objective(MODEL, F32, lora=LORA, sequence_parallel=sp),
    lambda sp: actor_critic_objective(MODEL, F32, lora=LORA, sequence_parallel=sp),
], ids=["lm", "reward", "actor_critic"])
def test_every_objective_builds_its_model_with_the_setting(objective):
    """SFT/DPO/GRPO (the LM with adapters), the reward model and PPO's actor-critic (and its critic) all split
    their residual stream; the parameters are those of the plain layout, and merging adapters keeps the setting."""
    def abstract(sp, then=lambda model: model):
        return nnx.merge(*jax.eval_shape(lambda: nnx.split(then(objective(sp).build_model(jax.random.key(0))))))

    models = {sp: abstract(sp) for sp in (False, True)}
    sp_model = models[True]
    assert sp_model.layers.seq_axis == "residual_seq" and models[False].layers.seq_axis == "seq"
    if hasattr(sp_model, "value"):
        assert sp_model.value.layers.seq_axis == "residual_seq"
    assert jax.tree.structure(nnx.state(models[True])) == jax.tree.structure(nnx.state(models[False]))
    if not hasattr(sp_model, "value"):  # the actor-critic is never merged (its critic shares the base)
        assert abstract(True, merge).sequence_parallel


def _config(**mesh) -> ml_collections.ConfigDict:
    cd = default_config_dict()
    cd.mesh.update({**dict(data=1, fsdp=1, tensor=2, stage=1, sequence_parallel=True), **mesh})
    cd.model.update(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=64)
    cd.train.update(batch_size=4, seq_len=64)
    return cd


def test_config_needs_seq_len_divisible_by_tensor():
    cd = _config()
    cd.train.seq_len = 63
    with pytest.raises(ConfigError, match=r"^mesh.sequence_parallel: .*mesh.tensor=2.*train.seq_len=63$"):
        validate(cd, 2)
    assert validate(_config(), 2).mesh.sequence_parallel


def test_config_accepts_tensor_1_and_pipeline_stages():
    """tensor = 1 splits nothing (any seq_len); stages compose (the pipeline carries the split residual)."""
    cd = _config(tensor=1)
    cd.train.seq_len = 63
    assert validate(cd, 1).mesh.sequence_parallel
    cd = _config(stage=2)
    cd.pipeline.microbatches = 2
    assert validate(cd, 4).mesh.shape == (1, 1, 1, 1, 2, 2)  # MESH_AXES order


@pytest.mark.parametrize("remat", ["none", "full"])
def test_planner_splits_what_a_layer_keeps(remat):
    """The --dry_run formula: the residual-stream part of the saved activations shrinks by tensor (all of them
    under remat full, where the scan keeps only each layer's input); one layer's backward working set does not."""
    parts = {}
    for sp in (False, True):
        cd = _config(sequence_parallel=sp)
        cd.model.remat = remat
        parts[sp] = step_temp_bytes(validate(cd, 2), "xla", trainable_bytes=0)
    assert parts[True]["layer_backward"] == parts[False]["layer_backward"]
    if remat == "full":
        assert parts[True]["saved_activations"] == parts[False]["saved_activations"] / 2
    else:
        assert parts[False]["saved_activations"] / 2 < parts[True]["saved_activations"] < parts[False]["saved_activations"]
