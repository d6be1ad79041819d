"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a mixture
of experts in every layer, `num_experts` gated experts of `moe_intermediate_size` hidden units, `num_experts_per_tok`
per token, renormalised when `norm_topk_prob`, plus a shared expert of `shared_expert_intermediate_size` hidden
units that every token runs, scaled by sigmoid(`shared_expert_gate`). Layers with a dense MLP (`mlp_only_layers`,
`decoder_sparse_step` > 1) are not supported."""

from jaxllm.config.families.blocks import (CHATML, Blocks, Family, FamilyConfigError, full_attention_only,
                                           qwen_experts_from_hf, qwen_experts_to_hf)


def _from_hf(hf: dict) -> dict:
    if not hf.get("qkv_bias", True):
        raise FamilyConfigError("qkv_bias=false is not supported (Qwen2-MoE's q/k/v projections here have biases)")
    full_attention_only(hf)
    shared = int(hf.get("shared_expert_intermediate_size", 0))
    if shared <= 0:
        raise FamilyConfigError(f"shared_expert_intermediate_size={shared} is not supported (a shared expert > 0)")
    return {"moe_shared_mlp_dim": shared, **qwen_experts_from_hf(hf)}


def _to_hf(fields: dict, rope: dict) -> dict:
    return {"qkv_bias": True, "shared_expert_intermediate_size": fields["moe_shared_mlp_dim"],
            **qwen_experts_to_hf(fields)}


FAMILY = Family(
    name="qwen2_moe",
    model_type="qwen2_moe",
    causal_lm="Qwen2MoeForCausalLM",
    sequence_classification="Qwen2MoeForSequenceClassification",
    blocks=Blocks(qkv_bias=True, experts="qwen_moe", shared_expert=True),
    from_hf=_from_hf,
    to_hf=_to_hf,
    presets={
        # Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active per token.
        "qwen2_moe_a2_7b": dict(vocab_size=151936, dim=2048, num_layers=24, num_heads=16, num_kv_heads=16,
                                head_dim=128, mlp_dim=1408, rope_theta=1000000.0, norm_eps=1e-6,
                                tie_embeddings=False, num_experts=60, experts_per_token=4, moe_renormalize=False,
                                moe_shared_mlp_dim=5632, moe_aux_loss_coef=0.001),
    },
    chat_template=CHATML,
)
