"""RoPE scaling for a longer context (linear, llama3, yarn): jaxllm's rotary tables are transformers' past the
original context, a YaRN checkpoint imports, decodes and exports as transformers runs it, and a config sets the
same scaling (`model.rope_scaling`) on every path, a bad one refused in one line naming the key."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from hf_models import random_causal_lm  # noqa: E402
from jaxllm.config.schema import ConfigError, ModelConfig, default_config_dict, validate  # noqa: E402
from jaxllm.interop import hf  # noqa: E402
from jaxllm.model.rope import RopeScaling, rope_tables  # noqa: E402
from jaxllm.model.transformer import KVCache, Transformer  # noqa: E402
from jaxllm.runs.base_model import ARCHITECTURE, Base, adopt_architecture  # noqa: E402

TOL = 1e-4  # logits, as tests/test_hf.py
ORIGINAL = 16  # the original context of the tiny models: every test reaches well past it
HEAD_DIM, THETA = 16, 10000.0
POSITIONS = np.array([[0, 1, 15, 16, 40, 63, 64, 100, 255, 400]])

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_betas_untruncated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIGINAL,
                               "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn_deepseek_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL,
                             "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 0.9},
}
# llama3 keeps jaxllm's earlier results bit for bit, which XLA computes one float32 ulp off transformers in the
# band between the two wavelengths (it divides by high_freq_factor - low_freq_factor as a product with the
# reciprocal): 1.4e-5 at position 400.
TABLE_TOL = {"llama3": 2e-5}
# A tiny Llama whose attention (hence RoPE) matters: larger weights, and sequences 3x its original context.
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5, tie_word_embeddings=False,
             initializer_range=0.1, max_position_embeddings=4 * ORIGINAL,
             rope_parameters={**SCALINGS["yarn"], "rope_theta": THETA})


def transformers_tables(params: dict):
    """(sin, cos) [1, T, H/2] of transformers' Llama rotary embedding at POSITIONS."""
    factor = params["factor"]
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                      max_position_embeddings=int(ORIGINAL * factor),
                                      rope_parameters={**params, "rope_theta": THETA})
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.tensor(POSITIONS))
    return sin.numpy()[..., :HEAD_DIM // 2], cos.numpy()[..., :HEAD_DIM // 2]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_are_transformers_past_the_original_context(name):
    params = SCALINGS[name]
    scaling = hf.rope_scaling_from_hf({"rope_parameters": params})
    theirs = transformers_tables(params)
    ours = rope_tables(jnp.asarray(POSITIONS), HEAD_DIM, THETA, scaling)
    err = max(np.abs(np.asarray(o) - t).max() for o, t in zip(ours, theirs))
    print(f"{name}: max abs table difference {err:.2e} (magnitude {scaling.magnitude():.6f})")
    assert err < TABLE_TOL.get(name, 1e-6)
    plain = rope_tables(jnp.asarray(POSITIONS), HEAD_DIM, THETA)
    assert np.abs(np.asarray(plain[0]) - theirs[0]).max() > 1e-2  # the scaling is what matches


def test_hf_spellings_of_yarn_are_read_as_transformers_reads_them():
    want = RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL)
    legacy = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}}
    assert hf.rope_scaling_from_hf(legacy) == want  # transformers 4.x files (Qwen2.5's README), `type` key
    # original context and factor left out: from max_position_embeddings, as transformers fills them in
    assert hf.rope_scaling_from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 4.0},
                                    "max_position_embeddings": ORIGINAL}) == want
    assert hf.rope_scaling_from_hf({"rope_scaling": {"rope_type": "yarn", "factor": None, "beta_fast": None,
                                                     "original_max_position_embeddings": ORIGINAL},
                                    "max_position_embeddings": 4 * ORIGINAL}) == want


@pytest.fixture(scope="module")
def yarn_llama(tmp_path_factory):
    """(transformers' tiny YaRN Llama, its save_pretrained directory, jaxllm's import of it)."""
    model = random_causal_lm(transformers.LlamaConfig(**LLAMA), seed=0)
    path = tmp_path_factory.mktemp("yarn_llama")
    model.save_pretrained(path)
    return model, path, hf.from_pretrained(path)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


IDS = np.random.RandomState(0).randint(0, LLAMA["vocab_size"], (2, 3 * ORIGINAL))


def test_yarn_checkpoint_imports_and_decodes_with_transformers_logits(yarn_llama):
    model, _, ours = yarn_llama
    assert ours.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL)
    want = torch_logits(model, IDS)
    err = np.abs(np.asarray(ours(jnp.asarray(IDS, jnp.int32))) - want).max()
    print(f"yarn llama: import max abs logit err {err:.2e}")
    assert err < TOL
    # the KV-cache path: a prefill, then the last token against the cache
    B, T = IDS.shape
    cache, start = KVCache.zeros(ours.cfg, B, T, ours.compute_dtype), jnp.zeros(B, jnp.int32)
    _, cache = ours.decode(jnp.asarray(IDS[:, :-1], jnp.int32), cache, 0, start)
    last, _ = ours.decode(jnp.asarray(IDS[:, -1:], jnp.int32), cache, T - 1, start)
    assert np.abs(np.asarray(last) - want[:, -1]).max() < TOL
    unscaled = nnx.merge(*nnx.split(ours))  # the same weights, plain RoPE
    unscaled.rope_scaling = None
    assert np.abs(np.asarray(unscaled(jnp.asarray(IDS, jnp.int32))) - want).max() > 10 * TOL  # RoPE matters


def test_yarn_export_round_trips(yarn_llama, tmp_path):
    model, _, ours = yarn_llama
    hf.save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and hf.rope_scaling_from_hf(config) == ours.rope_scaling
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    assert np.abs(torch_logits(reloaded, IDS) - torch_logits(model, IDS)).max() < TOL


def config_with(*overrides: str):
    cd = default_config_dict()
    cd.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    for item in overrides:
        key, value = item.split("=")
        section, field = key.split(".")
        cd[section][field] = type(cd[section][field])(value)
    return validate(cd, 8)


def build(cfg: ModelConfig) -> Transformer:
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(0))


def test_config_route_builds_the_same_tables_on_global_layers_only():
    cfg = config_with("model.rope_scaling=yarn", "model.rope_scaling_factor=4",
                      f"model.rope_original_context={ORIGINAL}")
    explicit = RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL)
    model = build(cfg.model)
    assert model.rope_scaling == explicit and hf.config_to_hf(cfg.model)["rope_parameters"]["rope_type"] == "yarn"
    positions = jnp.asarray(POSITIONS)
    for ours, want in zip(model._rotations(positions), rope_tables(positions, cfg.model.head_dim,
                                                                   cfg.model.rope_theta, explicit)):
        np.testing.assert_array_equal(ours, want)
    assert explicit.model_config_fields() == dict(rope_scaling="yarn", rope_scaling_factor=4.0,
                                                  rope_original_context=ORIGINAL)
    other_betas = RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL, beta_fast=8)
    assert other_betas.model_config_fields() is None  # scripts/convert_hf.py refuses what a config cannot spell
    # Gemma 3: its local layers rotate at their own base, unscaled
    gemma = ModelConfig(family="gemma3", num_layers=2, global_every=2, sliding_window=4, local_rope_theta=10.0,
                        rope_scaling="linear", rope_scaling_factor=8.0, tie_embeddings=True)
    (global_sin, local_sin), _ = build(gemma)._rotations(positions)
    np.testing.assert_array_equal(local_sin, rope_tables(positions, gemma.head_dim, 10.0)[0])
    np.testing.assert_array_equal(global_sin, rope_tables(positions, gemma.head_dim, gemma.rope_theta,
                                                          RopeScaling("linear", 8.0))[0])


@pytest.mark.parametrize("overrides,key", [
    (["model.rope_scaling=ntk"], "model.rope_scaling"),
    (["model.rope_scaling=yarn", "model.rope_scaling_factor=4"], "model.rope_original_context"),
    (["model.rope_scaling=llama3", "model.rope_scaling_factor=0.5", "model.rope_original_context=8"],
     "model.rope_scaling_factor"),
    (["model.rope_scaling_factor=4"], "model.rope_scaling_factor"),
    (["model.rope_scaling=linear", "model.rope_scaling_factor=2", "model.rope_original_context=-1"],
     "model.rope_original_context"),
])
def test_bad_rope_scaling_is_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        config_with(*overrides)
    assert info.value.key == key and "\n" not in str(info.value), str(info.value)


def test_a_base_keeps_its_scaling_and_a_config_extends_one_without():
    cfg = config_with()
    shape = {k: getattr(cfg.model, k) for k in ARCHITECTURE}
    yarn = config_with("model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_original_context=64")
    plain_base = Base("jaxllm", "/base/1", 1, shape, None)
    assert adopt_architecture(yarn, plain_base).model.rope_scaling == "yarn"  # extends the context
    yarn_base = Base("jaxllm", "/base/2", 2, {k: getattr(yarn.model, k) for k in ARCHITECTURE}, None)
    assert adopt_architecture(cfg, yarn_base).model == yarn.model  # a fine-tune of it keeps the base's scaling
    hf_base = Base("hf", "/base/3", None, shape, None, RopeScaling("llama3", 8.0))
    assert adopt_architecture(cfg, hf_base).model.rope_scaling == "none"  # travels as base.rope_scaling
    with pytest.raises(ConfigError) as info:
        adopt_architecture(yarn, hf_base)
    assert info.value.key == "model.rope_scaling"
