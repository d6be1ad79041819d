"""Context parallelism (jaxllm/parallel/context.py): the sequence split over `context` gives the losses and
gradients of the unsplit sequence, for both attention kinds, on packed rows whose documents straddle chunks, and
composed with the other axes and features; the ring equals plain attention; the balanced layout is balanced."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config.presets import PRESETS
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, OptimConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.layers import xla_attention
from jaxllm.model.sample import generate
from jaxllm.model.visibility import attention_mask
from jaxllm.objectives.pretrain import abstract_train_state, lm_objective
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.context import DocumentOrder, balanced_order, from_balanced, ring_attention, to_balanced
from jaxllm.parallel.mesh import make_mesh
from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.train.state import init_objective_state
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
PRECISION = PrecisionConfig(params="float32", compute="float32", output="float32")
T = 32
BATCH = synthetic_batch(7, 4, T, 256, max_docs=4)  # random cuts: documents straddle every chunk boundary
PLAIN = MeshConfig(data=2, fsdp=2, tensor=2)


def _loss_and_grads(mesh_cfg: MeshConfig, model: ModelConfig = MODEL, lora: LoRAConfig | None = None,
                    stages: int = 1):
    """(mean loss, gradients of the trainable parameters) of BATCH under `mesh_cfg`."""
    pipeline = PipelineConfig(microbatches=2) if stages > 1 else PipelineConfig()
    objective = lm_objective(model, PRECISION, pipeline, lora=lora, sequence_parallel=mesh_cfg.sequence_parallel)
    mesh = make_mesh(mesh_cfg)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    with jax.set_mesh(mesh):
        state, frozen, _, _ = init_objective_state(objective, tx, mesh, seed=0)
        fn = jax.jit(lambda p, f, b: grads_and_loss(objective.graphdef, p, b, 1, loss_fn=objective.loss_fn,
                                                    frozen=f))
        placed = {k: jax.make_array_from_process_local_data(batch_sharding(mesh), v) for k, v in BATCH.items()}
        grads, loss, _, _ = fn(state.params, frozen, placed)
    return float(loss), jax.device_get(grads)


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        scale = np.max(np.abs(w)) + 1e-12
        np.testing.assert_allclose(g / scale, w / scale, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def reference():
    return _loss_and_grads(PLAIN)


@pytest.mark.parametrize("kind", ["all_gather", "ring"])
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=2, tensor=2, context=2), MeshConfig(data=2, context=4),
                                      MeshConfig(context=8)], ids=["ctx2-fsdp2-tp2", "ctx4-dp2", "ctx8"])
def test_split_sequence_equals_whole(reference, mesh_cfg, kind):
    _assert_same(_loss_and_grads(mesh_cfg, dataclasses.replace(MODEL, context_attention=kind)), reference)


RING = dataclasses.replace(MODEL, context_attention="ring")
MOE = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=256, context_attention="ring"))  # dropless dispatch
# local and global layers (Gemma 3): a window that crosses chunk boundaries, two rotary bases
GEMMA3 = dataclasses.replace(RING, family="gemma3", sliding_window=6, global_every=2, local_rope_theta=1e4,
                             rope_theta=1e6)
COMPOSED = {  # name: (mesh, model, lora, stages); each against the same model and adapters on PLAIN
    "sequence_parallel": (MeshConfig(data=2, tensor=2, context=2, sequence_parallel=True), RING, None, 1),
    "remat_full_loss_chunk": (MeshConfig(data=2, context=4), dataclasses.replace(RING, remat="full", loss_chunk=8),
                              None, 1),
    "unrolled_layers": (MeshConfig(fsdp=2, tensor=2, context=2), dataclasses.replace(RING, scan_layers=False), None,
                        1),
    "lora_remat_context": (MeshConfig(fsdp=2, tensor=2, context=2),
                           dataclasses.replace(RING, remat="minimal_with_context"), LoRAConfig(rank=4, alpha=8.0), 1),
    "pipeline": (MeshConfig(data=2, context=2, stage=2), MODEL, None, 2),  # all-gather
    # the ring inside the pipeline's shard_map, manual over context too; local and global layers' two visibilities
    "ring_pipeline": (MeshConfig(data=2, context=2, stage=2), GEMMA3, None, 2),
    "ring_pipeline_experts": (MeshConfig(data=2, context=2, stage=2), MOE, None, 2),  # router sums over context
    # capacity buffers per whole row: the row gathered over context inside the pipeline (roomy: nothing dropped)
    "ring_pipeline_capacity": (MeshConfig(data=2, context=2, stage=2),
                               dataclasses.replace(MOE, moe_dispatch="capacity", moe_capacity_factor=8.0), None, 2),
    "experts": (MeshConfig(data=2, expert=2, context=2), MOE, None, 1),
    "local_global": (MeshConfig(fsdp=2, tensor=2, context=2), GEMMA3, None, 1),
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_composes(name):
    mesh_cfg, model, lora, stages = COMPOSED[name]
    want = _loss_and_grads(dataclasses.replace(PLAIN, sequence_parallel=mesh_cfg.sequence_parallel), model, lora)
    _assert_same(_loss_and_grads(mesh_cfg, model, lora, stages), want)


def _attention_case(seed: int):
    B, N, K, H = 2, 4, 2, 8
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    segments = jnp.asarray([[1] * 5 + [2] * 20 + [3] * 7, [1] * 29 + [0] * 3], jnp.int32)  # uneven, with padding
    return q, k, v, segments


@pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 6)], ids=["causal", "bidirectional",
                                                                                   "window"])
def test_ring_equals_plain_attention(causal, window):
    q, k, v, segments = _attention_case(0)
    B, shards, scale = q.shape[0], 4, q.shape[-1] ** -0.5
    rows = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B, T))
    order = balanced_order(T, shards) if causal else np.zeros(T)  # equal order: every key of the document
    if causal:
        mask = attention_mask(segments, window)
    else:
        mask = segments[:, :, None] == segments[:, None, :]

    def ring(q, k, v):
        q, k, v, seg = (to_balanced(a, shards) for a in (q, k, v, segments))
        who = DocumentOrder(seg, rows(order), jnp.full((B, T), window, jnp.int32))
        return from_balanced(ring_attention(q, k, v, who, scale, balanced=causal), shards)

    plain = lambda q, k, v: xla_attention(q, k, v, mask, scale)
    weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))  # a loss that weighs every output differently
    with jax.set_mesh(make_mesh(MeshConfig(data=2, context=shards))):
        got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(ring(*a) * weights), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: jnp.sum(plain(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    with jax.set_mesh(make_mesh(MeshConfig(data=2, context=shards))):
        out = jax.jit(ring)(q, k, v)
    np.testing.assert_allclose(out, plain(q, k, v), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_balanced_layout_round_trips(shards):
    x = jnp.arange(3 * T * 2).reshape(3, T, 2)
    laid_out = to_balanced(x, shards)
    np.testing.assert_array_equal(laid_out, x[:, balanced_order(T, shards)])
    np.testing.assert_array_equal(from_balanced(laid_out, shards), x)
    assert sorted(balanced_order(T, shards).tolist()) == list(range(T))


def _causal_work(order: np.ndarray, shards: int) -> list[int]:
    """Unmasked (query, key) pairs of one whole-row document, per device holding its share of `order`."""
    return [int(np.sum(part + 1)) for part in np.split(order, shards)]


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_balanced_layout_shares_causal_work(shards):
    length = 64
    balanced = _causal_work(balanced_order(length, shards), shards)
    assert max(balanced) == min(balanced)
    in_order = _causal_work(np.arange(length), shards)  # the plain split: the last device works far more
    chunk = length // shards
    assert max(in_order) - min(in_order) >= chunk * chunk


def test_checkpoint_moves_between_context_sizes_and_resumes_bitwise(tmp_path):
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    objective = lm_objective(RING, PRECISION)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, context=2))
    ckpt = Checkpointer(tmp_path / "ckpt")
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh)
        batch = {k: jax.make_array_from_process_local_data(batch_sharding(mesh), v) for k, v in BATCH.items()}
        state, _ = step(state, batch)
        ckpt.save(1, state, {"step": 1}, {})
        ckpt.wait()
        saved = [np.asarray(x) for x in jax.tree.leaves(state)]
        uninterrupted = [np.asarray(x) for x in jax.tree.leaves(step(state, batch)[0])]
        restored = ckpt.restore(1, abstract_train_state(RING, PRECISION, tx), mesh)["state"]
        resumed = [np.asarray(x) for x in jax.tree.leaves(step(restored, batch)[0])]
    for got, want in zip(resumed, uninterrupted, strict=True):
        assert np.array_equal(got, want, equal_nan=True)
    for other in (MeshConfig(data=2, context=4), MeshConfig(data=4, fsdp=2)):
        moved = ckpt.restore(1, abstract_train_state(RING, PRECISION, tx), make_mesh(other))["state"]
        for got, want in zip(jax.tree.leaves(moved), saved, strict=True):
            assert np.array_equal(np.asarray(got), want, equal_nan=True)
    ckpt.close()


def test_decoding_over_split_cache_slots_equals_whole():
    """KV-cache decoding permutes nothing: the cache's slots split over `context` and XLA takes each new token's
    softmax over the split slots. Greedy tokens and the cache's final logits equal those of the plain layout."""
    prompts = [[5, 9, 11, 3], [7, 7, 2, 8, 1, 4], [30, 31], [100, 3, 4, 5, 6]]

    def greedy(mesh_cfg):
        mesh = make_mesh(mesh_cfg)
        with jax.set_mesh(mesh):
            objective = lm_objective(RING, PRECISION)
            state, _, _, _ = init_objective_state(objective, make_optimizer(OptimConfig(), 10), mesh, seed=3)
            return generate((objective.graphdef, state.params), prompts, max_new_tokens=12)

    want = greedy(MeshConfig(data=2, fsdp=2, tensor=2))
    assert greedy(MeshConfig(data=2, fsdp=2, context=2)) == want
    assert greedy(MeshConfig(data=2, context=4)) == want
