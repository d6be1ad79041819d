"""The diagnosis replayed on recorded runs: every healthy trace gets no warning or critical finding, and every
seeded pathology is named (the way tests/test_anomaly.py replays its traces for the anomaly rule).

tests/data/diagnose/traces/<name>/ holds a finished run's config.json, summary.json, incidents.jsonl and
metrics.jsonl (gzipped); README.md there gives the command that recorded each. `seeded_<pathology>` traces come
from scripts/seeded_pathologies.py and must be named as its SEEDED table says; every other trace is a healthy
run of a shipped job and must get no finding above info, except those its `allowed.json` names with the reason
they are true of it. A rule added later joins this replay as it is."""

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

from jaxllm.diagnose.diagnosis import diagnose
from jaxllm.diagnose.run_data import load_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from seeded_pathologies import SEEDED, judge  # noqa: E402

TRACES = ROOT / "tests" / "data" / "diagnose" / "traces"
NAMES = sorted(p.name for p in TRACES.iterdir() if p.is_dir())
SEEDED_PREFIX = "seeded_"


def _unpacked(name: str, tmp_path: Path) -> Path:
    run_dir = tmp_path / name
    shutil.copytree(TRACES / name, run_dir)
    packed = run_dir / "metrics.jsonl.gz"
    (run_dir / "metrics.jsonl").write_bytes(gzip.decompress(packed.read_bytes()))
    packed.unlink()
    return run_dir


def test_the_traces_cover_the_shipped_jobs_and_every_seeded_pathology():
    healthy = [n for n in NAMES if not n.startswith(SEEDED_PREFIX)]
    assert {"default_seed0", "default_150_steps", "default_contended", "sft", "reward", "dpo", "grpo",
            "ppo"} <= set(healthy), healthy
    assert sum(n.startswith("default_seed") for n in healthy) >= 5, healthy
    assert {SEEDED_PREFIX + k for k in SEEDED if k != "healthy"} <= set(NAMES), NAMES


@pytest.mark.parametrize("name", NAMES)
def test_replayed_diagnosis(name, tmp_path):
    seeded = name.removeprefix(SEEDED_PREFIX) if name.startswith(SEEDED_PREFIX) else None
    must = SEEDED[seeded][1] if seeded else ()
    diagnosis = diagnose(load_run(_unpacked(name, tmp_path)))
    allowed = TRACES / name / "allowed.json"
    if allowed.exists():
        allowed_ids = json.loads(allowed.read_text())
        assert set(allowed_ids) <= set(diagnosis.ids()), ("allowed.json names findings the run no longer gets",
                                                          sorted(allowed_ids))
        diagnosis.findings[:] = [f for f in diagnosis.findings if f.id not in allowed_ids]
    passed, note = judge(seeded or name, must, diagnosis)
    assert passed, (note, [(f.id, f.severity, f.evidence.get("summary")) for f in diagnosis.findings])
