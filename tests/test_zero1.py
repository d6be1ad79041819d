"""ZeRO-1 (`optim.zero1`): the optimizer state split over the data-parallel replicas. Its placement (every Adam
moment owned in parts, the parameters where RULES put them), the compiled step's collectives (gradients
reduce-scattered and parameters all-gathered instead of gradients all-reduced), the same training as the
replicated update, and checkpoints that move between the two placements."""

import math
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.sharding import replicas_split
from jaxllm.runs.checkpoint import Checkpointer
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.recovery import restore_latest
from jaxllm.train.state import init_objective_state, state_shardings
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
ROWS, SEQ, STEPS = 8, 16, 3
SIZES = {"data": 4, "fsdp": 2, "expert": 1, "tensor": 1, "stage": 1}


@pytest.mark.parametrize("spec, shape, expected", [
    (P(), (32, 64), P(("data", "fsdp"), None)),    # replicated: all the batch axes on the first dimension
    (P("fsdp", None), (32, 64), P(("fsdp", "data"), None)),  # fsdp already splits dim 0: data joins it
    (P(), (6, 64), P(None, ("data", "fsdp"))),     # 6 rows take neither: the next dimension
    (P(), (4, 6), P("data", None)),                # no dimension takes both: data alone
    (P(), (3, 5), P()),                            # nothing divides: replicated
    (P(), (), P()),                                # a scalar
])
def test_replicas_split(spec, shape, expected):
    assert replicas_split(spec, shape, SIZES) == expected


def test_replicas_split_takes_the_context_axis_too():  # gradients reduce over it as over data
    assert replicas_split(P("fsdp", None), (32, 64), dict(SIZES, context=2)) == P(("fsdp", "data", "context"), None)


def _batch(mesh, seed):
    return to_global(synthetic_batch(seed, ROWS, SEQ, MODEL.vocab_size), batch_sharding(mesh), ROWS)


def _train(layout: MeshConfig, zero1: bool, steps: int = STEPS, start=None):
    """(losses, final state, shardings, the compiled step's HLO text) of `steps` steps of the tiny model."""
    mesh = make_mesh(layout)
    tx, objective = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10), lm_objective(MODEL, F32)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0, zero1=zero1)
        state = state if start is None else start(mesh, shardings)
        step = jit_train_step(make_train_step(objective, tx, zero1=zero1), shardings, mesh)
        hlo = step.lower(state, _batch(mesh, 0)).compile().as_text()
        losses = []
        for i in range(steps):
            state, metrics = step(state, _batch(mesh, int(state.step)))
            losses.append(float(metrics["loss"]))
    return losses, state, shardings, hlo


LAYOUTS = {"data8": MeshConfig(8, 1, 1, 1), "data2-fsdp2-tensor2": MeshConfig(2, 2, 2, 1)}


@pytest.fixture(scope="module")
def pairs():
    """{layout name: (replicated update's run, ZeRO-1 run)}."""
    return {name: (_train(layout, False), _train(layout, True)) for name, layout in LAYOUTS.items()}


def _moment_specs(shardings) -> list:
    adam = shardings.opt_state.inner_state[1][0]  # inject_hyperparams(chain(clip, chain(adam, ...)))
    return [s.spec for s in jax.tree.leaves((adam.mu, adam.nu))]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero1_places_every_moment_in_parts_and_leaves_the_parameters(pairs, name):
    (_, _, plain, _), (_, state, zero1, _) = pairs[name]
    assert [s.spec for s in jax.tree.leaves(zero1.params)] == [s.spec for s in jax.tree.leaves(plain.params)]
    for spec in _moment_specs(zero1):
        axes = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
        assert "data" in axes, (name, spec)
    mu = state.opt_state.inner_state[1][0].mu
    for leaf in jax.tree.leaves(mu):  # each device really holds a part
        assert leaf.addressable_shards[0].data.size * 2 <= leaf.size, leaf.sharding


def _gathered_elements(hlo: str) -> int:
    """The elements all the all-gathers of compiled HLO text produce."""
    total = 0
    for line in hlo.splitlines():
        found = re.search(r"= (.*?) all-gather(-start)?\(", line)
        for dims in re.findall(r"\w+\[([\d,]*)\]", found.group(1) if found else ""):
            total += math.prod(int(d) for d in dims.split(",") if d)
    return total


def test_zero1_step_all_gathers_each_new_parameter_once(pairs):
    """On data=8 the replicated step gathers nothing; the ZeRO-1 step gathers every new parameter exactly once
    (each device computed its eighth). XLA:CPU all-reduces the gradients and slices them (its pipeline has no
    reduce-scatter creation; GPU's turns the pair into a reduce-scatter), so that half is not asserted here."""
    (_, plain_state, _, plain_hlo), (_, _, _, zero1_hlo) = pairs["data8"]  # under fsdp both steps gather
    assert _gathered_elements(plain_hlo) == 0
    assert _gathered_elements(zero1_hlo) == sum(x.size for x in jax.tree.leaves(plain_state.params))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero1_trains_as_the_replicated_update(pairs, name):
    """The same losses, and the same parameters but for rounding noise: with its gradients constrained to parts,
    XLA partitions the backward's weight-gradient sums differently, so gradients that are cancellation noise
    (|g| ~ 1e-9 against a typical 1e-4) differ in their leading digits, and Adam's first steps (update ~ lr *
    sign(g), lr 3e-2 here) carry that into a few parameters at ~1e-3 of a step. A wrong part (a device updating
    another's share, a missed gather) moves whole arrays by a step."""
    (plain_losses, plain_state, _, _), (zero1_losses, zero1_state, _, _) = pairs[name]
    np.testing.assert_allclose(zero1_losses, plain_losses, rtol=1e-6, err_msg=name)
    diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel() for a, b in
                            zip(jax.tree.leaves(zero1_state.params), jax.tree.leaves(plain_state.params), strict=True)])
    assert diffs.max() < 1e-4, (name, diffs.max())
    assert np.mean(diffs > 1e-6) < 0.01, (name, np.sum(diffs > 1e-6), diffs.size)


def test_checkpoints_move_between_the_placements(tmp_path):
    """A ZeRO-1 run's checkpoint resumes under the replicated update and back, each continuing as the run that
    never stopped, in the placement of the run that resumed it."""
    layout = LAYOUTS["data8"]
    uninterrupted, _, _, _ = _train(layout, True, steps=4)
    for saved, resumed in ((True, False), (False, True)):
        directory = tmp_path / f"saved_zero1_{saved}"
        _, state, _, _ = _train(layout, saved, steps=2)
        ckpt = Checkpointer(directory, async_save=False, log=lambda msg: None)
        ckpt.save(2, state, {}, {})
        ckpt.close()
        abstract = jax.eval_shape(lambda: state)

        def restored(mesh, shardings):
            ckpt = Checkpointer(directory, log=lambda msg: None)
            restored_state, _ = restore_latest(ckpt, abstract, mesh, lambda msg: None, shardings=shardings)
            ckpt.close()
            return restored_state

        losses, final, shardings, _ = _train(layout, resumed, steps=2, start=restored)
        assert int(final.step) == 4
        np.testing.assert_allclose(losses, uninterrupted[2:], rtol=1e-6)
        for leaf, sharding in zip(jax.tree.leaves(final), jax.tree.leaves(shardings), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (resumed, leaf.shape)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero1_divides_the_optimizer_state_bytes_per_device(pairs, name):
    (_, plain_state, _, _), (_, zero1_state, _, _) = pairs[name]
    local = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    assert local(zero1_state.opt_state) * 1.8 < local(plain_state.opt_state)  # data splits each moment in 2+
    assert local(zero1_state.params) == local(plain_state.params)


@pytest.mark.parametrize("zero1", [False, True])
def test_the_memory_plan_counts_the_optimizer_state_as_placed(zero1):
    """The planner's optimizer bytes per device are those of the shardings the run places the state with."""
    from jaxllm.config.cli import build_config, split_overrides
    from jaxllm.config.schema import validate
    from jaxllm.plan.footprint import memory_plan
    from jaxllm.train.state import abstract_objective_state
    from train_runs import ROOT

    overrides = ["--config.mesh.data=4", "--config.mesh.fsdp=2", "--config.mesh.tensor=1",
                 f"--config.optim.zero1={str(zero1).lower()}"]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(overrides)[1]), 8)
    plan = memory_plan(cfg, compiled=False)
    objective = lm_objective(cfg.model, cfg.precision)
    state, _ = abstract_objective_state(objective, make_optimizer(cfg.optim, 10))
    opt = state_shardings(state, make_mesh(cfg.mesh), zero1=zero1).opt_state
    placed = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt), strict=True))
    assert plan["opt_bytes_per_device"] == placed
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
    assert placed * (7 if zero1 else 1.9) < whole  # data 4 x fsdp 2 split the moments in 8; fsdp alone in 2
