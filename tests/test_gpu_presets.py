"""The GPU presets (configs/gpu/): their XLA flags exist in the installed XLA and each has its reason in the file,
they validate for the meshes they name and plan with --dry_run on CPU, and the flags reach XLA before JAX starts."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.config.cli import build_config
from jaxllm.config.schema import ConfigError, validate
from jaxllm.runtime.xla_flags import check_xla_flags

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs" / "gpu").glob("*.py"))
FLAG_LINE = re.compile(r'^\s*"(xla_\w+)":')


def _env(**extra) -> dict:
    """This process's environment for a child, without the 8 fake devices conftest adds."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return dict(env, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)


def test_there_are_gpu_presets():
    assert {p.stem for p in PRESETS} >= {"llama_1b_h200", "llama_8b_h100x8"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_validates_for_its_mesh_and_states_a_reason_for_every_flag(preset):
    cd = build_config(str(preset), [])
    cfg = validate(cd, cd.mesh.data * cd.mesh.fsdp * cd.mesh.tensor * cd.mesh.stage, num_processes=None)
    assert cfg.precision.compute == "bfloat16" and cfg.model.preset.startswith("llama_")  # flags only if they help
    lines = preset.read_text().splitlines()
    in_file = {m.group(1): i for i, line in enumerate(lines) if (m := FLAG_LINE.match(line))}
    assert set(in_file) == set(cfg.xla_flags)
    for name, i in in_file.items():  # a one-line comment right above each flag, saying whether it is measured
        reason = lines[i - 1].strip()
        assert reason.startswith("# ") and not lines[i - 2].strip().startswith("#"), name
        assert "measured" in reason, f"{name}: say whether jaxllm has measured it"


def test_installed_xla_accepts_every_preset_flag_and_rejects_a_misspelled_one():
    flags = {}
    for preset in PRESETS:
        flags.update(build_config(str(preset), []).xla_flags)
    check_xla_flags(flags)  # one child process: XLA parses every name and value or ends it
    with pytest.raises(ConfigError, match="not a flag") as unknown:
        check_xla_flags({**flags, "xla_gpu_enable_latency_hiding_schedular": True})
    assert unknown.value.key == "xla_flags.xla_gpu_enable_latency_hiding_schedular"
    with pytest.raises(ConfigError, match="cannot read") as bad_value:
        check_xla_flags({**flags, "xla_gpu_enable_command_buffer": "FUSIONS"})
    assert bad_value.value.key == "xla_flags.xla_gpu_enable_command_buffer"


def test_config_flags_reach_xla_after_import_jax_and_the_environment_wins(tmp_path):
    """Applied after `import jax` but before the first device use, the flags take effect (XLA dumps where the
    config says); a flag the environment sets too keeps the environment's value; once the backend runs, applying
    more is an error, not a silent no-op."""
    config_dir, env_dir = tmp_path / "config", tmp_path / "env"
    script = (
        "import jax\n"
        "from jaxllm.runtime.xla_flags import apply_xla_flags\n"
        f"apply_xla_flags({{'xla_dump_to': {str(config_dir)!r}, 'xla_cpu_enable_fast_math': False}})\n"
        "jax.jit(lambda x: x + 1)(1)\n"
        "try:\n"
        "    apply_xla_flags({'xla_dump_to': 'elsewhere'})\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    for env_flags, dumped, empty in (("", config_dir, env_dir), (f"--xla_dump_to={env_dir}", env_dir, config_dir)):
        proc = subprocess.run([sys.executable, "-c", script], env=_env(XLA_FLAGS=env_flags), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("refused: xla_flags must be applied before"), proc.stdout
        assert any(dumped.glob("*.debug_options")) and not empty.exists(), env_flags
        shutil.rmtree(dumped)


def test_flag_values_are_checked_by_validate():
    cd = build_config(str(PRESETS[0]), [])
    with cd.unlocked():
        cd.xla_flags["gpu_no_prefix"] = True
    with pytest.raises(ConfigError) as exc:
        validate(cd, 1, num_processes=None)
    assert exc.value.key == "xla_flags.gpu_no_prefix"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_train_dry_run_applies_the_flags_and_plans_on_cpu(preset):
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config", str(preset), "--dry_run"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = build_config(str(preset), []).xla_flags
    applied = [line for line in proc.stdout.splitlines() if line.startswith("XLA_FLAGS=")]
    assert len(applied) == (1 if flags else 0), proc.stdout
    assert all(f"--{name}=" in applied[0] for name in flags), applied
    assert "H200 141 GB" in proc.stdout and "fits" in proc.stdout


def test_train_names_the_flag_xla_rejects_in_one_line():
    preset = next(p for p in PRESETS if "xla_gpu_enable_command_buffer" in build_config(str(p), []).xla_flags)
    proc = subprocess.run([sys.executable, "scripts/train.py", "--config", str(preset), "--dry_run",
                           "--config.xla_flags.xla_gpu_enable_command_buffer=FUSIONS"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: xla_flags.xla_gpu_enable_command_buffer: the installed XLA cannot read the value 'FUSIONS' "
        f"(jaxlib {importlib.metadata.version('jaxlib')})"], proc.stderr
