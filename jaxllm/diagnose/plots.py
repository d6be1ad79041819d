"""The diagnosis report's plots (PNG, matplotlib's Agg backend: no display needed).

Each plot function draws what the run has and returns None, or raises NotEvaluated with the reason when a plot's
data is missing (an older run): the report says which plots were not drawn and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.diagnose.findings import NotEvaluated, required_series  # noqa: E402
from jaxllm.diagnose.run_data import RunData  # noqa: E402
from jaxllm.diagnose.signals import running_median  # noqa: E402

SIZE = (7.5, 3.6)
MAX_MARKED = 20  # incidents labelled on the loss curve (the report's finding counts them all)
DPI = 100


def _figure(title: str):
    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    return fig, ax


def loss_plot(run: RunData, ax) -> None:
    """Train loss (raw and smoothed), held-out loss, and the anomaly incidents marked where they happened."""
    loss = required_series(run, "loss")
    ax.plot(run.step, loss, color="tab:blue", alpha=0.35, lw=1, label="train loss")
    ax.plot(run.step, running_median(loss, 5), color="tab:blue", lw=1.8, label="train loss (median of 5)")
    eval_steps, eval_loss = run.evals
    if len(eval_steps):
        ax.plot(eval_steps, eval_loss, "o-", color="tab:orange", lw=1.5, ms=4, label="held-out loss")
    for i, incident in enumerate(run.incidents[:MAX_MARKED]):
        ax.axvline(incident["step"], color="tab:red", alpha=0.6, lw=1, ls="--",
                   label="incident" if i == 0 else None)
        ax.annotate(f"{incident.get('kind', '?')}: {incident.get('action', '?')}", (incident["step"], 1.0),
                    xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7,
                    color="tab:red")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)


def lr_plot(run: RunData, ax) -> None:
    ax.plot(run.step, required_series(run, "lr"), color="tab:green")
    ax.set_ylabel("learning rate")


def grad_norm_plot(run: RunData, ax) -> None:
    """Gradient norm before clipping (log scale), after clipping when logged, and the clipping threshold."""
    ax.semilogy(run.step, required_series(run, "grad_norm"), color="tab:purple", lw=1, label="grad norm")
    clipped = run.series("grad_norm_clipped")
    if clipped is not None:
        ax.semilogy(run.step, clipped, color="tab:gray", lw=1, label="after clipping")
    clip = float(run.config_value("optim.clip_norm", 0.0) or 0.0)
    if clip > 0:
        ax.axhline(clip, color="tab:red", ls="--", lw=1, label=f"clip_norm {clip:g}")
    ax.set_ylabel("global norm")
    ax.legend(fontsize=8)


def update_ratio_heatmap(run: RunData, ax) -> None:
    """log10 of each layer's update/param ratio over the diagnostic steps."""
    series = run.layer_series("update_ratio")
    if not series:
        raise NotEvaluated("no `diag/update_ratio/layer_<i>` records")
    layers = sorted(series)
    steps = np.unique(np.concatenate([series[k][0] for k in layers]))
    grid = np.full((len(layers), len(steps)), np.nan)
    for row, layer in enumerate(layers):
        layer_steps, values = series[layer]
        grid[row, np.searchsorted(steps, layer_steps)] = np.log10(np.maximum(values, 1e-12))
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(layers) - 0.5))
    ax.set_yticks(range(len(layers)), [str(k) for k in layers])
    ax.set_ylabel("layer")
    ax.figure.colorbar(image, ax=ax, label="log10 update / param")


def activation_rms_plot(run: RunData, ax) -> None:
    series = run.layer_series("act_rms")
    if not series:
        raise NotEvaluated("no `diag/act_rms/layer_<i>` records")
    for layer, (steps, values) in sorted(series.items()):
        ax.semilogy(steps, values, marker=".", lw=1, label=f"layer {layer}")
    ax.set_ylabel("activation RMS")
    ax.legend(fontsize=7, ncol=4)


def throughput_plot(run: RunData, ax) -> None:
    """Tokens/s, and MFU on a second axis when the run knew its device's peak."""
    ax.plot(run.step, required_series(run, "tokens_per_sec"), color="tab:blue", lw=1)
    ax.set_ylabel("tokens / s", color="tab:blue")
    mfu = run.series("mfu")
    if mfu is not None and np.isfinite(mfu).any():
        twin = ax.twinx()
        twin.plot(run.step, 100 * mfu, color="tab:orange", lw=1)
        twin.set_ylabel("MFU %", color="tab:orange")


BREAKDOWN = (("data_wait_s", "data wait"), ("checkpoint_block_s", "checkpoint blocking"), ("eval_s", "eval"))


def step_time_plot(run: RunData, ax) -> None:
    """Each step's time split into device (the rest) and what the run logged of data wait, checkpoint blocking
    and evaluation, stacked."""
    total = required_series(run, "step_time_s")
    parts = [(label, np.nan_to_num(run.series(name))) for name, label in BREAKDOWN if run.series(name) is not None]
    logged = sum((values for _, values in parts), np.zeros_like(total))
    device = np.maximum(np.nan_to_num(total) - logged, 0.0)
    ax.stackplot(run.step, device, *[values for _, values in parts],
                 labels=["device and host (rest)"] + [label for label, _ in parts], alpha=0.8)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, loc="upper right")
    if not parts:
        ax.set_title(ax.get_title() + " (no breakdown fields logged)", fontsize=11)


PLOTS: tuple[tuple[str, str, Callable], ...] = (
    ("loss", "Loss (train, held-out) and incidents", loss_plot),
    ("lr", "Learning rate", lr_plot),
    ("grad_norm", "Gradient norm and clipping threshold", grad_norm_plot),
    ("update_ratio", "Update / parameter ratio per layer", update_ratio_heatmap),
    ("activation_rms", "Activation RMS per layer", activation_rms_plot),
    ("throughput", "Throughput and MFU", throughput_plot),
    ("step_time", "Step time breakdown", step_time_plot),
)


def make_plots(run: RunData, outdir: Path) -> tuple[dict[str, tuple[str, Path]], dict[str, str]]:
    """Draw every plot the run's data allows into `outdir`: ({name: (title, png path)}, {name: why not drawn})."""
    drawn, missing = {}, {}
    for name, title, draw in PLOTS:
        fig, ax = _figure(title)
        try:
            draw(run, ax)
        except NotEvaluated as why:
            missing[name] = str(why)
            plt.close(fig)
            continue
        path = outdir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        drawn[name] = (title, path)
    return drawn, missing
