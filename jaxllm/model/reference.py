"""The adapters-off view of a model: the frozen reference of DPO, PPO and GRPO at no second copy of the weights."""

from __future__ import annotations

from flax import nnx

from jaxllm.model.actor_critic import VALUE


def reference_model(model, plain_graphdef):
    """The model with its adapters off: its non-adapter variables (the same arrays) in the plain model's graph
    (a PPO actor-critic's critic left out)."""
    return nnx.merge(plain_graphdef, nnx.state(model, nnx.All(nnx.Not(nnx.LoRAParam), nnx.Not(VALUE))))
