"""The reward model: the decoder's final hidden states and a scalar head, `score` [D, 1] (Hugging Face's
LlamaForSequenceClassification with num_labels=1; no lm_head). It scores every position; a sequence's reward is
the score of its last token (jaxllm/objectives/pairs.py picks those in packed rows).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxllm.config.schema import LoRAConfig, ModelConfig, PrecisionConfig
from jaxllm.model.layers import param
from jaxllm.model.rope import RopeScaling
from jaxllm.model.transformer import Transformer

HEAD = nnx.PathContains("score")  # the score head's variables (a base has none: it is always new)


class RewardModel(Transformer):
    """Call it like the language model to get per-position rewards [B, T] in float32."""

    def __init__(self, cfg: ModelConfig, precision: PrecisionConfig = PrecisionConfig(), *, rngs: nnx.Rngs,
                 rope_scaling: RopeScaling | None = None, pipeline_microbatches: int = 1, pipeline_repeats: int = 1,
                 lora: LoRAConfig | None = None, sequence_parallel: bool = False,
                 pipeline_schedule: str = "gpipe"):
        super().__init__(cfg, precision, rngs=rngs, rope_scaling=rope_scaling,
                         pipeline_microbatches=pipeline_microbatches, pipeline_repeats=pipeline_repeats, lora=lora,
                         lm_head=False, sequence_parallel=sequence_parallel,
                         pipeline_schedule=pipeline_schedule)
        # transformers initialises the score head like its other Linear layers: N(0, initializer_range^2).
        self.score = param(rngs, (cfg.dim, 1), ("embed", None), jnp.dtype(precision.params), cfg.init_std)

    def __call__(self, tokens_BT, segment_ids_BT=None, positions_BT=None, rng=None):
        return self.scores_and_router(tokens_BT, segment_ids_BT, positions_BT, rng)[0]

    def scores_and_router(self, tokens_BT, segment_ids_BT=None, positions_BT=None, rng=None):
        """(every position's score [B, T] in float32, a mixture of experts' router sums or None): the trained
        forward, whose router sums give the auxiliary losses."""
        x_BTD, router = self.hidden_states_and_router(tokens_BT, segment_ids_BT, positions_BT, rng)
        scores_BT = jnp.einsum("BTD,DO->BTO", x_BTD, self.score[...].astype(x_BTD.dtype))[..., 0]
        return scores_BT.astype(jnp.float32), router

