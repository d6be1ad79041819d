"""Diagnostic statistics (jaxllm/observe/): per-layer and per-group norms against numpy, the diagnostic
variant's update bitwise equal to the production step's, the production step's program unchanged by
`diagnostics.every`, the records of a short run, and the naming of the first non-finite layer."""

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train_runs import ROOT, TINY, metrics

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import ConfigError, validate
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.observe.comms import collectives
from jaxllm.observe.nonfinite import first_nonfinite
from jaxllm.observe.norms import (GROUPS, STATS, arrays, global_norm, layer_and_group_norms, leaves,
                                     second_moments)
from jaxllm.train.diagnostic_step import NOT_REPRODUCED
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.loop import train
from jaxllm.train.step_runner import StepRunner
from jaxllm.objectives.pretrain import pretrain_objective
from jaxllm.train.state import init_objective_state
from jaxllm.train.step import batch_sharding

LAYERS = 2  # the tiny preset's
PER_STEP = ("grad_norm", "grad_norm_clipped", "param_norm", "update_norm", "update_ratio")


def _config(store, workdir, *overrides):
    _, pairs = split_overrides([*TINY, f"--config.data.path={store}", "--config.train.eval_every=1000",
                                "--config.checkpoint.every=2", "--config.optim.warmup_steps=0",
                                "--config.optim.clip_norm=0.05", *overrides])
    return validate(build_config(str(ROOT / "configs" / "pretrain.py"), pairs, str(workdir)), 8)


def _with_every(cfg, every):
    return dataclasses.replace(cfg, diagnostics=dataclasses.replace(cfg.diagnostics, every=every))


@pytest.fixture(scope="module")
def setup(shakespeare_store, tmp_path_factory):
    """The tiny job's objective, optimizer, mesh, a fresh state and a batch (synthetic tokens), and StepRunners
    of diagnostics.every = 0 and 50."""
    cfg = _config(shakespeare_store, tmp_path_factory.mktemp("diag_setup"))
    objective = pretrain_objective(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, 0)
    batch = to_global(synthetic_batch(0, cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size),
                      batch_sharding(mesh), cfg.train.batch_size)
    runners = [StepRunner(objective, tx, _with_every(cfg, every), shardings, frozen_shardings, mesh, log=print)
               for every in (0, 50)]
    return dict(cfg=cfg, state=state, frozen=frozen, batch=batch, runners=runners, mesh=mesh)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_per_layer_and_group_norms_match_numpy(setup):
    params = setup["state"].params
    grads = jax.tree.map(lambda x: x * 3.0, params)  # stand-ins with distinct norms
    updates = jax.tree.map(lambda x: -0.01 * x * x, params)
    with jax.set_mesh(setup["mesh"]):
        stats = jax.device_get(jax.jit(layer_and_group_norms)(params, grads, updates))
    infos = leaves(params)
    xs = {"param_norm": arrays(params), "grad_norm": arrays(grads), "update_norm": arrays(updates)}
    for stat, trees in xs.items():
        arrs = [np.asarray(x, np.float64) for x in trees]
        stacked = [a for info, a in zip(infos, arrs) if info.layer_axes == (0,)]
        assert len(stacked) == 9  # 2 norms + q, k, v, o + gate, up, down
        for i in range(LAYERS):
            expected = np.sqrt(sum(np.sum(a[i] ** 2) for a in stacked))
            np.testing.assert_allclose(stats[f"diag/{stat}/layer_{i}"], expected, rtol=1e-5)
        q = [a for info, a in zip(infos, arrs) if info.path == "layers.self_attn.q_proj"]
        np.testing.assert_allclose(stats[f"diag/{stat}/q"], np.sqrt(np.sum(q[0] ** 2)), rtol=1e-5)
        # The groups partition the parameters: their squares add up to the global norm's square.
        total = sum(stats[f"diag/{stat}/{g}"] ** 2 for g in GROUPS if f"diag/{stat}/{g}" in stats)
        np.testing.assert_allclose(total, np.sum([np.sum(a ** 2) for a in arrs]), rtol=1e-5)
    assert {f"diag/{s}/{g}" for s in STATS for g in GROUPS if g != "lora"} <= set(stats)
    np.testing.assert_allclose(stats["diag/update_ratio/layer_1"],
                               stats["diag/update_norm/layer_1"] / stats["diag/param_norm/layer_1"], rtol=1e-6)


def test_production_step_program_is_the_same_with_diagnostics_on_and_off(setup):
    off, on = setup["runners"]
    state, batch, frozen = setup["state"], setup["batch"], setup["frozen"]
    for runner in (off, on):
        runner.compile(state, batch, frozen)
    hot = off.compiled_for(batch).as_text()
    assert hot == on.compiled_for(batch).as_text()
    with jax.set_mesh(setup["mesh"]):  # the variant is another program (the comparison can see a difference)
        lowered = [jax.jit(fn).lower(state, batch, frozen).as_text()
                   for fn in (on.diagnostics._step_fn(), on._jit(on.objective))]
    assert lowered[0] != lowered[1]


def test_on_cpu_no_collective_of_the_variant_runs_in_a_loop(setup):
    """XLA:CPU does not keep a loop's collectives in one order with the collectives beside it across devices (a
    2-process GRPO job hung replaying a NaN step: jaxllm/train/diagnostic_step.py), so there the variant runs its
    layers unrolled: every collective of its program runs once a step. The production step keeps its layer
    scan: its FSDP all-gathers run once per layer, in the loop (the check sees a loop where there is one)."""
    off, on = setup["runners"]
    state, batch, frozen, mesh = setup["state"], setup["batch"], setup["frozen"], setup["mesh"]
    with jax.set_mesh(mesh):
        variant = on.diagnostics._variant(None).lower(state, batch, frozen).compile().as_text()
    shape, names = tuple(mesh.shape.values()), tuple(mesh.axis_names)
    found, unknown_loops = collectives(variant, shape, names)
    assert found and unknown_loops == 0 and [c.name for c in found if c.runs != 1] == []
    off.compile(state, batch, frozen)
    production, _ = collectives(off.compiled_for(batch).as_text(), shape, names)
    assert any(c.kind == "all-gather" and c.runs == LAYERS for c in production)


def test_the_variant_updates_bitwise_as_the_production_step(setup):
    """Two measured steps (diagnostics.every=50, steps 50 and 100; the second with Adam's moments nonzero) against
    two unmeasured ones from the same state: the same new state, the same metrics, and diag statistics besides."""
    off, on = setup["runners"]
    batch, frozen = setup["batch"], setup["frozen"]
    hot, variant = _copy(setup["state"]), _copy(setup["state"])
    for step in (50, 100):
        hot, hot_metrics = off(step, hot, batch, frozen)
        variant, variant_metrics = on(step, variant, batch, frozen)
    assert _bits(hot) == _bits(variant)
    assert not any(k.startswith("diag/") for k in hot_metrics)
    assert {k: float(v) for k, v in hot_metrics.items()} == {k: float(v) for k, v in variant_metrics.items()
                                                              if not k.startswith("diag/")}
    m = {k: float(v) for k, v in variant_metrics.items()}
    # Clipping at 0.05 bounds the norm; the groups' gradient norms add up to the step's global gradient norm.
    assert m["grad_norm"] > 0.05 and m["grad_norm_clipped"] == pytest.approx(0.05)
    assert sum(m[f"diag/grad_norm/{g}"] ** 2 for g in GROUPS if f"diag/grad_norm/{g}" in m) == pytest.approx(
        m["grad_norm"] ** 2, rel=1e-4)
    assert m["update_ratio"] == pytest.approx(m["update_norm"] / m["param_norm"], rel=1e-6)
    assert m["param_norm"] == pytest.approx(float(global_norm(setup["state"].params)), rel=0.05)
    nu = np.concatenate([np.asarray(x, np.float64).ravel() for x in second_moments(variant.opt_state)])
    assert nu.size == sum(np.size(x) for x in jax.tree.leaves(variant.params))  # one entry per parameter
    assert m["diag/adam_v_rms"] == pytest.approx(np.sqrt(np.mean(nu ** 2)), rel=1e-5) and m["diag/adam_v_rms"] > 0
    assert m["diag/adam_v_min"] == nu.min()  # 0 here: embedding rows of tokens absent from the batch


def _plant_nan(params, path: str, layer: int):
    """`params` with one NaN in `layer` of the stacked parameter at dotted `path` (placed as before)."""
    def plant(p, var):
        if ".".join(str(getattr(k, "key", k)) for k in p) != path:
            return var
        x = var[...]
        return var.replace(jax.device_put(x.at[(layer,) + (0,) * (x.ndim - 1)].set(jnp.nan), x.sharding))

    return jax.tree_util.tree_map_with_path(plant, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_a_planted_nan_is_named_by_layer_and_parameter(setup):
    off, _ = setup["runners"]
    state = setup["state"]
    bad = state.replace(params=_plant_nan(_copy(state.params), "layers.mlp.down_proj", 1))
    off.diagnostics.remember(7, setup["batch"])
    writes = []
    record = off.diagnostics.explain({"step": 7, "nonfinite": 1.0}, bad, setup["frozen"],
                                     type("W", (), {"write": staticmethod(writes.append)}), skipped=True)
    assert record["diag/first_nonfinite"] == "parameters of layer 1 (layers.mlp.down_proj)"
    (written,) = writes
    assert written["step"] == 7 and written["diag/first_nonfinite"] == record["diag/first_nonfinite"]
    assert np.isfinite(written["diag/param_norm/layer_0"]) and np.isnan(written["diag/param_norm/layer_1"])
    # The same batch from healthy parameters is finite: nothing to name.
    healthy = off.diagnostics.explain({"step": 7, "nonfinite": 1.0}, state, setup["frozen"],
                                      type("W", (), {"write": staticmethod(writes.append)}), skipped=True)
    assert healthy["diag/first_nonfinite"] == NOT_REPRODUCED


def _flags(bad_params=(), bad_grads=()):
    names = ("layers.input_layernorm.scale", "layers.self_attn.q_proj", "layers.mlp.up_proj",
             "layers.mlp.down_proj")
    tree = lambda bad: {**{n: np.array([(n, i) not in bad for i in range(3)]) for n in names},
                        "embed_tokens.embedding": np.array(("embed_tokens.embedding", None) not in bad),
                        "lm_head": np.array(("lm_head", None) not in bad)}
    return {"params": tree(set(bad_params)), "grads": tree(set(bad_grads))}


def test_first_nonfinite_follows_the_order_of_computation():
    # Gradients: backward order, so the last layer's down projection comes before its up projection and before
    # earlier layers; the head before any layer.
    grads = {("layers.mlp.up_proj", 2), ("layers.mlp.down_proj", 1), ("layers.self_attn.q_proj", 1)}
    assert first_nonfinite(_flags(bad_grads=grads), 1.0) == "gradients of layer 2 (layers.mlp.up_proj)"
    grads.discard(("layers.mlp.up_proj", 2))
    assert first_nonfinite(_flags(bad_grads=grads), 1.0) == "gradients of layer 1 (layers.mlp.down_proj)"
    assert first_nonfinite(_flags(bad_grads=grads | {("lm_head", None)}), 1.0) == "gradients of lm_head"
    # Parameters: forward order, before activations, the loss and gradients.
    params = {("layers.mlp.down_proj", 0), ("layers.self_attn.q_proj", 2)}
    assert (first_nonfinite(_flags(params, grads), float("nan"))
            == "parameters of layer 0 (layers.mlp.down_proj)")
    assert first_nonfinite(_flags(bad_params={("embed_tokens.embedding", None)}), 1.0) == \
        "parameters of embed_tokens.embedding"
    acts = {"act_rms": np.array([1.0, np.nan, np.nan]), "act_max": np.array([1.0, 2.0, np.inf]),
            "logits_max": np.nan}
    assert first_nonfinite(_flags(bad_grads=grads), float("nan"), acts) == "activations of layer 1"
    finite_acts = {"act_rms": np.ones(3), "act_max": np.ones(3), "logits_max": np.inf}
    assert first_nonfinite(_flags(), float("nan"), finite_acts) == "activations of the output logits"
    assert first_nonfinite(_flags(bad_grads=grads), float("nan")) == "the loss"
    assert first_nonfinite(_flags(), 1.0) is None


@pytest.fixture(scope="module")
def diag_run(shakespeare_store, tmp_path_factory):
    """5 tiny steps with diagnostics every 2 steps and a NaN injected at step 3 (rolled back to step 2)."""
    workdir = tmp_path_factory.mktemp("diag_run")
    cfg = _config(shakespeare_store, workdir, "--config.train.steps=5", "--config.diagnostics.every=2",
                  "--config.debug.inject_nan_at_step=3")
    out = io.StringIO()
    summary = train(cfg, stream=out)
    return workdir, summary, out.getvalue()


ACTIVATION_STATS = ("act_rms", "act_max", "gate_saturation", "attn_logit_max")  # jaxllm/observe/activations.py


def test_a_run_writes_per_step_norms_and_diag_records_every_n_steps(diag_run):
    workdir, summary, _ = diag_run
    records = metrics(workdir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 3, 4, 5]  # step 3 non-finite, rolled back and retried
    for r in steps:
        assert set(PER_STEP) <= set(r) and not any(k.startswith("diag/") for k in r), r
    finite = [r for r in steps if not r["nonfinite"]]
    assert all(r["param_norm"] > 0 and r["update_ratio"] > 0 for r in finite)
    periodic = [r for r in records if "diag/grad_norm/layer_0" in r and "diag/first_nonfinite" not in r]
    assert [r["step"] for r in periodic] == [2, 4]
    expected = ({f"diag/{s}/layer_{i}" for s in STATS for i in range(LAYERS)}
                | {f"diag/{s}/{g}" for s in STATS for g in GROUPS if g != "lora"}
                | {"diag/adam_v_rms", "diag/adam_v_min", "diag/logits_max", "diag/logits_lse_mean"}
                | {f"diag/{s}/layer_{i}" for s in ACTIVATION_STATS for i in range(LAYERS)})
    for r in periodic:
        assert set(r) == expected | {"step"}, set(r) ^ (expected | {"step"})
        assert all(np.isfinite(v) for v in r.values())
    assert summary["rollbacks"] == 1


def test_a_non_finite_step_is_analysed_and_named_in_metrics_and_incidents(diag_run):
    """The drill multiplies step 3's loss by NaN: replayed as it ran, parameters are finite and the loss is the
    first non-finite value (this variant measures no activations)."""
    workdir, _, log = diag_run
    (named,) = [r for r in metrics(workdir) if "diag/first_nonfinite" in r]
    assert named["step"] == 3 and named["diag/first_nonfinite"] == "the loss"
    assert np.isnan(named["diag/grad_norm/layer_0"]) and np.isfinite(named["diag/param_norm/layer_0"])
    (incident,) = [json.loads(x) for x in (workdir / "incidents.jsonl").read_text().splitlines()]
    assert incident["kind"] == "nonfinite" and incident["first_nonfinite"] == "the loss"
    assert "step 3: first non-finite: the loss" in log


def test_diagnostics_every_must_not_be_negative(shakespeare_store, tmp_path):
    with pytest.raises(ConfigError, match="diagnostics.every"):
        _config(shakespeare_store, tmp_path, "--config.diagnostics.every=-1")
