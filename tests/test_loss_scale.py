"""Loss scaling for float16 compute (jaxllm/optim/loss_scale.py): torch.amp.GradScaler's policy inside the compiled step,
the scale in the train state and the checkpoint."""

import dataclasses
import functools
import io
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from train_runs import RESUME, ROOT, TINY, metrics

from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import (ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, default_config_dict,
                           validate)
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.optim.loss_scale import INIT_SCALE, NO_LOSS_SCALING, LossScaling, loss_scaling
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.train.faults import with_scaled_loss
from jaxllm.train.loop import train
from jaxllm.train.objective import Objective
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.train.recovery import restore_latest
from jaxllm.train.state import abstract_objective_state, new_train_state
from jaxllm.objectives.pretrain import abstract_train_state, create_train_state
from jaxllm.train.step import grads_and_loss, make_train_step

# Finite (False) and overflowing (True) steps: with a growth interval of 3 the scale grows at steps 3, 10 and 15
# and backs off at 4, 7, 11 and 12 (7 also restarts the count that 5 and 6 built).
OVERFLOWS = [False, False, False, True, False, False, True, False, False, False, True, True, False, False, False,
             False]
GROWTH_INTERVAL = 3


def _validated(**precision):
    cd = default_config_dict()
    cd.precision.update(precision)
    return validate(cd, 1).precision


def test_float16_turns_dynamic_scaling_on_and_others_are_selectable():
    assert _validated(compute="float16").loss_scale == "dynamic"
    assert _validated(compute="float32").loss_scale == "none"
    assert _validated(compute="bfloat16").loss_scale == "none"
    assert loss_scaling(_validated(compute="float16")) == LossScaling("dynamic", INIT_SCALE, 2000)
    assert loss_scaling(_validated(compute="float16", loss_scale="none")).enabled is False
    assert loss_scaling(_validated(compute="float16", loss_scale="static:1024")) == LossScaling("static", 1024.0, 2000)
    assert loss_scaling(_validated(compute="float32", loss_scale="dynamic", loss_scale_growth_interval=7)) == \
        LossScaling("dynamic", INIT_SCALE, 7)


@pytest.mark.parametrize("key,value", [("loss_scale", "static:abc"), ("loss_scale", "static:-2"),
                                       ("loss_scale", "static:inf"), ("loss_scale", "dynamc"),
                                       ("loss_scale_growth_interval", 0)])
def test_a_malformed_loss_scale_is_a_config_error(key, value):
    with pytest.raises(ConfigError, match=f"^precision.{key}: "):
        _validated(compute="float16", **{key: value})


# A one-parameter objective whose gradient the batch sets: `poison` multiplies the backward pass only (1: the
# true gradient, inf: an overflow), so the loss stays finite, as when a float16 backward pass overflows.
@jax.custom_vjp
def _poisoned(w, poison):
    return w


_poisoned.defvjp(lambda w, poison: (w, poison), lambda poison, g: (g * poison[0], jnp.zeros_like(poison)))


class _Toy(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((1,), jnp.float32))


def _toy_loss(model, batch, rng):
    return jnp.sum(_poisoned(model.w[...], batch["poison"]) * 0.5), jnp.ones((), jnp.float32), {}


def _counts(opt_state) -> list[int]:
    """Every step counter of an optimizer state (the schedule's and the optimizer's)."""
    return [int(x) for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0] if "count" in str(path[-1])]


DYNAMIC = LossScaling("dynamic", INIT_SCALE, GROWTH_INTERVAL)


@functools.cache  # shared by the tests that read it
def _jaxllm_sequence(scaling: LossScaling = DYNAMIC):
    """(scale after each step, which steps left params and optimizer step counts as they were, metrics, final
    state) of the real jaxllm train step on OVERFLOWS."""
    objective = Objective(name="toy", build_model=lambda key: _Toy(nnx.Rngs(0)), loss_fn=_toy_loss)
    tx = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", clip_norm=0.0), 100)
    _, params, _ = objective.split(objective.build_model(None))
    state = new_train_state(params, tx, 0, window=2 * len(OVERFLOWS), init_scale=scaling.init_scale)
    step = jax.jit(make_train_step(objective, tx, loss_scaling=scaling, skip_anomalies=True))
    scales, skipped, records = [], [], []
    for overflow in OVERFLOWS:
        before = (np.asarray(state.params["w"][...]), _counts(state.opt_state))
        state, m = step(state, {"poison": jnp.asarray([np.inf if overflow else 1.0], jnp.float32)})
        after = (np.asarray(state.params["w"][...]), _counts(state.opt_state))
        scales.append(float(state.loss_scale.scale))
        kept = np.array_equal(before[0], after[0])
        assert (before[1] == after[1]) == kept  # a skipped step advances no counter; a taken one every counter
        skipped.append(kept)
        records.append(jax.device_get(m))
    return scales, skipped, records, state


def test_scale_sequence_follows_the_grad_scaler_rule_without_torch():
    """torch's GradScaler rule, written out: an overflow skips the step, halves the scale and restarts the count;
    GROWTH_INTERVAL finite steps in a row double it."""
    scale, finite_in_a_row, want = INIT_SCALE, 0, []
    for overflow in OVERFLOWS:
        if overflow:
            scale, finite_in_a_row = scale * 0.5, 0
        else:
            finite_in_a_row += 1
            if finite_in_a_row == GROWTH_INTERVAL:
                scale, finite_in_a_row = scale * 2.0, 0
        want.append(scale)
    scales, skipped, _, _ = _jaxllm_sequence()
    assert scales == want and skipped == OVERFLOWS


def test_scale_sequence_and_skipped_steps_match_torch_grad_scaler():
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=GROWTH_INTERVAL)
    want_scales, want_skipped = [], []
    for overflow in OVERFLOWS:
        opt.zero_grad()
        scaler.scale((p * 0.5).sum()).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        want_scales.append(scaler.get_scale())
        want_skipped.append(bool(torch.equal(before, p.detach())))

    scales, skipped, _, _ = _jaxllm_sequence()
    assert want_skipped == OVERFLOWS  # the torch side really overflowed where planted
    assert skipped == want_skipped
    assert scales == want_scales
    assert len(set(scales)) > 2  # it grew and backed off


def test_an_overflow_is_skipped_not_an_anomaly_and_stays_out_of_the_windows():
    scales, _, records, state = _jaxllm_sequence()
    used = [INIT_SCALE] + scales[:-1]
    assert [r["loss_scale"] for r in records] == used  # each step reports the scale it used
    assert [r["overflow"] for r in records] == [float(o) for o in OVERFLOWS]
    assert not any(r["anomaly"] or r["nonfinite"] for r in records)
    assert all(np.isfinite(r["loss"]) for r in records)
    assert int(np.isfinite(state.loss_window).sum()) == OVERFLOWS.count(False)  # the finite steps only
    assert int(np.isfinite(state.grad_window).sum()) == OVERFLOWS.count(False)
    assert not np.any(np.isinf(state.grad_window))  # no overflow's infinite norm got in


def test_a_static_scale_skips_overflows_and_never_changes():
    scales, skipped, records, _ = _jaxllm_sequence(LossScaling("static", 1024.0, GROWTH_INTERVAL))
    assert scales == [1024.0] * len(OVERFLOWS) and skipped == OVERFLOWS
    assert not any(r["anomaly"] for r in records)


def test_without_scaling_an_infinite_gradient_is_an_anomaly_as_before():
    _, skipped, records, state = _jaxllm_sequence(NO_LOSS_SCALING)
    assert [bool(r["nonfinite"]) for r in records] == OVERFLOWS and skipped == OVERFLOWS  # skip_anomalies
    assert "loss_scale" not in records[0] and "overflow" not in records[0]
    assert float(state.loss_scale.scale) == 1.0


def test_a_nonfinite_loss_under_scaling_is_still_an_anomaly():
    objective = Objective(name="toy", build_model=lambda key: _Toy(nnx.Rngs(0)),
                          loss_fn=lambda m, b, r: (jnp.sum(m.w[...]) * jnp.nan, jnp.ones(()), {}))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    _, params, _ = objective.split(objective.build_model(None))
    state = new_train_state(params, tx, 0, window=4, init_scale=INIT_SCALE)
    _, m = jax.jit(make_train_step(objective, tx, loss_scaling=LossScaling("dynamic", INIT_SCALE, 3)))(
        state, {"poison": jnp.ones((1,))})
    assert bool(m["anomaly"]) and bool(m["nonfinite"])


SMALL = ModelConfig(vocab_size=128, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
PLANTED = 2e-8  # the loss factor: every float16 cotangent falls below half float16's smallest subnormal (3e-8)


def test_a_planted_tiny_gradient_underflows_in_float16_without_scaling_and_not_with_it():
    batch = synthetic_batch(0, 4, 32, SMALL.vocab_size)

    def grads_of(compute: str):
        """Gradients of the planted loss (a function of the loss scale) under `compute`."""
        precision = PrecisionConfig(params="float32", compute=compute, output="float32")
        objective = with_scaled_loss(lm_objective(SMALL, precision), PLANTED)
        _, params, _ = objective.split(objective.build_model(jax.random.key(0)))
        step = jax.jit(lambda scale: grads_and_loss(objective.graphdef, params, batch, loss_fn=objective.loss_fn,
                                                    scale=scale)[0])
        return lambda scale: jnp.concatenate([x.ravel() for x in jax.tree.leaves(step(jnp.float32(scale)))])

    reference = grads_of("float32")(1.0)
    float16 = grads_of("float16")  # one compilation for both: the loss times 1 is the unscaled backward pass
    unscaled, scaled = float16(1.0), float16(INIT_SCALE)
    assert float(jnp.linalg.norm(reference)) > 0
    assert float(jnp.max(jnp.abs(unscaled))) == 0.0  # every gradient flushed to zero
    cosine = jnp.dot(scaled, reference) / (jnp.linalg.norm(scaled) * jnp.linalg.norm(reference))
    assert float(cosine) > 0.999, float(cosine)  # 0.999999 and a norm ratio of 1.00002 here
    assert float(jnp.linalg.norm(scaled) / jnp.linalg.norm(reference)) == pytest.approx(1.0, rel=0.01)


FLOAT16_STEPS = 16


def _config(store, workdir):
    """The default job with the tests' tiny model, computing in float16 (so dynamically loss-scaled), the scale
    growing after 2 finite steps so that it both grows and backs off within the run; every checkpoint kept."""
    _, pairs = split_overrides([*TINY, f"--config.data.path={store}", *RESUME, "--config.precision.compute=float16",
                                "--config.precision.loss_scale_growth_interval=2", "--config.checkpoint.keep=100",
                                f"--config.train.steps={FLOAT16_STEPS}"])
    return validate(build_config(str(ROOT / "configs" / "pretrain.py"), pairs, str(workdir)), 8)


@pytest.fixture(scope="module")
def float16_run(shakespeare_store, tmp_path_factory):
    """An uninterrupted float16 run (in process: one compilation, no interpreter start) and its metrics."""
    workdir = tmp_path_factory.mktemp("float16")
    cfg = _config(shakespeare_store, workdir)
    summary = train(cfg, stream=io.StringIO())
    return cfg, workdir, summary, [r for r in metrics(workdir) if "loss" in r]


def test_a_float16_run_trains_with_a_finite_falling_loss(float16_run):
    cfg, _, summary, records = float16_run
    assert cfg.precision.loss_scale == "dynamic"
    assert [r["step"] for r in records] == list(range(1, FLOAT16_STEPS + 1))
    losses = np.array([r["loss"] for r in records])
    assert np.all(np.isfinite(losses))
    assert losses[-4:].mean() < losses[:4].mean() - 0.1, losses
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    scales = [r["loss_scale"] for r in records]
    assert records[0]["loss_scale"] == INIT_SCALE
    assert {r["overflow"] for r in records} == {0.0, 1.0}  # some steps overflowed and were skipped
    assert any(b > a for a, b in zip(scales, scales[1:])) and any(b < a for a, b in zip(scales, scales[1:]))
    assert not any(r["anomaly"] for r in records) and summary["rollbacks"] == 0  # overflows are no anomaly


def _train_state(cfg, workdir, step):
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract, _ = abstract_objective_state(lm_objective(cfg.model, cfg.precision), tx, cfg.anomaly.window)
    ckpt = Checkpointer(workdir / "checkpoints")
    try:
        return ckpt.restore(step, abstract, make_mesh(cfg.mesh), items=("state",))["state"]
    finally:
        ckpt.close()


def test_resume_is_bitwise_with_the_scale_in_the_state(float16_run, shakespeare_store, tmp_path):
    cfg, workdir, _, records = float16_run
    # Resume from the newest checkpoint taken mid-way through growing (its good-step count is not 0): losing
    # the scale or its count would change which later steps overflow.
    at = max(step for step in range(2, FLOAT16_STEPS, 2)
             if int(_train_state(cfg, workdir, step).loss_scale.good_steps) > 0)
    saved = _train_state(cfg, workdir, at).loss_scale
    assert float(saved.scale) == records[at]["loss_scale"]  # the scale step `at + 1` used
    shutil.copytree(workdir / "checkpoints" / str(at), tmp_path / "checkpoints" / str(at))

    out = io.StringIO()
    train(_config(shakespeare_store, tmp_path), stream=out)
    assert f"resuming from checkpoint step {at}" in out.getvalue()
    resumed = [r for r in metrics(tmp_path) if "loss" in r]
    keys = ("step", "loss", "grad_norm", "loss_scale", "overflow")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in records[at:]]
    for a, b in zip(jax.tree.leaves(_train_state(cfg, tmp_path, FLOAT16_STEPS)),
                    jax.tree.leaves(_train_state(cfg, workdir, FLOAT16_STEPS))):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def test_a_checkpoint_from_before_loss_scaling_is_named_not_moved_aside(tmp_path):
    f32 = PrecisionConfig(params="float32", compute="float32", output="float32")
    tx = make_optimizer(OptimConfig(), 10)
    mesh = make_mesh(MeshConfig(8, 1, 1, 1))
    _, state, _ = create_train_state(SMALL, f32, tx, mesh, seed=0)
    older = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "loss_scale"}
    ckpt = Checkpointer(tmp_path, async_save=False, log=lambda msg: None)
    ckpt.save(3, older, {}, {})
    abstract = abstract_train_state(SMALL, f32, tx)
    with pytest.raises(ConfigError, match=r"^checkpoint: .*/3 was written by an older jaxllm: its train state has "
                                          r"no loss_scale; start a new run from its parameters"):
        restore_latest(ckpt, abstract, mesh, print)
    assert ckpt.steps() == [3]  # still there, not quarantined as unreadable
    params = ckpt.restore_params(3, abstract.params, mesh)  # what checkpoint.restore_from reads
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)))
    ckpt.close()
