"""The rules table and the default layout: a golden PartitionSpec file, and checks that weights are split."""

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.config.cli import build_config
from jaxllm.config.schema import MeshConfig, validate
from jaxllm.parallel.mesh import abstract_mesh, make_mesh
from jaxllm.parallel.sharding import (bytes_per_device, format_replicated, format_report, logical_to_spec, replicated_rows,
                             report_rows, sharding_tree, sum_over_devices)
from jaxllm.model.build import abstract_model, build_model

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "sharding_pretrain_2x2x2x1.txt"


@pytest.fixture(scope="module")
def default_cfg():
    return validate(build_config(str(ROOT / "configs" / "pretrain.py"), []), 8)


def test_logical_to_spec_rules():
    sizes = {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    assert logical_to_spec(("embed", "mlp"), (8, 8), sizes) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "seq", "embed"), (8, 4, 8), sizes, kind="activations") == P(("data", "fsdp"), None, None)
    # A mesh axis is used once per spec; an axis that does not divide the dimension is dropped.
    assert logical_to_spec(("heads", "mlp"), (8, 8), sizes) == P("tensor", None)
    assert logical_to_spec(("vocab", "embed"), (7, 8), sizes) == P(None, "fsdp")
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",))


def check_golden(text: str, golden: Path, update: bool) -> None:
    """Compare `text` with the checked-in `golden` file. Only an explicit request (JAXLLM_UPDATE_GOLDEN=1)
    rewrites it, and that run fails on purpose so it is never mistaken for a passing one; a missing golden
    file fails, it is never created here."""
    if update:
        golden.write_text(text)
        pytest.fail(f"rewrote {golden} (JAXLLM_UPDATE_GOLDEN=1): review its diff, then rerun without the variable")
    if not golden.exists():
        pytest.fail(f"golden file {golden} is missing: restore it from git, or write it with JAXLLM_UPDATE_GOLDEN=1")
    assert text == golden.read_text(), "layout changed: rerun with JAXLLM_UPDATE_GOLDEN=1 if intended"


def test_golden_partition_specs(default_cfg):
    state = nnx.state(abstract_model(default_cfg.model, default_cfg.precision))
    report = format_report(report_rows(state, make_mesh(default_cfg.mesh))) + "\n"
    check_golden(report, GOLDEN, update=os.environ.get("JAXLLM_UPDATE_GOLDEN") == "1")


def test_golden_files_are_only_written_on_request(tmp_path):
    missing, stale = tmp_path / "missing.txt", tmp_path / "stale.txt"
    stale.write_text("old\n")
    with pytest.raises(pytest.fail.Exception, match="is missing"):
        check_golden("new\n", missing, update=False)
    with pytest.raises(AssertionError, match="layout changed"):
        check_golden("new\n", stale, update=False)
    assert not missing.exists() and stale.read_text() == "old\n"
    with pytest.raises(pytest.fail.Exception, match="rewrote"):
        check_golden("new\n", stale, update=True)
    assert stale.read_text() == "new\n"


def test_large_parameters_are_split(default_cfg):
    mesh = make_mesh(default_cfg.mesh)
    state = nnx.state(abstract_model(default_cfg.model, default_cfg.precision))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    expected = total / (default_cfg.mesh.fsdp * default_cfg.mesh.tensor)
    assert abs(bytes_per_device(state, mesh) - expected) / expected < 0.10
    for row in report_rows(state, mesh):
        if row["bytes_total"] >= 64 * 1024:
            assert row["bytes_per_device"] * 4 == row["bytes_total"], row["path"]


def test_initialised_parameters_are_born_in_their_shards(default_cfg):
    mesh = make_mesh(default_cfg.mesh)
    shardings = sharding_tree(nnx.state(abstract_model(default_cfg.model, default_cfg.precision)), mesh)
    init = jax.jit(lambda k: nnx.state(build_model(default_cfg.model, default_cfg.precision, k)),
                   out_shardings=shardings)
    params = init(jax.random.key(0))
    q = params["layers"]["self_attn"]["q_proj"][...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    local = q.addressable_shards[0].data.shape
    assert local == (q.shape[0], q.shape[1] // 2, q.shape[2] // 2, q.shape[3])


def test_abstract_mesh_plans_beyond_this_machine(default_cfg):
    # 64-way fsdp on an 8-device machine: planning uses an AbstractMesh, so nothing needs 64 devices.
    from jaxllm.config.schema import MeshConfig
    mesh = abstract_mesh(MeshConfig(data=1, fsdp=64, tensor=1, stage=1))
    state = nnx.state(abstract_model(default_cfg.model, default_cfg.precision))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert np.isclose(bytes_per_device(state, mesh), total / 64, rtol=0.05)


def test_parameters_left_whole_by_an_undivided_axis_are_listed(default_cfg):
    """vocab 129 on tensor=2 and dim 66 on fsdp=4 (what validate now rejects, e.g. from a base's architecture):
    the layout still compiles, replicated, and the start-up warning names each parameter with its bytes."""
    mesh = make_mesh(MeshConfig(1, 4, 2, 1))
    odd = dataclasses.replace(default_cfg.model, vocab_size=129, dim=66, num_layers=2)
    rows = {r["path"]: r for r in replicated_rows(nnx.state(abstract_model(odd, default_cfg.precision)), mesh)}
    assert rows["embed_tokens.embedding"]["replicated_over"] == ("fsdp", "tensor")
    assert rows["embed_tokens.embedding"]["bytes_per_device"] == 129 * 66 * 4
    assert rows["layers.mlp.gate_proj"]["replicated_over"] == ("fsdp",)
    assert "norm.scale" not in rows and "layers.input_layernorm.scale" not in rows  # rules split norms over nothing
    text = format_replicated(list(rows.values()))
    assert text.startswith(f"warning: {len(rows)} parameters are replicated") and "lm_head (66, 129)" in text
    assert replicated_rows(nnx.state(abstract_model(default_cfg.model, default_cfg.precision)),
                           make_mesh(default_cfg.mesh)) == []
    assert format_replicated([]) == ""


@pytest.mark.parametrize("shape, spec", [((64, 48), P()), ((8, 64), P(None, "tensor")), ((6, 5), P("fsdp")),
                                         ((4, 16, 8), P(None, "fsdp", "tensor"))],
                         ids=["replicated", "split-over-tensor", "nothing-divides", "split-twice"])
def test_a_sum_over_devices_counts_every_element_once(shape, spec):
    """sum_over_devices on a (2, 2, 2) mesh equals the plain sum of squares, whatever the array's layout: every
    element is reduced by exactly one device (a replicated block split among its replicas, one that no dimension
    divides reduced whole by its first replica)."""
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7.0
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        total = jax.jit(lambda a: sum_over_devices(lambda b: (b * b).sum(), [a], [spec], mesh))(placed)
    np.testing.assert_allclose(float(total), float((x.astype(np.float64) ** 2).sum()), rtol=1e-6)


def test_each_replica_reduces_only_its_share_of_a_replicated_array():
    """The point of sum_over_devices: on 8 data-parallel devices each reduces an eighth of a replicated [64, 48]
    array (a dynamic slice of 8 rows), not all of it as a plain sum would."""
    mesh = make_mesh(MeshConfig(8, 1, 1, 1))
    with jax.set_mesh(mesh):
        placed = jax.device_put(np.ones((64, 48), np.float32), jax.sharding.NamedSharding(mesh, P()))
        hlo = jax.jit(lambda a: sum_over_devices(lambda b: (b * b).sum(), [a], [P()], mesh)).lower(
            placed).compile().as_text()
    assert "f32[8,48]" in hlo and "dynamic-slice" in hlo
