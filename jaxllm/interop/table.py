"""The conversion-table primitives shared by the Hugging Face and PEFT interchange: a `Row` names one tensor kind
on both sides (the Hugging Face name with `{i}` for the layer, the jaxllm parameter path) and the `Transform` of
its layout between them. A model family's table is a tuple of rows (jaxllm/interop/hf.py, hf_peft.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


# Layout transforms between one Hugging Face tensor and one layer's jaxllm parameter. HF Linear weights are
# [out, in]; jaxllm keeps [in, out] with heads split out. Each transform knows the HF shape for a jaxllm shape,
# which HF slice covers a jaxllm slice (so sharded loads read only what a shard needs), and both directions.
@dataclasses.dataclass(frozen=True)
class Transform:
    name: str
    hf_shape: Callable[[tuple], tuple]
    hf_slices: Callable[[tuple, tuple], tuple]  # (jaxllm slices, jaxllm shape) -> HF slices to read
    to_jax: Callable[[np.ndarray, tuple, tuple], np.ndarray]  # (HF part, jaxllm slices, jaxllm shape)
    to_hf: Callable[[np.ndarray], np.ndarray]


def _heads(s: slice, n: int, h: int) -> slice:
    """Rows of a fused [N*H] axis that cover heads `s` of [N, H]."""
    start, stop, _ = s.indices(n)
    return slice(start * h, stop * h)


IDENTITY = Transform("identity", lambda shape: shape, lambda sl, shape: sl, lambda w, sl, shape: w, lambda w: w)
TRANSPOSE = Transform(
    "transpose", lambda shape: shape[::-1], lambda sl, shape: sl[::-1], lambda w, sl, shape: w.T, lambda w: w.T
)
# q/k/v_proj: HF [N*H, D] <-> jaxllm [D, N, H].
SPLIT_OUT_HEADS = Transform(
    "[N*H, D] -> [D, N, H]",
    lambda shape: (shape[1] * shape[2], shape[0]),
    lambda sl, shape: (_heads(sl[1], shape[1], shape[2]), sl[0]),
    lambda w, sl, shape: w.T.reshape(w.shape[1], -1, shape[2])[:, :, sl[2]],
    lambda w: w.reshape(w.shape[0], -1).T,
)
# o_proj: HF [D, N*H] <-> jaxllm [N, H, D].
SPLIT_IN_HEADS = Transform(
    "[D, N*H] -> [N, H, D]",
    lambda shape: (shape[2], shape[0] * shape[1]),
    lambda sl, shape: (sl[2], _heads(sl[0], shape[0], shape[1])),
    lambda w, sl, shape: w.T.reshape(-1, shape[1], w.shape[0])[:, sl[1], :],
    lambda w: w.reshape(-1, w.shape[-1]).T,
)

# q/k/v biases: HF [N*H] <-> jaxllm [N, H].
SPLIT_HEADS = Transform(
    "[N*H] -> [N, H]",
    lambda shape: (shape[0] * shape[1],),
    lambda sl, shape: (_heads(sl[0], shape[0], shape[1]),),
    lambda w, sl, shape: w.reshape(-1, shape[1])[:, sl[1]],
    lambda w: w.reshape(-1),
)


def _experts_swapped(w: np.ndarray) -> np.ndarray:
    return np.swapaxes(w, -1, -2)


def _fused_half(half: int) -> Transform:
    """gate (`half` 0) or up (1) of transformers' fused experts: HF gate_up_proj [E, 2F, D] <-> jaxllm [E, D, F]."""
    return Transform(
        f"[E, 2F, D] half {half} -> [E, D, F]",
        lambda shape: (shape[0], 2 * shape[2], shape[1]),
        lambda sl, shape: (sl[0], slice(*(half * shape[2] + i for i in sl[2].indices(shape[2])[:2])), sl[1]),
        lambda w, sl, shape: _experts_swapped(w),
        _experts_swapped,
    )


# Experts fused as transformers 5 holds them in memory: gate and up in one gate_up_proj [E, 2F, D], and
# down_proj [E, D, F] <-> jaxllm [E, F, D]. Read only: exports write what transformers' save_pretrained writes.
FUSED_GATE, FUSED_UP = _fused_half(0), _fused_half(1)
FUSED_DOWN = Transform("[E, D, F] -> [E, F, D]", lambda shape: (shape[0], shape[2], shape[1]),
                       lambda sl, shape: (sl[0], sl[2], sl[1]), lambda w, sl, shape: _experts_swapped(w),
                       _experts_swapped)


@dataclasses.dataclass(frozen=True)
class Row:
    """One tensor kind: HF name (`{i}` = layer, `{e}` = expert), jaxllm parameter path, transform; `stacked` if
    per layer. A name with `{e}` is one expert's tensor: the parameter stacks the experts after the layers."""

    hf: str
    path: tuple[str, ...]
    transform: Transform

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    @property
    def lead_keys(self) -> tuple[str, ...]:
        """The name's indices that are leading axes of the parameter, in order: ("i",), ("i", "e") or ()."""
        return tuple(key for key in ("i", "e") if f"{{{key}}}" in self.hf)
