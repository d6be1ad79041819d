"""Named model shapes. `--config.model.preset=NAME` writes these into `model.*` first; explicit
`--config.model.*` overrides still win. Each family's real sizes live with the family (jaxllm/config/families/)
and name it; `tiny` is the tests' Llama."""

from jaxllm.config.families import FAMILIES

PRESETS: dict[str, dict] = {
    # Tests: small enough to compile in seconds on one CPU core.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128),
    # Tests and the CPU demo of a mixture of experts: `tiny` as Mixtral with 8 experts of 64 units, 2 per token.
    "moe_tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=64,
                     family="mixtral", num_experts=8, experts_per_token=2),
    **{name: dict(shape, family=family.name) for family in FAMILIES.values() for name, shape in family.presets.items()},
}

# Presets sized for accelerators (every family's real sizes): they compute in bfloat16.
GPU_PRESETS = frozenset(name for family in FAMILIES.values() for name in family.presets)
