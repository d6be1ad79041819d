"""`train(cfg)`: a whole training run from its config (the public `jaxllm.train.loop.train`)."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxllm.config.schema import Config
from jaxllm.objectives.registry import objective_for, resolved_shape
from jaxllm.plan import auto_fit
from jaxllm.train.fit import check_run_setup, fit, main_log
from jaxllm.train.objective import Objective


def resolve(cfg: Config, log=print) -> Config:
    """The one resolution phase of a run, before its objective is built: the shape of the model that will train
    (a fine-tuning base's architecture, a vocabulary of "auto", an RL run's rollout rows:
    `jaxllm.objectives.registry.resolved_shape`), then the "auto" settings chosen for it
    (jaxllm/plan/auto_fit.py: the remat policy is part of the model, so before it is built)."""
    return auto_fit.choose(resolved_shape(cfg), log)


def train(cfg: Config, stream=sys.stdout, objective: Objective | None = None) -> dict:
    """Train `cfg` end to end (resuming from `<workdir>/checkpoints` if there are any); returns the run's summary.

    Without `objective`, the config is resolved first (`resolve`) and the objective `train.objective` names is
    built from it (jaxllm/objectives/registry.py); a given `objective` trains under `cfg` as it is.
    """
    workdir = Path(cfg.workdir)
    new_workdir = not workdir.exists()
    try:
        if objective is None:
            check_run_setup(cfg)  # a bad --workdir or backend fails before anything is planned or built
            log = main_log(stream)
            cfg = resolve(cfg, log)
            objective = objective_for(cfg, log)
        return fit(cfg, objective, stream)
    except BaseException:
        # A run that stops before it wrote anything (bad data, a refused setting) leaves no directory behind.
        if new_workdir and workdir.is_dir() and not any(workdir.iterdir()):
            workdir.rmdir()
        raise
