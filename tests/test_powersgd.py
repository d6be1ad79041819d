"""PowerSGD over the `data` axis (jaxllm/powersgd.py): exact at full rank, error feedback, composition with fsdp,
tensor and accumulation, the all-reduce bytes across `data` in the compiled step, configuration errors."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from jaxllm import powersgd
from jaxllm.cli import build_config
from jaxllm.config import ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, default_config_dict, validate
from jaxllm.hlo_collectives import bytes_across
from jaxllm.mesh import make_mesh
from jaxllm.optim import make_optimizer
from jaxllm.train.loop import to_global
from jaxllm.train.pretrain import lm_objective
from jaxllm.train.state import abstract_objective_state, init_objective_state, state_shardings
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step


ROOT = Path(__file__).resolve().parents[1]
# Every weight gradient is a sum of one outer product per token position, so 8 rows x 2 positions give gradient
# matrices of rank <= 16: rank 16 is at least the matrix rank, and the 64-wide matrices still compress at it.
MODEL = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
ROWS, POSITIONS, FULL_RANK = 8, 2, 16


def _batch(seed, rows=ROWS, positions=POSITIONS):
    rng = np.random.default_rng(seed)
    shape = (rows, positions)
    return {"tokens": rng.integers(0, 128, shape).astype(np.int32),
            "targets": rng.integers(0, 128, shape).astype(np.int32),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.tile(np.arange(positions, dtype=np.int32), (rows, 1)),
            "loss_mask": (rng.random(shape) > 0.2).astype(np.float32)}


def _train(layout, compression, grad_accum=1, steps=3):
    """(parameters, losses) after `steps` SGD updates on one batch under mesh `layout`. SGD, because Adam's
    g / sqrt(v) turns float32 noise on a zero gradient (an unused embedding row) into a full-size step."""
    mesh = make_mesh(MeshConfig(*layout))
    objective = lm_objective(MODEL, F32)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        shardings = state_shardings(powersgd.with_state(jax.eval_shape(lambda: state), compression, mesh), mesh)
        state = powersgd.with_state(state, compression, mesh, shardings)
        step = jit_train_step(make_train_step(objective, tx, grad_accum, compression=compression), shardings, mesh)
        losses = []
        for i in range(steps):
            state, metrics = step(state, to_global(_batch(0), batch_sharding(mesh), ROWS))
            losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def test_matrices_and_vectors_are_told_apart():
    views = dict(powersgd._views(jax.eval_shape(lambda: lm_objective(MODEL, F32).split(
        lm_objective(MODEL, F32).build_model(jax.random.key(0)))[1]), FULL_RANK))
    assert views[("layers", "self_attn", "q_proj")] == powersgd.MatrixView(lead=1, split=2, m=64, n=64, rank=16)
    assert views[("layers", "self_attn", "o_proj")].m == 64  # [N, H, D] -> [N*H, D]
    assert views[("layers", "input_layernorm", "scale")] is None  # a vector per layer
    assert views[("layers", "self_attn", "k_proj")] is None  # [64, 32] at rank 16: factors not half its size


@pytest.mark.parametrize("layout,grad_accum", [((4, 2, 1, 1), 1), ((2, 2, 2, 1), 2)])
def test_rank_at_least_the_matrix_rank_equals_uncompressed(layout, grad_accum):
    """Full-rank PowerSGD (from step 1) trains like plain data parallelism, over fsdp, tensor and accumulation."""
    compression = powersgd.PowerSGD(rank=FULL_RANK, start_step=0)
    plain_params, plain_losses = _train(layout, None, grad_accum)
    params, losses = _train(layout, compression, grad_accum)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_low_rank_differs_and_starts_after_the_uncompressed_steps():
    """Rank 1 changes training, but not during the first `start_step` (uncompressed) steps."""
    _, plain = _train((4, 2, 1, 1), None)
    _, late = _train((4, 2, 1, 1), powersgd.PowerSGD(rank=1, start_step=2))
    np.testing.assert_allclose(late[:3], plain[:3], rtol=1e-5)  # the third step's loss is before its update
    _, early = _train((4, 2, 1, 1), powersgd.PowerSGD(rank=1, start_step=0), steps=3)
    assert abs(early[2] - plain[2]) > 1e-4


@pytest.fixture(scope="module")
def sums_of_gradients():
    """Over 12 steps at fixed parameters and one batch: the sums of the exact gradients and of rank-1 PowerSGD's
    with and without error feedback (without: the error buffers zeroed before every step), each compressed sum's
    relative distance to the exact one after every step, and the last error buffers."""
    mesh = make_mesh(MeshConfig(4, 2, 1, 1))
    objective = lm_objective(MODEL, F32)
    tx = make_optimizer(OptimConfig(), 10)
    compression = powersgd.PowerSGD(rank=1, start_step=0)
    with jax.set_mesh(mesh):
        state, frozen, _, _ = init_objective_state(objective, tx, mesh, seed=0)
        state = powersgd.with_state(state, compression, mesh,
                                    state_shardings(powersgd.with_state(jax.eval_shape(lambda: state), compression,
                                                                        mesh), mesh))
        compute = functools.partial(grads_and_loss, objective.graphdef, grad_accum=1, loss_fn=objective.loss_fn)
        batch = to_global(_batch(100, positions=8), batch_sharding(mesh), ROWS)
        exact = jax.device_get(jax.jit(lambda p, b: grads_and_loss(objective.graphdef, p, b)[0])(state.params, batch))
        compressed = jax.jit(lambda p, b, s: compressed_grads(compute, p, b, frozen, s, compression))
        sums = {"feedback": None, "no feedback": None}
        distances = {"feedback": [], "no feedback": []}
        fed, unfed = state.powersgd, state.powersgd
        add = lambda total, g: g if total is None else jax.tree.map(jnp.add, total, g)
        for t in range(1, 13):
            g, fed = compressed(state.params, batch, fed)
            sums["feedback"] = add(sums["feedback"], jax.device_get(g))
            unfed = unfed.replace(error=jax.tree.map(jnp.zeros_like, unfed.error))
            g, unfed = compressed(state.params, batch, unfed)
            sums["no feedback"] = add(sums["no feedback"], jax.device_get(g))
            total = jax.tree.map(lambda x: t * x, exact)
            for kind in sums:
                distances[kind].append(_distance(sums[kind], total) / _distance(total, jax.tree.map(np.zeros_like,
                                                                                                   total)))
        sums["exact"] = jax.tree.map(lambda x: 12 * x, exact)
    return sums, distances, jax.device_get(fed)


def compressed_grads(compute, params, batch, frozen, state, compression):
    grads, _, _, _, state = powersgd.compressed_grads_and_loss(compute, params, batch, frozen, None, state,
                                                               jnp.zeros((), jnp.int32), compression)
    return grads, state


def _distance(a, b):
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))))


def test_error_feedback_tracks_the_uncompressed_sum(sums_of_gradients):
    """With feedback the running sum of rank-1 gradients closes in on the exact sum; without, it stays off."""
    _, distances, _ = sums_of_gradients
    fed, unfed = distances["feedback"], distances["no feedback"]
    print("relative distance of the summed rank-1 gradients to the exact sum, steps 1..12:\n  with feedback "
          + " ".join(f"{d:.3f}" for d in fed) + "\n  without      " + " ".join(f"{d:.3f}" for d in unfed))
    assert fed[-1] < 0.8 * fed[0]
    assert fed[-1] < 0.85 * unfed[-1]
    assert unfed[-1] > 0.9 * unfed[0]


def _by_path(tree) -> dict:
    return {path: leaf for (path, _, _), leaf in zip(powersgd._leaves(tree), jax.tree.leaves(tree))}


def test_what_feedback_has_not_yet_sent_is_the_mean_error(sums_of_gradients):
    """sum of compressed = sum of exact - mean over data shards of the last error buffers (nothing is lost)."""
    sums, _, state = sums_of_gradients
    errors = {path: e.mean(axis=0) for path, e in traverse_util.flatten_dict(state.error).items()}
    exact, sent = _by_path(sums["exact"]), _by_path(sums["feedback"])
    assert errors  # something was compressed
    for path, error in errors.items():
        np.testing.assert_allclose(sent[path], exact[path] - error, atol=1e-5 * np.abs(exact[path]).max())


def _data_bytes(compression):
    """Bytes per device per step that the compiled default job's step (configs/pretrain.py) reduces across
    `data`, by an ahead-of-time compile (nothing allocated)."""
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), []), 8)
    mesh = make_mesh(cfg.mesh)
    objective = lm_objective(cfg.model, cfg.precision)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract = powersgd.with_state(abstract_objective_state(objective, tx)[0], compression, mesh)
    shardings = state_shardings(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), v.dtype)
             for k, v in _batch(0).items()}
    with jax.set_mesh(mesh):
        step = jit_train_step(make_train_step(objective, tx, compression=compression), shardings, mesh)
        hlo = step.lower(state, batch).compile().as_text()
    return bytes_across(hlo, tuple(mesh.axis_sizes), 0)


def test_compressed_step_reduces_ten_times_fewer_bytes_across_data():
    plain = _data_bytes(None)
    compressed = _data_bytes(powersgd.PowerSGD(rank=4, start_step=0))
    print(f"default job, bytes per device per step reduced across data: none {plain['total']:,}, "
          f"powersgd rank 4 {compressed['total']:,} ({plain['total'] / compressed['total']:.1f}x)")
    assert compressed["total"] * 10 <= plain["total"]


@pytest.mark.parametrize("overrides,key", [
    (dict(grad_compression="topk"), "optim.grad_compression"),
    (dict(grad_compression="powersgd", powersgd_rank=0), "optim.powersgd_rank"),
    (dict(grad_compression="powersgd", powersgd_start_step=-1), "optim.powersgd_start_step"),
])
def test_bad_settings_name_their_key(overrides, key):
    cd = default_config_dict()
    cd.mesh.update(data=8)
    cd.optim.update(**overrides)
    with pytest.raises(ConfigError, match=key):
        validate(cd, 8)


@pytest.mark.parametrize("mesh,says", [(dict(data=1, fsdp=8), "nothing to compress"),
                                       (dict(data=4, stage=2), "pipeline")])
def test_meshes_it_cannot_compress_are_config_errors(mesh, says):
    cd = default_config_dict()
    cd.mesh.update(**mesh)
    cd.optim.grad_compression = "powersgd"
    cd.pipeline.microbatches = 2
    with pytest.raises(ConfigError, match=says):
        validate(cd, 8)


def test_resume_is_bitwise(shakespeare_store, tmp_path):
    """A compressed run resumed from its step-4 checkpoint (factors and error buffers restored) ends bitwise
    where the uninterrupted run ends."""
    import shutil

    from train_runs import checkpoint_leaves, resume_command, run_command

    args = ("--config.train.steps=6", "--config.optim.grad_compression=powersgd", "--config.optim.powersgd_rank=2",
            "--config.optim.powersgd_start_step=2")
    full = tmp_path / "full"
    proc = run_command(resume_command(shakespeare_store, full, *args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    proc = run_command(resume_command(shakespeare_store, resumed, *args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint step 4" in proc.stdout
    for a, b in zip(checkpoint_leaves(resumed), checkpoint_leaves(full), strict=True):
        assert np.array_equal(a, b)
