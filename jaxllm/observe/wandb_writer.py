"""Weights & Biases as a metrics sink (`metrics.wandb=true`, the optional `wandb` extra), offline by default.

A training job must never stall on a login prompt or a network that is not there, so the run is offline (files
under `<workdir>/wandb`, uploaded later with `wandb sync <dir>`) unless WANDB_MODE asks for another mode, and
online only with an API key (WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes).
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Mapping

from jaxllm.observe.metrics import scalar_fields


def has_api_key(env: Mapping[str, str]) -> bool:
    """Whether wandb could authenticate: WANDB_API_KEY, or a ~/.netrc (NETRC) entry for a wandb host."""
    if env.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc(env.get("NETRC") or None).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_mode(env: Mapping[str, str]) -> str:
    """The mode to run in: WANDB_MODE when set ("online" only with an API key), else "offline"."""
    mode = env.get("WANDB_MODE", "").strip().lower()
    if not mode or (mode == "online" and not has_api_key(env)):
        return "offline"
    return mode


class WandbWriter:
    """Every scalar field of each record logged to one wandb run, against the record's `step`.

    The x axis is the logged `step` field (`define_metric`), not wandb's own strictly increasing counter, so a
    rollback that repeats steps, or an eval record at a step already logged, is kept rather than dropped.
    """

    def __init__(self, workdir: Path, project: str, run_config: dict):
        import wandb

        self.run = wandb.init(project=project, dir=str(workdir), mode=wandb_mode(os.environ), config=run_config,
                              name=Path(workdir).resolve().name, settings=wandb.Settings(console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict) -> None:
        if "step" in record:
            self.run.log({"step": int(record["step"]), **scalar_fields(record)})

    def close(self) -> None:
        self.run.finish()
