"""Mixtral (MixtralForCausalLM): Mistral whose MLP is a mixture of experts, `num_local_experts` gated experts of
which a router picks `num_experts_per_tok` per token, their weights renormalised to sum to 1."""

from jaxllm.config.families import mistral
from jaxllm.config.families.blocks import Blocks, Family, router_from_hf, router_to_hf

FAMILY = Family(
    name="mixtral",
    model_type="mixtral",
    causal_lm="MixtralForCausalLM",
    sequence_classification="MixtralForSequenceClassification",
    blocks=Blocks(sliding_window=True, experts="mixtral", experts_renormalized=True),
    from_hf=lambda hf: {"sliding_window": int(hf.get("sliding_window") or 0), "moe_renormalize": True,
                        **router_from_hf(hf, "num_local_experts")},
    to_hf=lambda fields, rope: {"sliding_window": fields["sliding_window"] or None,
                                **router_to_hf(fields, "num_local_experts")},
    presets={
        # Mixtral 8x7B (v0.1): 46.7B parameters, 12.9B active per token.
        "mixtral_8x7b": dict(vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             mlp_dim=14336, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False,
                             num_experts=8, experts_per_token=2, moe_renormalize=True, moe_aux_loss_coef=0.02),
    },
    chat_template=mistral.FAMILY.chat_template,  # Mixtral-Instruct's [INST] turns
)
