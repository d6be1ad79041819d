"""Pipeline schedules (jaxllm/parallel/schedules.py) and the explicit forward-backward that runs them
(jaxllm/parallel/scheduled.py, through the train step).

The tables are checked as data, over many (p, m, r), without compiling anything: dependencies, bubble formulas,
in-flight bounds, and a dry run of the executor's buffer slots. The compiled cases cover every explicit schedule
at p = 2 and 4, m = 4 and 8 (r = 2 interleaved), each mixed with data, fsdp, tensor or context, against the
unpipelined gradients; then the memory ordering that is the point of 1F1B.
"""

import dataclasses
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config.schema import EXPLICIT_SCHEDULES, PIPELINE_SCHEDULES, MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.build import build_model
from jaxllm.model.head import next_token_loss
from jaxllm.model.transformer import Transformer
from jaxllm.parallel import sharding
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.schedules import (BACKWARD, EXPLICIT, FORWARD, KIND_CODES, SCHEDULES, WEIGHT, Op, Schedule,
                                       build, program)
from jaxllm.train.step import batch_sharding, grads_and_loss

GRID = [(p, m, r) for p, m, r in itertools.product((2, 3, 4, 8), (1, 2, 3, 4, 8, 16), (1, 2, 3)) if m >= p]


def _schedules():
    for p, m, r in GRID:
        for name in SCHEDULES:
            circular = name in ("circular", "interleaved_1f1b")
            if (r > 1) != circular or (name == "interleaved_1f1b" and m % p):
                continue
            yield build(name, p, m, r)


def test_names_match_the_config():
    assert SCHEDULES == PIPELINE_SCHEDULES and EXPLICIT == EXPLICIT_SCHEDULES


def test_bubbles_equal_the_formulas():
    seen = set()
    for s in _schedules():
        p, m, r = s.stages, s.microbatches, s.repeats
        want = {"zb_h1": (p - 1) / (3 * m + p - 1)}.get(s.name, (p - 1) / (r * m + p - 1))
        assert s.bubble == pytest.approx(want), (s.name, p, m, r)
        seen.add(s.name)
        if s.name == "zb_h1":  # a third of 1F1B's, as m grows: never more than half
            assert s.bubble <= build("1f1b", p, m).bubble / 2 + 1e-12
    assert seen == set(SCHEDULES)


def test_in_flight_bounds():
    for s in _schedules():
        p, m, r = s.stages, s.microbatches, s.repeats
        held = s.in_flight()
        if s.name in ("gpipe", "circular"):
            assert held == [m * r] * p
        elif s.name == "1f1b":
            assert held == [min(p - stage, m) for stage in range(p)]
        elif s.name == "zb_h1":  # Ws deferred by s on stage s: every stage holds 1F1B's peak, no more
            assert held == [min(p, m)] * p
        else:  # Megatron's interleaved warm-up: (r-1)*p + 2*(p-1-s) + 1 chunks on stage s
            assert held == [min((r - 1) * p + 2 * (p - 1 - stage) + 1, m * r) for stage in range(p)]


def test_check_catches_a_broken_table():
    s = build("1f1b", 4, 8)
    ticks = [list(row) for row in s.ticks]
    t_b0 = next(t for t, row in enumerate(ticks) if row[0] == Op(BACKWARD, 0, 0))
    ticks[1][0], ticks[t_b0][0] = ticks[t_b0][0], ticks[1][0]  # stage 0's B0 long before its gradient exists
    with pytest.raises(AssertionError, match="before"):
        dataclasses.replace(s, ticks=tuple(map(tuple, ticks))).check()
    with pytest.raises(AssertionError, match="missing or repeated"):
        dataclasses.replace(s, ticks=s.ticks[:-1]).check()


def _dry_run(s: Schedule) -> None:
    """Run a schedule's program with labels in place of arrays: every operation must find its own micro-batch's
    activation and gradient in the slots the program names, and every label must be filed before it is read."""
    prog = program(s)
    p, C = s.stages, s.chunks
    acts = [[None] * prog.act_slots for _ in range(p)]
    grads = [[None] * prog.grad_slots for _ in range(p)]
    for t in range(prog.kind.shape[0]):
        sent_act, sent_grad = [None] * p, [None] * p
        for stage in range(p):
            kind = prog.kind[t, stage]
            if kind == KIND_CODES[None]:
                continue
            c = int(prog.repeat[t, stage]) * p + stage
            label = (int(prog.mb[t, stage]), c)
            assert bool(prog.first[t, stage]) == (c == 0) and bool(prog.last[t, stage]) == (c == C - 1)
            if c > 0:
                assert acts[stage][prog.act[t, stage]] == label, (s.name, t, stage)
            if kind in (KIND_CODES[BACKWARD], KIND_CODES[WEIGHT]) and c < C - 1:
                assert grads[stage][prog.grad[t, stage]] == label, (s.name, t, stage)
            if kind == KIND_CODES[FORWARD] and c < C - 1:
                sent_act[(stage + 1) % p] = (label[0], c + 1)
            if kind == KIND_CODES[BACKWARD] and c > 0:
                sent_grad[(stage - 1) % p] = (label[0], c - 1)
        for stage in range(p):
            for buffer, slot, sent in ((acts, prog.file_act[t, stage], sent_act[stage]),
                                       (grads, prog.file_grad[t, stage], sent_grad[stage])):
                assert (slot >= 0) == (sent is not None)
                if slot >= 0:
                    buffer[stage][slot] = sent


def test_programs_route_every_value_through_its_slots():
    for s in _schedules():
        _dry_run(s)
    prog = program(build("1f1b", 4, 16))
    assert prog.act_slots == 4  # p, not m


# ---------------------------------------------------------------------------------------------- compiled

MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
BATCH = synthetic_batch(7, 16, 16, MODEL.vocab_size)

# (schedule, mesh, micro-batches, repeats): each explicit schedule at p = 2 and 4 and at m = 4 and 8.
CASES = [
    ("1f1b", dict(data=2, fsdp=2, stage=2), 4, 1),
    ("1f1b", dict(data=2, stage=4), 8, 1),
    ("interleaved_1f1b", dict(context=2, tensor=2, stage=2), 4, 2),
    ("interleaved_1f1b", dict(fsdp=2, stage=4), 8, 2),
    ("zb_h1", dict(tensor=2, stage=4), 4, 1),
    ("zb_h1", dict(data=2, fsdp=2, stage=2), 8, 1),
]


@pytest.fixture(scope="module")
def params():
    return nnx.state(build_model(MODEL, F32, jax.random.key(0)))


def _graphdef(model, m=1, r=1, schedule="gpipe"):
    def make():
        with nnx.use_eager_sharding(False):
            return nnx.split(Transformer(model, F32, rngs=nnx.Rngs(0), pipeline_microbatches=m, pipeline_repeats=r,
                                         pipeline_schedule=schedule))

    return jax.eval_shape(make)[0]


def _compiled_grads(params, mesh_axes, m=1, r=1, schedule="gpipe", model=MODEL, batch=BATCH, scale=None):
    """(the compiled `grads_and_loss`, its arguments) on the mesh with the given schedule (and loss scale)."""
    mesh = make_mesh(MeshConfig(**mesh_axes))
    graphdef = _graphdef(model, m, r, schedule)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, sharding.sharding_tree(params, mesh))
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
        fn = jax.jit(lambda p, b: grads_and_loss(graphdef, p, b, 1, loss_fn=next_token_loss, scale=scale)[:2])
        return fn.lower(placed, batch).compile(), (placed, batch)


def _grads(params, *args, **kwargs):
    compiled, inputs = _compiled_grads(params, *args, **kwargs)
    grads, loss = compiled(*inputs)
    return jax.device_get(grads), float(loss)


@pytest.fixture(scope="module")
def reference(params):
    return _grads(params, dict(data=8))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-p{c[1]['stage']}-m{c[2]}")
def test_explicit_schedules_equal_the_unpipelined_gradients(params, reference, case):
    schedule, mesh_axes, m, r = case
    # under a loss scale (float16's): the backward is seeded with it and the gradients come back unscaled
    grads, loss = _grads(params, mesh_axes, m, r, schedule, scale=jnp.float32(64.0))
    ref_grads, ref_loss = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(want)) + 1e-12
        assert scale > 1e-8  # every parameter gets a gradient: a lost one would pass as zeros
        np.testing.assert_allclose(g / scale, want / scale, rtol=0, atol=1e-5)


def test_a_schedule_trains_a_head_on_a_frozen_body(params):
    """Only outer parameters train (the head; every layer frozen): the schedule still runs the layers' pass and
    the head's gradient equals the unpipelined one."""
    head, body = nnx.split_state(params, lambda path, _: path[0] == "lm_head", ...)

    def head_grads(mesh_axes, m, schedule):
        mesh, graphdef = make_mesh(MeshConfig(**mesh_axes)), _graphdef(MODEL, m, 1, schedule)
        with jax.set_mesh(mesh):
            h, f = (jax.device_put(x, sharding.sharding_tree(x, mesh)) for x in (head, body))
            batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in BATCH.items()}
            fn = jax.jit(lambda h, b, f: grads_and_loss(graphdef, h, b, 1, loss_fn=next_token_loss, frozen=f)[0])
            return jax.device_get(fn(h, batch, f))

    piped, plain = head_grads(dict(data=2, fsdp=2, stage=2), 4, "1f1b"), head_grads(dict(data=8), 1, "gpipe")
    want = jax.tree.leaves(plain)[0]
    assert np.max(np.abs(want)) > 1e-6
    np.testing.assert_allclose(jax.tree.leaves(piped)[0], want, rtol=0, atol=1e-6 * np.max(np.abs(want)) + 1e-9)


def test_one_f_one_b_holds_fewer_activations_than_gpipe(params):
    """p = 4, m = 16: GPipe keeps all m micro-batches' stage inputs until its backward, 1F1B at most p. Shapes
    where those inputs dominate the temporaries (wide rows, remat full); measured ratio 0.58 (jax 0.10, CPU)."""
    model = dataclasses.replace(MODEL, dim=256, mlp_dim=128, head_dim=16, remat="full")
    wide = nnx.state(build_model(model, F32, jax.random.key(0)))
    batch = synthetic_batch(3, 32, 64, MODEL.vocab_size)
    temp = {name: _compiled_grads(wide, dict(data=2, stage=4), 16, 1, name, model, batch)[0]
            .memory_analysis().temp_size_in_bytes for name in ("gpipe", "1f1b")}
    assert temp["1f1b"] < 0.75 * temp["gpipe"], temp


def test_the_docs_page_draws_the_tables_themselves():
    """docs/pipeline.md's tick tables are `render()` of these tables (regenerate them from it when it fails)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    for name, r in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        table = build(name, 4, 8, r).render()
        assert f"```\n{table}\n```" in page, f"{name}:\n{table}"


# ---------------------------------------------------------------------------------------------- mixtures of experts

MOE = dataclasses.replace(MODEL, num_layers=4, family="mixtral", num_experts=4, experts_per_token=2,
                          moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
MOE_BATCH = synthetic_batch(11, 32, 16, MODEL.vocab_size)

# (schedule, mesh, micro-batches, repeats, capacity factor)
MOE_CASES = [
    ("1f1b", dict(fsdp=2, expert=2, stage=2), 4, 1, 0.0),
    ("interleaved_1f1b", dict(fsdp=2, tensor=2, stage=2), 4, 2, 8.0),
    ("zb_h1", dict(tensor=2, expert=2, stage=2), 4, 1, 0.0),
]


def _moe_grads(params, mesh_axes, m, r=1, schedule="gpipe", grad_accum=1, capacity=0.0):
    model = dataclasses.replace(MOE, moe_capacity_factor=capacity)
    mesh = make_mesh(MeshConfig(**mesh_axes))
    graphdef = _graphdef(model, m, r, schedule)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, sharding.sharding_tree(params, mesh))
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in MOE_BATCH.items()}
        fn = jax.jit(lambda p, b: grads_and_loss(graphdef, p, b, grad_accum, loss_fn=next_token_loss))
        grads, loss, _, metrics = jax.device_get(fn(placed, batch))
    return grads, float(loss), metrics


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: f"{c[0]}-cap{c[4]:g}")
def test_explicit_schedules_run_mixtures_of_experts(case):
    """The router sums travel with the activations to the last stage: the loss, the auxiliary losses and every
    gradient (the routers' among them) equal unpipelined gradient accumulation over the same micro-batches (each
    micro-batch's own load-balancing loss, as under accumulation)."""
    schedule, mesh_axes, m, r, capacity = case
    params = nnx.state(build_model(MOE, F32, jax.random.key(1)))
    grads, loss, metrics = _moe_grads(params, mesh_axes, m, r, schedule, capacity=capacity)
    ref_grads, ref_loss, ref_metrics = _moe_grads(params, dict(data=8), m, grad_accum=m, capacity=capacity)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in ("moe_aux_loss", "moe_z_loss"):
        assert ref_metrics[name] > 0
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5)
    for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(want)) + 1e-12
        assert scale > 1e-8
        np.testing.assert_allclose(g / scale, want / scale, rtol=0, atol=1e-5)
