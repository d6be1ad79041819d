"""A `jax.profiler` trace of a few train steps (`profile.start_step`, `profile.steps`), for TensorBoard's profile
plugin / xprof (`*.xplane.pb`) and Perfetto (`perfetto_trace.json.gz`, ui.perfetto.dev).

Each dispatched step is a `StepTraceAnnotation("train", step_num=step)`, the step markers both viewers group a
trace by; the model names its layers (`layers` around the scanned stack, `layer_<i>` unrolled) and the pipeline
its stage body with `jax.named_scope`, so device ops carry those names. The trace stops after the last traced
step's results are ready, so it holds that step's device work, not only its dispatch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from jaxllm.config.schema import ProfileConfig

STEP_NAME = "train"


def trace_dir(workdir: Path) -> Path:
    """Where this process writes its trace: `<workdir>/profile`, per process in a multi-process job (processes
    sharing a host would otherwise write the same file names)."""
    if jax.process_count() == 1:
        return Path(workdir) / "profile"
    return Path(workdir) / "profile" / f"process_{jax.process_index()}"


class StepProfiler:
    """Starts a trace before step `cfg.start_step` and stops it after step `start_step + steps - 1` (off when
    `start_step` is 0). A rollback that repeats steps does not start a second trace."""

    def __init__(self, cfg: ProfileConfig, workdir: Path, log=print):
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.dir, self.log = trace_dir(workdir), log
        self.active, self.done = False, cfg.start_step == 0

    @contextlib.contextmanager
    def step(self, step: int):
        """Wrap the dispatch of train step `step`: starts the trace at the first traced step, then annotates."""
        if not self.done and not self.active and self.first <= step <= self.last:
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
            yield

    def after(self, step: int, outputs) -> None:
        """After dispatching `step` (its `outputs`): at the last traced step, wait for them and stop the trace."""
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)
            self.stop()
            self.log(f"profile of steps {self.first}..{step} written to {self.dir}")

    def stop(self) -> None:
        """Stop a running trace (also when the run ends or fails inside the traced steps)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.done = False, True
