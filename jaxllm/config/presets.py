"""Named Llama-style model shapes. `--config.model.preset=NAME` writes these into `model.*` first;
explicit `--config.model.*` overrides still win."""

PRESETS: dict[str, dict] = {
    # Tests: small enough to compile in seconds on one CPU core.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128),
    # GPT-2 small sized Llama (~125M parameters with a 32k vocabulary).
    "llama_125m": dict(
        vocab_size=32000, dim=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, mlp_dim=2048,
        rope_theta=10000.0, tie_embeddings=True,
    ),
    # Llama 3.2 1B.
    "llama_1b": dict(
        vocab_size=128256, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
        rope_theta=500000.0, tie_embeddings=True,
    ),
    # Llama 3.1 8B.
    "llama_8b": dict(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
        rope_theta=500000.0, tie_embeddings=False,
    ),
    # Llama 3.1 70B.
    "llama_70b": dict(
        vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
        rope_theta=500000.0, tie_embeddings=False,
    ),
}

# Presets sized for accelerators: they compute in bfloat16.
GPU_PRESETS = frozenset(name for name in PRESETS if name.startswith("llama_"))
