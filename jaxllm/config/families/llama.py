"""Llama 2 / 3.x (LlamaForCausalLM): the base every other family adds blocks to."""

from jaxllm.config.families.blocks import Family, refuse_true

FAMILY = Family(
    name="llama",
    model_type="llama",
    causal_lm="LlamaForCausalLM",
    sequence_classification="LlamaForSequenceClassification",
    from_hf=lambda hf: refuse_true(hf, "attention_bias", "mlp_bias", why="Llama projections here have no bias") or {},
    to_hf=lambda fields, rope: {"attention_bias": False, "mlp_bias": False},
    presets={
        # GPT-2 small sized Llama (~125M parameters with a 32k vocabulary).
        "llama_125m": dict(vocab_size=32000, dim=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                           mlp_dim=2048, rope_theta=10000.0, tie_embeddings=True),
        # Llama 3.2 1B.
        "llama_1b": dict(vocab_size=128256, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         mlp_dim=8192, rope_theta=500000.0, tie_embeddings=True),
        # Llama 3.1 8B.
        "llama_8b": dict(vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=14336, rope_theta=500000.0, tie_embeddings=False),
        # Llama 3.1 70B.
        "llama_70b": dict(vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                          mlp_dim=28672, rope_theta=500000.0, tie_embeddings=False),
    },
    chat_template=(
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"),
)
