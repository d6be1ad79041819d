"""A resume whose config does not match the run's checkpoints (their checksums verify: they are intact) is refused
in one line naming the config keys that differ, exit 2, with nothing moved or written: healthy checkpoints are
never quarantined as corrupt because the config changed. One case runs `scripts/train.py`; the others call the
library in this process (the refusal comes before anything compiles)."""

import hashlib
import io
import shutil
from pathlib import Path

import pytest

from train_runs import ROOT, TINY, rl_command, run_sft, sft_command

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import ConfigError, validate
from jaxllm.train.loop import train


def _snapshot(workdir: Path) -> dict[str, str]:
    """Every file under `workdir` (relative path -> SHA-256 of its bytes)."""
    return {p.relative_to(workdir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(workdir.rglob("*")) if p.is_file()}


def _copy(run: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    workdir = tmp_path / "run"
    shutil.copytree(run, workdir)
    return workdir, _snapshot(workdir)


def _refusal(command: list[str]) -> str:
    """The ConfigError message of training `command` (a scripts/train.py command line) in this process."""
    args, overrides = split_overrides(command[2:])
    config, workdir = args[args.index("--config") + 1], args[args.index("--workdir") + 1]
    cfg = validate(build_config(config, overrides, workdir), 8)
    with pytest.raises(ConfigError) as refused:
        train(cfg, stream=io.StringIO())
    return str(refused.value)


def _pretrain_command(store, workdir, *args):
    return ["python", "scripts/train.py", "--config", str(ROOT / "configs" / "pretrain.py"), "--workdir",
            str(workdir), f"--config.data.path={store}", *TINY, *args]


def test_a_lora_rank_change_is_refused_in_one_line_and_nothing_moves(bases, sft_task, lora_run, tmp_path):
    workdir, before = _copy(lora_run, tmp_path)
    proc = run_sft(bases[0], sft_task, workdir, "--config.lora.rank=8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: checkpoint:"), lines
    assert "lora.rank: 8 in the config, 16 in the checkpoints" in lines[0], lines
    assert _snapshot(workdir) == before


def test_other_lora_targets_are_refused(bases, sft_task, lora_run, tmp_path):
    workdir, before = _copy(lora_run, tmp_path)
    message = _refusal(sft_command(bases[0], sft_task, workdir, "--config.lora.targets=q_proj,k_proj,v_proj"))
    assert "lora.targets: 'q_proj,k_proj,v_proj' in the config, 'q_proj,v_proj' in the checkpoints" in message
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("override, named", [
    ("--config.model.num_layers=3", "model.num_layers: 3 in the config, 2 in the checkpoints"),
    ("--config.model.vocab_size=1024", "model.vocab_size: 1024 in the config, 512 in the checkpoints"),
])
def test_another_model_shape_or_vocabulary_is_refused(shakespeare_store, bases, tmp_path, override, named):
    workdir, before = _copy(bases[0], tmp_path)
    assert named in _refusal(_pretrain_command(shakespeare_store, workdir, override))
    assert _snapshot(workdir) == before


def test_another_objective_is_refused_whether_or_not_the_arrays_differ(bases, sft_task, lora_run, rl_prompts,
                                                                        tmp_path):
    workdir, before = _copy(bases[0], tmp_path)  # pretraining checkpoints, resumed as LoRA SFT: other arrays
    message = _refusal(sft_command(bases[0], sft_task, workdir))
    assert "train.objective: 'sft' in the config, 'pretrain' in the checkpoints" in message
    assert _snapshot(workdir) == before
    workdir, before = _copy(lora_run, tmp_path / "grpo")  # SFT adapters, resumed as GRPO's: the same arrays
    message = _refusal(rl_command("grpo", lora_run, rl_prompts, workdir, "--config.train.seq_len=128"))
    assert "train.objective=sft, not grpo" in message
    assert _snapshot(workdir) == before
