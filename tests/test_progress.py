"""The progress line's ETA counts steady steps only: the first step's compile and warm-up do not inflate it."""

import io

from jaxllm.observe import progress
from jaxllm.observe.progress import ProgressBar


def test_eta_is_estimating_until_steady_then_from_steady_steps_only(monkeypatch):
    clock = iter([1000.0, 1002.0, 1004.0, 1006.0])  # step 1 ends after a long compile; then 2 s a step
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    bar = ProgressBar(total=100, stream=stream, min_interval=0.0)
    for step in (1, 2, 3, 4):
        bar.update(step, loss=2.0, tokens_per_sec=1.0, mfu=0.1)
    etas = [line.rsplit("ETA ", 1)[1] for line in stream.getvalue().splitlines()]
    assert etas[:2] == ["estimating", "estimating"]
    assert etas[2:] == ["3m14s", "3m12s"]  # 97 and 96 steps left at 2 s each
