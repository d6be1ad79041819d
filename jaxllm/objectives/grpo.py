"""Group relative policy optimisation as an objective: the policy is the base LM with fresh LoRA adapters,
trained by the shared step and loop on batches its own rollouts make (jaxllm/objectives/rl.py: the sampler, the
reward, the batch source of iterations). Full fine-tuning (lora.rank=0) keeps the frozen base, its reference,
on the rollout devices (rl.placement=disaggregated).

Each iteration samples grpo.num_generations responses to each of its prompts; `group_advantages` compares each
response's score with its group's, and the rows feed grpo.epochs passes of minibatches through `grpo_loss_fn`
(jaxllm.objectives.losses.grpo_loss).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config.fine_tuning import GRPOConfig
from jaxllm.config.schema import Config
from jaxllm.model.head import with_router_penalty
from jaxllm.objectives.losses import group_advantages, grpo_loss, kl_penalty, ppo_policy_loss
from jaxllm.objectives.pairs import masked_mean
from jaxllm.objectives.rollout import response_stats_and_router
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.objectives.rl import RolloutBatches, rl_objective, rl_setup, rows_prompt_len

# Token-mean aggregations count tokens; the others average over sequences.
_PER_TOKEN = ("dapo", "bnpo")


def grpo_loss_fn(model, batch, rng=None, *, grpo: GRPOConfig):
    """`loss_fn` of GRPO on a minibatch of rollout rows; `rng` is unused (no dropout: see the module doc)."""
    mask = batch["mask"]
    prompt_len = rows_prompt_len(batch)
    logps, entropy, router = response_stats_and_router(model, batch["tokens"], batch["segment_ids"],
                                                       batch["positions"], prompt_len, grpo.temperature,
                                                       entropy=True)
    advantages = batch["advantages"]
    loss = grpo_loss(logps, batch["old_logps"], batch["ref_logps"] if grpo.beta else None, advantages, mask,
                     beta=grpo.beta, clip=grpo.clip, loss_agg=grpo.loss_agg, max_completion_length=mask.shape[1],
                     weights=batch.get("tis_weights"))
    count = jnp.sum(mask) if grpo.loss_agg in _PER_TOKEN else jnp.float32(mask.shape[0])
    _, clip_fraction, approx_kl = ppo_policy_loss(logps, batch["old_logps"],
                                                  jnp.broadcast_to(advantages, mask.shape), mask, grpo.clip)
    metrics = {"reward": jnp.mean(batch["scores"]), "kl": masked_mean(kl_penalty(logps, batch["ref_logps"], "k3"),
                                                                        mask),
               "clip_fraction": clip_fraction, "approx_kl": approx_kl,
               "entropy": masked_mean(jax.lax.stop_gradient(entropy), mask),
               "response_length": jnp.mean(jnp.sum(mask, axis=1)), "eos_rate": jnp.mean(batch["stopped"])}
    loss_sum, router_metrics = with_router_penalty(model, loss * count, count, router)
    return loss_sum, count, {**metrics, **router_metrics}


class GRPOBatches(RolloutBatches):
    """GRPO's iterations: grpo.num_generations responses to each prompt, with their group advantages."""

    def __init__(self, cfg: Config, request: BatchRequest, sampler, prompts: list[dict]):
        self.responses_per_prompt = cfg.grpo.num_generations
        super().__init__(cfg, cfg.grpo, request, sampler, prompts)

    def score(self, rows: dict[str, np.ndarray], variables) -> dict[str, np.ndarray]:
        rows["advantages"] = np.asarray(group_advantages(rows["scores"][:, 0], self.responses_per_prompt),
                                        np.float32)[:, None]
        return rows


def grpo_objective(cfg: Config, log=print) -> Objective:
    """The GRPO objective of a resolved `cfg`, reading the prompts first."""
    setup = rl_setup(cfg, "grpo", log)

    def open_batches(request: BatchRequest):
        return GRPOBatches(cfg, request, setup.sampler, setup.prompts["train"])

    return rl_objective(setup, "grpo", functools.partial(grpo_loss_fn, grpo=cfg.grpo), open_batches,
                             ("reward", "kl", "response_length"))
