"""The anomaly rule of the train step, replayed over recorded loss and gradient-norm traces.

`tests/data/healthy_traces.json` holds the per-step loss and gradient norm of healthy 300-step runs of the
default job (`make train`'s config: several seeds and the tied-embeddings variant), recorded with detection
switched off. The old rule rolled several of them back or killed them; the rule must now leave them alone and
still catch every injected fault (the drills' NaN and x1000 spike, exactly as `debug.inject_*` produce them).
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config.schema import AnomalyConfig
from jaxllm.train.anomaly import is_spike, replay

TRACES = json.loads((Path(__file__).parent / "data" / "healthy_traces.json").read_text())
RULE = AnomalyConfig()


def _acted(incidents):
    return [(i, kind) for i, kind, acted in incidents if acted]


@pytest.mark.parametrize("run", sorted(TRACES))
def test_healthy_runs_of_the_default_job_raise_no_anomaly(run):
    trace = TRACES[run]
    incidents = replay(trace["loss"], trace["grad_norm"], RULE)
    assert _acted(incidents) == [], incidents


@pytest.mark.parametrize("run", sorted(TRACES))
def test_injected_nan_and_spike_are_caught_at_their_step(run):
    trace = TRACES[run]
    loss, grad = np.array(trace["loss"]), np.array(trace["grad_norm"])
    for at in (25, 155, 290):  # early (fast-falling loss), around the recorded hard batch, late
        spiked_loss, spiked_grad = loss.copy(), grad.copy()
        spiked_loss[at] *= 1000.0  # debug.inject_spike_at_step scales the loss and every gradient by 1000
        spiked_grad[at] *= 1000.0
        assert _acted(replay(spiked_loss, spiked_grad, RULE)) == [(at, "loss_spike")]
        nan_loss = loss.copy()
        nan_loss[at] = np.nan
        assert _acted(replay(nan_loss, grad, RULE)) == [(at, "nonfinite")]


def test_one_hard_batch_is_not_a_spike_but_a_blow_up_is():
    loss, grad = np.array(TRACES["seed0"]["loss"]), np.array(TRACES["seed0"]["grad_norm"])
    for factor, expected in ((1.3, []), (2.0, [(200, "loss_spike")])):
        excursion = loss.copy()
        excursion[200] *= factor
        assert _acted(replay(excursion, grad, RULE)) == expected, factor


def test_gradient_norm_spikes_are_reported_and_acted_on_only_when_asked():
    grad = np.array(TRACES["seed0"]["grad_norm"])
    loss = np.array(TRACES["seed0"]["loss"])
    grad[200] *= 20.0
    reported = replay(loss, grad, RULE)
    assert (200, "grad_spike", False) in reported and _acted(reported) == []
    acting = replay(loss, grad, AnomalyConfig(act_on_grad_spike=True))
    assert (200, "grad_spike", True) in acting


def test_no_spike_without_enough_history():
    history = jnp.full((50,), jnp.nan, jnp.float32).at[-5:].set(3.0)
    assert not bool(is_spike(jnp.float32(3000.0), history, 6.0, 20, 1.5))
    assert bool(is_spike(jnp.float32(3000.0), history, 6.0, 5, 1.5))


def test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged():
    """A non-finite step under skip_anomalies (the real compiled step, its loss x NaN as debug.inject_nan_at_step
    does): parameters, optimizer state and optax's step counts come out bitwise as they went in. A healthy step
    from the same state then changes all of them (so the comparison can see a change)."""
    import jax

    from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
    from jaxllm.data.synthetic import synthetic_batch
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.optim.chain import make_optimizer
    from jaxllm.train.faults import NAN_FACTOR, with_scaled_loss
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.train.state import init_objective_state
    from jaxllm.train.step import make_train_step

    model = ModelConfig(vocab_size=128, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
    objective = lm_objective(model, PrecisionConfig(params="float32", compute="float32", output="float32"))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=2), 10)
    mesh = make_mesh(MeshConfig(1, 1, 1, 1), devices=jax.devices()[:1])
    batch = synthetic_batch(0, 4, 16, 128)
    with jax.set_mesh(mesh):
        state, frozen, _, _ = init_objective_state(objective, tx, mesh, seed=0)
        healthy = jax.jit(make_train_step(objective, tx, skip_anomalies=True))
        state, _ = healthy(state, batch, frozen)  # one real update first: Adam's moments and counts are nonzero
        before = jax.tree.map(np.asarray, (state.params, state.opt_state))
        skipped, metrics = jax.jit(make_train_step(with_scaled_loss(objective, NAN_FACTOR), tx,
                                                   skip_anomalies=True))(state, batch, frozen)
        stepped, _ = healthy(state, batch, frozen)
    assert bool(metrics["anomaly"]) and int(skipped.step) == int(state.step) + 1
    counts = [x for path, x in jax.tree_util.tree_flatten_with_path(before[1])[0] if "count" in str(path[-1])]
    assert counts and all(int(c) == 1 for c in counts)  # optax's step counts (schedule, Adam bias correction)
    after = jax.tree.map(np.asarray, (skipped.params, skipped.opt_state))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    changed = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves((stepped.params,
                                                                                       stepped.opt_state)),
                                                                      jax.tree.leaves(before))]
    assert sum(changed) >= len(changed) - 1  # all but the constant hyperparameters of inject_hyperparams
