"""bench_step's yardstick (scripts/plain_step.py) computes the same network as jaxllm: with jaxllm's weights
it gives jaxllm's loss, so the bare/plain ratio compares like with like."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from train_runs import ROOT

from jaxllm.config.schema import ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.head import next_token_loss
from jaxllm.model.build import build_model

sys.path.insert(0, str(ROOT / "scripts"))
import plain_step  # noqa: E402

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    init_std=0.2)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")


def _plain_params(model) -> dict:
    """jaxllm's weights in the plain step's layout (heads flattened into the projection matrices)."""
    layers, attn, mlp = model.layers, model.layers.self_attn, model.layers.mlp
    L = MODEL.num_layers

    def flat(x, shape):
        return jnp.asarray(x[...]).reshape(shape)

    return dict(embed=model.embed_tokens.embedding[...], head=model.lm_head[...], norm=model.norm.scale[...],
                ln1=layers.input_layernorm.scale[...], ln2=layers.post_attention_layernorm.scale[...],
                wq=flat(attn.q_proj, (L, MODEL.dim, -1)), wk=flat(attn.k_proj, (L, MODEL.dim, -1)),
                wv=flat(attn.v_proj, (L, MODEL.dim, -1)), wo=flat(attn.o_proj, (L, -1, MODEL.dim)),
                wg=mlp.gate_proj[...], wu=mlp.up_proj[...], wd=mlp.down_proj[...])


def test_the_plain_step_computes_jaxllms_loss():
    model = build_model(MODEL, F32, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0, 4, 32, MODEL.vocab_size).items()}
    loss_sum, count, _ = next_token_loss(model, batch)
    plain = plain_step.loss_fn(_plain_params(model), batch, MODEL)
    np.testing.assert_allclose(float(plain), float(loss_sum / count), rtol=1e-5)
    assert abs(float(plain) - np.log(MODEL.vocab_size)) > 0.01  # init_std 0.2: far from the uniform loss


def test_in_bfloat16_the_plain_step_computes_jaxllms_loss_under_the_same_precision_policy():
    """bf16 compute, float32 parameters: both cast weights to bf16 and keep norms, scores and the loss in float32,
    so the losses agree to bf16 rounding, far closer than the plain step's float32 loss (the casts really happen)."""
    bf16 = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    model = build_model(MODEL, bf16, jax.random.key(0))
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(0, 4, 32, MODEL.vocab_size).items()}
    loss_sum, count, _ = next_token_loss(model, batch)
    params = _plain_params(model)
    plain = plain_step.loss_fn(params, batch, MODEL, jnp.bfloat16)
    jaxllm = float(loss_sum / count)
    np.testing.assert_allclose(float(plain), jaxllm, rtol=1e-4)  # seen: 5.65151 vs 5.65113
    in_float32 = float(plain_step.loss_fn(params, batch, MODEL))  # 5.65239: three times further away
    assert abs(float(plain) - jaxllm) < abs(in_float32 - jaxllm) / 2
