"""One step off (rl.max_staleness=1): the next iteration's rollout, sampled and scored on the rollout devices in
a thread of its own while this iteration trains on the trainer's devices.

The rollout of iteration k + 1 starts at iteration k's first step, from the weights iteration k starts with
(copied to the rollout devices before the thread starts, so the updates that follow cannot touch them). The
trainer keeps a copy of those weights' trained variables (the adapters, or PPO's adapters and critic head:
small beside the frozen base, which is not copied), so that when the rows arrive it can compute their
log-probabilities "with the same weights" that sampled them: the log-prob mismatch. Trainer-side work runs on
the main thread only: two programs with collectives must not interleave on the same devices.

A checkpoint waits for the rollout in flight and saves it (rows and those trainer log-probs) with the batch
source's state, so a resumed run consumes the very rows the uninterrupted one did.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class RolloutAhead:
    """The rollout of `iteration`, in flight (a future) or finished (restored from a checkpoint)."""

    def __init__(self, iteration: int, trained=None, future: concurrent.futures.Future | None = None,
                 rows: dict[str, np.ndarray] | None = None, trainer_logps: np.ndarray | None = None,
                 timings: dict | None = None):
        self.iteration, self.trained, self.future = iteration, trained, future
        self.rows, self.trainer_logps = rows, trainer_logps
        self.timings = {} if timings is None else timings  # the rollout thread fills it

    @classmethod
    def start(cls, iteration: int, trained, sample: Callable[[dict], dict],
              executor: concurrent.futures.Executor) -> RolloutAhead:
        """Run `sample(timings)` (it fills `timings`) in `executor`; keep a copy of `trained`, the trainer's
        trained variables the rollout's weights were copied from."""
        timings: dict = {}
        copy = jax.tree.map(jnp.copy, trained)
        return cls(iteration, copy, executor.submit(sample, timings), timings=timings)

    def wait(self) -> float:
        """Block until the rows are here; the seconds waited (0 when they were)."""
        started = time.perf_counter()
        if self.rows is None:
            self.rows = self.future.result()
        return time.perf_counter() - started

    def sampled_logps(self, trainer_logps: Callable, current) -> np.ndarray:
        """The trainer's log-probabilities of the rows with the weights that sampled them: `current` (the
        trainer's variables) with the trained ones as they were at the start (computed once, main thread)."""
        self.wait()
        if self.trainer_logps is None:
            self.trainer_logps = trainer_logps(nnx.merge_state(current, self.trained), self.rows)
            self.trained = None  # no longer needed
        return self.trainer_logps
