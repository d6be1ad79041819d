"""The objectives by name: what `train.objective` may say, and the one table every tool builds an objective
through (the training entry, the memory plan of --dry_run, the --print_memory report).

Each entry has three parts: `shape(cfg)` is what the objective fixes in the config before anything is chosen
or built for it (with the base's architecture, which `resolved_shape` adopts first: the vocabulary, an RL run's
rows); `build(cfg, log)` makes the whole objective from that resolved config (it prepares the data and locates
the base, and changes no setting); `model(cfg)` gives only its model and what trains, which plans use without
data or a base.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxllm.config.schema import Config
from jaxllm.objectives.dpo import dpo_model, dpo_objective
from jaxllm.objectives.grpo import grpo_objective
from jaxllm.objectives.harness_tasks import with_harness_tasks
from jaxllm.objectives.ppo import actor_critic_objective, ppo_objective
from jaxllm.objectives.pretrain import lm_objective, pretrain_objective, with_store_vocab
from jaxllm.objectives.reward import reward_model_objective, reward_objective
from jaxllm.objectives.finetune import tokenizer_vocab
from jaxllm.objectives.rl import rollout_rows
from jaxllm.objectives.sft import sft_objective
from jaxllm.runs import base_model
from jaxllm.train.objective import Objective

Factory = Callable[[Config, Callable[[str], None]], Objective]


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: `build` makes it whole, `model` its model and trainable variables alone, `fine_tunes` says
    whether it starts from the base `checkpoint.restore_from` names and takes its architecture, `shape` what
    its own settings fix in the config (the vocabulary of "auto", RL's rows), and `step` the model with the
    objective's own loss when that loss is not `model`'s and reads no more than a language model's rows (for
    compiled plans; None: plan with `model`). `loss_kind` says what its logged loss measures, for the diagnosis
    (one of LOSS_KINDS)."""

    build: Factory
    model: Callable[[Config], Objective]
    fine_tunes: bool = True
    shape: Callable[[Config], Config] = lambda cfg: cfg
    step: Callable[[Config], Objective | None] = lambda cfg: None
    loss_kind: str = "token_mean"


LOSS_KINDS = {
    # a mean over the batch's tokens (thousands a step): its step-to-step change is small, so a large one is news
    "token_mean": "a mean over the batch's tokens",
    # a mean over a few preference pairs a step: it falls as the model learns, but one batch's easy or hard pairs
    # move it by tens of percent (DPO's sigmoid loss at batch 16: a 23% median step-to-step change in a healthy run)
    "pair_mean": "a mean over a few preference pairs a step",
    # a policy-gradient surrogate over whitened advantages: centred near zero by construction and not lower when
    # the policy is better; RL's progress is its reward
    "surrogate": "a policy-gradient surrogate whose value does not measure progress (the reward does)",
}


def _pretrain(cfg: Config, log=print) -> Objective:
    return pretrain_objective(cfg)


def _adapters(cfg: Config):
    """The run's LoRA settings when it trains adapters (rank > 0), else None: every parameter trains."""
    return cfg.lora if cfg.lora.rank else None


def _language_model(cfg: Config, lora=None) -> Objective:
    return lm_objective(cfg.model, cfg.precision, cfg.pipeline, lora=lora,
                        sequence_parallel=cfg.mesh.sequence_parallel)


def _dpo_step(cfg: Config) -> Objective | None:
    """DPO's step with the shared reference; None with a precomputed one (its loss reads the stored sums, a field
    plans do not make)."""
    return dpo_model(cfg)[1] if cfg.dpo.reference == "shared" else None


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "pretrain": ObjectiveSpec(_pretrain, _language_model, fine_tunes=False, shape=with_store_vocab),
    "sft": ObjectiveSpec(sft_objective, lambda cfg: _language_model(cfg, _adapters(cfg)),
                         shape=lambda cfg: tokenizer_vocab(cfg, "sft")),
    "reward": ObjectiveSpec(reward_objective, lambda cfg: reward_model_objective(
        cfg.model, cfg.precision, cfg.pipeline, _adapters(cfg), pairs_per_row=cfg.preference.pairs_per_row,
        sequence_parallel=cfg.mesh.sequence_parallel), shape=lambda cfg: tokenizer_vocab(cfg, "preference"),
        loss_kind="pair_mean"),
    "dpo": ObjectiveSpec(dpo_objective, lambda cfg: _language_model(cfg, _adapters(cfg)),
                         shape=lambda cfg: tokenizer_vocab(cfg, "preference"), step=_dpo_step, loss_kind="pair_mean"),
    "grpo": ObjectiveSpec(grpo_objective, lambda cfg: _language_model(cfg, cfg.lora),
                          shape=lambda cfg: rollout_rows(cfg, "grpo"), loss_kind="surrogate"),
    "ppo": ObjectiveSpec(ppo_objective, lambda cfg: actor_critic_objective(
        cfg.model, cfg.precision, cfg.pipeline, cfg.lora, sequence_parallel=cfg.mesh.sequence_parallel),
                         shape=lambda cfg: rollout_rows(cfg, "ppo"), loss_kind="surrogate"),
}


def objective_for(cfg: Config, log=print) -> Objective:
    """The objective `train.objective` names, built from a resolved config (`jaxllm.launch.train.resolve`), with
    the harness tasks of `eval.harness_every` when they are on."""
    return with_harness_tasks(OBJECTIVES[cfg.train.objective].build(cfg, log), cfg)


def resolved_shape(cfg: Config) -> Config:
    """The config of the model that will train, before anything is chosen or built for it: a fine-tuning run takes
    its base's architecture, then the objective's `shape` (a vocabulary of "auto" sized from the token store or the
    tokenizer, an RL run's rows); auto-fit and plans size that model."""
    spec = OBJECTIVES[cfg.train.objective]
    if spec.fine_tunes and cfg.checkpoint.restore_from:
        cfg = base_model.adopt_architecture(cfg, base_model.locate(cfg.checkpoint.restore_from))
    return spec.shape(cfg)


def planned_model(cfg: Config) -> Objective:
    """The model half of the objective `cfg` trains (what trains, what is frozen), for plans."""
    return OBJECTIVES[cfg.train.objective].model(cfg)


def planned_step(cfg: Config) -> Objective:
    """The step compiled plans (`--print_comms`, a compiled `--dry_run`) compile for `cfg`, with no data: the
    objective's own loss where it reads no more than a language model's rows (pretraining, SFT, the reward
    model, DPO with the shared reference); PPO, GRPO and DPO with a precomputed reference read rollout or stored
    fields, so they compile the language-model loss on their model (exact counts, approximate temporaries)."""
    return OBJECTIVES[cfg.train.objective].step(cfg) or planned_model(cfg)
