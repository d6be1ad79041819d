"""The diagnosis report of a run directory: `report/report.md`, the same as `report/report.html`, the plots
(PNG) and `report/findings.json` (a list of {"id", "severity", "evidence", "action"}, read by tests and tools).

The report is built once as a list of small blocks and rendered twice, to markdown and to HTML: no markdown
library is installed here, and five block kinds do not need one.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

import numpy as np

from jaxllm.diagnose.diagnosis import Diagnosis, diagnose
from jaxllm.diagnose.findings import THRESHOLDS, Finding
from jaxllm.diagnose.plots import make_plots
from jaxllm.diagnose.run_data import RunData, load_run
from jaxllm.observe.sizes import format_bytes

TITLES = {
    "loss_divergence": "The loss diverged",
    "loss_oscillation": "The loss oscillates or climbs back up",
    "lr_too_high": "The learning rate is too high",
    "warmup_too_short": "Warmup is too short",
    "gradient_explosion": "Gradients explode",
    "clipping_dominant": "Gradient clipping acts on most steps",
    "slow_convergence": "The loss is barely falling",
    "lr_too_low": "The learning rate is too low",
    "output_logits_saturated": "The output softmax is saturated",
    "anomaly_incidents": "Anomaly incidents",
    "dead_layer": "A layer is dead",
    "exploding_layer": "A layer's norms explode",
    "vanishing_gradients": "Gradients vanish toward the input",
    "saturated_gates": "MLP gates are saturated",
    "attention_logit_growth": "Attention logits grow",
    "input_bound": "Training waits for data",
    "low_mfu": "Low MFU",
    "checkpoint_blocking": "Checkpoint saves block training",
    "memory_headroom": "Little memory headroom",
    "loss_scale_overflow": "float16 gradients overflow",
}


@dataclasses.dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclasses.dataclass(frozen=True)
class Paragraph:
    text: str


@dataclasses.dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclasses.dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclasses.dataclass(frozen=True)
class Image:
    src: str
    alt: str


def _finding_blocks(finding: Finding) -> list:
    evidence = finding.evidence
    details = []
    if evidence.get("steps"):
        details.append("steps: " + ", ".join(str(s) for s in evidence["steps"]))
    if evidence.get("layers"):
        details.append("layers: " + ", ".join(str(k) for k in evidence["layers"]))
    return [Heading(3, f"{finding.severity.upper()}: {TITLES.get(finding.id, finding.id)} (`{finding.id}`)"),
            Paragraph(evidence["summary"][:1].upper() + evidence["summary"][1:] + "."),
            Bullets(details + [f"suggested action: {finding.action}"])]


def _overview(run: RunData) -> Paragraph:
    loss = run.steps["loss"]
    finite = loss[np.isfinite(loss)]
    text = (f"Steps {int(run.step[0])}..{int(run.step[-1])} ({len(run.step)} step records) of a "
            f"{run.config_value('train.objective', 'pretrain')} run")
    if finite.size:
        text += f"; train loss {finite[0]:.4g} at the first record, {finite[-1]:.4g} at the last"
    eval_steps, eval_loss = run.evals
    if len(eval_steps):
        text += f"; held-out loss {eval_loss[0]:.4g} (step {eval_steps[0]}) -> {eval_loss[-1]:.4g} (step {eval_steps[-1]})"
    return Paragraph(text + ".")


def _memory_blocks(memory: dict | None) -> list:
    """The compiled step's bytes per device that the run logged at start-up (summary.json `memory`)."""
    if not memory:
        return [Paragraph("Compiled step memory: not recorded in summary.json (a run from an older version, or a "
                          "backend without `memory_analysis()`).")]
    limit = memory.get("limit_bytes")
    against = (f", {100 * memory['per_device_bytes'] / limit:.1f}% of the {memory.get('limit_of', 'device')} limit "
               f"{format_bytes(limit)}" if limit else "; the device reports no limit")
    parts = ", ".join(f"{k} {format_bytes(memory[k])}" for k in ("arguments", "outputs", "temporaries", "aliased")
                      if k in memory)
    return [Paragraph(f"Compiled step memory per device: {format_bytes(memory['per_device_bytes'])} in all"
                      + (f" ({parts})" if parts else "") + f"{against}.")]


def _comms_blocks(comms: dict | None) -> list:
    """The compiled step's collectives (summary.json `comms`, `jaxllm.observe.comms.summarize`)."""
    if comms is None:
        return [Paragraph("Collectives: not recorded in summary.json (a run from an older version).")]
    if not comms["by_kind_axes"]:
        return [Paragraph("Collectives: none (one device, or nothing sharded).")]
    loops = (f" {comms['unknown_loops']} loops of unknown trip count are counted once." if comms["unknown_loops"]
             else "")
    return [Paragraph(f"Collectives of the compiled train step: {format_bytes(comms['total_bytes_per_step'])} per device "
                      f"per step, by kind and the mesh axes their device groups span.{loops}"),
            Table(["kind", "mesh axes", "ops", "runs/step", "bytes/step"],
                  [[r["kind"], r["axes"], str(r["ops"]), str(r["runs"]), format_bytes(r["bytes_per_step"])]
                   for r in comms["by_kind_axes"]]),
            Paragraph("The largest collectives:"),
            Table(["bytes/step", "runs", "kind", "mesh axes", "pass", "source"],
                  [[format_bytes(c["bytes_per_step"]), str(c["runs"]), c["kind"], c["axes_label"],
                    "backward" if c["backward"] else "forward", c["source"] or "?"] for c in comms["top"]])]


def build_report(run: RunData, diagnosis: Diagnosis, plots: dict, missing_plots: dict[str, str]) -> list:
    """The report's blocks: findings first (plain language, evidence, action), then plots, the compiled step's
    memory and communication, the checks that could not run, and the thresholds."""
    blocks: list = [Heading(1, f"Diagnosis of {run.root}"), _overview(run), Heading(2, "Findings")]
    if not diagnosis.findings:
        blocks.append(Paragraph("No findings: every check that could run passed."))
    for finding in diagnosis.findings:
        blocks += _finding_blocks(finding)
    blocks.append(Heading(2, "Plots"))
    for title, path in plots.values():
        blocks += [Heading(3, title), Image(path.name, title)]
    if missing_plots:
        blocks += [Paragraph("Not drawn:"), Bullets([f"{name}: {why}" for name, why in missing_plots.items()])]
    blocks.append(Heading(2, "Memory and communication"))
    blocks += _memory_blocks(run.summary.get("memory")) + _comms_blocks(run.summary.get("comms"))
    blocks.append(Heading(2, "Checks that could not run"))
    blocks.append(Table(["check", "why"], [[name, why] for name, why in diagnosis.not_evaluated.items()])
                  if diagnosis.not_evaluated else Paragraph("None: every check ran."))
    blocks += [Heading(2, "Thresholds"),
               Table(["threshold", "value"], [[k, f"{v:g}"] for k, v in dataclasses.asdict(THRESHOLDS).items()])]
    return blocks


def to_markdown(blocks: list) -> str:
    out = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            cell = lambda s: str(s).replace("|", "\\|")
            lines = ["| " + " | ".join(block.header) + " |", "|" + "---|" * len(block.header)]
            out.append("\n".join(lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in block.rows]))
        elif isinstance(block, Image):
            out.append(f"![{block.alt}]({block.src})")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    """Escaped text with markdown's `code` spans as <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def to_html(blocks: list, title: str) -> str:
    body = []
    for block in blocks:
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{_inline_html(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_inline_html(block.text)}</p>")
        elif isinstance(block, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline_html(str(c))}</td>" for c in row) + "</tr>"
                           for row in block.rows)
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif isinstance(block, Image):
            body.append(f'<img src="{html.escape(block.src)}" alt="{html.escape(block.alt)}">')
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}"
             "img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run: RunData | str | Path) -> tuple[Path, Diagnosis]:
    """Diagnose `run` (loaded, or its directory) and write `<run dir>/report/` (report.md, report.html,
    findings.json, PNG plots); returns (the report directory, the diagnosis). A RunDirError when the run cannot
    be read."""
    run = run if isinstance(run, RunData) else load_run(run)
    outdir = run.root / "report"
    outdir.mkdir(exist_ok=True)
    diagnosis = diagnose(run)
    plots, missing = make_plots(run, outdir)
    blocks = build_report(run, diagnosis, plots, missing)
    (outdir / "report.md").write_text(to_markdown(blocks))
    (outdir / "report.html").write_text(to_html(blocks, f"Diagnosis of {run.root}"))
    findings = [_strict_json(f.to_json()) for f in diagnosis.findings]
    (outdir / "findings.json").write_text(json.dumps(findings, indent=2, allow_nan=False) + "\n")
    return outdir, diagnosis


def _strict_json(value):
    """`value` with non-finite floats as None: findings.json is strict JSON for any reader."""
    if isinstance(value, dict):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value
