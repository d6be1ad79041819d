"""Auxiliary-loss-free balancing (DeepSeek-V3; `model.moe_bias_update_rate`) and sigmoid router scores
(`model.moe_router_scores`): the routing bias lives in the train state, gets no gradient and no optimizer update
(no weight decay), moves by exactly rate * sign(mean load - load) after each step, stays put on a vetoed step,
checkpoints with the state, and evens out a hot router's loads where the same run without it stays collapsed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.presets import PRESETS
from jaxllm.config.schema import ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.head import next_token_loss
from jaxllm.model.moe import EXPERT_LOAD, RouterBias
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.recovery import restore_latest
from jaxllm.train.state import init_objective_state
from jaxllm.train.step import SKIP_UPDATE, batch_sharding, jit_train_step, make_train_step

F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
RATE = 1e-2
ROWS, SEQ, VOCAB = 8, 16, 128


def _cfg(rate=RATE, scores="sigmoid", **extra):
    return ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=VOCAB, moe_router_scores=scores,
                              moe_bias_update_rate=rate, **extra))


def _bias(state) -> np.ndarray:
    (bias,) = [np.asarray(v[...]) for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
               if isinstance(v, RouterBias)]
    return bias


def _biased(build, bias_E):
    def build_model(key):
        model = build(key)
        bias = model.layers.mlp.router_bias
        bias[...] = jnp.broadcast_to(jnp.asarray(bias_E, jnp.float32), bias[...].shape)
        return model

    return build_model


def _router(state) -> np.ndarray:
    return np.asarray(state.params["layers"]["mlp"]["router"][...])


def _steps(cfg, steps: int, mesh=MeshConfig(2, 2, expert=2), loss_fn=None, seed_batches=True, start_bias=None,
           lr=3e-2):
    """A run of `steps` updates of `cfg`'s model (its routing bias starting at `start_bias` [E]): dict of the
    bias before and after each step (`biases`), the picks per layer and expert [L, E] the loss_fn reports for
    each step's batch before it (`loads`), each step's `metrics`, the first and last `routers`, the final `state`
    and the `mesh`."""
    objective = lm_objective(cfg, F32)
    if start_bias is not None:
        objective = dataclasses.replace(objective, build_model=_biased(objective.build_model, start_bias))
    if loss_fn is not None:
        objective = dataclasses.replace(objective, loss_fn=loss_fn)
    tx = make_optimizer(OptimConfig(lr=lr, warmup_steps=0), 10)
    mesh = make_mesh(mesh)
    run = dict(biases=[], loads=[], metrics=[], routers=[], mesh=mesh)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx), shardings, mesh, frozen_shardings)
        loads = jax.jit(lambda p, f, b: objective.loss_fn(nnx.merge(objective.graphdef, p, f), b, None)[2][EXPERT_LOAD])
        run["routers"].append(_router(state))
        for i in range(steps):
            batch = to_global(synthetic_batch(i if seed_batches else 0, ROWS, SEQ, VOCAB), batch_sharding(mesh), ROWS)
            if cfg.moe_bias_update_rate:
                run["biases"].append(_bias(state))
                run["loads"].append(np.asarray(loads(state.params, frozen, batch)))
            state, metrics = step(state, batch, frozen)
            run["metrics"].append(metrics)
        if cfg.moe_bias_update_rate:
            run["biases"].append(_bias(state))
        run["routers"].append(_router(state))
    return dict(run, state=state)


def test_the_bias_moves_by_the_rate_against_each_experts_load_and_nothing_else_touches_it():
    run = _steps(_cfg(), 3)
    assert not np.any(run["biases"][0])  # starts at zero
    assert all(EXPERT_LOAD not in m for m in run["metrics"])  # the step takes the loads out of the metrics
    for before, after, load in zip(run["biases"][:-1], run["biases"][1:], run["loads"], strict=True):
        expected = before + np.float32(RATE) * np.sign(load.mean(axis=-1, keepdims=True) - load)
        np.testing.assert_array_equal(after, expected.astype(np.float32))  # no decay, no Adam step
        assert np.any(after != before)
    assert np.any(run["routers"][-1] != run["routers"][0])  # the other parameters did train


def test_a_vetoed_step_leaves_the_bias_where_it_was():
    def skipping(model, batch, rng):
        loss, count, metrics = next_token_loss(model, batch, rng)
        return loss, count, {**metrics, SKIP_UPDATE: jnp.ones(())}

    run = _steps(_cfg(), 2, loss_fn=skipping)
    np.testing.assert_array_equal(run["biases"][-1], run["biases"][0])
    np.testing.assert_array_equal(run["routers"][-1], run["routers"][0])


def test_the_bias_checkpoints_with_the_state(tmp_path):
    run = _steps(_cfg(), 2)
    state, mesh = run["state"], run["mesh"]
    ckpt = Checkpointer(tmp_path, async_save=False, log=lambda msg: None)
    ckpt.save(2, state, {}, {})
    ckpt.close()
    with jax.set_mesh(mesh):
        restored, _ = restore_latest(Checkpointer(tmp_path, log=lambda msg: None), jax.eval_shape(lambda: state),
                                     mesh, lambda msg: None)
    np.testing.assert_array_equal(_bias(restored), run["biases"][-1])
    assert np.any(_bias(restored))


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
def test_balancing_evens_out_a_skewed_router(scores):
    """The same batch 24 times from a bias that sends every token to experts 0 and 1 (+0.2 on them): moved at 1e-2
    a step the bias evens the loads out (the experts' token counts' coefficient of variation over the last 8 steps
    0.26-0.34 against 1.73 at the start), while a bias that barely moves (1e-9) leaves them skewed. A sign error
    would keep the skew."""
    E = PRESETS["moe_tiny"]["num_experts"]
    skew = np.where(np.arange(E) < 2, 0.2, 0.0)

    def cvs(rate):
        run = _steps(_cfg(rate, scores, moe_aux_loss_coef=0.0), 24, mesh=MeshConfig(8), seed_batches=False,
                     start_bias=skew, lr=1e-4)
        return [np.mean([float(v) for k, v in m.items() if k.startswith("moe/expert_tokens_cv/")])
                for m in run["metrics"]]

    stuck, balanced = cvs(1e-9), cvs(1e-2)
    assert min(stuck) > 1.5, stuck  # every token on the two favoured experts, all along
    assert np.mean(balanced[-8:]) < 0.25 * np.mean(stuck[-8:]), balanced


@pytest.mark.parametrize("overrides, key", [
    (dict(moe_router_scores="tanh"), "model.moe_router_scores"),
    (dict(moe_bias_update_rate=-1e-3), "model.moe_bias_update_rate"),
])
def test_bad_balancing_settings_are_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        ModelConfig(**dict(PRESETS["moe_tiny"], **overrides)).check()


def test_a_dense_model_has_no_bias_to_balance():
    with pytest.raises(ConfigError, match="^model.moe_bias_update_rate"):
        ModelConfig(moe_bias_update_rate=1e-3).check()


def test_export_refuses_a_router_transformers_cannot_hold(tmp_path):
    from jaxllm.interop import hf

    model = lm_objective(_cfg(), F32).build_model(jax.random.key(0))
    with pytest.raises(ValueError, match="cannot be exported"):
        hf.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
