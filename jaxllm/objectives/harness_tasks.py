"""lm-evaluation-harness tasks on the model in training (`eval.harness_every`): the objective's periodic
evaluation, run by the training loop (jaxllm/train/fit.py) on the run's mesh with the parameters in memory."""

from __future__ import annotations

import dataclasses

from jaxllm.config.schema import Config
from jaxllm.config.typed_config import ConfigError
from jaxllm.train.objective import Objective


def with_harness_tasks(objective: Objective, cfg: Config) -> Objective:
    """`objective` with the harness tasks of `cfg.eval` as its periodic evaluation (unchanged when they are
    off). The lm_eval import is here, not at the top: runs that do not evaluate with it do not need it."""
    ec = cfg.eval
    if not ec.harness_every:
        return objective
    if objective.tokenizer is None:
        raise ConfigError("eval.harness_every", f"train.objective={cfg.train.objective} has no tokenizer to "
                                                "encode the tasks with")
    try:
        from jaxllm.eval import harness
    except ImportError as exc:
        raise ConfigError("eval.harness_every", f"needs lm_eval (pip install -e '.[eval]'): {exc}") from None
    try:
        harness.checked_tasks(ec.tasks(), ec.harness_include_path)
    except ValueError as exc:
        raise ConfigError("eval.harness_tasks", str(exc)) from None

    def evaluate(graphdef, variables, mesh):
        # The run's sft.template, as the backend takes it from a checkpoint's recorded config.
        loaded = harness.LoadedModel(graphdef, variables, mesh, objective.tokenizer, None, cfg.train.seq_len,
                                     cfg.sft.template)
        return harness.evaluate_tasks(loaded, ec.tasks(), include_path=ec.harness_include_path,
                                      limit=ec.harness_limit, batch_size=ec.harness_batch_size)

    return dataclasses.replace(objective, periodic_eval=evaluate,
                               periodic_eval_every=ec.harness_every)
