"""Mistral (MistralForCausalLM): Llama whose attention may be limited to a sliding window of the last
`sliding_window` positions (Mistral 7B v0.1: 4096; v0.2 and later: none)."""

from jaxllm.config.families.blocks import Blocks, Family

FAMILY = Family(
    name="mistral",
    model_type="mistral",
    causal_lm="MistralForCausalLM",
    sequence_classification="MistralForSequenceClassification",
    blocks=Blocks(sliding_window=True),
    from_hf=lambda hf: {"sliding_window": int(hf.get("sliding_window") or 0)},
    to_hf=lambda fields, rope: {"sliding_window": fields["sliding_window"] or None},
    presets={
        # Mistral 7B v0.3 (no sliding window).
        "mistral_7b": dict(vocab_size=32768, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           mlp_dim=14336, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False),
    },
    chat_template=(
        "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}{{- '[INST] ' + "
        "message['content'] + ' [/INST]' }}{%- elif message['role'] == 'assistant' %}{{- message['content'] + "
        "eos_token }}{%- endif %}{%- endfor %}"),
)
