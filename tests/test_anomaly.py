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

from jaxllm.config import AnomalyConfig
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
