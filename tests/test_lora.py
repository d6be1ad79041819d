"""LoRA on the stacked, scanned kernels: a fresh adapter changes nothing, merging is exact, only adapters train,
sharding follows the RULES table, and decoding with adapters equals decoding the merged model."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.schema import (LORA_TARGETS, LoRAConfig, MeshConfig, ModelConfig, OptimConfig, PipelineConfig,
                           PrecisionConfig)
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.lora import adapters_of, merge
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.model.sample import generate
from jaxllm.parallel.sharding import spec_tree
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.state import init_objective_state
from jaxllm.model.build import build_model
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
ALL = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=",".join(LORA_TARGETS))
BATCH = synthetic_batch(3, 4, 16, MODEL.vocab_size)


def _with_base(lora: LoRAConfig, base):
    """A model with adapters `lora` whose base weights are those of `base`."""
    model = build_model(MODEL, F32, jax.random.key(1), lora=lora)
    nnx.update(model, nnx.state(base))
    return model


def _randomise_b(model, seed=0):
    """Non-zero B everywhere (a fresh adapter has B = 0), so the adapters change the outputs."""
    for i, lora in enumerate(adapters_of(model).values()):
        lora.b[...] = 0.05 * jax.random.normal(jax.random.key(seed + i), lora.b.shape)
    return model


def _logits(model):
    return np.asarray(model(BATCH["tokens"], BATCH["segment_ids"], BATCH["positions"]))


@pytest.fixture(scope="module")
def base():
    return build_model(MODEL, F32, jax.random.key(0))


@pytest.mark.parametrize("lora", [LoRAConfig(rank=16, alpha=32.0, dropout=0.0), ALL], ids=["q_v", "all"])
def test_fresh_adapter_leaves_logits_bitwise_unchanged(base, lora):
    model = _with_base(lora, base)
    assert len(adapters_of(model)) == len(lora.target_list)
    assert np.array_equal(_logits(model), _logits(base))


def test_rank_zero_is_the_plain_model(base):
    model = build_model(MODEL, F32, jax.random.key(0), lora=LoRAConfig(rank=0))
    assert model.lora is None and not nnx.state(model, nnx.LoRAParam)
    assert np.array_equal(_logits(model), _logits(base))


def test_adapter_shapes_init_and_scale():
    model = build_model(MODEL, F32, jax.random.key(0), lora=dataclasses.replace(ALL, rslora=True))
    q, o = adapters_of(model)["q_proj"], adapters_of(model)["o_proj"]
    assert q.a.shape == (2, 32, 4) and q.b.shape == (2, 4, 4, 8)  # A [L, D, r], B [L, r, N, H]
    assert o.a.shape == (2, 4, 8, 4) and o.b.shape == (2, 4, 32)  # o_proj's input is (N, H)
    bound = 1 / np.sqrt(32)  # PEFT's kaiming-uniform bound 1/sqrt(fan_in)
    assert 0.8 * bound < float(jnp.max(jnp.abs(q.a[...]))) <= bound and not np.any(np.asarray(q.b[...]))
    assert q.scale == pytest.approx(8.0 / 2.0)  # rsLoRA: alpha / sqrt(r)
    plain = adapters_of(build_model(MODEL, F32, jax.random.key(0), lora=ALL))["q_proj"]
    assert plain.scale == pytest.approx(8.0 / 4.0)  # LoRA: alpha / r


def test_merge_equals_the_adapted_model(base):
    model = _randomise_b(_with_base(ALL, base))
    merged = merge(model)
    assert merged.lora is None and not nnx.state(merged, nnx.LoRAParam)
    assert not np.allclose(_logits(model), _logits(base), atol=1e-3)  # the adapters do change the model
    np.testing.assert_allclose(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)


def test_decoding_with_adapters_equals_decoding_the_merged_model(base):
    model = _randomise_b(_with_base(ALL, base), seed=7)
    prompts = [[1, 5, 9, 2], [3, 4]]
    with_adapters = generate(model, prompts, max_new_tokens=8)
    assert with_adapters == generate(merge(model), prompts, max_new_tokens=8)
    assert with_adapters != generate(base, prompts, max_new_tokens=8)


def test_adapters_shard_by_the_rules_table():
    model = build_model(MODEL, F32, jax.random.key(0), lora=ALL)
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    specs = spec_tree(nnx.state(model, nnx.LoRAParam), mesh)
    q, o = specs["layers"]["self_attn"]["q_proj_lora"], specs["layers"]["self_attn"]["o_proj_lora"]
    up = specs["layers"]["mlp"]["up_proj_lora"]
    spec = lambda variable: tuple(variable.get_value())
    assert spec(q["a"]) == ("stage", "fsdp", None)  # A's embed like the kernel's; rank replicated
    assert spec(q["b"]) == ("stage", None, "tensor", None)  # B's heads over tensor
    assert spec(o["a"]) == ("stage", "tensor", None, None) and spec(up["b"]) == ("stage", None, "tensor")


def test_lora_steps_train_adapters_only_and_keep_the_base_bitwise():
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    objective = lm_objective(MODEL, F32, lora=dataclasses.replace(ALL, dropout=0.1))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        trainable = {p for p, _ in nnx.to_flat_state(state.params)}
        is_adapter = lambda path: any(str(part).endswith("_lora") for part in path)
        assert trainable and all(is_adapter(p) for p in trainable)  # gradients only for adapters
        assert not any(is_adapter(p) for p, _ in nnx.to_flat_state(frozen))
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh, frozen_shardings)
        base_before = jax.device_get(frozen)
        b_before = jax.device_get(state.params["layers"]["self_attn"]["q_proj_lora"]["b"][...])
        for seed in range(3):
            batch = to_global(synthetic_batch(seed, 8, 16, MODEL.vocab_size), batch_sharding(mesh), 8)
            state, metrics = step(state, batch, frozen)
        assert np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.device_get(frozen))):
        assert np.array_equal(a, b)
    b_after = jax.device_get(state.params["layers"]["self_attn"]["q_proj_lora"]["b"][...])
    assert not np.any(b_before) and np.any(b_after)  # B moved off zero


@functools.cache
def _lora_losses(layout, dropout: float, steps: int = 3, schedule: str = "gpipe"):
    """Losses of `steps` LoRA steps (all targets) on one repeated batch, on mesh `layout` (pipelined with
    `schedule` when it has stages)."""
    mesh = make_mesh(MeshConfig(*layout))
    pipeline = PipelineConfig(microbatches=2, schedule=schedule) if layout[3] > 1 else PipelineConfig()
    objective = lm_objective(MODEL, F32, pipeline, lora=dataclasses.replace(ALL, dropout=dropout))
    tx = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=2), shardings, mesh, frozen_shardings)
        batch = to_global(synthetic_batch(5, 8, 16, MODEL.vocab_size), batch_sharding(mesh), 8)
        losses = []
        for _ in range(steps):
            state, metrics = step(state, batch, frozen)
            losses.append(float(metrics["loss"]))
    return tuple(losses)


def test_lora_losses_agree_across_layouts_and_stages():
    reference = _lora_losses((8, 1, 1, 1), 0.0)
    assert reference[2] < reference[0]  # the adapters learn (B leaves zero after the first step)
    for layout in ((1, 8, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2)):
        np.testing.assert_allclose(_lora_losses(layout, 0.0), reference, rtol=1e-5, err_msg=str(layout))
    # fsdp and tensor together inside a schedule's per-stage branch: the adapters' matrices in their compute
    # layout, or XLA's partitioner moves them with a collective permute that XLA:CPU cannot run there
    np.testing.assert_allclose(_lora_losses((1, 2, 2, 2), 0.0, schedule="1f1b"), reference, rtol=1e-5)


def test_lora_dropout_through_1f1b_equals_gpipe():
    """Each layer's dropout key travels with its chunk: the explicit schedule draws the masks GPipe draws."""
    gpipe = _lora_losses((2, 1, 2, 2), 0.1)
    np.testing.assert_allclose(_lora_losses((2, 1, 2, 2), 0.1, schedule="1f1b"), gpipe, rtol=1e-5)


def test_lora_dropout_is_layout_invariant_and_random():
    with_dropout = _lora_losses((8, 1, 1, 1), 0.1)
    np.testing.assert_allclose(_lora_losses((2, 2, 2, 1), 0.1), with_dropout, rtol=1e-5)
    assert with_dropout[1:] != _lora_losses((8, 1, 1, 1), 0.0)[1:]  # dropout does change the run
