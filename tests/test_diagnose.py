"""The diagnosis (scripts/diagnose.py, jaxllm/diagnose): each rule on a recorded healthy run of the default job
(tests/data/diagnose/healthy, 60 steps of configs/pretrain.py) and on that run with one pathology written into
its records at realistic magnitudes; the command's files and errors; the seeded-pathology hooks; and one real
seeded run (LR x30) end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxllm.diagnose.diagnosis import diagnose
from jaxllm.diagnose.findings import THRESHOLDS, WARNING, CRITICAL
from jaxllm.diagnose.run_data import load_run
from jaxllm.observe.sizes import format_bytes

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "diagnose" / "healthy"
LAYERS = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _write(run_dir: Path, records: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _with_new_fields(records: list[dict], every: int = 5) -> list[dict]:
    """The recorded run with the fields newer versions log, at healthy magnitudes: an update/param ratio near
    the default job's measured 2e-2 (docs/diagnostics.md, Diagnosis report), a loader that keeps up, per-layer statistics
    every `every` steps that agree across layers (norms within 2x, small gate saturation, attention logits
    ~5-10)."""
    rng = np.random.default_rng(0)
    out = []
    for record in records:
        record = dict(record)
        if "loss" in record:
            step, time_s = record["step"], record["step_time_s"]
            record.update(update_ratio=float(2e-2 * rng.uniform(0.7, 1.3)), data_wait_s=0.01 * time_s,
                          checkpoint_block_s=0.0, eval_s=0.0, grad_norm_clipped=min(record["grad_norm"], 1.0),
                          param_norm=60.0 + 0.05 * step, update_norm=0.25)
            if step % every == 0:
                for i in range(LAYERS):
                    jitter = rng.uniform(0.8, 1.25)
                    record.update({f"diag/grad_norm/layer_{i}": 0.3 * jitter, f"diag/param_norm/layer_{i}": 28.0 * jitter,
                                   f"diag/update_norm/layer_{i}": 0.1 * jitter,
                                   f"diag/update_ratio/layer_{i}": 2e-2 * jitter,
                                   f"diag/act_rms/layer_{i}": 1.0 + 0.3 * i, f"diag/act_max/layer_{i}": 12.0 + i,
                                   f"diag/gate_saturation/layer_{i}": 0.02 * jitter,
                                   f"diag/attn_logit_max/layer_{i}": 5.0 + 0.05 * step})
                record.update({"diag/logits_max": 12.0, "diag/logits_lse_mean": 6.0, "diag/adam_v_rms": 1e-6})
        out.append(record)
    return out


def _copy(tmp_path: Path, name: str = "run") -> Path:
    run_dir = tmp_path / name
    shutil.copytree(RECORDED, run_dir)
    return run_dir


def _alarms(run_dir: Path) -> list[str]:
    return [f.id for f in diagnose(load_run(run_dir)).findings if f.severity in (WARNING, CRITICAL)]


def test_the_recorded_healthy_run_has_no_findings():
    diagnosis = diagnose(load_run(RECORDED))
    assert diagnosis.findings == []
    # the fields this old recording lacks are reported as checks that could not run, with the reason
    assert "data_wait_s" in diagnosis.not_evaluated["input_bound"]
    assert "diag/" in diagnosis.not_evaluated["dead_layer"]
    assert "memory" in diagnosis.not_evaluated["memory_headroom"]
    assert "peak" in diagnosis.not_evaluated["low_mfu"]


def test_healthy_with_every_new_field_has_no_findings(tmp_path):
    run_dir = _copy(tmp_path)
    _write(run_dir, _with_new_fields(_records(run_dir)))
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis.findings == []
    for rule in ("lr_too_low", "dead_layer", "exploding_layer", "vanishing_gradients", "saturated_gates",
                 "attention_logit_growth", "input_bound", "checkpoint_blocking"):
        assert rule not in diagnosis.not_evaluated, diagnosis.not_evaluated.get(rule)


def _scale_steps(records, field, fn):
    for r in records:
        if "loss" in r:
            r[field] = fn(r["step"], r[field] if field in r else None)


def _set_diag(records, stat, layer, fn):
    for r in records:
        key = f"diag/{stat}/layer_{layer}"
        if key in r:
            r[key] = fn(r["step"], r[key])


def _climbing_loss(records):  # the loss falls, then climbs 30% from step 25 on
    _scale_steps(records, "loss", lambda s, v: v if s < 25 else v * (1 + 0.3 * min(1.0, (s - 25) / 10)))


def _lr_too_high(records, run_dir):
    _climbing_loss(records)
    _scale_steps(records, "update_ratio", lambda s, v: 0.12)  # LR x30 measured 0.06-0.16


def _lr_too_high_without_ratio(records, run_dir):  # old fields only: the climb comes as the LR rises (warmup 30)
    _scale_steps(records, "loss", lambda s, v: v if s < 12 else v * (1 + 0.25 * min(1.0, (s - 12) / 8)))
    for r in records:
        r.pop("update_ratio", None)


def _divergence(records, run_dir):
    _scale_steps(records, "loss", lambda s, v: v if s < 40 else float("nan"))


def _oscillation(records, run_dir):
    _scale_steps(records, "loss", lambda s, v: v * (1.12 if s % 2 else 0.9))


def _warmup_too_short(records, run_dir):
    config = json.loads((run_dir / "config.json").read_text())
    config["optim"]["warmup_steps"] = 5
    (run_dir / "config.json").write_text(json.dumps(config))
    _scale_steps(records, "loss", lambda s, v: v * 1.3 if 5 <= s <= 9 else v)


def _gradient_explosion(records, run_dir):
    _scale_steps(records, "grad_norm", lambda s, v: v if s < 30 else v * 1.25 ** (s - 30))


def _clipping(records, run_dir):
    _scale_steps(records, "grad_norm", lambda s, v: 3.0 * v)


def _slow(records, run_dir):
    _scale_steps(records, "loss", lambda s, v: 6.28 - 0.001 * s + 0.01 * (s % 3))


def _lr_too_low(records, run_dir):
    _slow(records, run_dir)
    _scale_steps(records, "update_ratio", lambda s, v: 4e-5)  # as measured at LR / 1000


def _saturated_softmax(records, run_dir):  # model.init_std x50: the first loss ~8x ln(512)
    _scale_steps(records, "loss", lambda s, v: v * 8.0)


def _incidents(records, run_dir):
    (run_dir / "incidents.jsonl").write_text(json.dumps(
        {"step": 33, "loss": 41.0, "grad_norm": 900.0, "kind": "loss_spike", "action": "rollback",
         "restored_step": 30, "skipped_steps": [31, 32, 33], "lr_scale": 0.5, "rollbacks": 1}) + "\n")


def _dead_layer(records, run_dir):
    for stat in ("grad_norm", "param_norm", "update_norm", "update_ratio"):
        _set_diag(records, stat, 2, lambda s, v: 0.0)


def _exploding_layer(records, run_dir):
    _set_diag(records, "grad_norm", 1, lambda s, v: v * 40)
    _set_diag(records, "update_ratio", 1, lambda s, v: v * 40)


def _vanishing(records, run_dir):
    for layer, factor in ((0, 1e-3), (1, 5e-3)):
        _set_diag(records, "grad_norm", layer, lambda s, v, f=factor: v * f)


def _saturated_gates(records, run_dir):
    _set_diag(records, "gate_saturation", 3, lambda s, v: 0.6)


def _attention_logits(records, run_dir):
    _set_diag(records, "attn_logit_max", 1, lambda s, v: 5.0 * 1.06 ** s)


def _input_bound(records, run_dir):  # a loader that sleeps 0.5 s per ~1 s step
    _scale_steps(records, "step_time_s", lambda s, v: v + 0.5)
    _scale_steps(records, "data_wait_s", lambda s, v: 0.5)


def _low_mfu(records, run_dir):
    config = json.loads((run_dir / "config.json").read_text())
    config["peak_flops"] = 989e12
    (run_dir / "config.json").write_text(json.dumps(config))
    _scale_steps(records, "mfu", lambda s, v: 0.08)


def _checkpoint_blocking(records, run_dir):
    _scale_steps(records, "checkpoint_block_s", lambda s, v: 2.0 if s % 10 == 0 else 0.0)


def _memory(records, run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["memory"] = {"per_device_bytes": 76 * 2**30, "limit_bytes": 80 * 2**30}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _overflow(records, run_dir):
    _scale_steps(records, "overflow", lambda s, v: 1.0 if s % 4 == 0 else 0.0)
    _scale_steps(records, "loss_scale", lambda s, v: 2.0 ** 15)


PATHOLOGIES = {  # finding id -> (how the records change, the layers it must name)
    "lr_too_high": (_lr_too_high, None),
    "loss_divergence": (_divergence, None),
    "loss_oscillation": (_oscillation, None),
    "warmup_too_short": (_warmup_too_short, None),
    "gradient_explosion": (_gradient_explosion, None),
    "clipping_dominant": (_clipping, None),
    "slow_convergence": (_slow, None),
    "lr_too_low": (_lr_too_low, None),
    "output_logits_saturated": (_saturated_softmax, None),
    "anomaly_incidents": (_incidents, None),
    "dead_layer": (_dead_layer, [2]),
    "exploding_layer": (_exploding_layer, [1]),
    "vanishing_gradients": (_vanishing, [0, 1]),
    "saturated_gates": (_saturated_gates, [3]),
    "attention_logit_growth": (_attention_logits, [1]),
    "input_bound": (_input_bound, None),
    "low_mfu": (_low_mfu, None),
    "checkpoint_blocking": (_checkpoint_blocking, None),
    "memory_headroom": (_memory, None),
    "loss_scale_overflow": (_overflow, None),
}


@pytest.mark.parametrize("finding_id", sorted(PATHOLOGIES))
def test_each_rule_names_its_pathology(tmp_path, finding_id):
    seed, layers = PATHOLOGIES[finding_id]
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    seed(records, run_dir)
    _write(run_dir, records)
    findings = {f.id: f for f in diagnose(load_run(run_dir)).findings}
    assert finding_id in findings, sorted(findings)
    found = findings[finding_id]
    assert found.evidence["summary"] and found.action
    if layers is not None:
        assert found.evidence["layers"] == layers


@pytest.mark.parametrize("above_clip, share, fires", [(1.05, 1.0, True), (0.95, 1.0, False),
                                                      (1.5, 0.55, True), (1.5, 0.45, False)])
def test_clipping_is_named_from_just_above_the_clip_norm_and_the_share(tmp_path, above_clip, share, fires):
    """Both sides of clipping_dominant's two limits: gradient norms just above optim.clip_norm (1.0) on every step
    after warmup fire and just below do not; norms well above it on just more than clip_share (half) of those
    steps fire and on just fewer do not."""
    run_dir = _copy(tmp_path)
    records = _records(run_dir)
    after = [r for r in records if "loss" in r and r["step"] > 30]  # the recorded run's warmup_steps
    clipped = set(r["step"] for r in after[:round(share * len(after))])
    _scale_steps(records, "grad_norm", lambda s, v: above_clip if s in clipped else (0.5 if s > 30 else v))
    _write(run_dir, records)
    assert ("clipping_dominant" in _alarms(run_dir)) == fires


def test_diag_records_on_their_own_lines_are_read_the_same(tmp_path):
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    _dead_layer(records, run_dir)
    split = []
    for r in records:
        diag = {k: r.pop(k) for k in list(r) if k.startswith("diag/")}
        split += [r] + ([{"step": r["step"], **diag}] if diag else [])
    _write(run_dir, split)
    findings = {f.id: f for f in diagnose(load_run(run_dir)).findings}
    assert list(findings) == ["dead_layer"] and findings["dead_layer"].evidence["layers"] == [2]


def test_lr_too_high_without_update_ratio_reads_the_lr_schedule(tmp_path):
    run_dir = _copy(tmp_path)
    records = _records(run_dir)
    _lr_too_high_without_ratio(records, run_dir)
    _write(run_dir, records)
    findings = {f.id: f for f in diagnose(load_run(run_dir)).findings}
    assert "lr_too_high" in findings
    assert findings["lr_too_high"].evidence["values"]["lr_at_top"] > 1.5 * findings["lr_too_high"].evidence["values"]["lr_at_low"]


def test_a_climbing_loss_with_healthy_updates_is_not_blamed_on_the_lr(tmp_path):
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    _climbing_loss(records)
    _write(run_dir, records)
    ids = {f.id for f in diagnose(load_run(run_dir)).findings}
    assert "loss_oscillation" in ids and "lr_too_high" not in ids


def test_a_run_with_only_step_and_loss_is_diagnosed(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    _write(run_dir, [{"step": s, "loss": 6.0 - 0.03 * s} for s in range(1, 41)])
    diagnosis = diagnose(load_run(run_dir))
    assert diagnosis.findings == []
    assert "grad_norm" in diagnosis.not_evaluated["gradient_explosion"]
    assert "clip_norm" in diagnosis.not_evaluated["clipping_dominant"]


def test_a_non_finite_step_the_run_recovered_from_is_no_divergence(tmp_path):
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    _scale_steps(records, "loss", lambda s, v: float("nan") if s == 40 else v)
    _incidents(records, run_dir)
    _write(run_dir, records)
    ids = {f.id for f in diagnose(load_run(run_dir)).findings}
    assert "anomaly_incidents" in ids and "loss_divergence" not in ids


def test_a_run_that_went_non_finite_at_once_is_diagnosed(tmp_path):
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    for r in records:
        if "loss" in r:
            r.update(loss=float("nan"), grad_norm=float("nan"), update_ratio=float("nan"))
    _write(run_dir, records)
    ids = {f.id for f in diagnose(load_run(run_dir)).findings}
    assert {"loss_divergence", "gradient_explosion"} <= ids and "lr_too_low" not in ids


def test_a_partial_last_line_is_dropped_and_a_bad_line_named(tmp_path):
    run_dir = _copy(tmp_path)
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 61, "lo')
    assert load_run(run_dir).step[-1] == 60
    lines = text.splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:5] + ["{oops"] + lines[5:]) + "\n")
    proc = _diagnose_command(run_dir)
    assert proc.returncode == 2 and "metrics.jsonl:6: not a JSON object per line" in proc.stderr


def _diagnose_command(run_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "diagnose.py"), str(run_dir)], capture_output=True,
                          text=True, timeout=300)


def test_the_command_writes_the_report(tmp_path):
    run_dir = _copy(tmp_path)
    records = _with_new_fields(_records(run_dir))
    _lr_too_high(records, run_dir)
    _incidents(records, run_dir)
    _write(run_dir, records)
    proc = _diagnose_command(run_dir)
    assert proc.returncode == 0, proc.stderr
    report = run_dir / "report"
    findings = json.loads((report / "findings.json").read_text())
    assert {"lr_too_high", "anomaly_incidents"} <= {f["id"] for f in findings}
    assert all(set(f) == {"id", "severity", "evidence", "action"} for f in findings)
    for name in ("loss", "lr", "grad_norm", "update_ratio", "activation_rms", "throughput", "step_time"):
        data = (report / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    markdown, html = (report / "report.md").read_text(), (report / "report.html").read_text()
    assert markdown.index("lr_too_high") < markdown.index("## Plots")  # findings first
    assert "Lower optim.lr" in markdown and "![" in markdown
    assert '<img src="loss.png"' in html and "lr_too_high" in html


@pytest.mark.parametrize("make, named", [(lambda p: p / "absent", "no such run directory"),
                                         (lambda p: p, "metrics.jsonl")])
def test_the_command_rejects_a_bad_run_dir_in_one_line(tmp_path, make, named):
    proc = _diagnose_command(make(tmp_path))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and named in proc.stderr


def test_the_readme_documents_every_threshold():
    page = (ROOT / "docs" / "diagnostics.md").read_text()  # the docs page that holds the Diagnosis report section
    section = page[page.index("## Diagnosis report"):]
    for name in THRESHOLDS.__dataclass_fields__:
        assert f"`{name}`" in section, name
    for finding_id in PATHOLOGIES:
        assert f"`{finding_id}`" in section, finding_id


def test_zero_layer_gets_no_gradient():
    """debug.zero_layer: a layer whose weights are all zero receives exactly zero gradient, so it stays dead."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.config.schema import ModelConfig, PrecisionConfig
    from jaxllm.train.faults import with_zeroed_layer
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.model.head import next_token_loss

    cfg = ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64)
    objective = with_zeroed_layer(lm_objective(cfg, PrecisionConfig("float32", "float32", "float32")), 1)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, 1), "segment_ids": jnp.ones_like(tokens),
             "positions": jnp.broadcast_to(jnp.arange(8), (2, 8)), "loss_mask": jnp.ones_like(tokens)}

    def grads_at_init(key):  # one compiled program: eager initialisation is slow on 8 fake devices
        graphdef, params = nnx.split(objective.build_model(key))
        return jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), batch)[0])(params)

    grads = jax.jit(grads_at_init)(jax.random.key(0))
    layer_grads = jax.tree.leaves(grads["layers"])
    assert all(float(jnp.abs(g[1]).max()) == 0.0 for g in layer_grads)
    assert all(float(jnp.abs(g[0]).max()) > 0.0 for g in layer_grads)


def test_router_scale_multiplies_the_routers_initial_weights_only():
    import jax
    from flax import nnx

    from jaxllm.config.presets import PRESETS
    from jaxllm.config.schema import ModelConfig, PrecisionConfig
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.train.faults import with_scaled_router

    objective = lm_objective(ModelConfig(**PRESETS["moe_tiny"]), PrecisionConfig("float32", "float32", "float32"))
    plain = nnx.state(objective.build_model(jax.random.key(0)), nnx.Param)
    hot = nnx.state(with_scaled_router(objective, 1000.0).build_model(jax.random.key(0)), nnx.Param)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(plain), jax.tree_util.tree_leaves_with_path(hot)):
        scale = 1000.0 if "router" in jax.tree_util.keystr(path) else 1.0
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a) * scale, err_msg=jax.tree_util.keystr(path))


def test_data_sleep_throttles_each_batch():
    from jaxllm.train.faults import ThrottledBatches

    class Source:
        def __next__(self):
            return {"tokens": 1}

        def get_state(self):
            return {"step": 7}

    throttled = ThrottledBatches(Source(), 0.05)
    start = time.perf_counter()
    assert next(throttled) == {"tokens": 1} and next(throttled) == {"tokens": 1}
    assert time.perf_counter() - start >= 0.1
    assert throttled.get_state() == {"step": 7}


@pytest.mark.parametrize("field, value, message", [
    ("zero_layer", 4, "debug.zero_layer: must be -1 (off) or a layer index below model.num_layers=4, got 4"),
    ("data_sleep_s", -1.0, "debug.data_sleep_s: must be >= 0 seconds, got -1.0"),
    ("router_scale", 1000.0, "debug.router_scale: scales a mixture of experts' routers; this model has none "
                             "(model.num_experts=0), got 1000"),
    ("router_scale", 0.0, "debug.router_scale: must be positive, got 0.0")])
def test_seeded_pathology_flags_are_validated(field, value, message):
    import importlib.util

    from jaxllm.config.schema import ConfigError, validate

    spec = importlib.util.spec_from_file_location("pretrain_config", ROOT / "configs" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config()
    cd.debug[field] = value
    with pytest.raises(ConfigError) as error:
        validate(cd, 8)
    assert str(error.value) == message


def test_a_real_run_with_the_lr_x30_is_named(shakespeare_store, tmp_path):
    """The one real seeded run: the default job's LR x30 (0.09) on the tiny model, warmup 8, 24 steps; the
    healthy counterpart is the recorded run above (scripts/seeded_pathologies.py runs both at full size)."""
    from train_runs import train_command, train_env

    workdir = tmp_path / "lr_x30"
    proc = subprocess.run(train_command(shakespeare_store, workdir, "--config.train.steps=24",
                                        "--config.optim.warmup_steps=8", "--config.optim.lr=0.09",
                                        "--config.train.eval_every=1000", "--config.checkpoint.every=1000",
                                        "--config.train.on_anomaly=skip",
                                        # a CPU reports no memory limit: a budget the step overfills stands in
                                        "--config.train.memory_budget_gb=0.001"),
                          capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = {f.id for f in diagnose(load_run(workdir)).findings}
    assert ids & {"loss_oscillation", "lr_too_high"}, ids
    assert "memory_headroom" in ids  # the compiled step's bytes, recorded at start-up, against the budget

    # The report carries the compiled step's memory and collectives the run recorded in summary.json.
    summary = json.loads((workdir / "summary.json").read_text())
    memory, comms = summary["memory"], summary["comms"]
    assert memory["limit_bytes"] == 10**6 and memory["per_device_bytes"] > 10**6
    axes = {row["axes"] for row in comms["by_kind_axes"]}
    assert {"tensor", "fsdp"} <= axes and comms["total_bytes_per_step"] > 0  # the default 2x2x2x1 mesh
    proc = _diagnose_command(workdir)
    assert proc.returncode == 0, proc.stderr
    markdown = (workdir / "report" / "report.md").read_text()
    section = markdown[markdown.index("## Memory and communication"):markdown.index("## Checks that could not run")]
    assert format_bytes(memory["per_device_bytes"]) in section
    assert format_bytes(comms["total_bytes_per_step"]) in section
    assert all(f"| {row['kind']} | {row['axes']} |" in section for row in comms["by_kind_axes"])


def test_the_aux_loss_balances_experts_and_a_hot_router_s_collapse_is_named(tmp_path):
    """Two recorded real moe_tiny runs of 200 steps (tests/data/diagnose/moe_tiny/README.md: why recorded): with the
    aux loss on (0.1) the tokens per expert's coefficient of variation ends at least 2x lower than with it off and a
    hot router (saturated: debug.router_scale=1000), whose experts stay collapsed and the diagnosis names it; the
    balanced run's does not. (The full-size pair, configs/pretrain_moe.py, is in the replayed traces.)"""
    import gzip

    def recorded(name):
        workdir = tmp_path / name
        shutil.copytree(ROOT / "tests" / "data" / "diagnose" / "moe_tiny" / name, workdir)
        (workdir / "metrics.jsonl").write_bytes(gzip.decompress((workdir / "metrics.jsonl.gz").read_bytes()))
        data = load_run(workdir)
        tail = data.step > 2 * data.step[-1] / 3
        cv = np.mean([np.median(data.series(f"moe/expert_tokens_cv/layer_{i}")[tail]) for i in range(2)])
        return cv, {f.id for f in diagnose(data).findings}

    balanced, balanced_ids = recorded("balanced")
    collapsed, collapsed_ids = recorded("hot_router")
    assert collapsed >= 2 * balanced, (balanced, collapsed)
    assert "expert_collapse" in collapsed_ids and "expert_collapse" not in balanced_ids, (collapsed_ids, balanced_ids)
