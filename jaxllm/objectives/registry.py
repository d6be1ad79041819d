"""The objectives by name: what `train.objective` may say, and the one place that turns a config into its
`Objective`. Every tool that needs a run's objective (the training entry, the memory report) builds it here.

A factory takes (config, device count, log) and returns the config as the objective shapes it (a fine-tuning run
adopts its base's architecture) with the objective.
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxllm.config.schema import Config
from jaxllm.objectives.dpo import dpo_objective
from jaxllm.objectives.grpo import grpo_objective
from jaxllm.objectives.ppo import ppo_objective
from jaxllm.objectives.pretrain import pretrain_objective, with_store_vocab
from jaxllm.objectives.reward import reward_objective
from jaxllm.objectives.sft import sft_objective
from jaxllm.train.objective import Objective

Factory = Callable[[Config, int, Callable[[str], None]], tuple[Config, Objective]]


def _pretrain(cfg: Config, num_devices: int, log=print) -> tuple[Config, Objective]:
    cfg = with_store_vocab(cfg)
    return cfg, pretrain_objective(cfg)


FACTORIES: dict[str, Factory] = {
    "pretrain": _pretrain,
    "sft": sft_objective,
    "reward": reward_objective,
    "dpo": dpo_objective,
    "grpo": grpo_objective,
    "ppo": ppo_objective,
}


def objective_for(cfg: Config, log=print) -> tuple[Config, Objective]:
    """The objective `train.objective` names, and the config as it shapes it (fine-tuning adopts the base
    model's architecture)."""
    return FACTORIES[cfg.train.objective](cfg, jax.device_count(), log)
