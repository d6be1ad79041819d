"""The objectives by name: what `train.objective` may say, and the one table every tool builds an objective
through (the training entry, the memory plan of --dry_run, the --print_memory report).

Each entry has two halves: `build(cfg, log)` makes the whole objective (it prepares the data and
locates the base; it returns the config as the objective shapes it: a fine-tuning run adopts its base's
architecture), and `model(cfg)` only its model and what trains, which plans use without data or a base.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxllm.config.schema import Config
from jaxllm.objectives.dpo import dpo_objective
from jaxllm.objectives.grpo import grpo_objective
from jaxllm.objectives.ppo import actor_critic_objective, ppo_objective
from jaxllm.objectives.pretrain import lm_objective, pretrain_objective, with_store_vocab
from jaxllm.objectives.reward import reward_model_objective, reward_objective
from jaxllm.objectives.rl import rollout_rows
from jaxllm.objectives.sft import sft_objective
from jaxllm.runs import base_model
from jaxllm.train.objective import Objective

Factory = Callable[[Config, Callable[[str], None]], tuple[Config, Objective]]


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: `build` makes it whole, `model` its model and trainable variables alone, and
    `fine_tunes` says whether it starts from the base `checkpoint.restore_from` names and takes its
    architecture."""

    build: Factory
    model: Callable[[Config], Objective]
    fine_tunes: bool = True
    shape: Callable[[Config], Config] = lambda cfg: cfg  # what the objective's own settings fix (RL: the rows)


def _pretrain(cfg: Config, log=print) -> tuple[Config, Objective]:
    cfg = with_store_vocab(cfg)
    return cfg, pretrain_objective(cfg)


def _adapters(cfg: Config):
    """The run's LoRA settings when it trains adapters (rank > 0), else None: every parameter trains."""
    return cfg.lora if cfg.lora.rank else None


def _language_model(cfg: Config, lora=None) -> Objective:
    return lm_objective(cfg.model, cfg.precision, cfg.pipeline, lora=lora,
                        sequence_parallel=cfg.mesh.sequence_parallel)


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "pretrain": ObjectiveSpec(_pretrain, _language_model, fine_tunes=False),
    "sft": ObjectiveSpec(sft_objective, lambda cfg: _language_model(cfg, _adapters(cfg))),
    "reward": ObjectiveSpec(reward_objective, lambda cfg: reward_model_objective(
        cfg.model, cfg.precision, cfg.pipeline, _adapters(cfg), pairs_per_row=cfg.preference.pairs_per_row,
        sequence_parallel=cfg.mesh.sequence_parallel)),
    "dpo": ObjectiveSpec(dpo_objective, lambda cfg: _language_model(cfg, _adapters(cfg))),
    "grpo": ObjectiveSpec(grpo_objective, lambda cfg: _language_model(cfg, cfg.lora),
                          shape=lambda cfg: rollout_rows(cfg, "grpo")),
    "ppo": ObjectiveSpec(ppo_objective, lambda cfg: actor_critic_objective(
        cfg.model, cfg.precision, cfg.pipeline, cfg.lora, sequence_parallel=cfg.mesh.sequence_parallel),
                         shape=lambda cfg: rollout_rows(cfg, "ppo")),
}


def objective_for(cfg: Config, log=print) -> tuple[Config, Objective]:
    """The objective `train.objective` names, and the config as it shapes it (fine-tuning adopts the base
    model's architecture)."""
    return OBJECTIVES[cfg.train.objective].build(cfg, log)


def resolved_shape(cfg: Config) -> Config:
    """The config of the model that will train, before anything is chosen or built for it: a fine-tuning run takes
    its base's architecture, an RL run's rows are its rollouts' (auto-fit and plans size that model)."""
    spec = OBJECTIVES[cfg.train.objective]
    if spec.fine_tunes and cfg.checkpoint.restore_from:
        cfg = base_model.adopt_architecture(cfg, base_model.locate(cfg.checkpoint.restore_from))
    return spec.shape(cfg)


def planned_config(cfg: Config) -> Config:
    """The configuration a plan describes: `resolved_shape`, with a vocabulary of "auto" sized from the token
    store's manifest."""
    return with_store_vocab(resolved_shape(cfg))


def planned_model(cfg: Config) -> Objective:
    """The model half of the objective `cfg` trains (what trains, what is frozen), for plans."""
    return OBJECTIVES[cfg.train.objective].model(cfg)
