"""Rotary position embeddings: the sin/cos tables of per-token positions, the rotation, and the context-extension
rescalings of their frequencies (Hugging Face's linear, llama3 and yarn `rope_type`s)."""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.numerics import widened


# Which fields each rope_type reads (Hugging Face's rope_parameters keys of the same names).
ROPE_TYPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor",
             "mscale", "mscale_all_dim"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Context-extension rescaling of the rotary frequencies: Hugging Face's `rope_type` 'linear', 'llama3' or
    'yarn', computed as transformers' `modeling_rope_utils` computes them (each type reads the fields
    `ROPE_TYPE_FIELDS` names).

    A frozen (hashable) dataclass so a model can hold it as static structure. A config names the common cases
    (`model.rope_scaling`: `from_model_config`); an imported checkpoint may set any field.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: frequencies that turn more than beta_fast times over the original context are kept, those that turn
    # fewer than beta_slow times are divided by `factor`, with a linear ramp between (its ends rounded outwards to
    # whole dimensions when `truncate`).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # YaRN's factor on cos and sin; None: from `factor` (and DeepSeek's mscale / mscale_all_dim when both are set).
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPE_FIELDS:
            raise NotImplementedError(f"rope_type {self.rope_type!r} is not supported (only {list(ROPE_TYPE_FIELDS)})")

    @classmethod
    def from_model_config(cls, cfg) -> RopeScaling | None:
        """The scaling a `ModelConfig` asks for (`rope_scaling`, `rope_scaling_factor`, `rope_original_context`;
        the other fields at their defaults: Llama 3.1's bands, YaRN's betas); None for "none"."""
        if cfg.rope_scaling == "none":
            return None
        if cfg.rope_scaling == "linear":
            return cls("linear", float(cfg.rope_scaling_factor))
        return cls(cfg.rope_scaling, float(cfg.rope_scaling_factor),
                   original_max_position_embeddings=cfg.rope_original_context)

    def model_config_fields(self) -> dict | None:
        """The `ModelConfig` fields that spell this scaling (`from_model_config`'s inverse); None when they
        cannot (a field off its default: other bands or betas, a given attention factor)."""
        original = 0 if self.rope_type == "linear" else self.original_max_position_embeddings
        fields = dict(rope_scaling=self.rope_type, rope_scaling_factor=float(self.factor),
                      rope_original_context=original)
        return fields if RopeScaling.from_model_config(types.SimpleNamespace(**fields)) == self else None

    def parameters(self) -> dict:
        """The fields this rope_type reads (those left None out), named as Hugging Face's rope_parameters."""
        return {k: getattr(self, k) for k in ROPE_TYPE_FIELDS[self.rope_type] if getattr(self, k) is not None}

    def magnitude(self) -> float:
        """The factor on cos and sin: YaRN's attention factor, 1.0 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def inv_freq(self, head_dim: int, theta: float) -> jax.Array:
        """The rescaled inverse frequencies [H/2] of a rotation of `head_dim` dimensions at base `theta`."""
        freqs = _rope_freqs(head_dim, theta)
        if self.rope_type == "yarn":
            return self._yarn(freqs, head_dim, theta)
        inv_freq = 1.0 / freqs
        if self.rope_type == "linear":
            return inv_freq / self.factor
        old_len = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context) are slowed down by `factor`, short ones kept, and
        # the band in between interpolated smoothly.
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)

    def _yarn(self, freqs, head_dim, theta):
        # The operations in transformers' order (`_compute_yarn_parameters`), so the float32 results are its own.
        def dimension(turns):  # the dimension whose frequency turns `turns` times over the original context
            return head_dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a ramp of no width
        # The ramp in numpy: XLA would turn the division by a constant into a product with its reciprocal.
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
        kept = 1 - ramp
        return 1.0 / (self.factor * freqs) * (1 - kept) + 1.0 / freqs * kept


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_freqs(head_dim: int, theta: float) -> jax.Array:
    """theta ** (2i / head_dim) for the H/2 rotated pairs: the inverse of the plain inverse frequencies."""
    return theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rope_tables(positions_BT: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """Rotary sin/cos tables [B, T, H/2] in float32 for the given per-token positions; with a `scaling`, its
    frequencies and its magnitude (YaRN's attention factor, which scales both tables)."""
    inv_freq = 1.0 / _rope_freqs(head_dim, theta) if scaling is None else scaling.inv_freq(head_dim, theta)
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    sin_BTh, cos_BTh = jnp.sin(angles_BTh), jnp.cos(angles_BTh)
    magnitude = 1.0 if scaling is None else scaling.magnitude()
    if magnitude != 1.0:  # a static Python float: the other types' tables stay untouched, bit for bit
        sin_BTh, cos_BTh = sin_BTh * magnitude, cos_BTh * magnitude
    return sin_BTh, cos_BTh


def apply_rope(x_BTNH: jax.Array, sin_BTh: jax.Array, cos_BTh: jax.Array) -> jax.Array:
    """Rotate halves (the Llama / Hugging Face convention: pairs are (i, i + H/2))."""
    half = x_BTNH.shape[-1] // 2
    x32 = widened(x_BTNH)
    x1, x2 = x32[..., :half], x32[..., half:]
    sin, cos = sin_BTh[:, :, None, :], cos_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)
