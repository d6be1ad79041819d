"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text): GeGLU, RMSNorms that scale by (1 + w), four
norms per layer, embeddings times sqrt(dim), q/k norms, attention scaled by query_pre_attn_scalar, and local
sliding-window layers with their own RoPE base beside every sixth, global, layer; tied embeddings."""

from jaxllm.config.families.blocks import Blocks, Family, FamilyConfigError, refuse_true


def _layer_pattern(hf: dict) -> dict:
    """global_every and sliding_window from `layer_types` (Gemma 3 writes them out; older files give
    `sliding_window_pattern`); FamilyConfigError for a pattern other than every k-th layer global."""
    layers = hf["num_hidden_layers"]
    every = int(hf.get("sliding_window_pattern") or 6)
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                      for i in range(layers)]
    if "sliding_attention" not in kinds:
        return {"global_every": 0, "sliding_window": 0}
    every = kinds.index("full_attention") + 1 if "full_attention" in kinds else layers + 1
    if kinds != ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]:
        raise FamilyConfigError(f"layer_types={kinds} is not supported (only every k-th layer global)")
    return {"global_every": every, "sliding_window": int(hf.get("sliding_window") or 0)}


def _from_hf(hf: dict) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise FamilyConfigError(f"{key}={hf[key]} is not supported (no soft-capping)")
    refuse_true(hf, "attention_bias", "use_bidirectional_attention", why="Gemma 3 here is causal, without biases")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise FamilyConfigError(f"hidden_activation={hf['hidden_activation']!r} is not supported "
                                "(only 'gelu_pytorch_tanh')")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise FamilyConfigError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is not "
                                "supported (only 'default')")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return {"local_rope_theta": float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
            "query_pre_attn_scalar": int(hf.get("query_pre_attn_scalar", head_dim)), **_layer_pattern(hf)}


def _to_hf(fields: dict, rope: dict) -> dict:
    every, layers = fields["global_every"], fields["num_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": fields["query_pre_attn_scalar"] or fields["head_dim"],
        "sliding_window": fields["sliding_window"] or None,
        "layer_types": ["full_attention" if not every or (i + 1) % every == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": fields["local_rope_theta"] or fields["rope_theta"]}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
    }


FAMILY = Family(
    name="gemma3",
    model_type="gemma3_text",
    causal_lm="Gemma3ForCausalLM",
    sequence_classification="Gemma3TextForSequenceClassification",
    blocks=Blocks(qk_norm=True, sliding_window=True, local_global=True, norm_plus_one=True, sandwich_norms=True,
                  activation="gelu_tanh", embed_scale=True),
    from_hf=_from_hf,
    to_hf=_to_hf,
    presets={
        # Gemma 3 1B.
        "gemma3_1b": dict(vocab_size=262144, dim=1152, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                          mlp_dim=6912, rope_theta=1000000.0, local_rope_theta=10000.0, sliding_window=512,
                          global_every=6, query_pre_attn_scalar=256, norm_eps=1e-6, tie_embeddings=True),
        # Gemma 3 4B's language model (its global layers' linear RoPE scaling x8 comes only with an imported
        # checkpoint: training from this preset rotates without it).
        "gemma3_4b": dict(vocab_size=262208, dim=2560, num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                          mlp_dim=10240, rope_theta=1000000.0, local_rope_theta=10000.0, sliding_window=1024,
                          global_every=6, query_pre_attn_scalar=256, norm_eps=1e-6, tie_embeddings=True),
    },
    chat_template=(
        "{{- bos_token }}{%- for message in messages %}{{- '<start_of_turn>' + ('model' if message['role'] == "
        "'assistant' else message['role']) + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"),
)
