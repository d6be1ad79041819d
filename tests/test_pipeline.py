"""Pipeline parallelism over `stage`: pipelined == sequential (loss and gradients), bubbles inert, and the
compiled step moves activations with collective-permutes without gathering a stage's layer weights.

All runs share one set of parameters (8 layers, so every (p, r) below divides it) and one unpipelined
reference. The pipelined runs use the layout the pipeline is meant for: the stored `layers` axis split over
`stage` (RULES['layers'] = ('stage', None); the fixture below pins it for this module).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm.model.layers as layers
import jaxllm.parallel.sharding as sharding
from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.model.layers import xla_attention
from jaxllm.model.transformer import Transformer
from jaxllm.model.visibility import attention_mask
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.pipeline import bubble_fraction, pipeline
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.pretrain import create_train_state
from jaxllm.model.build import build_model
from jaxllm.model.head import next_token_loss
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step

from packed_layout import mask_from_packed_layout

# mlp_dim 48 is a size nothing but layer weights has: the HLO check looks for it in stage-crossing gathers.
MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
PRECISION = PrecisionConfig(params="float32", compute="float32", output="float32")
BATCH = synthetic_batch(7, 8, 16, MODEL.vocab_size)

# (mesh (data, fsdp, tensor, stage), microbatches, repeats, remat)
CASES = [
    ((4, 1, 1, 2), 2, 1, "none"),
    ((2, 1, 2, 2), 4, 1, "full"),
    ((2, 1, 1, 4), 4, 1, "save_dots"),
    ((1, 2, 2, 2), 4, 2, "none"),
    ((1, 1, 2, 4), 8, 2, "full"),
]
NAN_CASE = ((2, 1, 1, 4), 8, 2, "none")


@pytest.fixture(scope="module", autouse=True)
def layers_split_over_stage():
    """The RULES entry the pipeline wants at rest: stacked layer weights split over `stage` (1/p per device)."""
    old = sharding.RULES["layers"]
    sharding.RULES["layers"] = ("stage", None)
    yield
    sharding.RULES["layers"] = old


@pytest.fixture(scope="module")
def params():
    return nnx.state(build_model(MODEL, PRECISION, jax.random.key(0)))


def _graphdef(cfg, m=1, r=1, nan_bubbles=False, precision=PRECISION):
    def make():
        with nnx.use_eager_sharding(False):
            model = Transformer(cfg, precision, rngs=nnx.Rngs(0), pipeline_microbatches=m, pipeline_repeats=r)
        model.pipeline_debug_nan_bubbles = nan_bubbles
        return nnx.split(model)

    return jax.eval_shape(make)[0]


def _grads(params, layout, m=1, r=1, remat="none", nan_bubbles=False, attention="xla", precision=PRECISION):
    """(gradients, loss, compiled HLO text) of `grads_and_loss` on `layout` with the given schedule."""
    mesh = make_mesh(MeshConfig(*layout))
    graphdef = _graphdef(dataclasses.replace(MODEL, remat=remat, attention=attention), m, r, nan_bubbles, precision)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, sharding.sharding_tree(params, mesh))
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in BATCH.items()}
        compiled = jax.jit(lambda p, b: grads_and_loss(graphdef, p, b, 1, loss_fn=next_token_loss)[:2]).lower(placed, batch).compile()
        grads, loss = compiled(placed, batch)
    return jax.device_get(grads), float(loss), compiled.as_text()


@pytest.fixture(scope="module")
def reference(params):
    return _grads(params, (8, 1, 1, 1))


@pytest.fixture(scope="module")
def pipelined(params):
    return {case: _grads(params, *case) for case in CASES}


def _assert_same(got, want, what):
    grads, loss, _ = got
    ref_grads, ref_loss, _ = want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=what)
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(leaves) == len(ref_leaves)
    for g, ref in zip(leaves, ref_leaves):
        assert np.all(np.isfinite(g)), what
        scale = np.max(np.abs(ref)) + 1e-12
        np.testing.assert_allclose(g / scale, ref / scale, rtol=0, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"mesh{c[0]}-m{c[1]}-r{c[2]}-{c[3]}")
def test_pipelined_equals_sequential(pipelined, reference, case):
    assert sum(float(np.abs(g).sum()) for g in jax.tree.leaves(reference[0])) > 0
    _assert_same(pipelined[case], reference, str(case))


def test_nan_in_bubbles_changes_nothing(params, reference):
    _assert_same(_grads(params, *NAN_CASE, nan_bubbles=True), reference, "NaN bubbles")


def test_bfloat16_activations_cross_the_stages(params):
    """bfloat16 compute through the pipeline: XLA:CPU's own float32 promotion of the stage sums (the outputs
    handed to every stage, the inputs' gradients) aborted the compile; the pipeline sums in float32 there."""
    bf16 = PrecisionConfig(params="float32", compute="bfloat16", output="float32")
    grads, loss, _ = _grads(params, (4, 1, 1, 2), m=2, precision=bf16)
    ref_grads, ref_loss, _ = _grads(params, (8, 1, 1, 1), precision=bf16)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(ref)) + 1e-12
        np.testing.assert_allclose(g / scale, ref / scale, rtol=0, atol=5e-2)


def _packed_layout_attention(q_BTNH, k_BSKH, v_BSKH, segments, window=0, scale=None):
    """CPU stand-in for cuDNN's kernel: attention under the mask its packed layout describes (the masked
    fallback when a row overflows the layout), so everything around the kernel can be checked here."""
    packed_BTS = mask_from_packed_layout(segments.offsets, segments.lengths, q_BTNH.shape[1])
    if window:  # the kernel's sliding window: the last `window` positions
        packed_BTS &= attention_mask(jnp.ones_like(segments.segment_ids), window)
    mask_BTS = jnp.where(segments.fits.all(), packed_BTS, attention_mask(segments.segment_ids, window))
    return xla_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale)


def test_cudnn_packed_layout_travels_through_pipeline_and_sharding(params, reference, monkeypatch):
    """model.attention=cudnn builds its packed-document layout once per batch; it must reach every layer intact
    through micro-batching, the circular schedule, remat and fsdp/tensor sharding. The kernel itself needs a
    GPU (tests/test_model.py checks it there), so a stand-in that reads the same layout replaces it here."""
    monkeypatch.setattr(layers, "cudnn_attention", _packed_layout_attention)
    _assert_same(_grads(params, (1, 2, 2, 2), 4, 2, "full", attention="cudnn"), reference, "cudnn layout, pipelined")


# ---- HLO inspection -------------------------------------------------------------------------------------------

def _iota_groups(groups_shape, dims, perm):
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(groups_shape).tolist()


def _ints(text):
    return [int(v) for v in re.findall(r"\d+", text)]


def replica_groups(line: str) -> list[list[int]]:
    """Device groups of one collective in compiled HLO text (explicit, iota and mesh-axes notations)."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        perm = _ints(iota.group(3)) if iota.group(3) else None
        return _iota_groups(_ints(iota.group(1)), _ints(iota.group(2)), perm)
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:
        axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = re.findall(r"'(\w+)'", named.group(2))
        ids = np.arange(int(np.prod(sizes)))
        device_ids = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", line)
        if device_ids:
            dims = _ints(device_ids.group(1))
            ids = ids.reshape(dims)
            if device_ids.group(2):
                ids = ids.transpose(_ints(device_ids.group(2)))
        ids = ids.reshape(sizes)
        keep = [i for i, n in enumerate(names) if n not in grouped]
        moved = np.moveaxis(ids, [names.index(g) for g in grouped], list(range(len(keep), len(names))))
        return moved.reshape(-1, int(np.prod([sizes[names.index(g)] for g in grouped]))).tolist()
    return [list(range(jax.device_count()))]  # no groups: every device


def test_replica_group_parser():
    assert replica_groups("replica_groups={{0,1},{2,3}}, dims") == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[4,2]<=[8], x") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    line = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true"
    assert replica_groups(line) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def stage_crossing_gathers(hlo: str, layout) -> list[str]:
    """All-gathers whose device groups span more than one pipeline stage (devices in MESH_AXES order)."""
    stage_of = np.unravel_index(np.arange(int(np.prod(layout))), layout)[3]
    out = []
    for line in hlo.splitlines():
        if re.search(r"\sall-gather(-start)?\(", line):
            if any(len({int(stage_of[d]) for d in group}) > 1 for group in replica_groups(line)):
                out.append(line.strip())
    return out


def _result_dims(line: str) -> set[int]:
    lhs = re.search(r"=\s*(.*?)\sall-gather(?:-start)?\(", line).group(1)
    return {int(d) for shape in re.findall(r"\[([\d,]*)\]", lhs) for d in _ints(shape)}


def _check_pipeline_hlo(hlo, layout, tensor):
    assert "collective-permute" in hlo
    mlp_sizes = {MODEL.mlp_dim, MODEL.mlp_dim // tensor}
    bad = [line for line in stage_crossing_gathers(hlo, layout) if _result_dims(line) & mlp_sizes]
    assert not bad, "layer weights all-gathered across stages:\n" + "\n".join(bad)


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:4], ids=lambda c: f"mesh{c[0]}-m{c[1]}-r{c[2]}")
def test_hlo_of_pipelined_grads(pipelined, case):
    _check_pipeline_hlo(pipelined[case][2], case[0], case[0][2])


def test_hlo_check_finds_the_gathers_of_an_unpipelined_compile(params, monkeypatch):
    """Positive control of the HLO check: the same stage-split weights run through the plain layer scan (the
    model told there is one stage) must gather layer weights across stages, and the same parser must say so."""
    from jaxllm.model import transformer

    monkeypatch.setattr(transformer, "num_stages", lambda *a, **k: 1)
    layout = (4, 1, 1, 2)
    _, _, hlo = _grads(params, layout)
    crossing = [line for line in stage_crossing_gathers(hlo, layout) if _result_dims(line) & {MODEL.mlp_dim}]
    assert crossing, "no stage-crossing all-gather of layer weights found in an unpipelined compile"
    with pytest.raises(AssertionError, match="all-gathered across stages"):
        _check_pipeline_hlo(hlo + "\ncollective-permute", layout, tensor=1)


def test_train_step_with_grad_accum(params, reference):
    """A full jitted train step on (1,2,2,2), circular schedule, 2 accumulation steps: right loss, sane HLO."""
    layout, m, r = (1, 2, 2, 2), 2, 2
    mesh = make_mesh(MeshConfig(*layout))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    with jax.set_mesh(mesh):
        _, state, shardings = create_train_state(MODEL, PRECISION, tx, mesh, seed=0)
        assert state.params["layers"]["mlp"]["up_proj"].sharding.spec[0] == "stage"
        state = state.replace(params=jax.device_put(params, shardings.params))  # the shared parameters
        step = jit_train_step(make_train_step(lm_objective(MODEL, PRECISION, PipelineConfig(m, r)), tx, grad_accum=2), shardings, mesh)
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in BATCH.items()}
        compiled = step.lower(state, batch).compile()
        _, metrics = compiled(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), reference[1], rtol=1e-5)
    ref_norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in jax.tree.leaves(reference[0])))
    np.testing.assert_allclose(float(metrics["grad_norm"]), ref_norm, rtol=1e-5)
    _check_pipeline_hlo(compiled.as_text(), layout, tensor=2)


def test_schedule_checks():
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 1, 1) == 0.0
    mesh = make_mesh(MeshConfig(4, 1, 1, 2))
    x = jax.numpy.zeros((8, 4, 2))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="cannot fill"):
        jax.eval_shape(lambda: pipeline(lambda w, x, a: x, {"w": jax.numpy.zeros((2, 1))}, x, (), microbatches=1))


@pytest.mark.smoke
def test_train_script_schedules_match_stage_1_and_resume_across_them(shakespeare_store, tmp_path):
    """Four steps through scripts/train.py (checkpoints at 2 and 4): a (2,1,2,2) 1F1B run equals the (2,2,2,1)
    run; resumed from its step 2 it is bitwise the same; the unpipelined run's step-2 checkpoint resumed as a
    2-stage ZB-H1 run continues it (checkpoints hold [L, ...] layers whatever the schedule)."""
    import shutil
    import subprocess

    from train_runs import losses as train_losses
    from train_runs import resume_command, train_env

    flat_mesh = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.stage=1")
    piped_mesh = ("--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=2", "--config.mesh.stage=2")

    def run(workdir, *args, resume_from=None):
        if resume_from is not None:  # a copy of that run, cut back to its step-2 checkpoint
            shutil.copytree(resume_from, workdir)
            shutil.rmtree(workdir / "checkpoints" / "4")
        cmd = resume_command(shakespeare_store, workdir, "--config.train.steps=4",
                             "--config.pipeline.microbatches=2", *args)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert resume_from is None or "resuming from checkpoint step 2" in proc.stdout
        return [loss for _, loss in sorted(train_losses(workdir).items())]

    flat = run(tmp_path / "flat", *flat_mesh)
    piped = run(tmp_path / "1f1b", *piped_mesh, "--config.pipeline.schedule=1f1b")
    assert len(flat) == len(piped) == 4
    np.testing.assert_allclose(piped, flat, rtol=1e-5)
    resumed = run(tmp_path / "1f1b_resumed", *piped_mesh, "--config.pipeline.schedule=1f1b",
                  resume_from=tmp_path / "1f1b")
    assert resumed == piped
    from test_checkpoint import _final_params
    for a, b in zip(_final_params(tmp_path / "1f1b_resumed", 4), _final_params(tmp_path / "1f1b", 4)):
        assert np.array_equal(a, b, equal_nan=True)
    moved = run(tmp_path / "zb_from_flat", *piped_mesh, "--config.pipeline.schedule=zb_h1",
                resume_from=tmp_path / "flat")
    np.testing.assert_allclose(moved, flat, rtol=1e-5)
