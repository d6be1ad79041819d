"""jaxllm LoRA against the real PEFT (torch, CPU): the same logits on the same weights, the same merge as
merge_and_unload, and adapters that travel both ways in PEFT's format."""

import copy
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jaxllm.interop import hf  # noqa: E402
from jaxllm.config.schema import LORA_TARGETS  # noqa: E402
from jaxllm.model.lora import merge  # noqa: E402

TOL = 1e-4
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
CASES = {"q_v": ["q_proj", "v_proj"], "all": list(LORA_TARGETS)}
IDS = np.random.default_rng(0).integers(0, 96, size=(2, 12))


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, attn_implementation="eager")).eval()
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=sorted(CASES))
def adapted(request, base, tmp_path_factory):
    """(PEFT model with non-zero A and B, its saved adapter directory) for one target set, r16 / alpha 32."""
    model, _ = base
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=CASES[request.param],
                             task_type="CAUSAL_LM")
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapters matter
                p.copy_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(f"adapter_{request.param}")
    peft_model.save_pretrained(path)
    return peft_model, path


def test_imported_peft_adapter_gives_peft_logits(base, adapted):
    peft_model, adapter = adapted
    model = hf.from_pretrained(base[1], adapter=adapter)
    expected = _logits(peft_model)
    assert not np.allclose(expected, _logits(base[0]), atol=1e-2)  # the adapters do change the model
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS, jnp.int32))), expected, rtol=TOL, atol=TOL)


def test_merge_equals_merge_and_unload(base, adapted, tmp_path):
    peft_model, adapter = adapted
    hf.save_pretrained(merge(hf.from_pretrained(base[1], adapter=adapter)), tmp_path)
    ours = load_file(tmp_path / "model.safetensors")
    theirs = {k: v.numpy() for k, v in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        np.testing.assert_allclose(tensor, theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_exported_adapter_loads_in_peft_with_the_same_logits(base, adapted, tmp_path):
    peft_model, adapter = adapted
    model = hf.from_pretrained(base[1], adapter=adapter)
    hf.save_pretrained(model, tmp_path, adapter_only=True)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base[0]), tmp_path).eval()
    np.testing.assert_allclose(_logits(reloaded), np.asarray(model(jnp.asarray(IDS, jnp.int32))), rtol=TOL,
                               atol=TOL)
    np.testing.assert_allclose(_logits(reloaded), _logits(peft_model), rtol=TOL, atol=TOL)


def test_save_pretrained_of_a_lora_model_writes_the_merged_model(base, adapted, tmp_path):
    peft_model, adapter = adapted
    hf.save_pretrained(hf.from_pretrained(base[1], adapter=adapter), tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(_logits(loaded), _logits(peft_model), rtol=TOL, atol=TOL)


def test_unsupported_adapters_are_one_line_errors(base, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                  '"target_modules": ["q_proj", "lm_head"]}')
    with pytest.raises(ValueError, match="target_modules"):
        hf.from_pretrained(base[1], adapter=tmp_path)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        hf.from_pretrained(base[1], adapter=tmp_path / "missing")
