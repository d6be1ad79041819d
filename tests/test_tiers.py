"""Checkpoints on two tiers (jaxllm/runs/tiers.py): saves on the local tier, background copies to the persistent
tier that count only once verified, each tier's retention, and restores from the newest step that verifies on
either tier. The drills (`local_wipe`, `slow_persistent`) on a real training job are in tests/test_drill.py."""

import json
import shutil

import jax
import numpy as np
import pytest

from jaxllm.drill.job import committed_steps
from jaxllm.config.schema import CheckpointConfig, ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.objectives.pretrain import abstract_train_state, create_train_state
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.runs.checksums import MANIFEST, verify_manifest, write_manifest
from jaxllm.runs.tiers import PersistentCopier, TieredCheckpointer, open_checkpointer

MODEL = ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")


@pytest.fixture(scope="module")
def states():
    """Two different train states (seeds 0 and 1) on a 2x2x2 mesh, with their abstract layout."""
    tx = make_optimizer(OptimConfig(), 10)
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    made = [create_train_state(MODEL, F32, tx, mesh, seed=seed)[1] for seed in (0, 1)]
    return made, abstract_train_state(MODEL, F32, tx), mesh


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _tiered(tmp_path, lines=None, slow_mb_s=0.0, **fields) -> TieredCheckpointer:
    cfg = CheckpointConfig(**{"every": 1, "keep": 2, "local_dir": str(tmp_path / "local"), **fields})
    log = lines.append if lines is not None else (lambda msg: None)
    checkpointer = open_checkpointer(cfg, tmp_path / "run", log, slow_mb_s=slow_mb_s)
    assert isinstance(checkpointer, TieredCheckpointer)
    return checkpointer


def test_saves_copy_to_the_persistent_tier_verified_with_each_tiers_retention(states, tmp_path):
    (state, _), abstract, mesh = states
    ckpt = _tiered(tmp_path, local_keep=2, keep=2, keep_every=4, persist_every=2)
    for step in range(1, 9):
        ckpt.save(step, state, {"step": step}, {})
    ckpt.close()
    local, persistent = tmp_path / "local", tmp_path / "run" / "checkpoints"
    assert committed_steps(local) == [7, 8]  # the last local_keep
    assert committed_steps(persistent) == [4, 6, 8]  # every persist_every-th copied; the last 2 kept, and every 4th
    for step in committed_steps(persistent):  # each copy complete: its files verify against its save's manifest
        assert verify_manifest(persistent / str(step)) is None
    assert not [p.name for p in persistent.iterdir() if "tmp" in p.name]
    assert [c["step"] for c in ckpt.copies] == [2, 4, 6, 8]


def test_restore_takes_the_newest_step_on_either_tier_and_survives_a_lost_local_tier(states, tmp_path):
    (old, new), abstract, mesh = states
    ckpt = _tiered(tmp_path, persist_every=2)
    ckpt.save(2, old, {"step": 2}, {"tier": "both"})
    ckpt.save(3, new, {"step": 3}, {"tier": "local only"})
    ckpt.close()
    ckpt = _tiered(tmp_path, persist_every=2)
    assert ckpt.steps() == [2, 3] and ckpt.latest_step() == 3
    assert ckpt.read_meta(3)["tier"] == "local only"
    restored = ckpt.restore(3, abstract, mesh)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_leaves(restored["state"]), _leaves(new)))
    ckpt.close()
    shutil.rmtree(tmp_path / "local")  # the node was replaced: its disk is gone
    lines = []
    ckpt = _tiered(tmp_path, lines, persist_every=2)
    assert ckpt.steps() == [2]
    restored = ckpt.restore(2, abstract, mesh)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_leaves(restored["state"]), _leaves(old)))
    assert restored["data"] == {"step": 2} and restored["meta"]["tier"] == "both"
    ckpt.close()


def test_a_corrupt_local_copy_is_moved_aside_and_the_persistent_copy_restores(states, tmp_path):
    (state, _), abstract, mesh = states
    ckpt = _tiered(tmp_path)
    ckpt.save(1, state, {"step": 1}, {})
    ckpt.close()
    local = tmp_path / "local" / "1"
    listed = sorted(json.loads((local / MANIFEST).read_text())["files"])
    victim = local / next(name for name in listed if "ocdbt" in name or "d/" in name)
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")  # one flipped byte at the end, size unchanged
    lines = []
    ckpt = _tiered(tmp_path, lines)
    restored = ckpt.restore(1, abstract, mesh)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_leaves(restored["state"]), _leaves(state)))
    assert any("restoring step 1 from the persistent tier" in line for line in lines), lines
    assert [p.name.split("-")[:2] for p in (tmp_path / "local").iterdir() if p.name.startswith("corrupt")] == [
        ["corrupt", "1"]]
    assert ckpt.steps() == [1]  # only the persistent copy is left
    ckpt.close()


def test_the_copy_never_holds_up_a_save(states, tmp_path):
    """On a throttled persistent tier the save returns with its local commit while the copy is still going;
    the copy lands before the job ends (close), and a later save's copy supersedes those it skipped."""
    (state, _), abstract, mesh = states
    lines = []
    ckpt = _tiered(tmp_path, lines, slow_mb_s=0.5, keep=5)
    ckpt.save(1, state, {"step": 1}, {})
    ckpt.wait()
    persistent = tmp_path / "run" / "checkpoints"
    assert (tmp_path / "local" / "1").is_dir() and not (persistent / "1").exists()  # copying still
    for step in (2, 3, 4):
        ckpt.save(step, state, {"step": step}, {})
        ckpt.wait()
    ckpt.close()
    # Behind, the copier skipped steps (each named in the log), never the newest; what it copied verifies.
    skipped = {int(s) for line in lines if "persistent tier behind" in line
               for s in line.split("[")[1].split("]")[0].split(", ")}
    copied = set(committed_steps(persistent))
    assert 4 in copied and skipped and copied | skipped == {1, 2, 3, 4}, lines
    assert all(verify_manifest(persistent / str(step)) is None for step in committed_steps(persistent))


def test_bad_local_dir_is_refused(tmp_path):
    cfg = CheckpointConfig(local_dir=str(tmp_path / "run" / "checkpoints" / "fast"))
    with pytest.raises(ConfigError, match="checkpoint.local_dir"):
        open_checkpointer(cfg, tmp_path / "run", print)
    with pytest.raises(ConfigError, match="checkpoint.persist_every"):
        CheckpointConfig(every=10, persist_every=15).check()


def test_a_copy_that_does_not_verify_never_lands(tmp_path):
    """A local step damaged after its save (its manifest disagrees) is not renamed into the persistent tier."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    for step in (1, 2):
        (local / str(step) / "state").mkdir(parents=True)
        (local / str(step) / "state" / "data").write_bytes(bytes(range(256)) * 64)
        write_manifest(local / str(step))
    (local / "2" / "state" / "data").write_bytes(bytes(256 * 64))  # same size, other bytes
    persistent.mkdir()
    lines = []
    copier = PersistentCopier(local, persistent, keep=3, keep_every=0, slow_mb_s=0.0, log=lines.append)
    copier.submit(1)
    copier.drain()
    copier.submit(2)
    copier.close()
    assert sorted(p.name for p in persistent.iterdir()) == ["1"]
    assert any("copy of checkpoint 2" in line and "does not match its checksum" in line for line in lines), lines
