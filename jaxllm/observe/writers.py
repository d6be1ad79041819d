"""The metrics writer of a run: every record goes to `<workdir>/metrics.jsonl`, and its numeric fields to
TensorBoard (`<workdir>/tb`) and Weights & Biases where `metrics.tensorboard` / `metrics.wandb` ask for them.

One object fans out, so whatever the loop writes (step records, eval records, diagnostics) reaches every sink
with the same values; only process 0 writes.
"""

from __future__ import annotations

from pathlib import Path

from jaxllm.config.schema import MetricsConfig
from jaxllm.observe.metrics import JsonlWriter
from jaxllm.observe.tensorboard import TensorBoardWriter
from jaxllm.observe.wandb_writer import WandbWriter


class MetricsWriter:
    """Writes each metrics record to metrics.jsonl and mirrors its scalars into TensorBoard / wandb.

    `enabled=False` (processes other than 0) writes nothing anywhere. `run_config` (the resolved config as a
    dict) is stored with the wandb run.
    """

    def __init__(self, workdir: str | Path, cfg: MetricsConfig = MetricsConfig(), enabled: bool = True,
                 run_config: dict | None = None):
        workdir = Path(workdir)
        self.sinks: list = [JsonlWriter(workdir / "metrics.jsonl", enabled=enabled)]
        if enabled and cfg.tensorboard:
            self.sinks.append(TensorBoardWriter(workdir / "tb"))
        if enabled and cfg.wandb:
            self.sinks.append(WandbWriter(workdir, cfg.wandb_project, run_config or {}))

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

