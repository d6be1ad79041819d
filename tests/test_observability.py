"""Diagnostics of a run (jaxllm/observe/): TensorBoard and wandb writers that hold what metrics.jsonl holds, a
profiler trace with step markers and named scopes, the start-up memory line, --print_memory, and the per-step host
time breakdown (data_wait_s, checkpoint_block_s, eval_s).

One short training run is shared by most tests: 6 tiny steps on a 2-stage pipeline with unrolled layers (so the
trace carries stage and layer scopes), saving every 2 steps, evaluating at step 3, tracing steps 2..3, with
TensorBoard (the default) and an offline wandb run.
"""

import gzip
import json
import math
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from train_runs import ROOT, metrics, run_command, train_command, train_env

from jaxllm.config.cli import build_config
from jaxllm.config.schema import ConfigError, MetricsConfig, validate
from jaxllm.observe.memory import format_step_memory, step_memory
from jaxllm.observe.tensorboard import read_scalars
from jaxllm.observe.wandb_writer import wandb_mode
from jaxllm.observe.writers import MetricsWriter

STEPS, PROFILED = 6, (2, 3)
RUN = ("--config.train.steps=6", "--config.train.eval_every=3", "--config.checkpoint.every=2",
       "--config.mesh.tensor=1", "--config.mesh.stage=2", "--config.pipeline.microbatches=2",
       "--config.model.scan_layers=false", f"--config.profile.start_step={PROFILED[0]}",
       f"--config.profile.steps={len(PROFILED)}", "--config.metrics.wandb=true")


@pytest.fixture(scope="module")
def run(shakespeare_store, tmp_path_factory):
    """(workdir, stdout) of the shared run; wandb offline with no key, its caches in the temporary directory."""
    workdir = tmp_path_factory.mktemp("observed")
    home = tmp_path_factory.mktemp("wandb-home")
    env = {k: v for k, v in train_env().items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), NETRC=str(home / "netrc"))
    proc = subprocess.run(train_command(shakespeare_store, workdir, *RUN), capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc.stdout


def _values_equal(got: float, want: float) -> bool:
    """TensorBoard keeps float32."""
    return (math.isnan(got) and math.isnan(want)) or got == float(np.float32(want))


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(run):
    workdir, _ = run
    records = metrics(workdir)
    want: dict[str, list] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                want.setdefault(key, []).append((record["step"], value))
    got = read_scalars(workdir / "tb")
    assert set(got) == set(want)
    assert {"loss", "eval_loss", "grad_norm", "step_time_s", "data_wait_s"} <= set(got)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert all(_values_equal(g, w) for (_, g), (_, w) in zip(got[tag], points)), (tag, got[tag], points)


def _wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a `.wandb` file. Hand-written because wandb (0.31) ships no Python reader: its
    files are LevelDB log files (32 KiB blocks; each chunk a CRC-32, length and type FULL/FIRST/MIDDLE/LAST) after a
    7-byte ":W&B" header."""
    data, block, offset, parts, records = path.read_bytes(), 32768, 7, [], []
    assert data[:4] == b":W&B"
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        chunk = data[offset + 7:offset + 7 + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad chunk at {offset}"
        parts = [chunk] if kind in (1, 2) else parts + [chunk]
        if kind in (1, 4):
            records.append(b"".join(parts))
        offset += 7 + length
    return records


def test_wandb_offline_run_logs_the_same_values(run):
    from wandb.proto.wandb_internal_pb2 import Record

    workdir, _ = run
    (run_file,) = workdir.glob("wandb/offline-run-*/run-*.wandb")
    rows = []
    for data in _wandb_records(run_file):
        record = Record.FromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    logged = {(row["step"], key): value for row in rows for key, value in row.items() if not key.startswith("_")}
    expected = {(r["step"], k): v for r in metrics(workdir) for k, v in r.items() if k != "step"}
    assert len(rows) == len(metrics(workdir))
    assert {key for key in logged if key[1] != "step"} == set(expected)
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-12), key


def _trace_events(workdir: Path) -> list[dict]:
    (trace,) = workdir.glob("profile/plugins/profile/*/perfetto_trace.json.gz")
    data = json.loads(gzip.decompress(trace.read_bytes()))
    return data["traceEvents"] if isinstance(data, dict) else data


def test_profile_trace_has_step_markers_and_named_scopes(run):
    workdir, stdout = run
    steps = [int(e["args"]["step_num"]) for e in _trace_events(workdir) if e.get("name") == "train"]
    assert steps == list(PROFILED)
    assert f"profile of steps 2..3 written to {workdir / 'profile'}" in stdout
    # The device ops' names (HLO metadata in the xplane) carry the pipeline stage and layer scopes.
    (xplane,) = workdir.glob("profile/plugins/profile/*/*.xplane.pb")
    names = set(re.findall(rb"jit\(step\)/[\w()/]*", xplane.read_bytes()))
    assert any(b"/stage/" in n and b"/layer_0/" in n for n in names), sorted(names)[:20]


def test_step_records_break_down_host_time(run):
    """Each step record takes the host time spent since the previous one: the save at step 2 and the next batch
    show in step 3's record, the evaluation at step 3 in step 4's, the initial evaluation in step 1's."""
    workdir, _ = run
    records = {r["step"]: r for r in metrics(workdir) if "loss" in r}
    assert sorted(records) == list(range(1, STEPS + 1))
    fields = ("data_wait_s", "checkpoint_block_s", "eval_s")
    assert all(isinstance(r[f], float) and r[f] >= 0.0 for r in records.values() for f in fields)
    nonzero = {f: [s for s, r in records.items() if r[f] > 0] for f in fields}
    assert nonzero["checkpoint_block_s"] == [3, 5]  # saves at 2 and 4 (the one at 6 follows the last record)
    assert nonzero["eval_s"] == [1, 4]
    assert nonzero["data_wait_s"] == [1, 3, 4, 5]  # steps 2 and 6 are written right after the step before
    for r in records.values():
        assert r["data_wait_s"] + r["checkpoint_block_s"] <= r["step_time_s"]


def _mib(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]


def test_startup_log_prints_compiled_step_memory(run):
    _, stdout = run
    size = r"([\d.]+ [KMG]iB)"
    match = re.search(rf"compiled step memory per device: arguments {size}, outputs {size}, temporaries {size}, "
                      rf"aliased {size}; in all {size} \(no limit reported by cpu\)", stdout)
    assert match, stdout[:3000]
    arguments, outputs, temporaries, aliased, total = map(_mib, match.groups())
    assert arguments > 0 and temporaries > 0 and 0 < aliased <= outputs  # the donated state is aliased
    assert total == pytest.approx(arguments + outputs - aliased + temporaries, abs=0.02)


class _Device:
    """A device with a memory limit (the CPU backend reports none; a GPU's figure is not available here)."""
    platform = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 2 * 1024**3}


def test_memory_line_numbers_come_from_the_compiled_step():
    x = np.ones((256, 1024), np.float32)  # 1 MiB
    compiled = jax.jit(lambda a: (a * 2, a.sum()), donate_argnums=0).lower(x).compile()
    stats = compiled.memory_analysis()
    memory = step_memory(compiled, jax.devices()[0])
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    assert memory["per_device_bytes"] == total and memory["limit_bytes"] is None
    line = format_step_memory(memory, jax.devices()[0])
    assert f"arguments {stats.argument_size_in_bytes / 2**20:.2f} MiB" in line
    assert line.endswith("(no limit reported by cpu)")
    on_gpu = step_memory(compiled, _Device())
    assert on_gpu["limit_bytes"] == 2**31
    assert f"(device limit 2.00 GiB, {100 * total / 2**31:.1f}% used)" in format_step_memory(on_gpu, _Device())
    budget = step_memory(compiled, jax.devices()[0], budget_bytes=2**30)  # train.memory_budget_gb=1 on a CPU
    assert (budget["limit_bytes"], budget["limit_of"]) == (2**30, "train.memory_budget_gb")


def test_print_memory_lists_the_largest_buffers_with_their_layout(shakespeare_store, tmp_path):
    proc = run_command(train_command(shakespeare_store, tmp_path, "--print_memory"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split() == ["buffer", "shape", "logical", "axes", "PartitionSpec", "bytes/device"]
    rows = [re.match(r"(\S+)\s+(\(.*?\))\s+(\(.*?\)|-)\s+(P\(.*?\))\s+([\d,]+)$", line) for line in lines[1:-1]]
    assert len(rows) == 20 and all(rows), lines
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}  # configs/pretrain.py
    sizes = []
    for row in rows:
        path, shape, logical, spec, size = row.groups()
        shape = eval(shape)  # noqa: S307  (a printed tuple of ints)
        spec = eval(spec, {"P": lambda *axes: axes})  # noqa: S307
        if logical != "-":
            assert len(logical.split(",")) == len(shape), path
        shards = [math.prod(mesh[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in spec]
        assert int(size.replace(",", "")) == math.prod(-(-d // s) for d, s in zip(shape, shards + [1] * 9)) * 4
        sizes.append(int(size.replace(",", "")))
    assert sizes == sorted(sizes, reverse=True)
    paths = [row.group(1) for row in rows]
    assert paths[0].startswith("params.") and any(".mu." in p for p in paths) and any(".nu." in p for p in paths)
    assert re.fullmatch(r"20 largest of \d+ buffers; all of them: [\d,]+ bytes per device \(.*\)", lines[-1])


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    cd = build_config(str(ROOT / "configs" / "pretrain.py"), [("metrics.wandb", "true")])
    validate(cd, 8)  # installed: fine
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like to imports
    with pytest.raises(ConfigError, match=r"^metrics\.wandb: needs the wandb package"):
        validate(cd, 8)


@pytest.mark.parametrize("key, value", [("profile.start_step", "-1"), ("profile.steps", "0")])
def test_bad_profile_settings_are_config_errors(key, value):
    cd = build_config(str(ROOT / "configs" / "pretrain.py"), [(key, value)])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be"):
        validate(cd, 8)


def test_wandb_is_offline_unless_asked_online_with_a_key(tmp_path):
    no_netrc = {"NETRC": str(tmp_path / "none")}
    assert wandb_mode(no_netrc) == "offline"
    assert wandb_mode({**no_netrc, "WANDB_MODE": "online"}) == "offline"  # no key: never a login prompt
    assert wandb_mode({**no_netrc, "WANDB_MODE": "online", "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({**no_netrc, "WANDB_MODE": "disabled"}) == "disabled"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k\n")
    assert wandb_mode({"NETRC": str(tmp_path / "netrc"), "WANDB_MODE": "online"}) == "online"


def test_tensorboard_is_on_by_default_and_can_be_turned_off(tmp_path):
    on = MetricsWriter(tmp_path / "on", MetricsConfig())
    off = MetricsWriter(tmp_path / "off", MetricsConfig(tensorboard=False))
    for writer in (on, off):
        writer.write({"step": 1, "loss": 2.5, "note": "text"})
        writer.close()
    assert read_scalars(tmp_path / "on" / "tb") == {"loss": [(1, 2.5)]}
    assert not (tmp_path / "off" / "tb").exists() and metrics(tmp_path / "off")[0]["loss"] == 2.5
    cd = build_config(str(ROOT / "configs" / "pretrain.py"), [])
    assert validate(cd, 8).metrics == MetricsConfig()
