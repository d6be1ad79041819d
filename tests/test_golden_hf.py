"""Torch-free twins of tests/test_hf.py, test_sample.py and test_convert_eval.py, on the checked-in reference of
transformers (tests/golden/reference/, see tests/golden/make_reference_outputs.py): import gives transformers'
logits (tied and untied, single-device and on a (2,2,2,1) mesh), export writes back the very tensors and
config, greedy decoding gives transformers' `generate`, evaluation scores give its log-probs. Part of the
smoke run, so Python 3.12 with current JAX (no torch there) covers Hugging Face interchange too."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from golden_reference import LLAMA, LLAMA_TIED, arrays, rows
from jaxllm.eval import evaluate
from jaxllm.interop import hf
from jaxllm.config.schema import MeshConfig
from jaxllm.parallel.mesh import make_mesh, single_device_mesh
from jaxllm.model.sample import generate

pytestmark = pytest.mark.smoke
TOL = 1e-4  # as tests/test_hf.py
MODELS = {"llama": LLAMA, "llama_tied": LLAMA_TIED}


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


@pytest.fixture(scope="module")
def llama():
    return hf.from_pretrained(LLAMA)


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_transformers(name):
    ref = arrays(MODELS[name])
    model = hf.from_pretrained(MODELS[name])
    assert model.cfg.tie_embeddings == json.loads((MODELS[name] / "config.json").read_text())["tie_word_embeddings"]
    err = np.abs(_logits(model, ref["ids"]) - ref["logits"]).max()
    print(f"{name}: import max abs err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("name", list(MODELS))
def test_export_writes_the_transformers_files(name, tmp_path):
    """Import then export gives back transformers' tensors bit for bit and a config read the same way."""
    hf.save_pretrained(hf.from_pretrained(MODELS[name]), tmp_path)
    ours, theirs = load_file(tmp_path / hf.WEIGHTS_FILE), load_file(MODELS[name] / hf.WEIGHTS_FILE)
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        np.testing.assert_array_equal(ours[key], tensor, err_msg=key)
    config, reference = (json.loads((d / hf.CONFIG_FILE).read_text()) for d in (tmp_path, MODELS[name]))
    assert hf.config_from_hf(config) == hf.config_from_hf(reference)
    assert hf.rope_scaling_from_hf(config) == hf.rope_scaling_from_hf(reference)
    assert (config["architectures"], config["tie_word_embeddings"]) == (reference["architectures"],
                                                                       reference["tie_word_embeddings"])


def test_sharded_import_matches_transformers():
    ref = arrays(LLAMA)
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    graphdef, params = nnx.split(hf.from_pretrained(LLAMA, mesh=mesh))
    assert params["layers"]["self_attn"]["q_proj"].get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, jnp.asarray(ref["ids"], jnp.int32))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() < TOL


def test_greedy_generate_matches_transformers(llama):
    """jaxllm's KV-cache greedy decoding gives transformers' `generate(do_sample=False)` tokens (the generator
    checked a top-1 / top-2 margin at every step, so this is exact)."""
    ref = arrays(LLAMA)
    prompts = rows(ref["prompts"], ref["prompt_lengths"])
    assert generate(llama, prompts, max_new_tokens=ref["greedy_tokens"].shape[1]) == ref["greedy_tokens"].tolist()


def test_continuation_logprobs_match_transformers(llama):
    """evaluate.continuation_logprobs (multiple-choice scoring) equals the summed log-softmax of transformers'
    logits over each continuation."""
    ref = arrays(LLAMA)
    pairs = [(seq[:n], seq[n:]) for seq, n in zip(rows(ref["pair_tokens"], ref["pair_lengths"]),
                                                   ref["pair_context_lengths"], strict=True)]
    graphdef, params = nnx.split(llama)
    got = evaluate.continuation_logprobs(graphdef, params, single_device_mesh(), pairs)
    np.testing.assert_allclose(got, ref["pair_logprobs"], rtol=TOL, atol=TOL)

