"""Where the host's time between steps goes: each step record of metrics.jsonl carries `data_wait_s` (getting
the next batch and placing it on the devices), `checkpoint_block_s` (the loop thread blocked in a checkpoint
save or wait) and `eval_s` (held-out evaluation), 0.0 when nothing of that kind happened.

A record takes the seconds spent since the previous step record was written. Records are written one step late
(after the next step is dispatched), so at an ordinary step that is what happened at its own boundary; a step
that checkpoints or evaluates is written before it does (its metrics must show it healthy first), so the save,
the evaluation and the next batch land in the following step's record. Either way every second is counted once,
inside the record whose `step_time_s` it lengthened, except that a mid-run evaluation restarts the step clock
(its time, and a save made at the same step, are outside `step_time_s`).
"""

from __future__ import annotations

import contextlib
import time

FIELDS = ("data_wait_s", "checkpoint_block_s", "eval_s")


class HostTimes:
    """Seconds per `FIELDS` kind accumulated since the last `take()`."""

    def __init__(self):
        self.seconds = dict.fromkeys(FIELDS, 0.0)

    @contextlib.contextmanager
    def measure(self, kind: str):
        """Add the time spent inside the `with` block to `kind`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The seconds accumulated so far, by kind, and start again from zero."""
        taken, self.seconds = self.seconds, dict.fromkeys(FIELDS, 0.0)
        return taken
