"""Orbax checkpoints of a run: async saves, retention, atomic commits, restore onto any mesh.

A checkpoint `<workdir>/checkpoints/<step>/` holds the train state (parameters, optimizer state, step, LR scale,
anomaly statistics), the data-iterator state and run metadata (RNG seed, resolved config, applied hot updates) as
JSON.
Orbax writes into a temporary directory and renames it on commit, so a crash at any moment leaves the previous
committed checkpoint loadable; uncommitted directories are never listed as steps and are cleaned up on start.

Each checkpoint carries a checksum manifest (jaxllm/runs/checksums.py), written by process 0 once every process's
files are complete: for an async save inside the temporary directory just before the rename, so the manifest
commits with the checkpoint; for a synchronous save right after the commit. Restores verify it first, and a
mismatch is a CheckpointError like any unreadable checkpoint (a resume then falls back to the previous one).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxllm.runs.checksums import MANIFEST, verify_manifest, write_manifest
from jaxllm.config.typed_config import ConfigError
from jaxllm.parallel.sharding import sharding_tree


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


class CheckpointMismatch(ConfigError):
    """An intact checkpoint (its files verify) whose train state is not the one this config builds: other array
    shapes, or arrays the one has and the other lacks. The config does not match the run, so the checkpoint must
    never be treated as corrupt (moved aside, fallen back past): whoever restores names what differs.
    `differences` lists them as `path: <in the checkpoint> in the checkpoint, <in the config>`."""

    def __init__(self, path: Path, differences: list[str]):
        self.path, self.differences = Path(path), differences
        more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
        super().__init__("checkpoint", f"{path} does not match this config's model: "
                                       f"{'; '.join(differences[:3])}{more}")


def _field_names(tree) -> set[str]:
    """The top-level names (dataclass fields, dict keys) under which `tree` has leaves."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] if path]
    return {str(_key_name(path[0])) for path in paths}


def array_shapes(tree) -> dict[str, tuple]:
    """{path: shape} of every array in `tree` (a train state, abstract or as orbax's metadata), with paths as orbax
    writes them (dataclass fields and dict keys become nested names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(_key_name(k)) for k in path): tuple(leaf.shape) for path, leaf in leaves
            if hasattr(leaf, "shape")}


def _key_name(key) -> str | int:
    """A tree path entry's name, as orbax names it on disk (field, dict key or index)."""
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return str(key)


def layout_differences(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """What differs between two {path: shape} maps, the checkpoint's and the config's, one phrase each."""
    missing = [f"{p} only in the config" for p in sorted(wanted.keys() - saved.keys())]
    extra = [f"{p} only in the checkpoint" for p in sorted(saved.keys() - wanted.keys())]
    shapes = [f"{p}: {saved[p]} in the checkpoint, {wanted[p]} in the config"
              for p in sorted(saved.keys() & wanted.keys()) if saved[p] != wanted[p]]
    return shapes + missing + extra


def everywhere(ok: bool) -> bool:
    """True when `ok` holds on every process (one collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _array_registry():
    """orbax's type handlers, with arrays written without replica-parallel slicing.

    orbax splits each replicated shard among its replicas by default on CPU (not on GPU) so that several hosts
    share its writing; that slices every replicated array on its device inside the blocking part of the save
    (about a millisecond per shard, plus a compilation per shape at the first save), which made the blocking part
    over half of an async save here. Without it each shard is written once, by its first replica, as on GPU.
    """
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import type_handler_registry

    arrays = ocp.type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(),
                                            use_replica_parallel=False)
    handlers = dict(type_handler_registry._DEFAULT_TYPE_HANDLERS)
    handlers[jax.Array] = arrays
    return type_handler_registry.create_type_handler_registry(*handlers.items())


def _restore_args(target):
    """PyTreeRestore arguments placing every array of `target` (ShapeDtypeStructs with shardings)."""
    return jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype), target)


class Checkpointer:
    """Saves and restores `{state, data, meta}` under `directory`, keeping the last `keep` checkpoints plus
    every `keep_every`-th step permanently (0: none)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, keep_every: int = 0,
                 async_save: bool = True, pinned_host_transfer: bool | None = None,
                 log: Callable[[str], None] = print):
        """`pinned_host_transfer`: copy arrays to page-locked host memory before writing (None: orbax's default,
        on for GPUs)."""
        self.directory = Path(directory).absolute()
        self.log = log
        self.async_save = async_save
        self._pending: dict | None = None
        self._lock = threading.Lock()
        self.saves: list[dict] = []
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max(keep, 1),  # never delete the only committed checkpoint
            keep_period=keep_every or None,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            # orbax calls this after each async commit (it accepts no callback for synchronous saves)
            async_options=ocp.AsyncOptions(post_finalization_callback=self._on_commit) if async_save else None,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
                "state": ocp.PyTreeCheckpointHandler(type_handler_registry=_array_registry(),
                                                     enable_pinned_host_transfer=pinned_host_transfer),
                "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
        except (OSError, PermissionError) as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {exc}") from None

    def _on_commit(self) -> None:
        """orbax's post-commit callback (background thread, process 0 only, once every process's files are
        written and before the step directory is renamed into place): write the checksum manifest, then log the
        save unless `save` has not returned yet. An error here fails the save (the step never commits)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        write_manifest(self._written_directory(pending["step"]))
        with self._lock:
            pending = self._pending
            if pending is None:
                return
            pending["total_s"] = time.perf_counter() - pending["start"]
            if pending["blocking_s"] is None:  # a tiny save committed before `save` returned: it logs it
                return
            self._pending = None
        self._record(pending)

    def _written_directory(self, step: int) -> Path:
        """Where `step`'s files are as it commits: orbax's temporary directory, or `<step>` once renamed."""
        prefix = f"{step}{ocp.path.atomicity.TMP_DIR_SUFFIX}"
        temporary = [p for p in self.directory.iterdir() if p.name.startswith(prefix)]
        return temporary[0] if temporary else self.directory / str(step)

    def _record(self, pending: dict) -> None:
        step, total = pending["step"], pending["total_s"]
        # The callback can run just before the temporary directory is renamed to the step: count either.
        size = sum(directory_bytes(p) for p in self.directory.glob(f"{step}*")
                   if p.name == str(step) or "tmp" in p.name)
        record = dict(step=step, blocking_s=pending["blocking_s"], total_s=total, bytes=size,
                      gb_per_s=size / total / 1e9 if total > 0 else 0.0)
        self.saves.append(record)
        self.log(f"checkpoint {step} committed: {size / 1e6:.2f} MB, blocking {record['blocking_s']:.2f}s, "
                 f"total {total:.2f}s, {1000 * record['gb_per_s']:.0f} MB/s")

    @property
    def copies(self) -> list[dict]:
        """Copies to a persistent tier: none, this is one tier (see jaxllm/runs/tiers.py)."""
        return []

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def check_for_errors(self) -> None:
        """Raise if a background save failed (called at every step boundary: a failed save is never silent).

        orbax's manager logs a failed commit from its finalize thread rather than re-raising it, so a save that
        is no longer in progress but never committed its step directory counts as failed too.
        """
        with self._lock:
            pending = self._pending
        try:
            self.manager.check_for_errors()
        except Exception as exc:  # orbax re-raises the background thread's exception
            # Name the step either way: whether orbax re-raises or only logs the failure is a race.
            what = f"save of step {pending['step']}" if pending is not None else "save"
            raise CheckpointError(f"background checkpoint {what} into {self.directory} failed: {exc}") from None
        # Only process 0 commits (renames) a multi-process checkpoint, and only it is sure to have finished when
        # its own save is no longer in progress; a failure there stops process 0, and the others with it.
        if pending is not None and jax.process_index() == 0 and not self.manager.is_saving_in_progress():
            if not (self.directory / str(pending["step"])).exists():
                with self._lock:
                    self._pending = None
                raise CheckpointError(
                    f"background save of step {pending['step']} into {self.directory} failed (see the log above)"
                )

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Start an async save of `state` at `step` (returns once device arrays are copied to host)."""
        # orbax would wait for the previous save inside `manager.save` anyway; waiting first keeps each commit
        # callback paired with its own save's record (and raises a failed earlier save, as `wait` checks errors).
        self.wait()
        start = time.perf_counter()
        with self._lock:
            self._pending = {"step": step, "start": start, "blocking_s": None}
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint save of step {step} into {self.directory} failed: {exc}") from None
        if not self.async_save and jax.process_index() == 0:  # committed, and orbax calls no callback: a kill
            write_manifest(self.directory / str(step))  # before this line leaves a checkpoint that loads unverified
        with self._lock:
            pending = self._pending
            if pending is not None:
                pending["blocking_s"] = time.perf_counter() - start
                if not self.async_save:  # committed already (orbax calls no callback for synchronous saves)
                    pending["total_s"] = pending["blocking_s"]
                if "total_s" not in pending:
                    return  # still in flight: its commit callback logs it
                self._pending = None
        if pending is not None:
            self._record(pending)

    def wait(self) -> None:
        """Block until the in-flight save has committed (or raise its error)."""
        with self._lock:
            pending = self._pending
        try:
            self.manager.wait_until_finished()
        except Exception as exc:
            what = f"save of step {pending['step']}" if pending is not None else "save"
            raise CheckpointError(f"checkpoint {what} into {self.directory} failed: {exc}") from None
        self.check_for_errors()

    def verify(self, step: int) -> None:
        """Check `step`'s files against the checksums written as it committed; raise CheckpointError naming the
        first bad file. Process 0 reads the files and every process gets its verdict (one collective), so all
        fall back together. A checkpoint without a manifest (an older jaxllm's, or a synchronous save killed
        before its manifest was written) passes, with a warning that it loads unverified."""
        path = self.directory / str(step)
        problem = None
        if jax.process_index() == 0:
            try:
                problem = verify_manifest(path)
            except FileNotFoundError:
                self.log(f"warning: checkpoint {path} has no {MANIFEST} (an older jaxllm's, or killed before it "
                         f"was written): loading it unverified")
        if jax.process_count() > 1:
            if bool(multihost_utils.broadcast_one_to_all(np.array(problem is not None))) and problem is None:
                problem = "it failed checksum verification on process 0"
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is unreadable: {problem}")

    def restore(self, step: int, abstract_state: Any, mesh, *, items=("state", "data", "meta"),
                shardings: Any = None, older: tuple | None = None) -> dict:
        """Restore `step` with every array placed per the sharding rules on `mesh` (resharding on load), or per
        `shardings` when given (a train state's from `jaxllm.train.state.state_shardings`: an offloaded optimizer
        state restores straight into pinned host memory, never through the device).

        `abstract_state` gives shapes and dtypes (e.g. `abstract_train_state(...)`); a checkpoint written on any
        other mesh or device count restores bit-exactly onto this one. The files are verified first (`verify`).
        `older` is (abstract state, shardings, upgrade) of an earlier jaxllm's state layout, tried when the
        checkpoint does not match the current one; `upgrade(state)` brings what it restores up to date.
        """
        self.verify(step)
        if "state" in items:
            self._check_saved_state(step, abstract_state, older)
        if shardings is None:
            shardings = sharding_tree(abstract_state, mesh)
        try:
            return self._restore(step, abstract_state, shardings, items)
        except CheckpointError as exc:
            if older is None or "state" not in items:
                raise
            error = exc
        older_state, older_shardings, upgrade = older
        try:
            restored = self._restore(step, older_state, older_shardings, items)
        except CheckpointError:
            raise error from None
        self.log(f"checkpoint {self.directory / str(step)} has an older jaxllm's train-state layout: upgraded on load")
        return dict(restored, state=upgrade(restored["state"]))

    def _restore(self, step: int, abstract_state: Any, shardings: Any, items) -> dict:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, shardings)
        available = {"state": ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target)),
                     "data": ocp.args.JsonRestore(),
                     "meta": ocp.args.JsonRestore()}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{k: available[k] for k in items}))
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is unreadable or does not match this model: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        return {k: restored[k] for k in items}

    def _check_saved_state(self, step: int, abstract_state, older: tuple | None) -> None:
        """Compare `step`'s train state, as its metadata records it (no array is read), with `abstract_state`.

        An intact checkpoint must not fail like an unreadable one (a resume would move it aside and fall back past
        it), so: a ConfigError when it lacks top-level fields (an older jaxllm wrote it, before `loss_scale`
        existed, say; its parameters still seed a new run), and a CheckpointMismatch when its arrays are neither
        those of `abstract_state` nor of the `older` layout (the config asks for another model). Unreadable
        metadata is left to the restore, which reports it as a CheckpointError."""
        try:
            saved = self.manager.item_metadata(step)["state"].tree
        except Exception:
            return
        if not isinstance(saved, dict):
            return
        path = self.directory / str(step)
        missing = sorted(_field_names(abstract_state) - set(saved))
        if missing:
            raise ConfigError("checkpoint", f"{path} was written by an older jaxllm: its train state has no "
                                            f"{', '.join(missing)}; start a new run from its parameters with "
                                            f"checkpoint.restore_from={path} and a new workdir")
        shapes = array_shapes(saved)
        layouts = [abstract_state] + ([older[0]] if older is not None else [])
        differences = [layout_differences(shapes, array_shapes(layout)) for layout in layouts]
        if all(differences):
            raise CheckpointMismatch(path, differences[0])

    def saved_param_names(self, step: int) -> set[str]:
        """The names (`array_shapes`) of the parameter arrays `step` holds, from its metadata (no array is read);
        empty when the metadata cannot be read (the restore then reports it)."""
        try:
            saved = self.manager.item_metadata(step)["state"].tree
        except Exception:
            return set()
        return set(array_shapes({"params": saved["params"]})) if isinstance(saved, dict) and "params" in saved else set()

    def read_meta(self, step: int) -> dict:
        """The run metadata (seed, config, base, ...) saved with `step`; no array is read."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as exc:
            raise CheckpointError(f"metadata of checkpoint {self.directory / str(step)} is unreadable: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    def restore_params(self, step: int, abstract_params: Any, mesh, verify: bool = True) -> Any:
        """Restore only the parameters (`state.params`) of `step`, placed per the sharding rules on `mesh`.

        The optimizer state and the other train-state fields are not read, so a checkpoint written with a
        different optimizer, anomaly window or train-state layout still seeds these parameters. The whole
        checkpoint is verified first (`verify`): parameters and optimizer state share data files (False: the
        caller verified it, restoring it in parts).
        """
        if verify:
            self.verify(step)
        # orbax's partial restore hands back the abstract leaf of an array the checkpoint lacks: refuse instead.
        saved = self.saved_param_names(step)
        missing = sorted(set(array_shapes({"params": abstract_params})) - saved) if saved else []
        if missing:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} holds no {', '.join(missing[:3])}"
                                  f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}: it is not "
                                  f"this model's")
        shardings = sharding_tree(abstract_params, mesh)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_params, shardings)
        args = ocp.args.PyTreeRestore(item={"params": target}, restore_args={"params": _restore_args(target)},
                                      partial_restore=True)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=args))
        except Exception as exc:
            raise CheckpointError(
                f"parameters of checkpoint {self.directory / str(step)} are unreadable or do not match this model: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        return restored["state"]["params"]

    def quarantine(self, step: int) -> Path | None:
        """Move an unreadable checkpoint aside (kept for inspection, never loaded or overwritten again).

        Every process calls this; process 0 moves the directory and the others wait for it. Returns the new
        path on process 0, None elsewhere.
        """
        target = None
        if jax.process_index() == 0:
            target = self.directory / f"corrupt-{step}-{int(time.time())}"
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxllm quarantine {step}")
        self.manager.reload()
        return target

    def close(self) -> None:
        self.manager.close()


def locate_checkpoints(path: str) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for the latest) of a checkpoint path given by a user: a step
    directory, a checkpoints directory, or a run's workdir."""
    p = Path(path)
    if (p / "_CHECKPOINT_METADATA").exists() and p.name.isdigit():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None
