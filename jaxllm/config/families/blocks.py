"""What a model family is, as data: the blocks its decoder layer is made of beyond Llama's, how its Hugging Face
`config.json` names them, and its presets. One module per family in this package describes one `Family`; the
model code (jaxllm/model/layers.py) reads `Blocks`, never a family's name, and the Hugging Face interchange
(jaxllm/interop/hf.py) reads the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The optional parts of a decoder layer, each off in Llama."""

    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2), none on o
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before the rotation (Qwen3, Gemma 3)
    sliding_window: bool = False  # attention may be limited to the last `model.sliding_window` positions (Mistral)
    # local (windowed) layers beside global ones, every `model.global_every`-th layer global, the local ones with
    # their own RoPE base `model.local_rope_theta` (Gemma 3's 5:1)
    local_global: bool = False
    norm_plus_one: bool = False  # RMSNorms scale by (1 + w), w starting at zero (Gemma)
    # norms on the attention's and the MLP's outputs too, before each residual add (Gemma 2/3's four per layer)
    sandwich_norms: bool = False
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    embed_scale: bool = False  # embeddings times sqrt(model.dim) on the way in (not in the tied output head)


class FamilyConfigError(ValueError):
    """A Hugging Face config.json value this family's jaxllm model cannot express: the message names the key."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture family.

    `model_type`, `causal_lm` and `sequence_classification` are its Hugging Face names (the last None where
    transformers has no such class). `from_hf(hf)` reads the family's own config.json keys into ModelConfig
    fields (the shapes every family shares are read by jaxllm/interop/hf.py) and raises FamilyConfigError on a
    value it cannot express; `to_hf(fields, rope)` writes them back (`rope`: the rope_parameters of the global
    layers). `presets` are named ModelConfig shapes
    (`model.preset`); `chat_template` is its tokenizers' Jinja chat template, for fixtures and docs."""

    name: str
    model_type: str
    causal_lm: str
    sequence_classification: str | None
    blocks: Blocks = Blocks()
    from_hf: Callable[[dict], dict] = lambda hf: {}
    to_hf: Callable[[dict, dict], dict] = lambda fields, rope: {}
    presets: dict[str, dict] = dataclasses.field(default_factory=dict)
    chat_template: str = ""


def refuse_true(hf: dict, *keys: str, why: str) -> None:
    """FamilyConfigError when any of `keys` is set true in `hf`."""
    for key in keys:
        if hf.get(key):
            raise FamilyConfigError(f"{key}=true is not supported ({why})")


def full_attention_only(hf: dict) -> dict:
    """{} when every layer attends to the whole context; FamilyConfigError naming the key otherwise (Qwen's
    windows on only the layers from `max_window_layers` on are per-layer windows, not supported yet)."""
    refuse_true(hf, "use_sliding_window", why="per-layer sliding windows are not supported")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        raise FamilyConfigError(f"layer_types={hf['layer_types']} is not supported (only full_attention layers)")
    return {}


CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
"""Qwen's ChatML turns (Qwen2, Qwen2.5 and Qwen3 instruct models, without tools or thinking blocks)."""
