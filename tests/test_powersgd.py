"""PowerSGD over the `data` axis (jaxllm/optim/powersgd.py): exact at full rank, error feedback, composition with fsdp,
tensor and accumulation, the all-reduce bytes across `data` in the compiled step, configuration errors."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec

from compile_flags import PRODUCTION_COMPILE
from jaxllm.optim import powersgd
from jaxllm.config.cli import build_config
from jaxllm.config.schema import (MESH_AXES, ConfigError, MeshConfig, ModelConfig, OptimConfig, PipelineConfig,
                           PrecisionConfig, default_config_dict, validate)
from jaxllm.observe.comms import collectives, reduced_bytes_across
from jaxllm.optim.loss_scale import NO_LOSS_SCALING, LossScaling
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.train.faults import with_scaled_loss
from jaxllm.parallel.host_rows import to_global
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.state import abstract_objective_state, init_objective_state, state_shardings
from jaxllm.model.head import next_token_loss
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


def _train(layout, compression, grad_accum=1, steps=3, loss_scaling=NO_LOSS_SCALING, loss_factor=1.0,
           compiler_options=None, pipeline=PipelineConfig()):
    """(final state, metrics of every step, initial state), on the host, after `steps` SGD updates on one batch
    under mesh `layout`; the loss multiplied by `loss_factor`. SGD, because Adam's g / sqrt(v) turns float32 noise
    on a zero gradient (an unused embedding row) into a full-size step."""
    mesh = make_mesh(MeshConfig(*layout))
    objective = with_scaled_loss(lm_objective(MODEL, F32, pipeline), loss_factor)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        shardings = state_shardings(powersgd.with_state(jax.eval_shape(lambda: state), compression, mesh), mesh)
        state = powersgd.with_state(state, compression, mesh, shardings)
        initial = jax.device_get(state)  # before the step donates it
        step = jit_train_step(make_train_step(objective, tx, grad_accum, loss_scaling=loss_scaling,
                                              compression=compression), shardings, mesh,
                              compiler_options=compiler_options)
        history = []
        for i in range(steps):
            state, metrics = step(state, to_global(_batch(0), batch_sharding(mesh), ROWS))
            history.append(jax.device_get(metrics))
    return jax.device_get(state), history, initial


def _params_and_losses(layout, compression, grad_accum=1, steps=3, pipeline=PipelineConfig()):
    state, history, _ = _train(layout, compression, grad_accum, steps, pipeline=pipeline)
    return state.params, [float(m["loss"]) for m in history]


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
    plain_params, plain_losses = _params_and_losses(layout, None, grad_accum)
    params, losses = _params_and_losses(layout, compression, grad_accum)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_full_rank_equals_uncompressed_through_pipeline_stages(schedule):
    """data 4 x stage 2, 2 micro-batches: PowerSGD reduces over `data` what either schedule's stages computed (the
    pipeline's shard_map over `stage` runs inside PowerSGD's over `data`)."""
    pipeline = PipelineConfig(microbatches=2, schedule=schedule)
    plain_params, plain_losses = _params_and_losses((4, 1, 1, 2), None, pipeline=pipeline)
    compression = powersgd.PowerSGD(rank=FULL_RANK, start_step=0)
    state, history, initial = _train((4, 1, 1, 2), compression, pipeline=pipeline)
    np.testing.assert_allclose([float(m["loss"]) for m in history], plain_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(a, b, atol=2e-5)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.powersgd.q),
                                                      jax.tree.leaves(initial.powersgd.q))]
    assert moved and all(moved)  # the factors were computed (warm-started) at every step: it compressed


def test_low_rank_differs_and_starts_after_the_uncompressed_steps():
    """Rank 1 changes training, but not during the first `start_step` (uncompressed) steps."""
    _, plain = _params_and_losses((4, 2, 1, 1), None)
    _, late = _params_and_losses((4, 2, 1, 1), powersgd.PowerSGD(rank=1, start_step=2))
    np.testing.assert_allclose(late[:3], plain[:3], rtol=1e-5)  # the third step's loss is before its update
    _, early = _params_and_losses((4, 2, 1, 1), powersgd.PowerSGD(rank=1, start_step=0), steps=3)
    assert abs(early[2] - plain[2]) > 1e-4


RANK_1 = powersgd.PowerSGD(rank=1, start_step=0)


def test_a_loss_scale_is_undone_before_compression():
    """Under a static power-of-two loss scale each shard's gradients are unscaled before they are compressed:
    parameters and error buffers end as without scaling."""
    # Compiled as users' runs are: the suite's own fusion emitters round the two programs apart in the last bits.
    plain, _, _ = _train((4, 2, 1, 1), RANK_1, steps=2, compiler_options=PRODUCTION_COMPILE)
    scaled, history, _ = _train((4, 2, 1, 1), RANK_1, steps=2, loss_scaling=LossScaling("static", 2.0**10),
                                compiler_options=PRODUCTION_COMPILE)
    assert [float(m["overflow"]) for m in history] == [0.0, 0.0]
    for a, b in zip(jax.tree.leaves((scaled.params, scaled.powersgd)), jax.tree.leaves((plain.params, plain.powersgd))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_an_overflowing_step_leaves_the_compression_state_unchanged():
    """A step whose scaled gradients overflow is skipped whole: parameters, optimizer state, Q and the error
    buffers stay as they were (the loss times 1e30 is finite, times the scale 1e10 it overflows)."""
    final, history, initial = _train((4, 2, 1, 1), RANK_1, steps=1, loss_factor=1e30,
                                     loss_scaling=LossScaling("static", 1e10))
    assert float(history[0]["overflow"]) == 1.0
    assert traverse_util.flatten_dict(final.powersgd.error)  # there are error buffers to keep
    for a, b in zip(jax.tree.leaves(final.replace(step=initial.step, loss_scale=initial.loss_scale)),
                    jax.tree.leaves(initial), strict=True):
        np.testing.assert_array_equal(a, b)


def _numpy_powersgd(local, q, error):
    """One step of Vogels et al.'s Algorithm 1 with error feedback in numpy, per matrix of a [layers, m, n] batch:
    `local` [workers, layers, m, n] gradients, `q` [layers, n, r], `error` like `local`. Returns (the mean
    gradient's approximation, new Q, new errors)."""
    m = local + error
    p = np.mean(m @ q, axis=0)  # all-reduce-mean of the workers' P
    p = np.linalg.qr(p)[0]
    q = np.mean(np.swapaxes(m, -1, -2) @ p, axis=0)
    approx = p @ np.swapaxes(q, -1, -2)
    return approx, q, m - approx


def test_matches_a_numpy_powersgd_with_warm_start():
    """`_compress` on 4 data shards, over 3 steps with warm start, against the numpy algorithm: the same mean
    approximation (its scale: the mean gradient's), the same per-shard errors, and the same Q up to the signs
    of its columns (compared as Q Q^T); for a tall and a wide matrix, each a batch of 2 layers."""
    mesh = make_mesh(MeshConfig(4, 2, 1, 1))
    rng = np.random.default_rng(0)
    for m_rows, n_cols in ((12, 5), (5, 12)):
        view = powersgd.MatrixView(lead=1, split=2, m=m_rows, n=n_cols, rank=2)
        q = rng.standard_normal((2, n_cols, 2)).astype(np.float32)
        error = np.zeros((4, 2, m_rows, n_cols), np.float32)
        compress = jax.jit(jax.shard_map(
            lambda g, q, e: (lambda a, q, e: (a, q, e[None]))(*powersgd._compress(g[0], q, e[0], view)),
            mesh=mesh, in_specs=(PartitionSpec("data"), PartitionSpec(), PartitionSpec("data")),
            out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec("data")), axis_names={"data"},
            check_vma=False))
        ours_q, ours_error = q, error
        for _ in range(3):
            local = rng.standard_normal((4, 2, m_rows, n_cols)).astype(np.float32)
            approx, q, error = _numpy_powersgd(local.astype(np.float64), q, error)
            ours, ours_q, ours_error = jax.device_get(compress(local, ours_q, ours_error))
            np.testing.assert_allclose(ours, approx, atol=1e-5)
            np.testing.assert_allclose(ours_error, error, atol=1e-5)
            np.testing.assert_allclose(ours_q @ np.swapaxes(ours_q, -1, -2), q @ np.swapaxes(q, -1, -2), atol=1e-4)
        assert np.abs(approx).max() > 0.1  # a real approximation, not zeros


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
        exact = jax.device_get(jax.jit(lambda p, b: grads_and_loss(objective.graphdef, p, b, loss_fn=next_token_loss)[0])(state.params, batch))
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
    grads, _, _, _, state, _ = powersgd.compressed_grads_and_loss(compute, params, batch, frozen, None, state,
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
    return reduced_bytes_across(collectives(hlo, tuple(mesh.axis_sizes), MESH_AXES)[0], "data")


def test_compressed_step_reduces_ten_times_fewer_bytes_across_data():
    plain = _data_bytes(None)
    compressed = _data_bytes(powersgd.PowerSGD(rank=4, start_step=0))
    print(f"default job, bytes per device per step reduced across data: none {plain:,}, "
          f"powersgd rank 4 {compressed:,} ({plain / compressed:.1f}x)")
    assert compressed * 10 <= plain


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


@pytest.mark.parametrize("mesh,says", [(dict(data=1, fsdp=8), "nothing to compress")])
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
