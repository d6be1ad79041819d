"""The GPU measurement scripts' own logic, on CPU without compiling anything: the profile breakdown's classes,
overlap and step split (scripts/profile_breakdown.py), the grid file's checks (scripts/bench_grid.py) and the
decode bound's cache bytes (scripts/bench_decode.py). Their figures need a GPU (docs/benchmarks.md)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode  # noqa: E402
import bench_families  # noqa: E402
import bench_grid  # noqa: E402
import profile_breakdown  # noqa: E402
from jaxllm.config.cli import UsageError  # noqa: E402
from jaxllm.config.schema import ModelConfig, check_across  # noqa: E402


def _kernel(name, ts, dur, tid=1):
    return {"ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur, "name": name}


def _trace(steps: int) -> dict:
    """`steps` steps of: a GEMM, cuDNN attention overlapping it on another stream, a norm, the last GEMM, two
    update kernels, then a 5 us host gap before the next step. Plus host events that must be ignored."""
    events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}}]
    for i in range(steps):
        t = 100.0 * i
        events += [_kernel("nvjet_sm90_tst_128x160", t, 30), _kernel("cudnn_generated_sdpa_fprop", t + 20, 20, tid=2),
                   _kernel("loop_multiply_fusion", t + 40, 10), _kernel("gemm_fusion_dot_7", t + 50, 20),
                   _kernel("loop_add_fusion", t + 70, 15), _kernel("MemcpyD2D", t + 85, 10),
                   {"ph": "X", "pid": 9, "tid": 1, "ts": t, "dur": 99, "name": "PjitFunction(jit(step))"}]
    return {"traceEvents": events}


def test_profile_breakdown_classes_overlap_and_gaps():
    ms = profile_breakdown.breakdown(_trace(3), steps=3)
    # Per step: busy 95 us of a 95 us span (the attention overlaps the first GEMM by 10 us); kernel time 105 us,
    # scaled to the busy time: matmul 50, attention 20, elementwise 10, optimizer 15, copies 10.
    scale = 95 / 105
    expected = {"matmul": 50 * scale, "attention": 20 * scale, "elementwise": 10 * scale, "optimizer": 15 * scale,
                "collectives": 0.0, "copies": 10 * scale, "host gaps": 0.0}
    assert ms == pytest.approx({k: v / 1e3 for k, v in expected.items()})
    assert sum(ms.values()) == pytest.approx(0.095)


def test_profile_breakdown_refuses_a_trace_that_does_not_split_into_steps(tmp_path):
    with pytest.raises(ValueError, match="do not split into 4 equal steps"):
        profile_breakdown.breakdown(_trace(3), steps=4)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": []}, f)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_breakdown.py"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {path}: no GPU kernels in this trace"


def test_grid_file_is_checked(tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"name": "a", "overrides": []}, {"name": "b", "overrides": ["--config.x=1"]}]))
    assert [v["name"] for v in bench_grid.read_grid(str(grid), "b")] == ["b"]
    with pytest.raises(UsageError, match=r"--only: \['c'\] are not variants"):
        bench_grid.read_grid(str(grid), "a,c")
    grid.write_text(json.dumps({"name": "a"}))
    with pytest.raises(UsageError, match="must hold a JSON list"):
        bench_grid.read_grid(str(grid), None)
    shipped = bench_grid.read_grid(str(ROOT / "configs" / "gpu" / "llama_1b_h200_grid.json"), None)
    assert shipped[0] == {"name": "preset", "overrides": []} and len({v["name"] for v in shipped}) == len(shipped)


def test_decode_bound_counts_every_layer_slot_and_head():
    cfg = ModelConfig(num_layers=16, num_kv_heads=8, head_dim=64)
    assert bench_decode.kv_bytes_per_row(cfg, 1024, 2) == 2 * 16 * 1024 * 8 * 64 * 2  # 33.5 MB: llama_1b's


def test_family_variants_keep_the_shape_and_pass_the_checks():
    """bench_families compares like with like: every family at the config's width and depth, each a valid
    config (its windows and layer pattern included), and the window comparison differs only in the window."""
    args, cfg = bench_families.bench_arguments(["--config", str(ROOT / "configs" / "pretrain.py"), "--steps", "3"],
                                               bench_families.__doc__)
    assert args.steps == 3
    assert "mixtral" not in bench_families.DENSE_FAMILIES and "mistral" in bench_families.DENSE_FAMILIES
    for name in bench_families.DENSE_FAMILIES:
        variant = bench_families.family_variant(cfg, name, 64)
        variant.model.check()
        check_across(variant)
        shape = ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")
        assert [getattr(variant.model, k) for k in shape] == [getattr(cfg.model, k) for k in shape]
        assert variant.model.family == name
    full, windowed = bench_families.window_variants(cfg, 4096, 512)
    assert (full.model.sliding_window, windowed.model.sliding_window) == (0, 512)
    assert full.train == windowed.train and full.train.seq_len == 4096
    check_across(windowed)


def test_a_bench_scripts_bad_config_is_one_line_exit_2(capsys):
    """Every bench script reads its command line through bench_step.bench_arguments: a bad override is one line
    naming the key, exit 2, no traceback."""
    with pytest.raises(SystemExit) as stopped:
        bench_families.bench_arguments(["--config", str(ROOT / "configs" / "pretrain.py"), "--config.mesh.tensor=3"],
                                       bench_families.__doc__)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: mesh"), err
