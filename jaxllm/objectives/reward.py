"""The reward model as an objective: the base decoder with a scalar head (jaxllm/model/reward.py), trained on
preference pairs with the Bradley-Terry loss; all of it trainable, or LoRA adapters plus the head.

Metrics per step: loss, pair accuracy (r_chosen > r_rejected), mean margin (r_chosen - r_rejected), and the mean
and standard deviation of all rewards. The task report gives held-out pair accuracy per kind of pair and on the
length-matched subset (jaxllm/objectives/pair_eval.py), before and after training.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config.fine_tuning import RewardConfig
from jaxllm.config.schema import Config, LoRAConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.preference import eval_pairs, prepare_preference
from jaxllm.data.row_prep import PreparedRows
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.model.head import with_router_penalty
from jaxllm.model.reward import HEAD, RewardModel
from jaxllm.objectives import pair_eval
from jaxllm.objectives.losses import bradley_terry_loss
from jaxllm.objectives.pairs import at_last_tokens, masked_mean, pair_mask
from jaxllm.objectives.finetune import check_vocab, data_errors, locate_base, row_batches, tokenizer_path
from jaxllm.train.objective import Objective
from jaxllm.model.build import build_model

def pair_rewards(model, batch, pairs_per_row: int, rng=None):
    """(chosen [B, K], rejected [B, K], pair mask [B, K]): each sequence's reward is its last token's score."""
    return pair_rewards_and_router(model, batch, pairs_per_row, rng)[:3]


def pair_rewards_and_router(model, batch, pairs_per_row: int, rng=None):
    """(`pair_rewards`, a mixture of experts' router sums or None)."""
    rewards_BT, router = model.scores_and_router(batch["tokens"], batch["segment_ids"], batch["positions"], rng=rng)
    chosen, rejected = at_last_tokens(rewards_BT, batch["segment_ids"], pairs_per_row)
    return chosen, rejected, pair_mask(batch["segment_ids"], pairs_per_row), router


def reward_loss(model, batch, rng=None, *, pairs_per_row: int, reward: RewardConfig = RewardConfig()):
    """`loss_fn` of the reward model: the Bradley-Terry loss summed over the batch's pairs, counted per pair (a
    mixture of experts' auxiliary losses in its gradient, `jaxllm.model.head.with_router_penalty`)."""
    chosen, rejected, mask, router = pair_rewards_and_router(model, batch, pairs_per_row, rng)
    losses = bradley_terry_loss(chosen, rejected, reward.margin or None, reward.center_coef)
    both, both_mask = jnp.concatenate([chosen, rejected]), jnp.concatenate([mask, mask])
    mean = masked_mean(both, both_mask)
    metrics = {"accuracy": masked_mean((chosen > rejected).astype(jnp.float32), mask),
               "margin": masked_mean(chosen - rejected, mask), "reward_mean": mean,
               "reward_std": jnp.sqrt(masked_mean((both - mean) ** 2, both_mask))}
    count = jnp.sum(mask)
    loss_sum, router_metrics = with_router_penalty(model, jnp.sum(losses * mask), count, router)
    return loss_sum, count, {**metrics, **router_metrics}


def reward_model_objective(model: ModelConfig, precision: PrecisionConfig, pipeline: PipelineConfig = PipelineConfig(),
                           lora: LoRAConfig | None = None, rope_scaling=None, pairs_per_row: int = 4,
                           reward: RewardConfig = RewardConfig(), sequence_parallel: bool = False) -> Objective:
    """The model-and-loss half of the reward model (no data). With `lora` (rank > 0) the adapters and the head
    train; the head is always new (`fresh`): a base has none. `sequence_parallel` as `build_model`."""
    adapters = lora is not None and lora.rank
    return Objective(name="reward", build_model=functools.partial(build_model, model, precision, pipeline=pipeline,
                                                                   lora=lora, rope_scaling=rope_scaling,
                                                                   model_class=RewardModel,
                                                                   sequence_parallel=sequence_parallel),
                     loss_fn=functools.partial(reward_loss, pairs_per_row=pairs_per_row, reward=reward),
                     trainable=nnx.Any(nnx.LoRAParam, HEAD) if adapters else nnx.Param, fresh=HEAD)


def load_pairs(cfg: Config, log) -> tuple[object, Path, dict]:
    """(the base, the prepared directory, its manifest): the preference data of `cfg.preference` prepared with
    the base's tokenizer (shared by the reward model and DPO)."""
    base = locate_base(cfg, "preference")
    tokenizer_file = tokenizer_path(cfg, base, "preference")
    pc, tc = cfg.preference, cfg.train
    with data_errors("preference"):
        manifest = prepare_preference(cfg.data.path, train_file=pc.train_file, eval_file=pc.eval_file,
                                      tokenizer_path=tokenizer_file, template=pc.template, seq_len=tc.seq_len,
                                      overlong=pc.overlong, eval_fraction=pc.eval_fraction, seed=tc.seed,
                                      pairs_per_row=pc.pairs_per_row, log=log)
    check_vocab(cfg, manifest, tokenizer_file)
    return base, Path(cfg.data.path), manifest


def held_out_rows(cfg: Config, directory: Path, extra: dict | None = None) -> tuple[list[dict], dict]:
    """(the first preference.eval_pairs held-out pairs, every held-out row with its `extra` fields) for task
    reports."""
    pairs = eval_pairs(directory)
    pairs = pairs[: cfg.preference.eval_pairs] if cfg.preference.eval_pairs else pairs
    rows = PreparedRows(directory, "eval", shuffle=False, extra=extra)
    return pairs, rows.get_rows(np.arange(max(p["row"] for p in pairs) + 1))  # the rows those pairs are in


def reward_objective(cfg: Config, log=print) -> Objective:
    """The reward-model objective of a resolved `cfg`, preparing the pairs first."""
    base, directory, manifest = load_pairs(cfg, log)
    K = cfg.preference.pairs_per_row
    pairs, rows = held_out_rows(cfg, directory)
    open_batches, eval_batches = row_batches(cfg, directory)

    def report(graphdef, variables, mesh):
        scored = pair_eval.score_rows(graphdef, variables, mesh, rows, cfg.train.batch_size,
                                      lambda model, batch: dict(zip(("chosen", "rejected"),
                                                                    pair_rewards(model, batch, K)[:2])))
        chosen, rejected = (pair_eval.per_pair(pairs, scored[s]) for s in ("chosen", "rejected"))
        return pair_eval.accuracy_report(pairs, {"accuracy": chosen > rejected})

    lora = cfg.lora if cfg.lora.rank else None
    model = reward_model_objective(cfg.model, cfg.precision, cfg.pipeline, lora, base and base.rope_scaling, K,
                                   cfg.reward, sequence_parallel=cfg.mesh.sequence_parallel)
    return dataclasses.replace(model, open_batches=open_batches, eval_batches=eval_batches,
                                    tokenizer=load_tokenizer(directory / manifest["tokenizer"]), sample_prompt=None,
                                    base=base, report=report)
