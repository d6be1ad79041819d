"""Per-step records of the training loop: metrics.jsonl, the progress bar, step timing and throughput/MFU.

A step counts as completed when its metrics are fetched (one step late, see jaxllm/train/fit.py); `on_step`
hears of each one (the hang watchdog's heartbeat).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxllm.config.schema import Config
from jaxllm.observe.step_timing import HostTimes
from jaxllm.train.diagnostic_step import split_diag
from jaxllm.observe.writers import MetricsWriter
from jaxllm.observe.metrics import mfu, peak_flops_per_device
from jaxllm.model.transformer import train_flops_per_token
from jaxllm.observe.progress import ProgressBar


class MetricsLog:
    """Per-step records (metrics.jsonl), the progress bar and step timing, written by process 0.

    `on_step(step, seconds)` is called as each step's metrics arrive. `stalls` ({step: seconds}, the drill
    debug.stall_at_step) sleeps before fetching that step's metrics, as if the step never finished on the
    devices: the loop blocks exactly where a hung collective would block it.
    """

    def __init__(self, cfg: Config, mesh, workdir: Path, is_main: bool, stream,
                 progress_metrics: tuple[str, ...] = (), on_step: Callable[[int, float], None] = lambda *_: None,
                 stalls: dict[int, float] | None = None):
        tc = cfg.train
        # FLOPs per token at the longest rows (RL rows shorter than train.seq_len overstate the attention part).
        self.flops = train_flops_per_token(cfg.model, tc.seq_len)
        self.flops_causal = train_flops_per_token(cfg.model, tc.seq_len, causal=True)
        self.peak, self.devices = peak_flops_per_device(cfg.peak_flops, cfg.precision.compute), mesh.size
        self.writer = MetricsWriter(workdir, cfg.metrics, enabled=is_main, run_config=cfg.to_dict())
        self.host_times = HostTimes()  # the loop's data wait, checkpoint blocking and eval, per record
        self.bar = ProgressBar(tc.steps, stream=stream) if is_main else None
        self.shown = progress_metrics
        self.log_every, self.total = tc.log_every, tc.steps
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.losses: list[float] = []
        self.on_step, self.stalls = on_step, dict(stalls or {})
        self.restart_clock()

    def restart_clock(self) -> None:
        """Time from now on counts toward the next step (eval and checkpoint restores do not)."""
        self.last_ready = time.perf_counter()

    def mfu(self, tokens_per_sec: float, causal: bool = False) -> float:
        return mfu(tokens_per_sec, self.flops_causal if causal else self.flops, self.devices, self.peak)

    def report(self, step: int, metrics, host: dict, tokens: int) -> dict:
        """Fetch one step's metrics (blocks on that step only), log them with the `host` ones of its batch (see
        `host_metrics`), its throughput (`tokens` slots in the batch) and the host time breakdown since the last
        record (`host_times`, jaxllm/observe/step_timing.py), return them."""
        time.sleep(self.stalls.pop(step, 0.0))
        values, diag = split_diag({k: float(v) for k, v in jax.device_get(metrics).items()})
        now = time.perf_counter()
        step_time, self.last_ready = now - self.last_ready, now
        self.on_step(step, step_time)
        tps = tokens / step_time
        record = dict(values, step=step, step_time_s=step_time, tokens_per_sec=tps, mfu=self.mfu(tps),
                      mfu_causal=self.mfu(tps, causal=True), **host, **self.host_times.take())
        self.writer.write(record)
        if diag:  # the diagnostic variant's statistics (jaxllm/observe/): a record of their own
            self.writer.write({"step": step, **diag})
        self.step_times.append(step_time)
        self.step_tokens.append(tokens)
        self.losses.append(values["loss"])
        if self.bar is not None and (step % self.log_every == 0 or step == self.total):
            self.bar.update(step, values["loss"], tps, record["mfu"], force=step == self.total,
                            extra={name: record[name] for name in self.shown if name in record})
        return record

    def steady_tokens_per_sec(self) -> float:
        if not self.step_times:
            return float("nan")
        first = min(2, len(self.step_times) - 1)
        return float(np.sum(self.step_tokens[first:]) / np.sum(self.step_times[first:]))

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
