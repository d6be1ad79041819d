"""The hang watchdog: a run whose steps stop completing (a collective waiting for a dead peer, a stuck data
worker, a wedged device) dumps every thread's stack and exits with HANG_EXIT_CODE, so the scheduler can requeue
it (scripts/launch/slurm.sbatch does) instead of holding the allocation until its time limit.

A daemon thread checks the time since the last completed step. A hung process cannot be stopped from inside
(the main thread is blocked in C++, and Python exceptions reach it only between bytecodes), so the watchdog
writes its report and ends the process with `os._exit`: no cleanup runs, and the last committed checkpoint is
where the requeued run resumes.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

# EX_TEMPFAIL (sysexits.h): a temporary failure, worth retrying. Distinct from a config error (2), a crash (1)
# and a kill by signal (128 + n).
HANG_EXIT_CODE = 75
FIRST_STEP_FACTOR = 2.0  # the first step's allowance, in hang timeouts (see HangWatchdog)


class HangWatchdog:
    """Ends the process when no step completes within `timeout_s` seconds (0: never; `start` does nothing).

    The clock starts at `start()` (the loop calls it after compiling the step and the first evaluation), and
    the first step gets FIRST_STEP_FACTOR times the allowance: its first execution can still be slow (lazy
    initialisation of collectives, an RL objective's first rollout). After that, each `beat(step, seconds)`
    (a step completed, taking `seconds`) restarts the clock; the time between two beats includes whatever the
    loop does between steps (evaluation, the blocking part of a checkpoint save, a rollback's restore).

    On a hang it writes a one-line message naming the last completed step, every thread's stack
    (faulthandler) to `stream` and to `dump_path` when given, then calls `exit(HANG_EXIT_CODE)`.
    """

    def __init__(self, timeout_s: float, dump_path: Path | None = None, stream=None,
                 exit: Callable[[int], None] = os._exit, poll_s: float | None = None):
        self.timeout_s = timeout_s
        self.dump_path = dump_path
        self.stream = stream or sys.stderr
        self.exit = exit
        self.poll_s = poll_s or min(max(timeout_s / 10, 0.05), 10.0)
        self.last_step: int | None = None
        self.last_step_s: float | None = None
        self._last = time.monotonic()
        self._allowance = FIRST_STEP_FACTOR * timeout_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "HangWatchdog":
        """Start the clock and the watching thread (no thread when the timeout is 0)."""
        self._last = time.monotonic()
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="jaxllm-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, step_s: float) -> None:
        """Step `step` completed, taking `step_s` seconds: restart the clock with the normal allowance."""
        self.last_step, self.last_step_s = step, step_s
        self._allowance = self.timeout_s
        self._last = time.monotonic()

    def stop(self) -> None:
        """Stop watching (the loop is over; what follows it is not a step)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            waited = time.monotonic() - self._last
            if waited > self._allowance:
                self._fire(waited)
                return

    def message(self, waited: float) -> str:
        """The one-line report of a hang, `waited` seconds after the last completed step (or the start)."""
        if self.last_step is None:
            last = "no step completed since the loop started"
        else:
            last = f"last completed step {self.last_step} (took {self.last_step_s:.2f}s)"
        return (f"hang watchdog: no step completed in {waited:.1f}s (train.hang_timeout_s={self.timeout_s:g}); "
                f"{last}; dumping all thread stacks and exiting with code {HANG_EXIT_CODE}")

    def _fire(self, waited: float) -> None:
        line = self.message(waited)
        print(line, file=self.stream, flush=True)
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
        if self.dump_path is not None:
            try:
                with open(self.dump_path, "w") as f:
                    print(line, file=f, flush=True)
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError as exc:  # the report on stream is what matters; a full disk must not stop the exit
                print(f"hang watchdog: could not write {self.dump_path}: {exc}", file=self.stream, flush=True)
        self.stream.flush()
        self.exit(HANG_EXIT_CODE)
