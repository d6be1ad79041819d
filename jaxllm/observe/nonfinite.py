"""Which part of a non-finite step went non-finite first.

The diagnostic variant (jaxllm/train/diagnostic_step.py) records, for each parameter and each stacked layer,
whether the step's parameters and gradients are all finite, and the activation statistics when it measures
them. `first_nonfinite` reads those in the order the step computed them:

1. parameters, in forward order (embedding, layers 0..L-1, the final norm and head): a non-finite parameter
   poisons everything computed after it;
2. activations, layer by layer forward, then the output logits (only when the variant measures activations);
3. the loss;
4. gradients in backward order (head, final norm, layers L-1..0, the embedding last): backpropagation computes
   the last layer's gradients first, so the first non-finite gradient is the one nearest the output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.observe.norms import arrays, leaves

# The order a decoder layer (and the model around it) computes its parameters' contributions; an adapter
# (`<target>_lora`) sits with its target.
FORWARD_NAMES = ("embed_tokens", "input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
                 "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "norm", "lm_head", "score")
ACTIVATION_KEYS = ("act_rms", "act_max")  # [L] arrays of jaxllm/observe/activations.py
LOGIT_KEYS = ("logits_max", "logits_lse_mean")


def forward_rank(path: str) -> int:
    """Where a parameter's computation sits in the forward pass (unknown names last)."""
    for name in reversed(path.split(".")):
        name = name.removesuffix("_lora")
        if name in FORWARD_NAMES:
            return FORWARD_NAMES.index(name)
    return len(FORWARD_NAMES)


def finite_flags(tree) -> dict[str, object]:
    """{parameter path: all-finite flag}, per layer ([L] booleans) for a stacked parameter, one boolean
    otherwise, for a tree shaped like the parameters (computed inside the compiled variant)."""
    out = {}
    for info, x in zip(leaves(tree), arrays(tree), strict=True):
        finite = jnp.isfinite(x)
        if info.layer_axes:
            moved = jnp.moveaxis(finite, info.layer_axes, tuple(range(len(info.layer_axes))))
            out[info.path] = jnp.all(moved.reshape(int(np.prod(moved.shape[:len(info.layer_axes)])), -1), axis=1)
        else:
            out[info.path] = jnp.all(finite)
    return out


def _places(flags: dict[str, np.ndarray], backward: bool) -> list[tuple[str, int | None]]:
    """(path, layer or None) of every parameter slice, in forward (or backward) order of computation."""
    stacked = sorted((p for p, f in flags.items() if np.ndim(f)), key=forward_rank)
    layers = max((len(flags[p]) for p in stacked), default=0)
    alone = sorted((p for p, f in flags.items() if not np.ndim(f)), key=forward_rank)
    before = [(p, None) for p in alone if forward_rank(p) == 0]  # the embedding
    after = [(p, None) for p in alone if forward_rank(p) != 0]
    middle = [(p, i) for i in range(layers) for p in stacked if i < len(flags[p])]
    order = before + middle + after
    return order[::-1] if backward else order


def _name(what: str, path: str, layer: int | None) -> str:
    return f"{what} of {path}" if layer is None else f"{what} of layer {layer} ({path})"


def _first_bad(flags: dict, what: str, backward: bool) -> str | None:
    for path, layer in _places(flags, backward):
        ok = flags[path] if layer is None else flags[path][layer]
        if not bool(ok):
            return _name(what, path, layer)
    return None


def first_nonfinite(finite: dict, loss: float, activations: dict | None = None) -> str | None:
    """What went non-finite first in one analysed step (fetched to the host): "parameters of layer 2
    (layers.mlp.down_proj)", "activations of layer 2", "activations of the output logits", "the loss", "gradients
    of layer 2 (layers.mlp.down_proj)" or "gradients of lm_head"; None when everything is finite.

    `finite` holds the variant's `finite_flags` of the parameters (`params`) and gradients (`grads`);
    `activations` the activation statistics, when measured.
    """
    found = _first_bad(finite["params"], "parameters", backward=False)
    if found:
        return found
    if activations is not None:
        per_layer = [np.asarray(activations[k]) for k in ACTIVATION_KEYS if k in activations]
        bad = [i for i in range(max((len(a) for a in per_layer), default=0))
               if not all(np.isfinite(a[i]) for a in per_layer if i < len(a))]
        if bad:
            return f"activations of layer {bad[0]}"
        if not all(np.isfinite(activations[k]) for k in LOGIT_KEYS if k in activations):
            return "activations of the output logits"
    if not np.isfinite(loss):
        return "the loss"
    return _first_bad(finite["grads"], "gradients", backward=True)
