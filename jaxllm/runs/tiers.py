"""Checkpoints on two tiers: saves land on a fast local tier (`checkpoint.local_dir`) and are copied to the
persistent tier (`<workdir>/checkpoints`) in the background; restores take the newest step that verifies on
either tier.

Why not orbax's own multi-tier checkpointing: `orbax.checkpoint.experimental.emergency.CheckpointManager`
(0.12) writes the local tier only on the replicas outside the primary slice (a one-slice GPU or CPU job gets no
local tier at all), restores a local checkpoint by broadcasting it from another slice, and keeps a single
`state` item (a run's data-iterator state and metadata have no place); its replicator variant needs GKE's
replicator service. So the local tier is orbax's async save as everywhere else (`Checkpointer`), and the
persistent copy is a file copy of a committed step, verified against the checksum manifest the save wrote
(jaxllm/runs/checksums.py) and renamed into place only then: a step on the persistent tier is complete and
verified, or absent.

The local tier holds orbax's global-array format, whose commit (process 0 merges every process's files)
needs every process of the job to see the directory: a node's disk for a one-node job, or a fast filesystem
shared by the job's nodes. `open_checkpointer` checks that at start and refuses otherwise.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm.config.schema import CheckpointConfig, ConfigError
from jaxllm.runs.checkpoint import CheckpointError, Checkpointer, everywhere
from jaxllm.runs.checksums import MANIFEST, verify_manifest
from jaxllm.runtime.throttle import Throttle

COPYING = ".orbax-checkpoint-tmp-copy"  # orbax's temporary suffix: never listed as a step, cleaned up on start
UNBOUNDED = 1 << 30  # orbax's retention of a tier whose retention jaxllm applies itself
COPY_CHUNK = 1 << 20  # bytes copied at a time (and the throttle's granularity)


def open_checkpointer(cfg: CheckpointConfig, workdir: Path, log: Callable[[str], None], slow_mb_s: float = 0.0):
    """The run's checkpointer: `<workdir>/checkpoints` alone, or under `cfg.local_dir` when that is set.
    `slow_mb_s` (drills and benchmarks): the persistent copy's rate limit in MB/s (0: none)."""
    persistent = Path(workdir) / "checkpoints"
    if not cfg.local_dir:
        return Checkpointer(persistent, keep=cfg.keep, keep_every=cfg.keep_every, async_save=cfg.async_save, log=log)
    local = Path(cfg.local_dir).absolute()
    if local == persistent.absolute() or persistent.absolute() in local.parents:
        raise ConfigError("checkpoint.local_dir", f"{local} is the persistent tier (or inside it): name a fast "
                                                  f"local directory apart from {persistent}")
    check_shared(local)
    return TieredCheckpointer(local, persistent, cfg, log, slow_mb_s)


def check_shared(local: Path) -> None:
    """Refuse a local tier that some process of the job cannot see (one collective on every process)."""
    try:
        local.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("checkpoint.local_dir", f"cannot create {local}: {exc.strerror}") from None
    if jax.process_count() == 1:
        return
    token = int(multihost_utils.broadcast_one_to_all(np.array(secrets.randbits(31), dtype=np.int32)))
    probe = local / f".jaxllm-shared-{token}"
    if jax.process_index() == 0:
        probe.write_text(str(token))
    multihost_utils.sync_global_devices("jaxllm local tier probe")
    sees = probe.is_file() and probe.read_text() == str(token)
    shared = everywhere(sees)
    multihost_utils.sync_global_devices("jaxllm local tier probed")
    if jax.process_index() == 0:
        probe.unlink(missing_ok=True)
    if not shared:
        raise ConfigError("checkpoint.local_dir", f"{local} is not one directory for every process of the job "
                                                  f"(process {jax.process_index()} "
                                                  f"{'sees' if sees else 'does not see'} process 0's probe): "
                                                  f"the local tier must be shared by the job's processes")


class PersistentCopier:
    """A background thread that copies committed local steps to the persistent tier, one at a time, and applies
    the persistent tier's retention. Runs on process 0 only (the local tier is shared by the job's processes).

    When copies fall behind (a slow persistent tier), the newest queued step and the permanent ones
    (`keep_every` multiples) are copied and the others skipped: the persistent tier stays as fresh as it can
    without ever slowing the step."""

    def __init__(self, local: Path, persistent: Path, *, keep: int, keep_every: int, slow_mb_s: float,
                 log: Callable[[str], None]):
        self.local, self.persistent, self.keep, self.keep_every = local, persistent, max(keep, 1), keep_every
        self.throttle = Throttle(slow_mb_s)
        self.log = log
        self.copies: list[dict] = []
        self._queue: queue.Queue = queue.Queue()
        self._protected: set[int] = set()  # queued or being copied: the local tier keeps them
        self._protected_lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="jaxllm-persistent-copy", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Copy `step` once its local save has committed (the save may still be in flight)."""
        self._idle.clear()
        with self._protected_lock:
            self._protected.add(step)
        self._queue.put(step)

    def protected(self) -> set[int]:
        """Steps queued or being copied (the local tier must not delete them yet)."""
        with self._protected_lock:
            return set(self._protected)

    def _release(self, steps) -> None:
        with self._protected_lock:
            self._protected -= set(steps)

    def pending(self) -> bool:
        return not self._idle.is_set()

    def drain(self) -> None:
        """Block until every submitted step is copied (or skipped)."""
        self._idle.wait()

    def close(self) -> None:
        self.drain()
        self._closing = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            steps = [self._queue.get()]
            while not self._queue.empty():
                steps.append(self._queue.get())
            if None in steps:
                return
            chosen = self._worth_copying(steps)
            self._release(set(steps) - set(chosen))
            for step in chosen:
                try:
                    self._copy(step)
                except (OSError, CheckpointError) as exc:  # the next save tries again; training goes on
                    self.log(f"warning: persistent copy of checkpoint {step} to {self.persistent} failed: {exc}")
                self._release([step])
            if self._queue.empty():
                self._idle.set()

    def _worth_copying(self, steps: list[int]) -> list[int]:
        newest = max(steps)
        chosen = [s for s in steps if s == newest or (self.keep_every and s % self.keep_every == 0)]
        skipped = sorted(set(steps) - set(chosen))
        if skipped:
            self.log(f"persistent tier behind: skipped copying checkpoints {skipped}, copying {chosen}")
        return sorted(set(chosen))

    def _copy(self, step: int) -> None:
        source, target = self.local / str(step), self.persistent / str(step)
        if not self._wait_committed(source):
            raise CheckpointError(f"local checkpoint {source} never committed")
        if target.exists():
            return  # copied before this start (a resume re-saves no step it resumed past)
        start = time.perf_counter()
        temporary = self.persistent / f"{step}{COPYING}"
        shutil.rmtree(temporary, ignore_errors=True)
        size = self._copy_tree(source, temporary)
        problem = verify_manifest(temporary)
        if problem is not None:
            shutil.rmtree(temporary, ignore_errors=True)
            raise CheckpointError(f"the copy did not verify: {problem}")
        os.rename(temporary, target)
        _fsync_directory(self.persistent)
        seconds = time.perf_counter() - start
        self.copies.append(dict(step=step, bytes=size, copy_s=seconds, mb_per_s=size / max(seconds, 1e-9) / 1e6))
        self.log(f"checkpoint {step} persistent: {size / 1e6:.2f} MB copied and verified in {seconds:.2f}s")
        self._retain()

    def _wait_committed(self, source: Path, timeout_s: float = 3600.0) -> bool:
        """Whether `source` has committed with its manifest (an async save renames it into place later)."""
        deadline = time.monotonic() + timeout_s
        while not (source / MANIFEST).is_file():
            if self._closing or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _copy_tree(self, source: Path, target: Path) -> int:
        """Copy `source` to `target` file by file (fsynced), at most `slow_mb_s` when throttled; bytes copied."""
        copied = 0
        for path in sorted(source.rglob("*")):
            destination = target / path.relative_to(source)
            if path.is_dir():
                destination.mkdir(parents=True, exist_ok=True)
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as reader, open(destination, "wb") as writer:
                while chunk := reader.read(COPY_CHUNK):
                    self.throttle.pass_bytes(len(chunk))  # a throttled tier: never faster than its rate
                    writer.write(chunk)
                    copied += len(chunk)
                writer.flush()
                os.fsync(writer.fileno())
        return copied

    def _retain(self) -> None:
        """Keep the newest `keep` persistent steps and every `keep_every`-th one."""
        steps = sorted(int(p.name) for p in self.persistent.iterdir() if p.name.isdigit())
        kept = set(steps[-self.keep:]) | {s for s in steps if self.keep_every and s % self.keep_every == 0}
        for step in steps:
            if step not in kept:
                shutil.rmtree(self.persistent / str(step), ignore_errors=True)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class TieredCheckpointer:
    """`Checkpointer`'s interface over two tiers: saves go to the local tier (kept: `local_keep`), each
    `persist_every`-th step (0: every save) is then copied to the persistent tier (kept: `keep` and every
    `keep_every`-th), and a step is restored from the local tier when it is there and verifies, else from the
    persistent one (a local copy that fails is moved aside, as any unreadable checkpoint is)."""

    def __init__(self, local: Path, persistent: Path, cfg: CheckpointConfig, log: Callable[[str], None],
                 slow_mb_s: float = 0.0):
        self.log = log
        # The local tier's retention is ours (`_retain_local`), not orbax's: a step waiting for its copy stays.
        self.local = Checkpointer(local, keep=UNBOUNDED, async_save=cfg.async_save, log=log)
        self.local_keep = cfg.local_keep
        # Read, restored and pruned here; only the copier writes into it.
        self.persistent = Checkpointer(persistent, keep=cfg.keep, keep_every=cfg.keep_every, log=log)
        self.persist_every = cfg.persist_every
        self.copier = (PersistentCopier(self.local.directory, self.persistent.directory, keep=cfg.keep,
                                        keep_every=cfg.keep_every, slow_mb_s=slow_mb_s, log=log)
                       if jax.process_index() == 0 else None)
        log(f"checkpoints on two tiers: local {self.local.directory} (last {cfg.local_keep}), persistent "
            f"{self.persistent.directory}")

    @property
    def directory(self) -> Path:
        """The persistent tier: where the run's checkpoints are named and read by other tools."""
        return self.persistent.directory

    @property
    def saves(self) -> list[dict]:
        return self.local.saves

    @property
    def copies(self) -> list[dict]:
        """The persistent copies made so far (process 0; elsewhere none)."""
        return self.copier.copies if self.copier is not None else []

    def steps(self) -> list[int]:
        """Steps committed on either tier, oldest first."""
        return sorted(set(self.local.steps()) | set(self.persistent.steps()))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        self.local.save(step, state, data_state, meta)
        if self.copier is None:
            return
        if not self.persist_every or step % self.persist_every == 0:
            self.copier.submit(step)
        self._retain_local()

    def _retain_local(self) -> None:
        """Keep the newest `local_keep` committed local steps, and those still waiting for their copy."""
        committed = self.local.steps()
        kept = set(committed[-self.local_keep:]) | self.copier.protected()
        for step in committed:
            if step not in kept:
                shutil.rmtree(self.local.directory / str(step), ignore_errors=True)

    def wait(self) -> None:
        """Block until the local save in flight has committed (the persistent copy goes on)."""
        self.local.wait()

    def check_for_errors(self) -> None:
        self.local.check_for_errors()

    def _tiers(self, step: int) -> list[Checkpointer]:
        return [tier for tier in (self.local, self.persistent) if step in tier.steps()]

    def restore(self, step: int, abstract_state: Any, mesh, **kwargs) -> dict:
        """`Checkpointer.restore` from the first tier where `step` verifies and restores."""
        return self._from_tiers(step, lambda tier: tier.restore(step, abstract_state, mesh, **kwargs))

    def restore_params(self, step: int, abstract_params: Any, mesh) -> Any:
        return self._from_tiers(step, lambda tier: tier.restore_params(step, abstract_params, mesh))

    def _from_tiers(self, step: int, read: Callable[[Checkpointer], Any]) -> Any:
        tiers = self._tiers(step)
        if not tiers:
            raise CheckpointError(f"no checkpoint of step {step} in {self.local.directory} or {self.directory}")
        for tier in tiers[:-1]:  # the local copy, with the persistent one behind it
            error = None
            try:
                return_value = read(tier)
            except CheckpointError as exc:
                error = exc
            if everywhere(error is None):
                return return_value
            moved = tier.quarantine(step)
            self.log(f"warning: {error or f'checkpoint {step} failed to restore on another process'}; moved it to "
                     f"{moved}; restoring step {step} from the persistent tier")
        return read(tiers[-1])

    def verify(self, step: int) -> None:
        self._tiers(step)[0].verify(step)

    def read_meta(self, step: int) -> dict:
        return self._tiers(step)[0].read_meta(step)

    def saved_param_names(self, step: int) -> set[str]:
        return self._tiers(step)[0].saved_param_names(step)

    def quarantine(self, step: int) -> Path | None:
        """Move `step` aside on every tier that holds it; the persistent tier's new path (process 0)."""
        moved = None
        for tier in self._tiers(step):
            moved = tier.quarantine(step)
        return moved

    def close(self) -> None:
        """Finish the local save in flight and every persistent copy (the run's last checkpoint must reach the
        persistent tier before the job ends), then release both tiers."""
        self.local.wait()
        if self.copier is not None:
            if self.copier.pending():
                self.log("waiting for the persistent copy of the last checkpoints")
            self.copier.close()
            self._retain_local()
        if jax.process_count() > 1:  # no process leaves while process 0 still copies
            multihost_utils.sync_global_devices("jaxllm persistent copy done")
        self.local.close()
        self.persistent.close()
