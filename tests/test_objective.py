"""The objective-agnostic core: frozen variables, per-step randomness, drills outside the production step, and
the shared loop training an objective other than pretraining."""

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train_runs import ROOT, TINY

from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, validate
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.loop import train
from jaxllm.train.step_runner import StepRunner
from jaxllm.objectives.pretrain import lm_objective, pretrain_objective
from jaxllm.model.head import cross_entropy_sum
from jaxllm.train.state import abstract_objective_state, init_frozen, init_objective_state
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
HEAD_ONLY = nnx.All(nnx.Param, nnx.PathContains("lm_head"))


def head_only(objective):
    """`objective` with everything but the output head frozen (a stand-in for a frozen LoRA base)."""
    return dataclasses.replace(objective, name="head_only", trainable=HEAD_ONLY)


def _batch(mesh, seed=0):
    return to_global(synthetic_batch(seed, 8, 16, MODEL.vocab_size), batch_sharding(mesh), 8)


def _paths(state):
    return {path for path, _ in nnx.to_flat_state(state)}


def _aliased_arguments(lowered) -> list[int]:
    """Indices of the compiled function's arguments whose buffers are donated to an output."""
    text = lowered.as_text()
    signature = text[text.index("func.func public @main("):]
    signature = signature[:signature.index(") -> (")]
    return [i for i, arg in enumerate(signature.split("%arg")[1:]) if "tf.aliasing_output" in arg]


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) > 0)


def test_frozen_variables_are_inputs_never_donated_updated_or_optimised():
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    objective = head_only(lm_objective(MODEL, F32))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        assert _paths(state.params) == {("lm_head",)}
        assert ("embed_tokens", "embedding") in _paths(frozen)
        assert _nbytes(state.opt_state) == 2 * _nbytes(state.params)  # AdamW moments of the head only
        lowered = jit_train_step(make_train_step(objective, tx), shardings, mesh, frozen_shardings).lower(
            state, _batch(mesh), frozen)
        # Arguments are the state's leaves, then the batch's, then the frozen variables': only the state's
        # buffers are donated to (aliased with) the outputs.
        aliased = _aliased_arguments(lowered)
        assert aliased and max(aliased) < len(jax.tree.leaves(state)), aliased
        compiled = lowered.compile()
        frozen_before = jax.device_get(frozen)
        # What a resume re-creates, without materialising the trainable variables again:
        for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(jax.device_get(init_frozen(objective, mesh, 0)))):
            assert np.array_equal(a, b)
        head_before = jax.device_get(state.params)
        old_state = state
        for seed in range(3):
            state, metrics = compiled(state, _batch(mesh, seed), frozen)
        assert all(x.is_deleted() for x in jax.tree.leaves(old_state.params))  # the state is donated ...
        assert not any(x.is_deleted() for x in jax.tree.leaves(frozen))  # ... the frozen variables never
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(jax.device_get(frozen))):
        assert np.array_equal(a, b)
    assert not np.array_equal(jax.tree.leaves(head_before)[0], jax.tree.leaves(jax.device_get(state.params))[0])
    assert np.isfinite(float(metrics["loss"]))


def token_dropout_loss(model, batch, rng):
    """Next-token loss over a random half of the targets: a loss that depends on the step's randomness."""
    mask = batch["loss_mask"]
    if rng is not None:
        mask = mask * jax.random.bernoulli(rng, 0.5, mask.shape)
    loss_sum, count, _ = cross_entropy_sum(model, batch, mask)
    return loss_sum, count, {"kept_fraction": count / jnp.maximum(jnp.sum(batch["loss_mask"]), 1)}


def test_step_randomness_is_per_step_and_resumes_bitwise(tmp_path):
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    objective = dataclasses.replace(lm_objective(MODEL, F32), loss_fn=token_dropout_loss)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=2), shardings, mesh, frozen_shardings)
        batch = _batch(mesh)

        def run(state, count):
            losses = []
            for _ in range(count):
                state, metrics = step(state, batch, frozen)
                losses.append(float(metrics["loss"]))
                assert 0.2 < float(metrics["kept_fraction"]) < 0.8  # loss_fn metrics come through
            return state, losses

        # The same parameters and batch at another step draw other randomness, hence another loss.
        losses_at = [float(step(jax.tree.map(jnp.copy, state).replace(step=jnp.int32(n)), batch, frozen)[1]["loss"])
                     for n in (0, 1)]
        assert losses_at[0] != losses_at[1]
        state, first = run(state, 2)
        ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
        ckpt.save(2, state, {}, {})
        state, uninterrupted = run(state, 2)
        abstract, _ = abstract_objective_state(objective, tx)
        restored = ckpt.restore(2, abstract, mesh, items=("state",))["state"]
        ckpt.close()
        _, resumed = run(restored, 2)
    assert resumed == uninterrupted  # bitwise: the key of step N is fold_in(state.rng, N)
    assert len({*first, *uninterrupted}) == 4  # the same batch, a different draw every step


def _config(store, workdir, *overrides):
    _, pairs = split_overrides([*TINY, f"--config.data.path={store}", "--config.train.eval_every=1000",
                                "--config.checkpoint.every=2", "--config.optim.warmup_steps=0", *overrides])
    return validate(build_config(str(ROOT / "configs" / "pretrain.py"), pairs, str(workdir)), 8)


def _step_runners(cfg, *configs):
    """StepRunners of `configs` for cfg's tiny LM, its fresh state and `batch_of(seed, T)`: synthetic global
    batches of T tokens a row."""
    objective = lm_objective(cfg.model, cfg.precision)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, 0)
    batch_of = lambda seed, T: to_global(synthetic_batch(seed, cfg.train.batch_size, T, cfg.model.vocab_size),
                                         batch_sharding(mesh), cfg.train.batch_size)
    runners = [StepRunner(objective, tx, c, shardings, frozen_shardings, mesh, log=print) for c in configs]
    return runners, state, frozen, batch_of


def test_drills_run_outside_the_production_step(shakespeare_store, tmp_path):
    cfg = _config(shakespeare_store, tmp_path)
    drill = dataclasses.replace(cfg, debug=dataclasses.replace(cfg.debug, inject_nan_at_step=2))
    runners, state, frozen, batch_of = _step_runners(cfg, cfg, drill)
    batch = batch_of(0, cfg.train.seq_len)
    for runner in runners:
        runner.compile(state, batch, frozen)
    assert runners[0].compiled_for(batch).as_text() == runners[1].compiled_for(batch).as_text()  # no injection in it
    flags = []
    for step in (1, 2, 3):
        state, metrics = runners[1](step, state, batch, frozen)
        flags.append(bool(metrics["nonfinite"]))
    assert flags == [False, True, False]  # only step 2 ran the drill variant, once


def test_a_batch_of_a_new_shape_gets_its_own_compiled_step(shakespeare_store, tmp_path):
    """RL rows are as long as their iteration's prompt bucket: a shorter batch compiles once more, then reuses."""
    cfg = _config(shakespeare_store, tmp_path)
    (runner,), state, frozen, batch_of = _step_runners(cfg, cfg)
    logged = []
    runner.log = logged.append
    long, short = batch_of(0, cfg.train.seq_len), batch_of(1, cfg.train.seq_len // 2)
    runner.compile(state, long, frozen)
    for step, batch in enumerate((long, short, short, long), start=1):
        state, metrics = runner(step, state, batch, frozen)
        assert np.isfinite(float(metrics["loss"]))
    shape = (cfg.train.batch_size, cfg.train.seq_len // 2)
    assert len(runner.compiled) == 2 and len(logged) == 1
    assert logged[0].startswith(f"compiled the train step for batches of shape {shape} in "), logged


@pytest.fixture(scope="module")
def head_only_run(shakespeare_store, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("head_only")
    cfg = _config(shakespeare_store, workdir, "--config.train.steps=4", "--config.train.sample_tokens=4")
    summary = train(cfg, stream=io.StringIO(), objective=head_only(pretrain_objective(cfg)))
    return cfg, workdir, summary


def test_the_loop_trains_an_objective_with_frozen_variables(head_only_run):
    cfg, workdir, summary = head_only_run
    assert summary["final_step"] == 4 and np.isfinite(summary["final_eval_loss"])
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["sample"]  # the sample merges trainable and frozen variables
    ckpt = Checkpointer(workdir / "checkpoints")
    objective = head_only(lm_objective(cfg.model, cfg.precision))
    abstract, _ = abstract_objective_state(objective, make_optimizer(cfg.optim, cfg.train.steps))
    restored = ckpt.restore(4, abstract, make_mesh(cfg.mesh), items=("state",))["state"]
    ckpt.close()
    assert _paths(restored.params) == {("lm_head",)}  # checkpoints hold what trains

    again = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6))
    out = io.StringIO()
    resumed = train(again, stream=out, objective=head_only(pretrain_objective(again)))
    assert "resuming from checkpoint step 4" in out.getvalue() and resumed["final_step"] == 6
