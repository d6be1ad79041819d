"""The checked-in reference of tests/golden/reference/: intact (every file as its MANIFEST.json records, the
whole well under 1 MB; smoke), and still what transformers, PEFT and TRL produce (a fresh generation into a
temporary directory, compared file by file; needs torch, so not in the Python 3.12 smoke run)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from golden_reference import REFERENCE

GENERATOR = REFERENCE.parent / "make_reference_outputs.py"
MAX_BYTES = 600_000
# Rerunning the generator with the same libraries and one torch thread on the same CPU reproduces the files
# bit for bit. Another CPU picks other BLAS kernels (another reduction order): on an AVX-512 FP16/BF16 Xeon the
# tiny models' logits (|x| <= 2.2) moved by up to 2.2e-6, elementwise outputs not at all. Reduction-order error
# scales with the values summed, so the absolute tolerance is a share of each array's largest magnitude: 5e-6 of
# it (1.1e-5 on those logits, ten times below their parity tolerance of 1e-4, tests/test_hf.py), and small-valued
# arrays such as GRPO losses of 2e-3 stay held to ~1e-8.
FRESH_RTOL, FRESH_ATOL_SHARE = 1e-6, 5e-6
VERSION_KEYS = {"transformers_version", "peft_version"}


def _generator():
    spec = importlib.util.spec_from_file_location("make_reference_outputs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.smoke
def test_reference_matches_its_manifest():
    """Every file is the one the generator wrote (no test rewrote or dropped one, none was added by hand)."""
    recorded = json.loads((REFERENCE / "MANIFEST.json").read_text())
    assert _generator().manifest(REFERENCE) == recorded
    assert sum(f["bytes"] for f in recorded.values()) < MAX_BYTES


def _compare_arrays(ours: dict, theirs: dict, where: str) -> None:
    assert sorted(ours) == sorted(theirs), where
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, f"{where}: {key}"
        if np.issubdtype(value.dtype, np.floating):
            atol = FRESH_ATOL_SHARE * float(np.abs(value).max(initial=0.0))
            np.testing.assert_allclose(ours[key], value, rtol=FRESH_RTOL, atol=atol, err_msg=f"{where}: {key}")
        else:
            np.testing.assert_array_equal(ours[key], value, err_msg=f"{where}: {key}")


def _load(path: Path):
    from safetensors.numpy import load_file

    if path.suffix == ".npz":
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    if path.suffix == ".safetensors":
        return load_file(path)
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if k not in VERSION_KEYS} if isinstance(data, dict) else data


def test_reference_is_what_the_libraries_produce_now(tmp_path):
    """Regenerate with the installed torch / transformers / PEFT / TRL and compare with the checked-in files. On
    a difference after an upgrade: rerun tests/golden/make_reference_outputs.py and commit its output."""
    for name in ("torch", "transformers", "peft", "trl"):
        pytest.importorskip(name)
    _generator().write_reference(tmp_path / "reference")
    fresh = sorted(p.relative_to(tmp_path / "reference") for p in (tmp_path / "reference").rglob("*") if p.is_file())
    assert fresh == sorted(p.relative_to(REFERENCE) for p in REFERENCE.rglob("*") if p.is_file())
    for rel in fresh:
        if rel.name == "MANIFEST.json":
            continue
        ours, theirs = _load(tmp_path / "reference" / rel), _load(REFERENCE / rel)
        if rel.suffix in (".npz", ".safetensors"):
            _compare_arrays(ours, theirs, str(rel))
        else:
            assert ours == theirs, rel
