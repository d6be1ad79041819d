"""The Makefile's user paths, without running them (`make -n`, and the checks that stop a target early): training
installs the package alone and the test extra comes with `make test`; a post-training target started before the
run it builds on refuses in one line before it installs or builds anything."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STARTS_FROM = {"sft": "train", "reward": "train", "dpo": "sft", "grpo": "sft", "ppo": "sft", "long-context": "train"}


def _make(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args, f"VENV={directory / 'venv'}"], cwd=directory,
                          capture_output=True, text=True, timeout=60)


SOURCES = ("Makefile", "pyproject.toml", "data/shakespeare.jsonl.gz", "scripts/make_sft_task.py",
           "scripts/make_preference_set.py")


@pytest.fixture
def bare(tmp_path):
    """A checkout's sources the targets depend on, and no venv, data or runs."""
    for name in SOURCES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_training_installs_the_package_alone_and_make_test_adds_the_test_extra(bare):
    train = _make(bare, "-n", "train")
    assert train.returncode == 0, train.stderr
    assert "pip install -q -e ." in train.stdout and "[test]" not in train.stdout, train.stdout
    test = _make(bare, "-n", "test")
    assert "pip install -q -e '.[test]'" in test.stdout and "pytest" in test.stdout, test.stdout


@pytest.mark.parametrize("target", sorted(STARTS_FROM))
def test_post_training_without_its_starting_run_refuses_before_installing_anything(bare, target):
    proc = _make(bare, target, "PYTHON=false")  # had anything been installed, it would have failed here
    before = STARTS_FROM[target]
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        f"error: make {target} starts from the model of make {before} "
        f"(runs/{'pretrain' if before == 'train' else 'sft_lora'}): run make {before} first"), proc.stderr
    assert sorted(str(p.relative_to(bare)) for p in bare.rglob("*") if p.is_file()) == sorted(SOURCES)
