"""What a sweep leaves behind (scripts/sweep.py): the table of its trials, optuna's importance and history plots,
and the best trial as a config file that scripts/train.py takes."""

from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from jaxllm.diagnose.run_data import read_jsonl


def _replace(path: Path, write) -> None:
    """`write(tmp)` then rename it to `path`: workers that end together each leave whole files."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def steps_run(workdir: Path) -> int:
    """The last step a trial's run trained (its metrics.jsonl), 0 if none."""
    path = workdir / "metrics.jsonl"
    records = read_jsonl(path) if path.exists() else []
    return max((r["step"] for r in records if "loss" in r), default=0)


def trial_rows(study: optuna.Study) -> list[dict]:
    """One row a trial: number, state, its parameters, held-out loss (final, or the last reported when pruned),
    steps run, pruned or not."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        last = t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None
        loss = t.value if t.state == TrialState.COMPLETE else last
        workdir = Path(t.user_attrs.get("workdir", ""))
        rows.append({"trial": t.number, "state": t.state.name.lower(), **{f"--config.{k}": v for k, v in
                     t.params.items()}, "held_out_loss": loss, "steps": steps_run(workdir) if workdir.name else 0,
                     "pruned": t.state == TrialState.PRUNED})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    if not rows:
        return "(no trials)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    text = lambda v: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
    widths = {k: max(len(k), *(len(text(r.get(k))) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines += ["  ".join(text(r.get(k)).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def write_best_config(study: optuna.Study, path: Path) -> optuna.trial.FrozenTrial:
    """The best complete trial as a config file: the sweep's base config with its fixed overrides, then the
    trial's parameters (scripts/train.py --config <path>)."""
    best = study.best_trial
    overrides = [tuple(kv) for kv in study.user_attrs["overrides"]] + [(k, str(v)) for k, v in best.params.items()]
    _replace(path, lambda tmp: tmp.write_text(
        f'"""Best trial {best.number} of the sweep in {path.parent}: held-out loss {best.value:.6g}.\n'
        f'Written by scripts/sweep.py; train it with `python scripts/train.py --config {path}`."""\n\n'
        "from jaxllm.config.cli import build_config\n\n"
        f"BASE = {study.user_attrs['config']!r}\n"
        "# The sweep's fixed overrides, then the trial's parameters.\nOVERRIDES = [\n"
        + "".join(f"    {kv!r},\n" for kv in overrides) + "]\n\n\n"
        "def get_config():\n    return build_config(BASE, OVERRIDES)\n"))
    return best


def save_plots(study: optuna.Study, out: Path) -> list[str]:
    """optuna's parameter importances and optimisation history as PNG files; notes for those it could not draw
    (too few complete trials)."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

    notes = []
    for name, plot in (("importance", plot_param_importances), ("history", plot_optimization_history)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
                axes = plot(study)
            _replace(out / f"{name}.png", lambda tmp: axes.figure.savefig(tmp, format="png", dpi=100,
                                                                          bbox_inches="tight"))
            matplotlib.pyplot.close(axes.figure)
        except (ValueError, RuntimeError) as exc:
            notes.append(f"{name}.png not drawn: {exc}")
    return notes


def write_results(study: optuna.Study, out: Path, log=print) -> None:
    """trials.csv, importance.png, history.png and best_config.py under `out`; the table and the best trial
    logged."""
    rows = trial_rows(study)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    def write_csv(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)

    _replace(out / "trials.csv", write_csv)
    log(format_rows(rows))
    for note in save_plots(study, out):
        log(note)
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best = write_best_config(study, out / "best_config.py")
        log(f"best: trial {best.number}, held-out loss {best.value:.6g}, {best.params}: {out / 'best_config.py'}")
