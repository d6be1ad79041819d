"""A bandwidth limit for emulated slow storage tiers (drills and benchmarks): the persistent checkpoint tier
(`debug.slow_persistent_mb_s`) and the cold data tier (`debug.slow_cold_mb_s`)."""

from __future__ import annotations

import threading
import time


class Throttle:
    """At most `mb_s` MB/s through `pass_bytes` over all the threads of a process (0: no limit): each call waits
    until the bytes it passes fit the rate since the first call."""

    def __init__(self, mb_s: float):
        self.bytes_s = mb_s * 1e6
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link is free again (time.monotonic())

    def pass_bytes(self, count: int) -> None:
        if not self.bytes_s:
            return
        with self._lock:
            start = max(self._free_at, time.monotonic())
            self._free_at = start + count / self.bytes_s
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))

    def __getstate__(self):  # crosses into grain's worker processes: each gets its own link
        return {"bytes_s": self.bytes_s}

    def __setstate__(self, state):
        self.__init__(state["bytes_s"] / 1e6)
