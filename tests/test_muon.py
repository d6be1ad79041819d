"""Muon (`optim.name=muon`, jaxllm/optim/muon.py): the update of a matrix equals a NumPy transcription of the
reference step, stacked layers and experts are one matrix each, the Adam side is optax's AdamW on exactly the
parameters it should have, and a sharded (fsdp=2, tensor=2) run with gradient accumulation, clipping and the
anomaly veto equals the single-device run, with ZeRO-1 or the optimizer state in host memory too, and resumes
from a checkpoint bitwise."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from in_process_steps import run_steps

from jaxllm.config.cli import build_config
from jaxllm.config.schema import ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, validate
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.build import build_model
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.optim.chain import current_clip_norm, current_lr, decay_mask, make_optimizer
from jaxllm.optim.muon import MUON, muon_labels, regroup, scale_by_muon
from jaxllm.parallel.host_rows import to_global
from jaxllm.observe.norms import adam_v_stats, second_moments
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.sharding import report_rows
from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.train.recovery import restore_latest
from jaxllm.train.state import abstract_objective_state, init_objective_state, state_shardings
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step, vetoed_update

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
CFG = OptimConfig(name="muon", lr=2e-2, warmup_steps=0, schedule="constant", clip_norm=0.0, weight_decay=0.1)


def reference_muon(w, grads, lr, weight_decay, beta=0.95, steps=5):
    """The matrices `w` after Keller Jordan's Muon steps on `grads` (modded-nanogpt: momentum buffer, Nesterov,
    quintic Newton-Schulz on the transpose of a tall matrix), each scaled by Moonlight's 0.2 * sqrt(max(A, B))
    with decoupled weight decay; float64 NumPy. Returns the matrix after each step."""
    a, b, c = 3.4445, -4.7750, 2.0315
    w, buf, out = w.astype(np.float64), np.zeros(w.shape), []
    for g in grads:
        buf = beta * buf + g
        x = g + beta * buf
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / (np.linalg.norm(x) + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if tall else x
        w = w * (1 - lr * weight_decay) - lr * 0.2 * np.sqrt(max(w.shape)) * x
        out.append(w)
    return out


def _param(value, *names):
    return nnx.Param(jnp.asarray(value, jnp.float32), out_sharding=names, eager_sharding=False)


def _updates(tx, params, grads):
    """The parameters after each of `grads` (trees like `params`) under `tx`."""
    state, out, update_fn = tx.init(params), [], jax.jit(tx.update)
    for g in grads:
        update, state = update_fn(g, state, params)
        params = optax.apply_updates(params, update)
        out.append(params)
    return out


def test_one_matrix_follows_the_reference_muon_step():
    """A wide (q_proj, D x N*H) and a tall (down_proj, F x D) matrix, three steps each (the momentum and
    Nesterov terms only matter from the second on): the NumPy reference to 1e-5."""
    rng = np.random.default_rng(0)
    q, down = rng.normal(0, 0.02, (32, 4, 16)), rng.normal(0, 0.02, (96, 32))
    params = nnx.State({"q_proj": _param(q, "embed", "heads", "head_dim"), "down_proj": _param(down, "mlp", "embed")})
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(0, 1, p.shape), jnp.float32), params) for _ in range(3)]
    ours = _updates(make_optimizer(CFG, 10), params, grads)
    for key, w in (("q_proj", q.reshape(32, 64)), ("down_proj", down)):
        want = reference_muon(w, [np.asarray(g[key][...]).reshape(w.shape) for g in grads], CFG.lr, CFG.weight_decay)
        for got, expected in zip(ours, want, strict=True):
            np.testing.assert_allclose(np.asarray(got[key][...]).reshape(w.shape), expected, rtol=0, atol=1e-5)


def test_stacked_layers_and_experts_are_one_matrix_each():
    """A [L, D, N, H] q_proj, a [L, N, H, D] o_proj and a [L, E, F, D] expert kernel: the stacked update equals
    each layer's (each expert's) matrix updated alone."""
    rng = np.random.default_rng(1)
    stacked = {"q_proj": (rng.normal(size=(3, 32, 4, 8)), ("layers", "embed", "heads", "head_dim")),
               "o_proj": (rng.normal(size=(3, 4, 8, 32)), ("layers", "heads", "head_dim", "embed")),
               "down_proj": (rng.normal(size=(2, 3, 48, 32)), ("layers", "expert", "mlp", "embed"))}
    tx = scale_by_muon()
    for key, (g, names) in stacked.items():
        tree = {key: _param(g, *names)}
        whole, _ = tx.update(tree, tx.init(tree), tree)
        lead = 2 if "expert" in names else 1
        for index in np.ndindex(g.shape[:lead]):
            alone = {key: _param(g[index], *names[lead:])}
            one, _ = tx.update(alone, tx.init(alone), alone)
            np.testing.assert_allclose(np.asarray(whole[key][...])[index], np.asarray(one[key][...]), rtol=1e-5,
                                       atol=1e-6)


def test_adam_takes_embeddings_norms_and_head_and_muon_the_hidden_kernels():
    """Three steps of a 1-layer model: the embeddings, norms and head move as optax's AdamW (decay masked by
    `decay_mask`) moves them, every hidden kernel as the NumPy Muon reference moves each layer's matrix."""
    model = dataclasses.replace(MODEL, num_layers=1)
    params = nnx.state(build_model(model, F32, jax.random.key(0)))
    labels = {k: v.get_value() for k, v in nnx.to_flat_state(muon_labels(params))}
    assert {".".join(map(str, k)) for k, v in labels.items() if v == MUON} == {
        f"layers.{m}.{p}" for m, ps in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for p in
        (f"{x}_proj" for x in ps)}
    grads = [jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size + i), p.shape), params) for i in range(3)]
    adamw = optax.adamw(CFG.lr, b1=CFG.b1, b2=CFG.b2, eps=CFG.eps, weight_decay=CFG.weight_decay, mask=decay_mask)
    ours, theirs = _updates(make_optimizer(CFG, 10), params, grads), _updates(adamw, params, grads)
    flat = lambda tree: {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(tree)}
    grads = [flat(g) for g in grads]
    for path, label in labels.items():
        got = [flat(p)[path] for p in ours]
        if label == MUON:  # [1, D, N, H] / [1, N, H, D] / [1, D, F] / [1, F, D]: one matrix, split at embed
            w = flat(params)[path][0]
            rows = w.shape[0] if path[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else -1
            shape = (rows, w.size // rows) if rows > 0 else (w.size // w.shape[-1], w.shape[-1])
            want = reference_muon(w.reshape(shape), [g[path][0].reshape(shape) for g in grads], CFG.lr,
                                  CFG.weight_decay)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a[0].reshape(shape), b, atol=1e-5, err_msg=str(path))
        else:
            for a, b in zip(got, [flat(p)[path] for p in theirs], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9, err_msg=str(path))


@pytest.mark.parametrize("shape, moved", [
    ((4, 32, 4, 8), [("tensor", 2, 0), ("fsdp", 1, 0)]),   # 4 layers take fsdp and tensor: all-to-alls only
    ((2, 32, 4, 8), [("tensor", 2, None), ("fsdp", 1, 0)]),  # 2 layers take fsdp; tensor is gathered
])
def test_each_device_gets_whole_matrices(shape, moved):
    spec, moves = regroup(("layers", "embed", "heads", "head_dim"), shape, {"data": 2, "fsdp": 2, "tensor": 2})
    assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert sorted(moves) == sorted(moved)


def _batch(mesh, seed):
    return to_global(synthetic_batch(seed, 8, 16, MODEL.vocab_size), batch_sharding(mesh), 8)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _train(layout: MeshConfig, devices=None, directory=None, steps: int = 3, offload="none", zero1=False):
    """(losses, final state, compiled step, mesh) of `steps` default-like steps (clipping at 1.0, the anomaly
    veto, 2 micro-batches) of the tiny model under Muon; with `directory`, step 1's state is checkpointed."""
    mesh = make_mesh(layout, devices=devices)
    tx = make_optimizer(dataclasses.replace(CFG, clip_norm=1.0, lr=3e-2), 10)
    objective = lm_objective(MODEL, F32)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0, offload=offload, zero1=zero1)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=2, skip_anomalies=True, zero1=zero1),
                              shardings, mesh)
        state, losses = run_steps(step, state, lambda i: _batch(mesh, i), steps, directory)
    return dict(losses=losses, state=state, step=step, mesh=mesh, tx=tx)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("muon") / "checkpoints"
    return {"one": _train(MeshConfig(1, 1, 1, 1), jax.devices()[:1]),
            "sharded": _train(MeshConfig(2, 2, 2, 1), directory=directory), "directory": directory}


def test_sharded_run_equals_the_single_device_run(runs):
    one, sharded = runs["one"], runs["sharded"]
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-5)
    for a, b in zip(_leaves(sharded["state"].params), _leaves(one["state"].params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)
    opt_state = sharded["state"].opt_state  # the schedule and the clipping threshold as for every optimizer
    assert np.isclose(float(current_lr(opt_state)), 3e-2) and float(current_clip_norm(opt_state)) == 1.0


def test_zero1_and_host_offload_train_as_the_plain_sharded_run(runs):
    """The optimizer state in host memory: bitwise the same run; split over the data replicas (the momentum
    gathered over `data` for the iterations): the same to float rounding."""
    sharded = runs["sharded"]
    offloaded, zero1 = _train(MeshConfig(2, 2, 2, 1), offload="host"), _train(MeshConfig(2, 2, 2, 1), zero1=True)
    assert offloaded["losses"] == sharded["losses"]
    for a, b, c in zip(_leaves(offloaded["state"]), _leaves(sharded["state"]), _leaves(zero1["state"]), strict=True):
        assert np.array_equal(a, b, equal_nan=True)
        np.testing.assert_allclose(c, b, rtol=1e-4, atol=2e-6)


def test_resume_from_a_checkpoint_is_bitwise(runs):
    sharded, mesh = runs["sharded"], runs["sharded"]["mesh"]
    abstract = abstract_objective_state(lm_objective(MODEL, F32), sharded["tx"])[0]
    ckpt = Checkpointer(runs["directory"], log=lambda msg: None)
    with jax.set_mesh(mesh):
        state, _ = restore_latest(ckpt, abstract, mesh, print, items=("state",),
                                  shardings=state_shardings(abstract, mesh))
        ckpt.close()
        assert int(state.step) == 1
        for i in range(1, 3):
            state, _ = sharded["step"](state, _batch(mesh, i))
    for a, b in zip(_leaves(state), _leaves(sharded["state"]), strict=True):
        assert np.array_equal(a, b, equal_nan=True)


def test_a_vetoed_step_keeps_the_whole_optimizer_state(runs):
    """Muon is vetoed by the train step's select (anomaly, overflow): parameters' momentum and Adam moments."""
    sharded = runs["sharded"]
    state, tx = sharded["state"], sharded["tx"]
    grads = jax.tree.map(jnp.ones_like, state.params)
    with jax.set_mesh(sharded["mesh"]):
        update = jax.jit(lambda keep: vetoed_update(tx, grads, state.opt_state, state.params, keep)[1])
        kept, moved = update(jnp.array(True)), update(jnp.array(False))
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(kept), _leaves(state.opt_state), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(moved), _leaves(state.opt_state), strict=True))


def test_reports_read_the_state_of_both_sides(runs):
    """The memory report lists every array of the state once; the diagnostics' Adam second moments are the
    AdamW side's (the embeddings, norms and head), none of a hidden kernel's (`optax.MaskedNode` there)."""
    state, mesh = runs["sharded"]["state"], runs["sharded"]["mesh"]
    rows = report_rows(state, mesh)
    assert len(rows) == len(jax.tree.leaves(state)) and not [r for r in rows if r["path"].endswith("_proj")
                                                             and ".adam." in r["path"]]
    assert len(second_moments(state.opt_state)) == 5  # embed_tokens, the three norms, lm_head
    assert np.isfinite(float(adam_v_stats(state.opt_state)["diag/adam_v_rms"]))


@pytest.mark.parametrize("field, value", [("muon_momentum", 1.0), ("muon_momentum", -0.1), ("muon_ns_steps", 0)])
def test_bad_muon_settings_name_their_key(field, value):
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        dataclasses.replace(CFG, **{field: value}).check()


def test_the_default_job_takes_muon_with_zero1_and_host_offload():
    overrides = [("optim.name", "muon"), ("optim.zero1", "true"), ("optim.offload", "host")]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), overrides), 8)
    assert (cfg.optim.name, cfg.optim.muon_momentum, cfg.optim.muon_ns_steps) == ("muon", 0.95, 5)
