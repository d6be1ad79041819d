"""Hugging Face interchange: jaxllm logits == transformers logits on the same weights, both directions,
single-file / index-sharded / bf16 checkpoints, loading straight into a (2,2,2,1) mesh, and clear errors."""

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxllm.interop import hf  # noqa: E402
from jaxllm.config.schema import MeshConfig  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.parallel.sharding import spec_tree  # noqa: E402

TOL = 1e-4

# name -> LlamaConfig kwargs: GQA ratios 2 / 1 / 4, odd sizes, tied and untied, non-default theta and eps,
# Llama-3 RoPE scaling (a short original context puts head_dim 6's three frequencies in its three bands; larger
# weights make attention, hence RoPE, matter: without the scaling, logits miss by ~0.25).
CONFIGS = {
    "gqa2_odd": dict(vocab_size=97, hidden_size=48, intermediate_size=100, num_hidden_layers=3,
                     num_attention_heads=6, num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True),
    "gqa4_llama3": dict(vocab_size=128, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 256},
                        tie_word_embeddings=False, initializer_range=0.1),
}


def torch_model(kwargs, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**kwargs, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to ones: randomise them so a mixed-up scale would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def jax_logits(model, ids):
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (torch model, its save_pretrained directory)."""
    out = {}
    for seed, (name, kwargs) in enumerate(CONFIGS.items()):
        model = torch_model(kwargs, seed)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(0, 97, (2, 12))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_matches_transformers(saved, ids, name):
    model, path = saved[name]
    jm = hf.from_pretrained(path)
    assert jm.cfg.tie_embeddings == CONFIGS[name]["tie_word_embeddings"]
    err = np.abs(jax_logits(jm, ids) - torch_logits(model, ids)).max()
    print(f"{name}: import max abs err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_round_trip(saved, ids, tmp_path, name):
    model, path = saved[name]
    jm = hf.from_pretrained(path)
    hf.save_pretrained(jm, tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    err = np.abs(torch_logits(reloaded, ids) - torch_logits(model, ids)).max()
    print(f"{name}: export max abs err {err:.2e}")
    assert err < TOL
    assert reloaded.config.tie_word_embeddings == CONFIGS[name]["tie_word_embeddings"]


def test_index_sharded_checkpoints(saved, ids, tmp_path):
    model, _ = saved["gqa2_odd"]
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    assert (tmp_path / "theirs" / hf.INDEX_FILE).is_file()
    jm = hf.from_pretrained(tmp_path / "theirs")
    assert np.abs(jax_logits(jm, ids) - torch_logits(model, ids)).max() < TOL

    hf.save_pretrained(jm, tmp_path / "ours", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "ours" / hf.INDEX_FILE).is_file()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert np.abs(torch_logits(reloaded, ids) - torch_logits(model, ids)).max() < TOL


def test_bfloat16_checkpoint(saved, ids, tmp_path):
    model, _ = saved["gqa2_odd"]
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.to(torch.float32)  # now holds the bf16-rounded weights, in float32
    jm = hf.from_pretrained(tmp_path)  # bf16 on disk -> float32 parameters
    assert jm.embed_tokens.embedding[...].dtype == jnp.float32
    assert np.abs(jax_logits(jm, ids) - torch_logits(model, ids)).max() < TOL
    bf16 = hf.from_pretrained(tmp_path, dtype="bfloat16")
    assert bf16.layers.self_attn.q_proj[...].dtype == jnp.bfloat16


def test_sharded_load(saved, ids, tmp_path):
    model, path = saved["gqa4_llama3"]
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    plain = hf.from_pretrained(path)
    sharded = hf.from_pretrained(path, mesh=mesh)
    expected = spec_tree(nnx.state(plain), mesh)
    for (key, var), (_, spec) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(expected)):
        value = var.get_value()
        assert value.sharding.spec == spec.get_value(), key
        np.testing.assert_array_equal(np.asarray(value), np.asarray(_get(nnx.state(plain), key)), str(key))
    assert sharded.layers.self_attn.q_proj[...].sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded.layers.mlp.down_proj[...].sharding.spec == P(None, "tensor", "fsdp")
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda m, x: m(x))(sharded, jnp.asarray(ids, jnp.int32))
    assert np.abs(np.asarray(logits) - torch_logits(model, ids)).max() < TOL
    hf.save_pretrained(sharded, tmp_path)  # export gathers one layer at a time
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert np.abs(torch_logits(reloaded, ids) - torch_logits(model, ids)).max() < TOL


def _get(state, key):
    for k in key:
        state = state[k]
    return state.get_value()


def test_missing_files(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.from_pretrained(tmp_path)
    shutil.copy(saved["gqa2_odd"][1] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.from_pretrained(tmp_path)


def test_wrong_shape_and_architecture(saved, tmp_path):
    path = saved["gqa2_odd"][1]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.zeros((101, 48), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.*\[101, 48\].*\[100, 48\]"):
        hf.from_pretrained(tmp_path)

    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        hf.from_pretrained(tmp_path)


def test_config_round_trip():
    cfg = hf.config_from_hf(hf.config_to_hf(hf.config_from_hf(dict(
        CONFIGS["gqa2_odd"], rope_parameters=None, rope_theta=5000.0))))
    assert (cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim) == (48, 6, 3, 8, 100)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.vocab_size, cfg.num_layers) == (5000.0, 1e-5, 97, 3)
    with pytest.raises(NotImplementedError, match="longrope"):
        hf.rope_scaling_from_hf({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}})
