"""Random tiny transformers models as references (tests/test_families.py, tests/test_moe_models.py): built from
a config, their biases and norm weights randomised, saved with save_pretrained and imported into jaxllm."""

import torch
import transformers

from jaxllm.interop import hf


def random_causal_lm(config: transformers.PretrainedConfig, seed: int):
    """transformers' causal LM of `config` (eager attention), seeded; biases start at zero and norms at one in
    transformers, so they are randomised too: a mixed-up bias or norm scale would then show."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def saved_and_imported(tmp_path_factory, configs: dict) -> dict:
    """name -> (its random model, the directory save_pretrained wrote, jaxllm's import of it) for each
    `configs[name] = (config class, its kwargs)`, seeded by position."""
    out = {}
    for seed, (name, (config_class, kwargs)) in enumerate(configs.items()):
        model = random_causal_lm(config_class(**kwargs), seed)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path, hf.from_pretrained(path))
    return out
