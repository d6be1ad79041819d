"""PPO's actor and critic in one module over one frozen base: the language model with LoRA adapters (the policy)
and, as its attribute `value`, a reward-model-shaped critic (jaxllm/model/reward.py: the decoder and a scalar
head) with adapters of its own.

The critic's base variables are the policy's own Variable objects (tied after construction), so the module's
state holds the base once, at the language model's paths: the frozen tree is exactly a plain LM's (the base
checkpoint loads into it unchanged) and the critic adds only its adapters and head. Calling the module is the
policy's forward; `module.value(tokens, ...)` gives per-position values [B, T]. With `own_critic_body` (a
critic started from a trained reward model) nothing is tied: the critic's body is frozen variables of its own,
under `value`. Without adapters (full fine-tuning: every weight of both trains) the critic's body is its own too.
"""

from __future__ import annotations

from flax import nnx

from jaxllm.config.schema import LoRAConfig, ModelConfig, PrecisionConfig
from jaxllm.model.rope import RopeScaling
from jaxllm.model.reward import RewardModel
from jaxllm.model.base_quant import QuantizedKernel
from jaxllm.model.transformer import Transformer

VALUE = nnx.PathContains("value")  # the critic's variables (adapters and head; and its body, when it has its own)
CRITIC_HEAD = nnx.All(VALUE, nnx.PathContains("score"))


class ActorCritic(Transformer):
    """The policy (this Transformer) and its critic `value` sharing one base."""

    def __init__(self, cfg: ModelConfig, precision: PrecisionConfig = PrecisionConfig(), *, rngs: nnx.Rngs,
                 rope_scaling: RopeScaling | None = None, pipeline_microbatches: int = 1, pipeline_repeats: int = 1,
                 lora: LoRAConfig | None = None, sequence_parallel: bool = False,
                 pipeline_schedule: str = "gpipe", own_critic_body: bool = False):
        shape = dict(rope_scaling=rope_scaling, pipeline_microbatches=pipeline_microbatches,
                     pipeline_repeats=pipeline_repeats, lora=lora, sequence_parallel=sequence_parallel,
                     pipeline_schedule=pipeline_schedule)
        super().__init__(cfg, precision, rngs=rngs, **shape)
        self.value = RewardModel(cfg, precision, rngs=rngs, **shape)
        # With adapters the critic's base is the policy's frozen one, unless it keeps a body of its own
        # (ppo.critic_init=rm:...); without adapters (full fine-tuning) both bodies train, each its own.
        if lora is not None and lora.rank and not own_critic_body:
            _tie_base(self.value, self)


def _tie_base(critic: nnx.Module, policy: nnx.Module) -> None:
    """Replace each plain Param of `critic` (its base; not its adapters, not the head the policy lacks) and each
    quantised kernel of a QLoRA base by the policy's at the same path. The critic's own copies, initialised and
    then dropped, cost nothing under jit: XLA removes what no output uses."""
    policy_nodes = dict(nnx.iter_graph(policy))
    for path, node in list(nnx.iter_graph(critic)):
        if not isinstance(node, nnx.Module):
            continue
        for name, variable in list(vars(node).items()):
            shared = policy_nodes.get(tuple(path) + (name,))
            plain = type(variable) is nnx.Param and type(shared) is nnx.Param
            if plain or (isinstance(variable, QuantizedKernel) and isinstance(shared, QuantizedKernel)):
                setattr(node, name, shared)
