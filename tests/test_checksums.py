"""Checkpoint checksums: bytes flipped without changing a file's size are caught before loading, and a resume
falls back to the previous checkpoint; an intact checkpoint verifies; one without a manifest still loads."""

import json

import jax
import numpy as np
import pytest

from jaxllm.runs.checkpoint import CheckpointError, Checkpointer
from jaxllm.runs.checksums import MANIFEST
from jaxllm.config.schema import MeshConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.recovery import restore_latest


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": jax.numpy.asarray(rng.standard_normal((256, 256), np.float32)),
            "b": jax.numpy.asarray(rng.standard_normal((64,), np.float32))}


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint directory with steps 1 and 2 (different values), and a list of the lines it logged."""
    lines = []
    ckpt = Checkpointer(tmp_path, log=lines.append)
    for step in (1, 2):
        ckpt.save(step, _state(step), {"step": step}, {"seed": step})
    ckpt.wait()
    yield ckpt, lines
    ckpt.close()


def _restore(ckpt, lines):
    """(step, state) that a resume would start from, with every array as numpy."""
    state, meta = restore_latest(ckpt, _abstract(_state(0)), make_mesh(MeshConfig(1, 8, 1, 1)), lines.append)
    return meta["seed"], jax.tree.map(np.asarray, state)


def _equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


@pytest.mark.parametrize("async_save", [True, False])
def test_intact_checkpoint_verifies(tmp_path, async_save):
    ckpt = Checkpointer(tmp_path, async_save=async_save, log=lambda msg: None)
    ckpt.save(1, _state(1), {"step": 1}, {"seed": 1})
    ckpt.wait()
    assert (tmp_path / "1" / MANIFEST).is_file()  # committed with the checkpoint (async) or right after (sync)
    ckpt.verify(1)
    listed = json.loads((tmp_path / "1" / MANIFEST).read_text())["files"]
    arrays = [p for p in (tmp_path / "1" / "state").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert arrays and {str(p.relative_to(tmp_path / "1")) for p in arrays} <= set(listed)  # every state file
    biggest = max(arrays, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    biggest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{biggest.relative_to(tmp_path / '1')} does not match its checksum"):
        ckpt.verify(1)
    ckpt.close()


def test_flipped_bytes_fall_back_to_the_previous_checkpoint(saved):
    ckpt, lines = saved
    step_dir = ckpt.directory / "2"
    biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    biggest.write_bytes(bytes(data))  # same size, different bytes
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        ckpt.verify(2)

    step, state = _restore(ckpt, lines)
    assert step == 1 and _equal(state, _state(1))
    warning = [line for line in lines if "moved it to" in line]
    assert len(warning) == 1 and biggest.relative_to(step_dir).as_posix() in warning[0], lines
    assert ckpt.steps() == [1]
    assert [p.name.split("-")[:2] for p in ckpt.directory.glob("corrupt-*")] == [["corrupt", "2"]]


def test_missing_file_is_corruption(saved):
    ckpt, lines = saved
    (ckpt.directory / "2" / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match="meta/metadata is missing"):
        ckpt.verify(2)


def test_checkpoint_without_manifest_loads_unverified(saved):
    ckpt, lines = saved
    (ckpt.directory / "2" / MANIFEST).unlink()
    step, state = _restore(ckpt, lines)
    assert step == 2 and _equal(state, _state(2))
    assert any("unverified" in line for line in lines), lines
