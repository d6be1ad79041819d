"""The checked-in outputs of transformers, PEFT and TRL in tests/golden/reference/ (written only by
tests/golden/make_reference_outputs.py), read by the torch-free parity tests tests/test_golden_*.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parent / "golden" / "reference"
LLAMA = REFERENCE / "llama"  # untied, GQA, Llama-3 RoPE scaling
LLAMA_TIED = REFERENCE / "llama_tied"  # tied, multi-head
LORA = REFERENCE / "lora"  # a PEFT adapter on LLAMA


def arrays(directory: Path) -> dict[str, np.ndarray]:
    """Every array of `directory`/reference.npz."""
    with np.load(directory / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def trl_cases() -> list[dict]:
    """TRL reference cases: name, loss, kwargs and the key prefix of their inputs (see trl/reference.npz)."""
    return json.loads((REFERENCE / "trl" / "cases.json").read_text())


def rows(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """Ragged rows out of a zero-padded [N, L] array and their lengths."""
    return [t[:n].tolist() for t, n in zip(tokens, lengths, strict=True)]
