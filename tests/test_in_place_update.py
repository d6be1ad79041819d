"""The compiled train step updates its donated state in place: XLA copies no parameter or optimizer moment on
entry. A copy of the whole state (params and both Adam moments) cost the data-parallel step about a tenth of its
time on CPU (scripts/bench_step.py, bare vs plain); the anomaly skip's selects brought it in once.

And it makes no more passes over parameter-sized arrays than a minimal step (scripts/plain_step.py): the veto and
the norms were a fifth of the data-parallel bf16 step on CPU until they cost nothing (jaxllm/optim/veto.py,
jaxllm/parallel/sharding.py's sum_over_devices; scripts/bench_peers.py)."""

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_runs import ROOT

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import validate
from jaxllm.observe.hlo_text import HloModule, array_shapes, shape_bytes

sys.path.insert(0, str(ROOT / "scripts"))
import plain_step  # noqa: E402
from bench_step import prepared_step  # noqa: E402
from compile_flags import PRODUCTION_COMPILE  # noqa: E402

SMALL = ("--config.model.num_layers=2", "--config.model.dim=64", "--config.model.num_heads=4",
         "--config.model.num_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.model.vocab_size=256", "--config.train.seq_len=32", "--config.train.batch_size=8")


def _entry(hlo_text: str) -> list:
    """The instructions of the entry computation (the step outside its loops)."""
    module = HloModule.parse(hlo_text)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M).group(1)
    return [i for i in module.instructions if i.computation == entry]


def _entry_copies_of_arguments(hlo_text: str) -> list[str]:
    """The entry computation's copies of its (array, not scalar) arguments, as printed."""
    instructions = _entry(hlo_text)
    arguments = {i.name for i in instructions if i.opcode == "parameter"
                 if any(len(dims) >= 2 for _, dims in array_shapes(i.shape))}
    return [i.text.strip()[:120] for i in instructions
            if i.opcode == "copy" and re.search(r"copy\(%?([\w.\-]+)\)", i.text).group(1) in arguments]


@functools.cache
def _compiled_step(mesh: tuple, on_anomaly: str):
    """(config, HLO text) of the real compiled train step of the small model on `mesh` (data, fsdp, tensor)."""
    data, fsdp, tensor = mesh
    overrides = [*SMALL, f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
                 f"--config.mesh.tensor={tensor}", f"--config.train.on_anomaly={on_anomaly}"]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(overrides)[1]), 8)
    runner, _, batch, _, _ = prepared_step(cfg, compiler_options=PRODUCTION_COMPILE)
    return cfg, runner.compiled_for(batch).as_text()


@pytest.mark.parametrize("mesh, on_anomaly", [((8, 1, 1), "rollback"), ((2, 2, 2), "skip"), ((8, 1, 1), "abort")],
                         ids=["data8-rollback", "2x2x2-skip", "data8-abort"])
def test_the_step_copies_no_state_on_entry(mesh, on_anomaly):
    assert _entry_copies_of_arguments(_compiled_step(mesh, on_anomaly)[1]) == []


# jaxllm's step may write this many times the parameters' bytes more than the plain step: it writes Adam's update
# direction out once (the parameter write and the update norm's slices both read it; the plain step fuses it into
# its parameter write), 1.13x on the tests' model. Norms taken in full on every replica made it 1.92x, and the
# veto's selects of the whole state 3.9x.
PLAIN_MARGIN = 1.5
# What the entry computation does not write: its arguments, views of them, loop results, and tuples of them.
NOT_WRITTEN = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "partition-id"}


def _bytes_written(hlo_text: str) -> int:
    """Bytes of every array the step writes outside its loops (fusions, copies, collectives' results): the
    optimizer's passes over parameter-sized arrays, the head's, the norms'."""
    return sum(shape_bytes(i.shape) for i in _entry(hlo_text) if i.opcode not in NOT_WRITTEN)


def _plain_step_bytes_written(cfg) -> int:
    """`_bytes_written` of scripts/plain_step.py's step (clipping, AdamW, no veto, no norms) on `cfg`'s model,
    data-parallel over every device, as scripts/bench_step.py times it."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    step, tx = plain_step.make_step(cfg)
    params = jax.device_put(plain_step.init_params(jax.random.key(0), cfg.model), replicated)
    batch = jax.device_put({k: jnp.zeros((cfg.train.batch_size, cfg.train.seq_len), jnp.int32)
                            for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}, rows)
    lowered = step.lower(params, jax.device_put(tx.init(params), replicated), batch)
    return _bytes_written(lowered.compile(PRODUCTION_COMPILE).as_text())


def _parameter_bytes(cfg) -> int:
    shapes = jax.eval_shape(lambda key: plain_step.init_params(key, cfg.model), jax.random.key(0))
    return 4 * sum(x.size for x in jax.tree.leaves(shapes))


def test_the_veto_costs_no_pass_over_the_state():
    """A step that can veto its update (on_anomaly=rollback) writes what one that never vetoes (abort) writes:
    the moments are vetoed inside Adam's own kernels. Selecting the whole new state afterwards wrote both Adam
    moments once more (twice the parameters' bytes)."""
    cfg, vetoing = _compiled_step((8, 1, 1), "rollback")
    never = _compiled_step((8, 1, 1), "abort")[1]
    assert abs(_bytes_written(vetoing) - _bytes_written(never)) < 0.1 * _parameter_bytes(cfg)


def test_the_step_writes_what_a_minimal_step_writes():
    """On 8 data-parallel devices (parameters replicated) jaxllm's step, with its anomaly checks, veto and
    parameter / update norms, writes outside its loops at most PLAIN_MARGIN of the parameters' bytes more than
    the plain step: the norms are each device's share (sum_over_devices), no update is written out whole for them
    (that cost the whole parameters' bytes once more)."""
    cfg, text = _compiled_step((8, 1, 1), "rollback")
    extra = _bytes_written(text) - _plain_step_bytes_written(cfg)
    assert extra < PLAIN_MARGIN * _parameter_bytes(cfg), extra / _parameter_bytes(cfg)
