"""Preemption: SIGTERM (and SIGINT) ask the loop to finish the current step, save, and exit cleanly."""

from __future__ import annotations

import signal
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

# With several processes a SIGTERM stops the job at the next multiple of this many steps (see `should_stop`).
CHECK_EVERY = 10


class PreemptionGuard:
    """Catches SIGTERM/SIGINT while installed; `should_stop()` is then True at the next step boundary.

    With several processes the decision is agreed on (any process signalled -> all stop at the same step),
    so they all take part in the final checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, check_every: int = CHECK_EVERY):
        self.check_every = check_every
        self.signalled: int | None = None
        self._previous = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a notebook worker): no handler
                pass

    def _handle(self, signum, frame) -> None:
        self.signalled = signum

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after `step`.

        With several processes the processes agree every `check_every` steps only: agreeing is a collective
        that waits for the step in flight, which would otherwise stall every step's dispatch. A scheduler's
        grace period (tens of seconds at least) covers that many steps.
        """
        if jax.process_count() > 1 and step % self.check_every:
            return False
        return self.agreed(self.signalled is not None)

    @staticmethod
    def agreed(local: bool) -> bool:
        """Whether any process says `local` True (a collective with several processes: every one must ask)."""
        if jax.process_count() == 1:
            return local
        return bool(np.any(multihost_utils.process_allgather(np.array([local]))))

    def wait_for_signal(self, timeout: float) -> bool:
        """Sleep until SIGTERM/SIGINT arrives or `timeout` seconds pass; True when this process, or with several
        processes any of them, was signalled (every process must call it: they agree)."""
        deadline = time.monotonic() + timeout
        while self.signalled is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.agreed(self.signalled is not None)

    def restore(self) -> None:
        """Reinstate the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
