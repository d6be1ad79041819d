"""Diagnosis rules on where the time and memory went: waiting for data, MFU against the device's peak,
checkpoint saves blocking training, memory headroom, and float16 overflows.

Shares are of step time over the steady steps (the first two carry compilation and warm-up).
"""

from __future__ import annotations

import numpy as np

from jaxllm.diagnose.findings import WARNING, Finding, NotEvaluated, Rule, Thresholds, required_series
from jaxllm.diagnose.run_data import RunData
from jaxllm.diagnose.signals import steady
from jaxllm.observe.metrics import PEAK_FLOPS


def _share(run: RunData, part: str) -> tuple[float, float]:
    """(share of steady step time spent in the step field `part`, its total seconds)."""
    spent, total = required_series(run, part), required_series(run, "step_time_s")
    mask = steady(run.step) & np.isfinite(spent) & np.isfinite(total)
    seconds = float(np.sum(spent[mask]))
    return seconds / max(float(np.sum(total[mask])), 1e-12), seconds


# An RL run's batches are its rollouts: the seconds its sampler and scorer took (jaxllm/objectives/rl.py) are
# RL's own work inside the wait for the next batch, not an input pipeline's.
ROLLOUT_FIELDS = ("rollout_s", "scoring_s")


def input_bound(run: RunData, t: Thresholds) -> Finding | None:
    """The devices wait for the next batch for a large share of each step (less the rollouts' time in RL)."""
    share, seconds = _share(run, "data_wait_s")
    rollouts = [_share(run, field) for field in ROLLOUT_FIELDS if run.series(field) is not None]
    share = max(0.0, share - sum(s for s, _ in rollouts))
    seconds = max(0.0, seconds - sum(s for _, s in rollouts))
    if share <= t.data_wait_share:
        return None
    return Finding("input_bound", WARNING,
                   {"summary": f"{100 * share:.0f}% of step time ({seconds:.1f}s) is spent waiting for data"
                               + (" (not counting the rollouts' sampling and scoring)" if rollouts else ""),
                    "values": {"data_wait_share": share, "threshold": t.data_wait_share}},
                   "Raise data.num_workers (grain worker processes) or prefetch, or pre-tokenize/pack the data "
                   "offline; check the loader is not doing per-batch work on the training thread.")


def peak_known(run: RunData) -> str | None:
    """Why the device's peak FLOP/s is known (a config value or a GPU in jaxllm.observe.metrics.PEAK_FLOPS), else None.
    A CPU's peak is a measured matmul, not a roofline: MFU there is not judged."""
    if float(run.config_value("peak_flops", 0.0) or 0.0) > 0:
        return f"config peak_flops={run.config_value('peak_flops'):g}"
    kind, platform = run.summary.get("device_kind"), run.summary.get("platform")
    if platform == "gpu" and kind and any(name in kind for name in PEAK_FLOPS):
        return f"device {kind}"
    return None


def low_mfu(run: RunData, t: Thresholds) -> Finding | None:
    """Model FLOPs utilisation well below the device's peak (only where that peak is known)."""
    why = peak_known(run)
    if why is None:
        raise NotEvaluated("the device's peak FLOP/s is not known (no config peak_flops, and summary.json names no "
                           f"GPU in the peak table; platform {run.summary.get('platform', 'unrecorded')})")
    mfu = required_series(run, "mfu")
    median = float(np.nanmedian(mfu[steady(run.step)]))
    if median >= t.low_mfu:
        return None
    return Finding("low_mfu", WARNING,
                   {"summary": f"median MFU {100 * median:.1f}% of the peak ({why})",
                    "values": {"mfu_median": median, "threshold": t.low_mfu}},
                   "Profile a step (jax.profiler): raise the per-device batch, use bfloat16 compute, check the mesh "
                   "(less tensor parallelism across slow links) and the step-time breakdown for non-device time.")


def checkpoint_blocking(run: RunData, t: Thresholds) -> Finding | None:
    """Checkpoint saves block training for a large share of its time (`checkpoint_block_s` per step, else the
    summary's record of each save)."""
    try:
        share, seconds = _share(run, "checkpoint_block_s")
    except NotEvaluated:
        saves = run.summary.get("checkpoint_saves")
        train_s = run.summary.get("train_s")
        if not saves or not train_s:
            raise NotEvaluated("no `checkpoint_block_s` in metrics.jsonl and no checkpoint_saves/train_s in "
                               "summary.json") from None
        seconds = float(sum(s.get("blocking_s", 0.0) for s in saves))
        share = seconds / float(train_s)
    if share <= t.checkpoint_share:
        return None
    return Finding("checkpoint_blocking", WARNING,
                   {"summary": f"checkpoint saves blocked training for {seconds:.1f}s, {100 * share:.0f}% of its time",
                    "values": {"checkpoint_share": share, "threshold": t.checkpoint_share}},
                   "Save less often (checkpoint.every), keep checkpoint.async_save on, or write to faster storage.")


def memory_headroom(run: RunData, t: Thresholds) -> Finding | None:
    """Per-device memory close to the device's limit (summary.json `memory`)."""
    memory = run.summary.get("memory")
    if not isinstance(memory, dict) or not memory.get("limit_bytes"):
        live = run.summary.get("startup_peak_live_bytes")
        raise NotEvaluated("summary.json has no `memory` with per_device_bytes and limit_bytes"
                           + (f" (startup peak live bytes {live / 2**20:.0f} MiB, but no limit to compare with)"
                              if live else ""))
    used = float(memory["per_device_bytes"]) / float(memory["limit_bytes"])
    if used <= t.memory_used:
        return None
    return Finding("memory_headroom", WARNING,
                   {"summary": f"{100 * used:.0f}% of device memory in use "
                               f"({memory['per_device_bytes'] / 2**30:.2f} of {memory['limit_bytes'] / 2**30:.2f} GiB)",
                    "values": {"used_fraction": used, "threshold": t.memory_used}},
                   "Little headroom for longer rows or fragmentation: enable model.remat, shard more (mesh.fsdp), "
                   "or lower the per-device batch.")


def loss_scale_overflow(run: RunData, t: Thresholds) -> Finding | None:
    """float16: gradients overflowed on many steps (each one skipped and the loss scale halved)."""
    overflow = run.series("overflow")
    if overflow is None:
        raise NotEvaluated("no `overflow` in metrics.jsonl (not a float16 run with loss scaling)")
    share = float(np.nanmean(overflow > 0))
    if share <= t.overflow_share:
        return None
    return Finding("loss_scale_overflow", WARNING,
                   {"summary": f"gradients overflowed on {100 * share:.0f}% of steps (updates skipped)",
                    "steps": [int(s) for s in run.step[overflow > 0]][:20], "values": {"overflow_share": share}},
                   "Use bfloat16 compute, or start the loss scale lower.")


SYSTEM_RULES: tuple[Rule, ...] = (input_bound, low_mfu, checkpoint_blocking, memory_headroom, loss_scale_overflow)
