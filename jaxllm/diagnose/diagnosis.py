"""Run every diagnosis rule on a run: the findings, most severe first, and the checks that could not run."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from jaxllm.diagnose.findings import CRITICAL, INFO, RULES, THRESHOLDS, WARNING, Finding, NotEvaluated, Rule, Thresholds
from jaxllm.diagnose.layer_rules import LAYER_RULES
from jaxllm.diagnose.run_data import RunData
from jaxllm.diagnose.system_rules import SYSTEM_RULES

ALL_RULES: tuple[Rule, ...] = RULES + LAYER_RULES + SYSTEM_RULES
SEVERITY_ORDER = {CRITICAL: 0, WARNING: 1, INFO: 2}


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The findings of a run (most severe first) and {rule: why it could not run}."""

    findings: list[Finding]
    not_evaluated: dict[str, str]

    def ids(self) -> list[str]:
        return [f.id for f in self.findings]


def diagnose(run: RunData, t: Thresholds = THRESHOLDS, rules: tuple[Rule, ...] = ALL_RULES) -> Diagnosis:
    """Apply `rules` to `run`. A rule returns None, a Finding or a list of them, or raises NotEvaluated."""
    findings, skipped = [], {}
    for rule in rules:
        try:
            # NaN records are expected (skipped non-finite steps): numpy's warnings about them are noise here
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                found = rule(run, t)
        except NotEvaluated as why:
            skipped[rule.__name__] = str(why)
            continue
        findings.extend(found if isinstance(found, list) else [found] if found else [])
    return Diagnosis(sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity]), skipped)
