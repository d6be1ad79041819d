"""The model families jaxllm builds, one module each (jaxllm/config/families/blocks.py says what a family is).

Adding a family: a module here with its `FAMILY`, listed below; a block no family had before is a `Blocks` field,
read where the layer is built (jaxllm/model/layers.py), plus its Hugging Face rows (jaxllm/interop/hf.py)."""

from jaxllm.config.families import gemma3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from jaxllm.config.families.blocks import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY,
                                                     gemma3.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
                                                     qwen3_moe.FAMILY)}


def family_of_model_type(model_type: str) -> Family | None:
    """The family whose Hugging Face `model_type` this is; None when jaxllm has none."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)
