"""Small numeric views of a training series that the diagnosis rules share: running medians that take batch
noise out, and the loss's rise, wobble and progress.

Medians rather than means throughout: a single hard batch (healthy runs of the default job show lone gradient
norms 10-60x the usual) must not move a judgement that is about the run's trend.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def running_median(values: np.ndarray, window: int) -> np.ndarray:
    """Median of the last `window` finite values up to and including each position (NaN before any)."""
    out = np.full(len(values), np.nan)
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        chunk = chunk[np.isfinite(chunk)]
        if chunk.size:
            out[i] = np.median(chunk)
    return out


def trailing_ratio(values: np.ndarray, window: int) -> np.ndarray:
    """Each value over the median of the `window` values before it (NaN where there is no history)."""
    out = np.full(len(values), np.nan)
    for i in range(1, len(values)):
        history = values[max(0, i - window):i]
        history = history[np.isfinite(history)]
        if history.size and np.median(history) > 0:
            out[i] = values[i] / np.median(history)
    return out


@dataclasses.dataclass(frozen=True)
class LossShape:
    """What the loss curve did. `rise`: how far the smoothed loss ends above its minimum (fraction of the
    minimum); `excursion`: the largest climb of the smoothed loss above its lowest point so far (fraction of
    that low), from `excursion_from` to `excursion_to` (indices); `wobble`: the median step-to-step change over
    the judged steps, as a fraction of the smoothed level; `progress`: how far the smoothed loss fell from its
    start (fraction of the start)."""

    smoothed: np.ndarray
    min_index: int
    rise: float
    excursion: float
    excursion_from: int
    excursion_to: int
    wobble: float
    progress: float
    nonfinite_steps: list[int]


def loss_shape(steps: np.ndarray, loss: np.ndarray, window: int, judged_from: int) -> LossShape:
    """The LossShape of `loss` (aligned with `steps`), the wobble judged on steps after `judged_from` (the end
    of warmup: the loss falls fastest then, which is progress, not wobble)."""
    finite = np.isfinite(loss)
    smoothed = running_median(np.where(finite, loss, np.nan), window)
    min_index = int(np.nanargmin(smoothed))
    low, end = smoothed[min_index], smoothed[-1]
    start = float(np.median(loss[finite][:window]))
    judged = (steps > judged_from) if np.sum(steps > judged_from) >= 2 * window else (steps > steps[len(steps) // 2])
    changes = np.abs(np.diff(loss))[judged[1:]] / smoothed[:-1][judged[1:]]
    changes = changes[np.isfinite(changes)]
    running_low = np.fmin.accumulate(np.where(np.isfinite(smoothed), smoothed, np.inf))
    climb = (smoothed - running_low) / np.abs(running_low)
    to = int(np.nanargmax(climb))
    return LossShape(smoothed=smoothed, min_index=min_index, rise=float((end - low) / abs(low)),
                     excursion=float(climb[to]), excursion_from=int(np.nanargmin(smoothed[:to + 1])), excursion_to=to,
                     wobble=float(np.median(changes)) if changes.size else 0.0,
                     progress=float((start - end) / abs(start)), nonfinite_steps=[int(s) for s in steps[~finite]])


def steady(steps: np.ndarray, skip: int = 2) -> np.ndarray:
    """Mask of the steps after the first `skip` of the run's start (they carry compilation and warm-up)."""
    return steps > steps[0] + skip - 1 if len(steps) > skip else np.ones(len(steps), bool)
