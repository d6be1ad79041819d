"""Qwen3 dense models (Qwen3ForCausalLM): Llama with an RMSNorm over each head of q and k (`q_norm`, `k_norm`)
and a head size of its own (head_dim 128 whatever the width)."""

from jaxllm.config.families.blocks import CHATML, Blocks, Family, full_attention_only, refuse_true

FAMILY = Family(
    name="qwen3",
    model_type="qwen3",
    causal_lm="Qwen3ForCausalLM",
    sequence_classification="Qwen3ForSequenceClassification",
    blocks=Blocks(qk_norm=True),
    from_hf=lambda hf: refuse_true(hf, "attention_bias", why="Qwen3 projections here have no bias")
    or full_attention_only(hf),
    to_hf=lambda fields, rope: {"attention_bias": False, "use_sliding_window": False,
                          "max_window_layers": fields["num_layers"]},
    presets={
        # Qwen3 0.6B.
        "qwen3_0_6b": dict(vocab_size=151936, dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                           mlp_dim=3072, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True),
        # Qwen3 8B.
        "qwen3_8b": dict(vocab_size=151936, dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=12288, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False),
    },
    chat_template=CHATML,
)
