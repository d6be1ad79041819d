"""Diagnose a finished (or running) training run: `python scripts/diagnose.py RUNDIR`.

Writes RUNDIR/report/: report.md and report.html (findings in plain language with their evidence and a
suggested action, then plots), findings.json (a list of {"id", "severity", "evidence", "action"}) and the PNG
plots. Prints the findings, one line each. Exit 0; 2 with one line when RUNDIR or its metrics.jsonl is missing
or unreadable.
"""

from __future__ import annotations

import sys

from jaxllm.diagnose.run_data import RunDirError, load_run

USAGE = "usage: python scripts/diagnose.py RUNDIR"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        run = load_run(argv[0])
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from jaxllm.diagnose.report import write_report  # after the checks: matplotlib and jax take seconds

    outdir, diagnosis = write_report(run)
    for finding in diagnosis.findings:
        print(f"{finding.severity:8s} {finding.id}: {finding.evidence['summary']}")
    if not diagnosis.findings:
        print("no findings")
    print(f"{len(diagnosis.not_evaluated)} checks could not run (listed in the report); report in {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
