"""Direct preference optimisation as an objective: the policy is the base LM with fresh LoRA adapters (or all of
it at lora.rank=0). The reference is, with `dpo.reference="shared"`, the same base with the adapters off: the
frozen arrays themselves, merged into the plain model's graph, so it costs no second copy of the weights
(`jaxllm.model.reference`); with "precomputed", the base's log-probabilities of every pair, computed once before
training and stored with the data (jaxllm/objectives/reference.py), read from the batch.

A LoRA SFT run as the base is merged first (jaxllm/runs/base_model.py, kind "jaxllm-lora"): the merged SFT model
is the frozen base, hence the reference, and DPO trains new adapters on it.

Log-probabilities are summed over each response's tokens (jaxllm/objectives/pairs.py); the loss is
jaxllm.objectives.losses.dpo_loss. Metrics carry TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected. The task report gives, per kind of held-out pair, the accuracy of
the implicit reward (beta * (log pi - log ref) of chosen above rejected) and of the policy's own log-likelihood
(chosen more likely than rejected), before and after training.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config.fine_tuning import DPOConfig
from jaxllm.config.schema import Config, ConfigError
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.model.head import head_stats, with_router_penalty
from jaxllm.model.lora import adapters_off
from jaxllm.model.reference import reference_model
from jaxllm.objectives import pair_eval
from jaxllm.objectives.retention import with_sft_task
from jaxllm.objectives.losses import dpo_loss
from jaxllm.objectives.pairs import masked_mean, pair_mask, per_sequence_sums
from jaxllm.objectives.finetune import row_batches
from jaxllm.train.objective import Objective
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.reference import FIELD, reference_logps
from jaxllm.objectives.reward import held_out_rows, load_pairs


def sequence_logps(model, batch, pairs_per_row: int, rng=None):
    """(chosen [B, K], rejected [B, K]): each response's log-probability, summed over its tokens."""
    return sequence_logps_and_router(model, batch, pairs_per_row, rng)[:2]


def sequence_logps_and_router(model, batch, pairs_per_row: int, rng=None):
    """(chosen [B, K], rejected [B, K], a mixture of experts' router sums or None): `sequence_logps` of the
    trained forward, whose router sums give the auxiliary losses (`jaxllm.model.head.with_router_penalty`)."""
    x_BTD, router = model.hidden_states_and_router(batch["tokens"], batch["segment_ids"], batch["positions"], rng)
    logps_BT = head_stats(model, x_BTD, batch["targets"])[0] * batch["loss_mask"]
    return (*per_sequence_sums(logps_BT, batch["segment_ids"], pairs_per_row), router)


def pair_logps(model, batch, plain_graphdef, pairs_per_row: int, rng=None) -> dict:
    """Policy and reference log-probabilities of each pair's responses, and the responses' lengths in tokens."""
    return pair_logps_and_router(model, batch, plain_graphdef, pairs_per_row, rng)[0]


def pair_logps_and_router(model, batch, plain_graphdef, pairs_per_row: int, rng=None) -> tuple[dict, object]:
    """(`pair_logps`, the policy forward's router sums: None for a dense model)."""
    chosen, rejected, router = sequence_logps_and_router(model, batch, pairs_per_row, rng)
    if FIELD in batch:  # precomputed
        ref_chosen, ref_rejected = batch[FIELD][..., 0], batch[FIELD][..., 1]
    else:
        ref_chosen, ref_rejected = jax.lax.stop_gradient(
            sequence_logps(reference_model(model, plain_graphdef), batch, pairs_per_row))
    chosen_len, rejected_len = per_sequence_sums(batch["loss_mask"], batch["segment_ids"], pairs_per_row)
    return {"chosen": chosen, "rejected": rejected, "ref_chosen": ref_chosen, "ref_rejected": ref_rejected,
            "chosen_len": chosen_len, "rejected_len": rejected_len}, router


def dpo_loss_fn(model, batch, rng=None, *, plain_graphdef, pairs_per_row: int, dpo: DPOConfig = DPOConfig()):
    """`loss_fn` of DPO: the loss summed over the batch's pairs, counted per pair. With `dpo.rpo_alpha` the
    chosen responses' mean negative log-likelihood per token (over the batch, as TRL's "sft" term) is added to
    each pair's loss, times rpo_alpha, and logged as nll_loss."""
    lp, router = pair_logps_and_router(model, batch, plain_graphdef, pairs_per_row, rng)
    mask = pair_mask(batch["segment_ids"], pairs_per_row)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        lp["chosen"], lp["rejected"], lp["ref_chosen"], lp["ref_rejected"], beta=dpo.beta, loss_type=dpo.loss,
        label_smoothing=dpo.label_smoothing, chosen_lengths=lp["chosen_len"], rejected_lengths=lp["rejected_len"])
    metrics = {"rewards/chosen": masked_mean(chosen_rewards, mask),
               "rewards/rejected": masked_mean(rejected_rewards, mask),
               "rewards/accuracies": masked_mean((chosen_rewards > rejected_rewards).astype(jnp.float32), mask),
               "rewards/margins": masked_mean(chosen_rewards - rejected_rewards, mask),
               "logps/chosen": masked_mean(lp["chosen"], mask), "logps/rejected": masked_mean(lp["rejected"], mask)}
    loss_sum, count = jnp.sum(losses * mask), jnp.sum(mask)
    if dpo.rpo_alpha:
        nll = -jnp.sum(lp["chosen"] * mask) / jnp.maximum(jnp.sum(lp["chosen_len"] * mask), 1)
        loss_sum += dpo.rpo_alpha * nll * count  # per pair, so the mean over pairs is the DPO loss + alpha * nll
        metrics["nll_loss"] = nll
    loss_sum, router_metrics = with_router_penalty(model, loss_sum, count, router)
    return loss_sum, count, {**metrics, **router_metrics}


def dpo_model(cfg: Config, rope_scaling=None) -> tuple[Objective, Objective]:
    """(the plain language model, the policy with DPO's loss) of `cfg`, no data: the model-and-loss half the
    objective trains and compiled plans compile. The reference is the policy's base with its adapters off (the
    plain model's graph over the same arrays); with stored reference sums in a batch the loss reads those."""
    sp = cfg.mesh.sequence_parallel
    plain = lm_objective(cfg.model, cfg.precision, cfg.pipeline, adapters_off(cfg.lora), rope_scaling=rope_scaling,
                         sequence_parallel=sp)
    policy = lm_objective(cfg.model, cfg.precision, cfg.pipeline, cfg.lora if cfg.lora.rank else None,
                          rope_scaling=rope_scaling, sequence_parallel=sp)
    loss_fn = functools.partial(dpo_loss_fn, plain_graphdef=plain.graphdef, pairs_per_row=cfg.preference.pairs_per_row,
                                dpo=cfg.dpo)
    return plain, dataclasses.replace(policy, name="dpo", loss_fn=loss_fn)


def dpo_objective(cfg: Config, log=print) -> Objective:
    """The DPO objective of a resolved `cfg`, preparing the pairs (and, precomputed, the reference
    log-probabilities) first."""
    base, directory, manifest = load_pairs(cfg, log)
    if base is None:
        raise ConfigError("checkpoint.restore_from", "DPO starts from a model, its reference: name a jaxllm run or "
                                                     "a Hugging Face model directory")
    K = cfg.preference.pairs_per_row
    plain, policy = dpo_model(cfg, base.rope_scaling)
    extra = {}
    if cfg.dpo.reference == "precomputed":
        stored = reference_logps(cfg, base, directory, plain, lambda m, b: sequence_logps(m, b, K), log)
        extra = {split: {FIELD: stored / f"{split}.npy"} for split in ("train", "eval")}
    pairs, rows = held_out_rows(cfg, directory, extra.get("eval"))
    open_batches, eval_batches = row_batches(cfg, directory, extra)

    def report(graphdef, variables, mesh):
        lp = pair_eval.score_rows(graphdef, variables, mesh, rows, cfg.train.batch_size,
                                  lambda model, batch: pair_logps(model, batch, plain.graphdef, K))
        get = lambda name: pair_eval.per_pair(pairs, lp[name])
        margin = (get("chosen") - get("ref_chosen")) - (get("rejected") - get("ref_rejected"))
        correct = {"logp_accuracy": get("chosen") > get("rejected")}
        # The implicit reward's accuracy means nothing while the policy is its reference (the base model, before
        # training): every margin is 0 by construction, so the report leaves it out rather than print 0%.
        if np.any(margin != 0):
            correct = {"reward_accuracy": margin > 0, **correct}
        return pair_eval.accuracy_report(pairs, correct)

    return dataclasses.replace(policy, open_batches=open_batches, eval_batches=eval_batches,
                                    tokenizer=load_tokenizer(directory / manifest["tokenizer"]), sample_prompt=None,
                                    base=base, report=with_sft_task(report, base, cfg.train.batch_size, log))
