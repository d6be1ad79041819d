"""The diagnostic forward's per-layer statistics (jaxllm/observe/activations.py): equal to a hand computation
layer by layer, the same on every layout (fsdp/tensor, pipeline stages, unrolled layers, micro-batches), of the
adapted model with LoRA, a bound with cuDNN attention, NaN from the layer where a NaN is planted on, and absent from
the plain forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm.parallel.sharding as sharding
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.observe.activations import GATE_SATURATION, activation_stats, first_nonfinite_layer
from jaxllm.model.lora import merge
from jaxllm.parallel.mesh import make_mesh
import jaxllm.model.layers as layers
from jaxllm.model.layers import xla_attention
from jaxllm.model.rope import apply_rope, rope_tables
from jaxllm.model.reward import RewardModel
from jaxllm.model.visibility import attention_mask
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.parallel.host_rows import to_global
from jaxllm.model.build import build_model
from jaxllm.model.head import next_token_loss
from jaxllm.train.step import NO_FROZEN, batch_sharding

from packed_layout import mask_from_packed_layout

MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
B, T = 8, 16
FULL_BATCH = synthetic_batch(3, B, T, MODEL.vocab_size)
BATCH = {k: v for k, v in FULL_BATCH.items() if k not in ("targets", "loss_mask")}
PER_LAYER = ("act_rms", "act_max", "gate_saturation", "attn_logit_max")
HEAD = ("logits_max", "logits_lse_mean")


def _model_params(cfg=MODEL, **kw):
    """(graphdef, params) of a model whose gates open and shut (gate_proj scaled up: some g < -6) and whose
    logits are far from uniform (a larger head), so every statistic is away from its trivial value."""
    graphdef, params = nnx.split(build_model(cfg, F32, jax.random.key(0), **kw))
    params["layers"]["mlp"]["gate_proj"][...] = params["layers"]["mlp"]["gate_proj"][...] * 400.0
    params["layers"]["self_attn"]["q_proj"][...] = params["layers"]["self_attn"]["q_proj"][...] * 30.0
    return graphdef, params


# One jitted function: calls with the same graphdef, shapes and layouts reuse one executable.
_JITTED = jax.jit(activation_stats, static_argnums=(0,), static_argnames=("micro_batches",))


def _stats(graphdef, params, batch=BATCH, frozen=NO_FROZEN, micro_batches=1):
    return jax.device_get(_JITTED(graphdef, params, frozen, batch, micro_batches=micro_batches))


@pytest.fixture(scope="module")
def plain():
    graphdef, params = _model_params()
    return graphdef, params, _stats(graphdef, params)


def _reference(model, batch) -> dict:
    """The statistics by hand: each layer called on its own slice of the stacked weights, in order, its gate and
    attention scores recomputed from its weights, everything reduced in numpy over the valid tokens."""
    cfg = model.cfg
    tokens, segment_ids, positions = (jnp.asarray(batch[k]) for k in ("tokens", "segment_ids", "positions"))
    valid = np.asarray(segment_ids) > 0
    sin, cos = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    mask = attention_mask(segment_ids)
    layer_graphdef, stacked = nnx.split(model.layers)
    x = model.embed_tokens(tokens, jnp.float32)
    out = {name: [] for name in PER_LAYER + ("attn_logit_bound",)}
    for i in range(cfg.num_layers):
        layer = nnx.merge(layer_graphdef, jax.tree.map(lambda a: a[i], stacked))
        normed = layer.input_layernorm(x)
        q = apply_rope(jnp.einsum("BTD,DNH->BTNH", normed, layer.self_attn.q_proj[...]), sin, cos)
        k = apply_rope(jnp.einsum("BTD,DKH->BTKH", normed, layer.self_attn.k_proj[...]), sin, cos)
        q, k, m = np.asarray(q), np.asarray(k), np.asarray(mask)
        norm = lambda a: np.linalg.norm(a[valid], axis=-1).max()
        out["attn_logit_bound"].append(norm(q) * norm(k) / np.sqrt(cfg.head_dim))
        group = cfg.num_heads // cfg.num_kv_heads
        logit_max = -np.inf
        for n in range(cfg.num_heads):
            scores = np.einsum("BTH,BSH->BTS", q[:, :, n], k[:, :, n // group]) / np.sqrt(cfg.head_dim)
            logit_max = max(logit_max, scores[m & valid[:, :, None]].max())
        h = x + layer.self_attn(normed, mask, sin, cos)
        gate = np.asarray(jnp.einsum("BTD,DF->BTF", layer.post_attention_layernorm(h), layer.mlp.gate_proj[...]))
        x = layer(x, mask, sin, cos)
        xv = np.asarray(x)[valid]
        out["act_rms"].append(np.sqrt(np.mean(xv**2)))
        out["act_max"].append(np.abs(xv).max())
        out["gate_saturation"].append(np.mean(gate[valid] < GATE_SATURATION))
        out["attn_logit_max"].append(logit_max)
    logits = np.asarray(model(tokens, segment_ids, positions), np.float64)[valid]
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    return {**{k: np.array(v) for k, v in out.items()}, "logits_max": logits.max(), "logits_lse_mean": lse.mean()}


@pytest.fixture(scope="module")
def reference(plain):
    graphdef, params, _ = plain
    return _reference(nnx.merge(graphdef, params), BATCH)


def test_stats_equal_a_hand_computation_layer_by_layer(plain, reference):
    _, _, got = plain
    want = reference
    for name in PER_LAYER + HEAD:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert got["act_rms"].shape == (MODEL.num_layers,)
    # The model was set up so that no statistic is trivial: gates both shut and open, logits well above zero.
    assert 0.05 < got["gate_saturation"].min() and got["gate_saturation"].max() < 0.95, got["gate_saturation"]
    assert got["attn_logit_max"].min() > 0.1 and got["logits_max"] > 0.1
    assert first_nonfinite_layer(got) is None


def test_padding_is_left_out(plain):
    """The same rows with their padding tokens changed: statistics over valid tokens only are unchanged (padding
    attends only to padding, so valid tokens' activations do not see the change)."""
    graphdef, params, got = plain
    other = dict(BATCH, tokens=np.where(BATCH["segment_ids"] > 0, BATCH["tokens"], 5))
    assert (other["tokens"] != BATCH["tokens"]).any()
    changed = _stats(graphdef, params, other)
    for name in PER_LAYER + HEAD:
        np.testing.assert_allclose(changed[name], got[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("layer", [0, 2])
def test_a_nan_in_a_layer_shows_from_that_layer_on(plain, layer):
    graphdef, params, _ = plain
    broken = jax.tree.map(lambda a: a, params)
    down = broken["layers"]["mlp"]["down_proj"]
    down[...] = down[...].at[layer, 3, 5].set(jnp.nan)
    got = _stats(graphdef, broken)
    for name in PER_LAYER:
        assert np.isfinite(got[name][:layer]).all(), (name, got[name])
        assert np.isnan(got[name][layer:]).all(), (name, got[name])
    assert first_nonfinite_layer(got) == layer
    assert np.isnan(got["logits_max"]) and np.isnan(got["logits_lse_mean"])


def test_a_nan_in_padding_alone_still_shows(plain):
    """A row of padding only, whose token embeds to NaN: no valid token sees it, but the loss does (its masked
    terms are 0 * NaN), so the statistics must not hide it behind the valid-token masks."""
    graphdef, params, _ = plain
    pad = 1  # synthetic batches draw tokens from 4 up: only the padding row uses id 1
    batch = dict(BATCH, tokens=BATCH["tokens"].copy(), segment_ids=BATCH["segment_ids"].copy())
    batch["tokens"][0], batch["segment_ids"][0] = pad, 0
    broken = jax.tree.map(lambda a: a, params)
    table = broken["embed_tokens"]["embedding"]
    table[...] = table[...].at[pad].set(jnp.nan)
    loss_sum, _, _ = jax.jit(lambda p, b: next_token_loss(nnx.merge(graphdef, p), b))(broken, dict(FULL_BATCH, **batch))
    assert np.isnan(loss_sum)
    got = _stats(graphdef, broken, batch)
    assert all(np.isnan(got[name]).all() for name in PER_LAYER + HEAD), got
    assert first_nonfinite_layer(got) == 0


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (scan, jit, checkpoint bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _equations(sub)


def test_the_plain_forward_has_no_statistics_outputs(plain):
    """Statistics are switched on statically: the training forward's layer scan has no per-layer outputs
    (only its carry), the diagnostic forward's has them."""
    graphdef, params, _ = plain
    args = (BATCH["tokens"], BATCH["segment_ids"], BATCH["positions"])

    def layer_scan(fn):
        scans = [e for e in _equations(jax.make_jaxpr(fn)(params).jaxpr)
                 if e.primitive.name == "scan" and e.params["length"] == MODEL.num_layers]
        assert len(scans) == 1
        return scans[0]

    plain_scan = layer_scan(lambda p: nnx.merge(graphdef, p)(*args))
    assert len(plain_scan.outvars) == plain_scan.params["num_carry"] == 1  # the residual stream only
    probed_scan = layer_scan(lambda p: activation_stats(graphdef, p, NO_FROZEN, BATCH))
    assert len(probed_scan.outvars) > probed_scan.params["num_carry"]


def test_unrolled_layers_a_chunked_head_and_micro_batches_give_the_same_statistics(plain):
    graphdef, params, want = plain
    variant = lambda **kw: nnx.split(build_model(dataclasses.replace(MODEL, **kw), F32, jax.random.key(0)))[0]
    for got in (_stats(variant(scan_layers=False), params), _stats(variant(loss_chunk=4), params),
                _stats(graphdef, params, micro_batches=2)):
        for name in PER_LAYER + HEAD:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# The pipeline case runs the circular schedule (2 stages x 2 repeats of 1 layer): its stats come back from
# stages in neither layer nor row order.
# The context cases: per-token statistics taken in the balanced layout come back in sequence order.
@pytest.mark.parametrize("mesh_shape, pipeline, sequence_parallel, context_attention",
                         [((2, 2, 2, 1), PipelineConfig(), True, "all_gather"),
                          ((2, 1, 2, 2), PipelineConfig(microbatches=2, repeats=2), False, "all_gather"),
                          (MeshConfig(data=2, fsdp=2, context=2), PipelineConfig(), False, "ring"),
                          (MeshConfig(data=2, context=4), PipelineConfig(), False, "all_gather"),
                          (MeshConfig(data=2, context=2, stage=2), PipelineConfig(microbatches=2), False, "ring")],
                         ids=["data-fsdp-tensor-sequence-parallel", "pipeline-2-stages-circular", "context-ring",
                              "context-all-gather", "pipeline-context-ring"])
def test_sharded_statistics_equal_single_device(plain, monkeypatch, mesh_shape, pipeline, sequence_parallel,
                                                context_attention):
    graphdef, params, want = plain
    # The layout the pipeline is meant for (tests/test_pipeline.py): stacked layers split over `stage`.
    monkeypatch.setitem(sharding.RULES, "layers", ("stage", None))
    config = mesh_shape if isinstance(mesh_shape, MeshConfig) else MeshConfig(*mesh_shape)
    mesh = make_mesh(config, jax.devices()[:config.num_devices])
    with jax.set_mesh(mesh):
        model = build_model(dataclasses.replace(MODEL, context_attention=context_attention), F32,
                            jax.random.key(0), pipeline, sequence_parallel=sequence_parallel)
        mesh_graphdef, _ = nnx.split(model)
        placed = jax.device_put(params, sharding_tree(params, mesh))
        batch = to_global(BATCH, batch_sharding(mesh), B)
        got = _stats(mesh_graphdef, placed, batch)
    for name in PER_LAYER + HEAD:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_lora_statistics_are_those_of_the_adapted_model():
    """With adapters (B != 0) the statistics equal those of the merged model W + scale * A @ B."""
    lora = LoRAConfig(rank=4, targets="q_proj,gate_proj,down_proj")
    model = build_model(MODEL, F32, jax.random.key(0), lora=lora)
    for adapter in jax.tree.leaves(nnx.state(model, nnx.LoRAParam), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        adapter[...] = 0.5 * jax.random.normal(jax.random.key(1), adapter.shape)
    graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    merged_graphdef, merged_params = nnx.split(merge(model))
    # The adapters change the kernels they target, so ignoring them could not pass.
    assert not np.allclose(merged_params["layers"]["mlp"]["gate_proj"][...],
                           frozen["layers"]["mlp"]["gate_proj"][...], atol=1e-2)
    adapted, want = _stats(graphdef, params, frozen=frozen), _stats(merged_graphdef, merged_params)
    for name in PER_LAYER + HEAD:
        np.testing.assert_allclose(adapted[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_reward_model_has_the_decoder_s_statistics_and_no_logits(plain):
    graphdef, params, want = plain
    reward_graphdef, reward_params = nnx.split(build_model(MODEL, F32, jax.random.key(0), model_class=RewardModel))
    body = {k: v for k, v in params.items() if k != "lm_head"}  # the LM's decoder under the reward model's head
    reward_params = nnx.State({**body, "score": reward_params["score"]})
    got = _stats(reward_graphdef, reward_params)
    assert set(got) == set(PER_LAYER)
    for name in PER_LAYER:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


def _packed_layout_attention(q_BTNH, k_BSKH, v_BSKH, segments, window=0, scale=None):
    """CPU stand-in for cuDNN's kernel (as tests/test_pipeline.py): attention under the mask its packed layout
    describes (this Llama has no sliding window). The probe's bound reads the real projections around it."""
    assert window == 0
    return xla_attention(q_BTNH, k_BSKH, v_BSKH, mask_from_packed_layout(segments.offsets, segments.lengths,
                                                                         q_BTNH.shape[1]))


def test_with_cudnn_the_logit_statistic_is_the_norm_bound(plain, reference, monkeypatch):
    """cuDNN's scores never exist: attn_logit_max is max ||q|| * max ||k|| / sqrt(H), an upper bound of the exact
    maximum; the other statistics are unchanged."""
    graphdef, params, exact = plain
    monkeypatch.setattr(layers, "cudnn_attention", _packed_layout_attention)
    cudnn_graphdef, _ = nnx.split(build_model(dataclasses.replace(MODEL, attention="cudnn"), F32, jax.random.key(0)))
    got = _stats(cudnn_graphdef, params)
    np.testing.assert_allclose(got["attn_logit_max"], reference["attn_logit_bound"], rtol=1e-5)
    assert (got["attn_logit_max"] >= exact["attn_logit_max"]).all()
    for name in ("act_rms", "act_max", "gate_saturation") + HEAD:
        np.testing.assert_allclose(got[name], exact[name], rtol=1e-5, atol=1e-6, err_msg=name)
