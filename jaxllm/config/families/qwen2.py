"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama with biases on the q, k and v projections; the small sizes tie
their embeddings."""

from jaxllm.config.families.blocks import CHATML, Blocks, Family, full_attention_only

FAMILY = Family(
    name="qwen2",
    model_type="qwen2",
    causal_lm="Qwen2ForCausalLM",
    sequence_classification="Qwen2ForSequenceClassification",
    blocks=Blocks(qkv_bias=True),
    from_hf=full_attention_only,
    to_hf=lambda fields, rope: {"use_sliding_window": False, "max_window_layers": fields["num_layers"]},
    presets={
        # Qwen2.5 1.5B.
        "qwen2_5_1_5b": dict(vocab_size=151936, dim=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                             mlp_dim=8960, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True),
        # Qwen2.5 7B.
        "qwen2_5_7b": dict(vocab_size=152064, dim=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                           mlp_dim=18944, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False),
    },
    chat_template=CHATML,
)
