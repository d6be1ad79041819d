"""Model semantics on one device: causality by gradient, packed-document isolation, attention variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.schema import ConfigError, ModelConfig, PrecisionConfig
from jaxllm.model.transformer import total_params
from jaxllm.model.visibility import attention_mask, packed_segments
from jaxllm.model.build import build_model

from packed_layout import mask_from_packed_layout

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


@pytest.mark.parametrize("remat", ["full", "save_dots", "minimal_with_context", "save_qkv_proj"])
def test_remat_policies_give_identical_gradients(model, remat):
    tokens = np.random.default_rng(2).integers(4, CFG.vocab_size, (2, 8)).astype(np.int32)
    other = build_model(ModelConfig(**{**CFG.__dict__, "remat": remat}), F32, jax.random.key(0))

    def grads(m):
        graphdef, params = nnx.split(m)
        return jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).sum())(params)

    for got, want in zip(jax.tree.leaves(grads(other)), jax.tree.leaves(grads(model))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_named_remat_policies_keep_what_they_name():
    """Compiled temp bytes of one layer's gradient, B2 T256: each policy keeps the residuals it names, so memory
    orders full < save_qkv_proj < minimal_with_context < none (a name lost from the layers would collapse a
    policy onto `full`)."""
    cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 3, "dim": 64, "mlp_dim": 256, "num_heads": 8,
                         "num_kv_heads": 4})
    tokens = np.zeros((2, 256), np.int32)
    temp = {}
    for remat in ("full", "save_qkv_proj", "minimal_with_context", "none"):
        graphdef, params = nnx.split(build_model(ModelConfig(**{**cfg.__dict__, "remat": remat}), F32,
                                                 jax.random.key(0)))
        grad = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p).hidden_states(tokens) ** 2)))
        temp[remat] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["save_qkv_proj"] < temp["minimal_with_context"] < temp["none"], temp


def test_bfloat16_compute_policy_keeps_float32_params_and_logits():
    policy = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    m = build_model(CFG, policy, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m)))
    logits = m(np.ones((1, 4), np.int32))
    assert logits.dtype == jnp.float32
    reference = build_model(CFG, F32, jax.random.key(0))(np.ones((1, 4), np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), atol=5e-2)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_layer_loop_takes_its_weights_in_the_compute_dtype(scan_layers):
    """The stacked kernels are cast to bf16 once, before the layer loop (jaxllm.model.transformer.in_compute_dtype):
    the loop's inputs hold no float32 matrix, so its backward pass neither casts them again nor converts each layer's
    gradient on its own. Norm scales stay float32. The values are those of a cast inside each matmul."""
    import dataclasses

    policy = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    m = build_model(dataclasses.replace(CFG, scan_layers=scan_layers), policy, jax.random.key(0))
    graphdef, params = nnx.split(m)
    tokens = np.ones((1, 4), np.int32)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params).jaxpr
    if scan_layers:
        (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        matrices = [v.aval for v in scan.invars if len(v.aval.shape) >= 3 and v.aval.shape[0] == CFG.num_layers]
    else:  # the unrolled loop slices each layer from the cast stack
        matrices = [e.outvars[0].aval for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                    and len(e.outvars[0].aval.shape) >= 3 and e.outvars[0].aval.shape[0] == CFG.num_layers]
    assert len(matrices) == 7 and {a.dtype for a in matrices} == {jnp.dtype(jnp.bfloat16)}, matrices


@pytest.mark.parametrize("max_runs", [64, 7, 3])
def test_packed_document_layout_describes_the_attention_mask(max_runs):
    """cuDNN's offsets/lengths cover every token once and give exactly the causal same-document mask; rows with
    more runs than the layout holds are flagged (cuDNN attention then uses the masked kernel)."""
    T = 24
    segments = np.array([
        [1] * 5 + [2] * 9 + [3] * 6 + [0] * 4,  # padding at the end is a run of its own
        [1] * T,
        [1, 2, 3, 4, 5, 6] + [7] * 18,
        [1] * 10 + [2] * 13 + [0],
    ], np.int32)
    runs = np.array([4, 1, 7, 3])
    layout = packed_segments(jnp.asarray(segments), max_runs)
    M = min(max_runs, T)
    assert layout.offsets.shape == (4, M + 1) and layout.lengths.shape == (4, M)
    fits = np.asarray(layout.fits)
    np.testing.assert_array_equal(fits, runs <= M)
    offsets, lengths = np.asarray(layout.offsets)[fits], np.asarray(layout.lengths)[fits]
    assert (offsets[:, -1] == -1).all() and (offsets[:, :-1][lengths < 0] == -1).all()
    np.testing.assert_array_equal((lengths > 0).sum(axis=1), runs[fits])
    np.testing.assert_array_equal(lengths.clip(0).sum(axis=1), T)
    np.testing.assert_array_equal(np.asarray(mask_from_packed_layout(offsets, lengths, T)),
                                  np.asarray(attention_mask(jnp.asarray(segments[fits]))))


def test_auto_attention_resolves_per_backend_and_precision():
    from jaxllm.model.visibility import resolve_attention
    on_gpu = jax.default_backend() == "gpu"
    assert resolve_attention("auto", "bfloat16") == ("cudnn" if on_gpu else "xla")
    assert resolve_attention("auto", "float16") == ("cudnn" if on_gpu else "xla")
    assert resolve_attention("auto", "float32") == "xla"
    assert resolve_attention("dot_product", "bfloat16") == "dot_product"
    bf16 = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    assert build_model(CFG, bf16, jax.random.key(0)).cfg.attention == ("cudnn" if on_gpu else "xla")


def test_cudnn_attention_needs_a_gpu_and_half_precision():
    cfg = ModelConfig(**{**CFG.__dict__, "attention": "cudnn"})
    bf16 = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="model.attention: 'cudnn' needs GPUs"):
            build_model(cfg, bf16, jax.random.key(0))(np.ones((1, 8), np.int32))
    from jaxllm.config.schema import default_config_dict, validate
    cd = default_config_dict()
    cd.model.attention, cd.precision.compute = "cudnn", "float32"
    with pytest.raises(ConfigError, match="needs precision.compute bfloat16 or float16"):
        validate(cd, 1)


def _many_short_documents(T):
    """One row of 1-2 token documents: more runs than cuDNN's packed layout holds."""
    lengths = np.tile([1, 2], T)[:T]
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:T]
    return ids, np.concatenate([np.arange(n) for n in lengths])[:T]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention runs on GPUs only; the packed layout "
                    "it reads is checked on CPU above")
@pytest.mark.parametrize("layout", ["packed", "masked_fallback"])
def test_cudnn_attention_matches_xla_on_gpu(layout):
    """Logits and gradients of the whole model with cuDNN attention vs the einsum path, in bfloat16: rows within
    the packed layout's bound, and a row of more documents than it holds (the masked kernel)."""
    cfg = ModelConfig(vocab_size=256, dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=512)
    bf16 = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    T = 128
    tokens = np.random.default_rng(3).integers(4, cfg.vocab_size, (2, T)).astype(np.int32)
    segments = np.array([[1] * 40 + [2] * 50 + [3] * 30 + [0] * 8, [1] * T], np.int32)
    positions = np.stack([np.concatenate([np.arange(40), np.arange(50), np.arange(30), np.arange(8)]), np.arange(T)])
    if layout == "masked_fallback":
        segments[1], positions[1] = _many_short_documents(T)
    assert bool(packed_segments(jnp.asarray(segments)).fits.all()) == (layout == "packed")
    real = segments > 0

    def logits_and_grads(attention):
        m = build_model(ModelConfig(**{**cfg.__dict__, "attention": attention}), bf16, jax.random.key(0))
        graphdef, params = nnx.split(m)

        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens, segments, positions)
            return (logits.mean(-1) * real).sum(), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return np.asarray(logits)[real], jax.tree.leaves(grads)

    got_logits, got_grads = logits_and_grads("cudnn")
    want_logits, want_grads = logits_and_grads("xla")
    np.testing.assert_allclose(got_logits, want_logits, atol=3e-2)
    for got, want in zip(got_grads, want_grads):
        scale = np.abs(np.asarray(want)).max()
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 3e-2 * scale + 1e-6
