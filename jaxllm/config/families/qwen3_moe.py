"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention with a mixture of experts in every layer, `num_experts`
gated experts of `moe_intermediate_size` hidden units, `num_experts_per_tok` per token, renormalised when
`norm_topk_prob`. Layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are not supported."""

from jaxllm.config.families.blocks import (CHATML, Blocks, Family, full_attention_only, qwen_experts_from_hf,
                                           qwen_experts_to_hf, refuse_true)


def _from_hf(hf: dict) -> dict:
    refuse_true(hf, "attention_bias", why="Qwen3 projections here have no bias")
    full_attention_only(hf)
    return qwen_experts_from_hf(hf)


FAMILY = Family(
    name="qwen3_moe",
    model_type="qwen3_moe",
    causal_lm="Qwen3MoeForCausalLM",
    sequence_classification="Qwen3MoeForSequenceClassification",
    blocks=Blocks(qk_norm=True, experts="qwen_moe"),
    from_hf=_from_hf,
    to_hf=lambda fields, rope: {"attention_bias": False, **qwen_experts_to_hf(fields)},
    presets={
        # Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token.
        "qwen3_30b_a3b": dict(vocab_size=151936, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                              head_dim=128, mlp_dim=768, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False,
                              num_experts=128, experts_per_token=8, moe_renormalize=True,
                              moe_aux_loss_coef=0.001),
    },
    chat_template=CHATML,
)
