"""A dependency-free console progress bar: one redrawn line on a terminal, periodic lines in a log file."""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class ProgressBar:
    """Shows step, bar, loss, an objective's own metrics (`extra`, e.g. RL's reward and KL), tokens/s, MFU and
    ETA. `update` is cheap; output is throttled.

    The ETA counts steady steps only: the first update's step carries the compile and warm-up, so the rate is
    taken from that update on, and the ETA reads "estimating" until STEADY_STEPS more steps are done."""

    STEADY_STEPS = 2

    def __init__(self, total: int, stream=None, width: int = 24, min_interval: float | None = None):
        self.total, self.width = total, width
        self.stream = stream or sys.stdout
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.min_interval = min_interval if min_interval is not None else (0.2 if self.tty else 10.0)
        self._last = 0.0
        self._anchor: tuple[float, int] | None = None  # (time, step) of the first update

    def update(self, step: int, loss: float, tokens_per_sec: float, mfu: float, force: bool = False,
               extra: dict[str, float] | None = None) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.min_interval and step < self.total:
            return
        self._last = now
        if self._anchor is None:
            self._anchor = (now, step)
        since, first = self._anchor
        steady = step - first
        eta = (format_duration((self.total - step) * (now - since) / steady)
               if steady >= self.STEADY_STEPS else "estimating")
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"step {step:>6}/{self.total} [{bar}] loss {loss:7.4f}"
            + "".join(f" {name} {value:.3g}" for name, value in (extra or {}).items())
            + f" | {tokens_per_sec:>9,.0f} tok/s"
            f" | MFU {100 * mfu:5.2f}% | ETA {eta}"
        )
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
