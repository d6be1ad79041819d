"""Where a run starts and how it recovers: resume from the newest readable checkpoint (falling back past a
corrupted one), start from another run's checkpoint, or roll back after an anomaly."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxllm.checkpoint import CheckpointError, Checkpointer
from jaxllm.config import Config


class AnomalyAbort(RuntimeError):
    """Training stopped on an anomaly (policy `abort`, no checkpoint to roll back to, or too many rollbacks)."""


def restore_latest(checkpointer: Checkpointer, abstract, mesh, log, items=("state", "data", "meta")):
    """(state, meta, data) of the newest checkpoint that restores, trying older ones when one is unreadable;
    None when there is none."""
    for step in reversed(checkpointer.steps()):
        error = None
        try:
            restored = checkpointer.restore(step, abstract, mesh, items=items)
        except CheckpointError as exc:
            error = exc
        if not _everywhere(error is None):  # all processes must fall back together, or none
            moved = checkpointer.quarantine(step)
            log(f"warning: {error or f'checkpoint {step} failed to restore on another process'}; moved it to "
                f"{moved} and trying an earlier checkpoint")
            continue
        return restored["state"], {**restored.get("meta", {}), "data": restored.get("data", {})}
    return None


def _everywhere(ok: bool) -> bool:
    """True when `ok` holds on every process."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def _locate(path: str) -> tuple[Path, int | None]:
    """A checkpoint path given by a user: a step directory, a checkpoints directory, or a run's workdir."""
    p = Path(path)
    if (p / "_CHECKPOINT_METADATA").exists() and p.name.isdigit():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None


def restore_start(cfg: Config, checkpointer: Checkpointer, state, abstract, mesh, log):
    """The state to start from, the data offset (data index = step - 1 + offset) and the rollbacks so far.

    Resuming this run's own checkpoints wins; otherwise `checkpoint.restore_from` seeds the run (parameters
    only, or everything with `checkpoint.restore_all`); otherwise the freshly initialised `state`.
    """
    restored = restore_latest(checkpointer, abstract, mesh, log)
    if restored is not None:
        new_state, meta = restored
        step = int(new_state.step)
        offset = int(meta["data"].get("step", step)) - step
        log(f"resuming from checkpoint step {step} in {checkpointer.directory}"
            + (f" (data offset {offset} after rollbacks)" if offset else ""))
        return new_state, offset, int(meta.get("rollbacks", 0))
    if cfg.checkpoint.restore_from:
        directory, step = _locate(cfg.checkpoint.restore_from)
        source = Checkpointer(directory, keep=1000, log=log)
        try:
            step = source.latest_step() if step is None else step
            if step is None:
                raise CheckpointError(f"no committed checkpoint in {directory}")
            if cfg.checkpoint.restore_all:
                other = source.restore(step, abstract, mesh, items=("state",))["state"]
            else:  # parameters only: the source's optimizer state and windows are never read
                params = source.restore_params(step, abstract.params, mesh)
        finally:
            source.close()
        if cfg.checkpoint.restore_all:
            log(f"starting from {directory / str(step)} (everything: parameters, optimizer state, step)")
            return other, 0, 0
        log(f"starting from the parameters of {directory / str(step)}")
        return state.replace(params=params), 0, 0
    return state, 0, 0
