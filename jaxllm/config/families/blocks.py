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
    # A mixture of experts in place of the MLP (model.num_experts > 0), named as Hugging Face names this family's
    # experts: "mixtral" (block_sparse_moe.experts.{e}.w1/w2/w3) or "qwen_moe" (mlp.experts.{e}.gate_proj/...);
    # "": a dense MLP. With experts_renormalized the top-k router weights always sum to 1 (Mixtral).
    experts: str = ""
    experts_renormalized: bool = False
    # a shared expert beside the routed ones, of model.moe_shared_mlp_dim > 0 hidden units (Qwen2-MoE's
    # mlp.shared_expert.gate_proj/up_proj/down_proj and mlp.shared_expert_gate)
    shared_expert: bool = False


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


def router_from_hf(hf: dict, num_experts_key: str) -> dict:
    """The ModelConfig fields of a mixture of experts' router from config.json (experts under `num_experts_key`);
    FamilyConfigError for router noise, which jaxllm does not add."""
    if hf.get("router_jitter_noise"):
        raise FamilyConfigError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported (no router noise)")
    return {"num_experts": int(hf[num_experts_key]), "experts_per_token": int(hf["num_experts_per_tok"]),
            "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}


def router_to_hf(fields: dict, num_experts_key: str) -> dict:
    """`router_from_hf` backwards."""
    return {num_experts_key: fields["num_experts"], "num_experts_per_tok": fields["experts_per_token"],
            "router_aux_loss_coef": fields["moe_aux_loss_coef"], "router_jitter_noise": 0.0,
            "output_router_logits": False}


def qwen_experts_from_hf(hf: dict) -> dict:
    """The ModelConfig fields of a Qwen mixture of experts (Qwen2-MoE, Qwen3-MoE) from config.json: experts in every
    layer (a FamilyConfigError for dense layers, `mlp_only_layers` or `decoder_sparse_step` > 1), the router."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise FamilyConfigError(f"mlp_only_layers={hf.get('mlp_only_layers')} with decoder_sparse_step="
                                f"{hf.get('decoder_sparse_step', 1)} is not supported (only experts in every layer)")
    experts = "num_experts" if "num_experts" in hf else "num_local_experts"
    return {"mlp_dim": int(hf["moe_intermediate_size"]), "moe_renormalize": bool(hf.get("norm_topk_prob", False)),
            **router_from_hf(hf, experts)}


def qwen_experts_to_hf(fields: dict) -> dict:
    """`qwen_experts_from_hf` backwards. Every layer has experts, so intermediate_size (a dense layer's) is never
    used: it is written as the experts'."""
    return {"use_sliding_window": False, "max_window_layers": fields["num_layers"],
            "moe_intermediate_size": fields["mlp_dim"], "intermediate_size": fields["mlp_dim"],
            "norm_topk_prob": fields["moe_renormalize"], "decoder_sparse_step": 1, "mlp_only_layers": [],
            **router_to_hf(fields, "num_experts")}
