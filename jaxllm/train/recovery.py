"""Where a run starts and how it recovers: resume from the newest readable checkpoint (falling back past a
corrupted one), start from another run's checkpoint, or act on an anomaly (the policy below).

A run never holds two train states: a resume restores straight into abstract shapes (no state is initialised
first), a start from another run's parameters builds the optimizer state around the restored parameters, and
a rollback frees the bad state before restoring the healthy one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxllm.runs.checkpoint import (CheckpointError, CheckpointMismatch, Checkpointer, everywhere,
                                   locate_checkpoints)
from jaxllm.config.schema import Config, ConfigError
from jaxllm.optim.loss_scale import loss_scaling
from jaxllm.train.anomaly import incident_kind
from jaxllm.runs.base_model import accepted, check_same_base
from jaxllm.runs.loader import load_base
from jaxllm.train.control import HOT_UPDATES
from jaxllm.train.state import (init_frozen, init_objective_state, init_part, init_trainable_state, older_layout,
                               state_from_params, state_shardings)


class AnomalyAbort(RuntimeError):
    """Training stopped on an anomaly (policy `abort`, no checkpoint to roll back to, or too many rollbacks)."""


def restore_latest(checkpointer: Checkpointer, abstract, mesh, log, items=("state", "data", "meta"),
                   shardings=None, older=None):
    """(state, meta, data) of the newest checkpoint that restores (placed per `shardings`, default the rules on
    `mesh`; `older`: an earlier state layout it may have, see `Checkpointer.restore`), trying older ones when
    one is unreadable; None when there is none."""
    for step in reversed(checkpointer.steps()):
        error = None
        try:
            restored = checkpointer.restore(step, abstract, mesh, items=items, shardings=shardings, older=older)
        except CheckpointError as exc:
            error = exc
        if not everywhere(error is None):  # all processes must fall back together, or none
            moved = checkpointer.quarantine(step)
            log(f"warning: {error or f'checkpoint {step} failed to restore on another process'}; moved it to "
                f"{moved} and trying an earlier checkpoint")
            continue
        return restored["state"], {**restored.get("meta", {}), "data": restored.get("data", {})}
    return None


# The config keys that decide the train state's arrays (names, shapes), by dotted prefix: when a run's
# checkpoints do not match its config, these are the keys a refusal names.
STATE_KEYS = ("model.vocab_size", "model.dim", "model.num_layers", "model.num_heads", "model.num_kv_heads",
              "model.head_dim", "model.mlp_dim", "model.tie_embeddings", "model.scan_layers", "model.preset",
              "lora.rank", "lora.targets", "train.objective", "optim.name", "optim.grad_compression",
              "optim.powersgd_rank", "anomaly.window", "precision.loss_scale")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"section.key": value} of a nested config dict."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def config_mismatch(cfg: Config, checkpointer: Checkpointer, path: Path, differences: list[str]) -> ConfigError:
    """The one-line error of a run whose intact checkpoints were trained with other settings than `cfg`: the
    state-shaping keys that differ between `cfg` and the config saved with the checkpoint at `path` (else the
    arrays that differ). Nothing is moved or written."""
    try:
        saved = _flat(checkpointer.read_meta(int(path.name)).get("config") or {})
    except CheckpointError:
        saved = {}
    ours = _flat(cfg.to_dict())
    keys = [k for k in ours if k.startswith(STATE_KEYS) and k in saved and saved[k] != ours[k]]
    what = (", ".join(f"{k}: {ours[k]!r} in the config, {saved[k]!r} in the checkpoints" for k in keys)
            or "; ".join(differences[:3]))
    return ConfigError("checkpoint", f"this run's checkpoints in {checkpointer.directory} were trained with other "
                                     f"settings ({what}); resume with the run's settings or use another workdir "
                                     f"(nothing was moved or written)")


# What an objective trains toward beyond its arrays: resumed under another reward, an RL run would go on pulling
# its policy toward a different goal, or, already at its last step, report its policy under the new reward as if
# trained on it (`make ppo` then `make ppo ARGS=--config.ppo.reward=rm:...` in one workdir did that).
OBJECTIVE_GOALS = {"ppo": ("reward",), "grpo": ("reward",)}


def _check_objective(cfg: Config, directory: Path, meta: dict) -> None:
    """A run's checkpoints resume only under the objective that wrote them (DPO adapters have the shapes of SFT
    adapters, so the arrays alone do not tell), and an RL run's only under the reward it was trained on."""
    recorded = meta.get("config") or {}
    objective = cfg.train.objective
    saved = recorded.get("train", {}).get("objective", objective)
    if saved != objective:
        raise ConfigError("train.objective", f"this run's checkpoints in {directory} were trained with "
                                             f"train.objective={saved}, not {objective}; use another "
                                             f"workdir (nothing was moved or written)")
    for field in OBJECTIVE_GOALS.get(objective, ()):
        was, now = recorded.get(objective, {}).get(field), getattr(getattr(cfg, objective), field)
        if was is not None and was != now:
            raise ConfigError(f"{objective}.{field}", f"this run's checkpoints in {directory} were trained with "
                                                      f"{objective}.{field}={was}, not {now}; use another workdir "
                                                      f"(nothing was moved or written)")


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: its train state and frozen variables, the data offset (data index = step - 1 +
    offset; rollbacks skip data), the rollbacks so far, the record of the base model it fine-tunes (None:
    none), the base model's task report taken at step 0 (None: not yet taken), the batch source's state
    saved with the checkpoint it resumes (None: not a resume) and the hot updates in effect in that checkpoint
    (jaxllm/train/control.py)."""

    state: object
    frozen: object
    data_offset: int
    rollbacks: int
    base: dict | None = None
    base_report: dict | None = None
    data_state: dict | None = None
    hot_updates: tuple = ()


def restore_start(cfg: Config, objective, tx, checkpointer: Checkpointer, abstract, mesh, log,
                  on_loaded=lambda: None) -> Start:
    """Resuming this run's own checkpoints wins; otherwise `checkpoint.restore_from` seeds the run (parameters
    only, or everything with `checkpoint.restore_all`); otherwise a fresh initialisation from `train.seed`.

    An objective with a `base` (fine-tuning) starts from it instead; its checkpoints record the base, and a
    resume loads the same base again (a different one is a ConfigError).

    `abstract` is the (state, frozen) pair of ShapeDtypeStructs; frozen variables come from the base, else from
    the objective's initialiser (pretraining has none). `on_loaded()` is called once the state exists, before
    anything used to make it is released (the loop measures peak live bytes there).
    """
    seed, window, offload, zero1 = cfg.train.seed, cfg.anomaly.window, cfg.optim.offload, cfg.optim.zero1
    init_scale = loss_scaling(cfg.precision).init_scale  # a fresh state's (a resume keeps the checkpoint's)
    abstract_state, _ = abstract
    shardings = state_shardings(abstract_state, mesh, offload, zero1)
    older = older_layout(abstract_state, shardings, cfg.optim.clip_norm)
    try:
        restored = restore_latest(checkpointer, abstract_state, mesh, log, shardings=shardings, older=older)
    except CheckpointMismatch as exc:
        raise config_mismatch(cfg, checkpointer, exc.path, exc.differences) from None
    if restored is not None:
        state, meta = restored
        _check_objective(cfg, checkpointer.directory, meta)
        step = int(state.step)
        offset = int(meta["data"].get("step", step)) - step
        log(f"resuming from checkpoint step {step} in {checkpointer.directory}"
            + (f" (data offset {offset} after rollbacks)" if offset else ""))
        on_loaded()
        frozen, base = _frozen(objective, mesh, cfg, abstract, meta.get("base"))
        return Start(state, frozen, offset, int(meta.get("rollbacks", 0)), base, meta.get("base_report"),
                     meta["data"], tuple(meta.get(HOT_UPDATES, ())))
    if objective.base is not None:
        return _start_from_base(objective, tx, abstract, mesh, seed, window, log, on_loaded, shardings, init_scale)
    if not cfg.checkpoint.restore_from:
        state, frozen, _, _ = init_objective_state(objective, tx, mesh, seed, window, offload, init_scale, zero1)
        on_loaded()
        return Start(state, frozen, 0, 0)
    directory, step = locate_checkpoints(cfg.checkpoint.restore_from)
    source = Checkpointer(directory, keep=1000, log=log)
    try:
        step = source.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no committed checkpoint in {directory}")
        if cfg.checkpoint.restore_all:
            state = source.restore(step, abstract_state, mesh, items=("state",), shardings=shardings,
                                   older=older)["state"]
            log(f"starting from {directory / str(step)} (everything: parameters, optimizer state, step)")
        else:  # parameters only: the source's optimizer state and windows are never read
            params = source.restore_params(step, abstract_state.params, mesh)
            state = state_from_params(params, tx, shardings, seed, window, init_scale)
            log(f"starting from the parameters of {directory / str(step)}")
        on_loaded()
    finally:
        source.close()
    return Start(state, _frozen(objective, mesh, cfg, abstract, None)[0], 0, 0)


def _start_from_base(objective, tx, abstract, mesh, seed: int, window: int, log, on_loaded, shardings,
                     init_scale: float) -> Start:
    """A fresh fine-tuning run: the base loads into the frozen variables (new adapters train) or, when nothing
    is frozen (full fine-tuning), into the trainable ones; what the base lacks (`objective.fresh`) is initialised
    from the seed. `shardings` are the train state's (`state_shardings`: where the optimizer state lives),
    `init_scale` the loss scale's start."""
    abstract_state, abstract_frozen = abstract
    base = objective.base
    if jax.tree.leaves(abstract_frozen):
        frozen, identity = load_frozen(objective, abstract_frozen, mesh)
        record = base.record(identity)
        state = init_trainable_state(objective, tx, shardings, seed, window, init_scale)
        if objective.own is not None:  # trainable variables the objective loads itself replace the seed's
            _, own = abstract_state.params.split(nnx.Not(objective.own), ...)
            params = nnx.merge_state(state.params, objective.load_own(own, mesh))
            state = state_from_params(params, tx, shardings, seed, window, init_scale)
    else:
        params, identity = _base_and_fresh(objective, abstract_state.params, mesh, seed)
        record = base.record(identity)
        state = state_from_params(nnx.merge_state(*params), tx, shardings, seed, window, init_scale)
        frozen = abstract_frozen
    log(f"starting from the base model {base.path} (fingerprint {record['fingerprint']})")
    on_loaded()
    return Start(state, frozen, 0, 0, record)


def _base_and_fresh(objective, abstract_params, mesh, seed: int):
    """((the trainable variables the base provides, loaded; the `fresh` ones, initialised from the seed; those
    the objective loads itself (`own`)), the base's fingerprint)."""
    from_base, parts = abstract_params, []
    if objective.own is not None:
        from_base, own = from_base.split(nnx.Not(objective.own), ...)
        parts.append(objective.load_own(own, mesh))
    if objective.fresh is not None:
        _, from_base = from_base.split(objective.fresh, ...)
        parts.append(init_part(lambda key: objective.split(objective.build_model(key))[1].split(objective.fresh,
                                                                                               ...)[0], mesh, seed))
    loaded, identity = load_base(objective.base, from_base, mesh)
    return (loaded, *parts), identity


def _frozen(objective, mesh, cfg: Config, abstract, recorded: dict | None):
    """(frozen variables, base record) of a restored run: nothing to make when the objective trains everything;
    else the base again (checked against the one the checkpoint `recorded`), or the seeded initialisation."""
    _, abstract_frozen = abstract
    if not jax.tree.leaves(abstract_frozen):
        return abstract_frozen, recorded
    if objective.base is None:
        if recorded:
            raise ConfigError("checkpoint.restore_from", f"this run's checkpoints were trained on the base "
                                                         f"{recorded['path']}: name it again to resume")
        return init_frozen(objective, mesh, cfg.train.seed), recorded  # never a second copy of what trains
    frozen, identity = load_frozen(objective, abstract_frozen, mesh)
    record = objective.base.record(identity)
    check_same_base(accepted(recorded, identity, frozen), record)
    return frozen, record


def load_frozen(objective, abstract_frozen, mesh):
    """(the frozen variables: the base's, and those the objective loads itself (`objective.own`); the base's
    fingerprint)."""
    if objective.own is None:
        return load_base(objective.base, abstract_frozen, mesh)
    from_base, own = abstract_frozen.split(nnx.Not(objective.own), ...)
    frozen, identity = load_base(objective.base, from_base, mesh)
    return nnx.merge_state(frozen, objective.load_own(own, mesh)), identity


ROLLBACK, SKIP, ABORT = "rollback", "skip", "abort"
NO_CHECKPOINT_SKIP = "skip (no healthy checkpoint to roll back to)"


@dataclasses.dataclass(frozen=True)
class AnomalyPolicy:
    """What a flagged step calls for (`train.on_anomaly`, `anomaly.max_rollbacks`)."""

    on_anomaly: str
    max_rollbacks: int

    def decide(self, record: dict, rollbacks: int, have_checkpoint: bool) -> str:
        """ROLLBACK, SKIP (the compiled step already left the state unchanged), NO_CHECKPOINT_SKIP (a rollback
        with nothing to go back to) or an ABORT reason ("abort ...")."""
        if self.on_anomaly == "skip":
            return SKIP
        if self.on_anomaly == "abort":
            return ABORT
        if rollbacks >= self.max_rollbacks:
            return f"abort (gave up after {rollbacks} rollbacks)"
        return ROLLBACK if have_checkpoint else NO_CHECKPOINT_SKIP


def free(tree) -> None:
    """Release the device buffers of every array in `tree` now (the tree must not be used again)."""
    jax.block_until_ready(tree)
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class Recovery:
    """Acts on the anomaly flags of each step's metrics: reports gradient-norm spikes, and skips, rolls back
    (restore the newest healthy checkpoint, skip the data that led to the anomaly, lower the LR) or aborts per
    the policy. Every incident is a line of `incidents`."""

    def __init__(self, cfg: Config, checkpointer: Checkpointer, incidents, abstract_state, mesh, log):
        self.policy = AnomalyPolicy(cfg.train.on_anomaly, cfg.anomaly.max_rollbacks)
        self.lr_factor = cfg.anomaly.lr_factor
        self.checkpointer, self.incidents, self.abstract, self.mesh, self.log = (
            checkpointer, incidents, abstract_state, mesh, log)
        self.shardings = state_shardings(abstract_state, mesh, cfg.optim.offload, cfg.optim.zero1)
        self.older = older_layout(abstract_state, self.shardings, cfg.optim.clip_norm)
        self.grad_spikes = 0
        self.loss_spikes = 0

    def __call__(self, run, record: dict) -> bool:
        """Handle `record` (one step's fetched metrics) for `run`; True when `run` was rolled back."""
        step = record["step"]
        incident = dict(step=step, loss=record["loss"], grad_norm=record["grad_norm"], kind=incident_kind(record))
        if "diag/first_nonfinite" in record:  # named by the diagnostic variant (jaxllm/train/diagnostic_step.py)
            incident["first_nonfinite"] = record["diag/first_nonfinite"]
        if record["grad_spike"] and not record["anomaly"]:  # counted and reported, not acted on
            self.grad_spikes += 1
            self.incidents.write(dict(incident, action="reported", kind="grad_spike"))
            self.log(f"step {step}: gradient-norm spike ({record['grad_norm']:.4g}, loss {record['loss']:.4g}); "
                     f"reported only (clipping bounds the update)")
        if record["loss_spike"] and not record["anomaly"]:  # anomaly.act_on_loss_spike is off
            self.loss_spikes += 1
            self.incidents.write(dict(incident, action="reported", kind="loss_spike"))
            self.log(f"step {step}: loss spike ({record['loss']:.4g}); reported only (anomaly.act_on_loss_spike)")
        if not record["anomaly"]:
            return False
        if self.policy.on_anomaly == "rollback":
            self.checkpointer.wait()  # the save in flight may be the checkpoint to go back to
        action = self.policy.decide(record, run.rollbacks, bool(self.checkpointer.steps()))
        if action == ROLLBACK:
            self._roll_back(run, incident)
            return True
        incident["action"] = action
        what = f"step {step}: {incident['kind']} (loss {record['loss']:.4g}"
        if action.startswith(ABORT):
            self.incidents.write(incident)
            self.checkpointer.wait()
            raise AnomalyAbort(f"{what}, grad norm {record['grad_norm']:.4g}); {action}")
        self.incidents.write(dict(incident, skipped_steps=[step]))
        self.log(f"{what}), update skipped" + (" (no healthy checkpoint to roll back to)" if action != SKIP else ""))
        return False

    def _roll_back(self, run, incident: dict) -> None:
        bad = incident["step"]
        free(run.state)  # never two train states at once
        run.state = None
        restored = restore_latest(self.checkpointer, self.abstract, self.mesh, self.log, shardings=self.shardings,
                                  older=self.older)
        if restored is None:
            raise AnomalyAbort(f"step {bad}: {incident['kind']}; no readable checkpoint left to roll back to")
        healthy, meta = restored
        at = int(healthy.step)
        run.rollbacks += 1
        # The restored step's successor reads the data after what step `bad` consumed (the offset already
        # accounts for earlier rollbacks).
        run.data_offset += bad - at
        lr_scale = float(healthy.lr_scale) * self.lr_factor
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        run.state = healthy.replace(lr_scale=jax.device_put(np.float32(lr_scale), replicated))
        run.data_state = meta["data"]
        run.hot_updates = list(meta.get(HOT_UPDATES, ()))
        run.reopen_batches()
        self.incidents.write(dict(incident, action=ROLLBACK, restored_step=at,
                                  skipped_steps=list(range(at + 1, bad + 1)), lr_scale=lr_scale,
                                  rollbacks=run.rollbacks))
        self.log(f"step {bad}: {incident['kind']} (loss {incident['loss']:.4g}); rolled back to step {at}, "
                 f"skipping data of steps {at + 1}..{bad}, LR scale now {lr_scale:g}")
