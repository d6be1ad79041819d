"""Host offload (jaxllm/parallel/offload.py): the optimizer state in pinned host memory and offloaded remat residuals give
the on-device results bitwise; the state really lives in host memory (init, every step, checkpoint restore);
a backend without host memory is a one-line config error. XLA:CPU has a pinned_host memory space, so all of
this runs on the CPU."""

import dataclasses
import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from in_process_steps import run_steps

from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.config.cli import build_config
from jaxllm.config.schema import ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, validate
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.offload import HOST, require_host_memory
from jaxllm.optim.chain import make_optimizer
from jaxllm.plan.footprint import format_plan, memory_plan
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.recovery import restore_latest
from jaxllm.train.state import abstract_objective_state, init_objective_state, state_shardings
from jaxllm.model.head import next_token_loss
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LAYOUT = MeshConfig(2, 2, 2, 1)
ROWS, SEQ, STEPS = 8, 16, 3


def _tx():
    return make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10)


def _batch(mesh, seed=0):
    return to_global(synthetic_batch(seed, ROWS, SEQ, MODEL.vocab_size), batch_sharding(mesh), ROWS)


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _train(offload: str, directory=None):
    """(states after each of STEPS steps as numpy leaves, losses, final state, jitted step) of the tiny model with
    `optim.offload=offload`; with `directory` the state after step 1 is checkpointed there."""
    mesh, tx, objective = make_mesh(LAYOUT), _tx(), lm_objective(MODEL, F32)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0, offload=offload)
        born = _kinds(state.opt_state)
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh)
        state, losses = run_steps(step, state, lambda i: _batch(mesh, i), STEPS, directory)
    return dict(state=state, losses=losses, step=step, born=born)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("offload") / "checkpoints"
    return {"none": _train("none"), "host": _train("host", directory), "directory": directory}


def test_optimizer_offload_equals_on_device_bitwise(runs):
    on_device, offloaded = runs["none"], runs["host"]
    assert offloaded["losses"] == on_device["losses"]
    for a, b in zip(_leaves(offloaded["state"]), _leaves(on_device["state"])):
        np.testing.assert_array_equal(a, b)
    # born in host memory, and still there after the donated steps; parameters stay on the device
    assert offloaded["born"] == _kinds(offloaded["state"].opt_state) == {HOST}
    assert _kinds(offloaded["state"].params) == {"device"}
    assert _kinds(on_device["state"].opt_state) == {"device"}


def test_offloaded_checkpoint_restores_into_host_memory_and_resumes_bitwise(runs):
    offloaded = runs["host"]
    mesh, objective = make_mesh(LAYOUT), lm_objective(MODEL, F32)
    abstract = abstract_objective_state(objective, _tx())[0]
    ckpt = Checkpointer(runs["directory"], log=lambda msg: None)
    with jax.set_mesh(mesh):
        state, _ = restore_latest(ckpt, abstract, mesh, print, items=("state",),
                                  shardings=state_shardings(abstract, mesh, "host"))
        ckpt.close()
        assert int(state.step) == 1
        assert _kinds(state.opt_state) == {HOST} and _kinds(state.params) == {"device"}
        for i in range(1, STEPS):
            state, _ = offloaded["step"](state, _batch(mesh, i))
    for a, b in zip(_leaves(state), _leaves(offloaded["state"])):
        np.testing.assert_array_equal(a, b)


def test_remat_offload_equals_kept_residuals_bitwise(runs):
    mesh, tx, batch = make_mesh(LAYOUT), _tx(), _batch(make_mesh(LAYOUT))
    state = runs["none"]["state"]
    out = {}
    for remat in ("save_qkv_proj", "minimal_with_context", "save_dots"):
        for offload in ("none", "host"):
            objective = lm_objective(dataclasses.replace(MODEL, remat=remat, remat_offload=offload), F32)
            with jax.set_mesh(mesh):
                # the real train step moves the saved residuals to host memory, and only with offload on
                jaxpr = str(jax.make_jaxpr(make_train_step(objective, tx))(state, batch))
                assert ("MemorySpace.Host" in jaxpr) == (offload == "host"), (remat, offload)
                if remat == "save_qkv_proj":
                    grads = jax.jit(lambda p, b: grads_and_loss(objective.graphdef, p, b, loss_fn=next_token_loss)[:2])(state.params, batch)
                    out[offload] = _leaves(grads)
    for a, b in zip(out["host"], out["none"]):
        np.testing.assert_array_equal(a, b)


def _config(*overrides):
    return build_config(str(ROOT / "configs" / "pretrain.py"), [tuple(o.split("=", 1)) for o in overrides])


@pytest.mark.parametrize("overrides, key", [
    (("optim.offload=disk",), "optim.offload"),
    (("model.remat_offload=nvme",), "model.remat_offload"),
    (("model.remat_offload=host",), "model.remat_offload"),  # remat none: nothing saved by name
    (("model.remat_offload=host", "model.remat=full"), "model.remat_offload"),
])
def test_bad_offload_values_are_config_errors(overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(_config(*overrides), 8)
    assert err.value.key == key and "\n" not in str(err.value)


class _NoHostMemory:
    """A device whose only memory space is its own (as a backend without host offload support)."""

    platform, id = "fake", 0

    def addressable_memories(self):
        return [type("Memory", (), {"kind": "device"})()]


def test_backend_without_host_memory_is_a_config_error():
    cfg = validate(_config("optim.offload=host"), 8)
    require_host_memory(cfg)  # XLA:CPU has pinned_host
    with pytest.raises(ConfigError, match=r"^optim.offload: 'host' needs a 'pinned_host' memory space"):
        require_host_memory(cfg, [_NoHostMemory()])
    require_host_memory(validate(_config(), 8), [_NoHostMemory()])  # nothing offloaded: nothing to check


def test_cli_reports_missing_host_memory_in_one_line(monkeypatch, capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("_train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("jaxllm.parallel.offload.memory_kinds", lambda device: {"device"})
    with pytest.raises(SystemExit) as exit_:
        script.main(["--config", str(ROOT / "configs" / "pretrain.py"), "--workdir", str(tmp_path),
                     "--config.model.remat=save_qkv_proj", "--config.model.remat_offload=host"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.remat_offload: 'host' needs a 'pinned_host' memory space")
    assert err.count("\n") == 1
    assert not (tmp_path / "config.json").exists()  # stopped before anything was written


def test_planner_counts_offloaded_bytes_in_host_memory():
    plans = {overrides: memory_plan(validate(_config(*overrides), 8), compiled=False) for overrides in [
        (), ("optim.offload=host",), ("model.remat=save_qkv_proj",),
        ("model.remat=save_qkv_proj", "model.remat_offload=host")]}
    base, opt_host, kept, act_host = plans.values()
    assert base["host_bytes_per_device"] == kept["host_bytes_per_device"] == 0
    assert opt_host["host_bytes_per_device"] == base["opt_bytes_per_device"] > 0
    assert opt_host["total_bytes_per_device"] == base["total_bytes_per_device"] - base["opt_bytes_per_device"]
    assert "pinned host memory per device (offload)" in format_plan(opt_host)
    moved = kept["temp_parts"]["saved_activations"] - act_host["temp_parts"]["saved_activations"]
    assert moved == act_host["host_bytes_per_device"] > 0
