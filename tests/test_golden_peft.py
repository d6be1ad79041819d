"""Torch-free twins of tests/test_peft.py on the checked-in reference of PEFT (tests/golden/reference/lora/, see
tests/golden/make_reference_outputs.py): an imported PEFT adapter gives PEFT's logits, merging gives
merge_and_unload's tensors, and an exported adapter is PEFT's own files again. Part of the smoke run (Python
3.12 with current JAX, no torch there)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from golden_reference import LLAMA, LORA, arrays
from jaxllm.interop import hf, hf_peft

pytestmark = pytest.mark.smoke
TOL = 1e-4  # logits, as tests/test_peft.py
MERGED_TOL = dict(rtol=1e-5, atol=1e-6)  # merged tensors, as tests/test_peft.py


@pytest.fixture(scope="module")
def adapted():
    return hf.from_pretrained(LLAMA, adapter=LORA)


def test_imported_peft_adapter_gives_peft_logits(adapted):
    ref = arrays(LORA)
    assert not np.allclose(ref["logits"], arrays(LLAMA)["logits"], atol=1e-2)  # the adapters do change the model
    np.testing.assert_allclose(np.asarray(adapted(jnp.asarray(ref["ids"], jnp.int32))), ref["logits"], rtol=TOL,
                               atol=TOL)


def test_merge_equals_merge_and_unload(adapted, tmp_path):
    """save_pretrained of a LoRA model writes it merged: merge_and_unload's tensors (those it changes, the
    adapted ones; every other one is the base's), through jaxllm.model.lora.merge."""
    ref = arrays(LORA)
    hf.save_pretrained(adapted, tmp_path)
    ours, base = load_file(tmp_path / hf.WEIGHTS_FILE), load_file(LLAMA / hf.WEIGHTS_FILE)
    assert sorted(ours) == sorted(base)
    merged = {k.removeprefix("merged."): v for k, v in ref.items() if k.startswith("merged.")}
    assert merged and set(merged) < set(base)
    for name, tensor in ours.items():
        if name in merged:
            np.testing.assert_allclose(tensor, merged[name], **MERGED_TOL, err_msg=name)
        else:
            np.testing.assert_array_equal(tensor, base[name], err_msg=name)


def test_exported_adapter_is_peft_own_files(adapted, tmp_path):
    """adapter_only export writes PEFT's tensor names and values, and PEFT's rank, alpha and targets."""
    hf.save_pretrained(adapted, tmp_path, adapter_only=True)
    ours, theirs = (load_file(d / hf_peft.WEIGHTS_FILE) for d in (tmp_path, LORA))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    config, reference = (json.loads((d / hf_peft.CONFIG_FILE).read_text()) for d in (tmp_path, LORA))
    for key in ("peft_type", "r", "lora_alpha", "use_rslora"):
        assert config.get(key, False) == reference[key], key
    assert sorted(config["target_modules"]) == sorted(reference["target_modules"])
