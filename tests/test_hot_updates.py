"""Hot updates of a running job (jaxllm/train/control.py): parsing and rejecting the control file, each action's
effect on a train state, ids applied once, the clipping threshold as optimizer state (one compiled update for
every threshold, older checkpoints still restore), and a real run steered by control.json, stopped by it and
resumed with the changed learning rate."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxllm.runs.checkpoint import CheckpointMismatch, Checkpointer
from jaxllm.config.schema import OptimConfig
from jaxllm.observe.metrics import JsonlWriter
from jaxllm.optim.chain import (current_clip_norm, decay_mask, learning_rate_schedule, make_optimizer,
                          without_clip_norm)
from jaxllm.train.control import Change, HotUpdates, parse_control, write_control
from jaxllm.train.state import new_train_state, older_layout
from tests.train_runs import metrics, train_command, train_env, wait_for_step

PARAMS = nnx.State({"w": nnx.Param(jnp.arange(1.0, 7.0).reshape(2, 3)), "b": nnx.Param(jnp.ones(3))})


def optim_config(clip_norm=1.0):
    return OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", clip_norm=clip_norm)


def tiny_state(clip_norm=1.0):
    tx = make_optimizer(optim_config(clip_norm), 10)
    return tx, new_train_state(PARAMS, tx, 0, 4)


def incidents(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not valid JSON"),
    ('{"id": "a", "lr_scale": 0.5, "lr": 1}', "unknown key 'lr'"),
    ('{"lr_scale": 0.5}', 'needs an "id"'),
    ('{"id": "a"}', "no action"),
    ('{"id": "a", "lr_scale": 0}', "lr_scale must be a finite number > 0"),
    ('{"id": "a", "lr_scale": true}', "lr_scale must be a finite number > 0"),
    ('{"id": "a", "clip_norm": -1}', "clip_norm must be a finite number >= 0"),
    ('{"id": "a", "stop": false}', "stop must be true"),
    ('[3]', "a change is a JSON object"),
    ('{"id": "a", "lr_scale": 0.5, "at_step": 0}', "at_step must be an integer >= 1"),
    ('{"id": "a", "lr_scale": 0.5, "at_step": 2.5}', "at_step must be an integer >= 1"),
    ('{"id": "a", "at_step": 3}', "no action"),
])
def test_bad_changes_are_rejected_with_the_reason(text, reason):
    changes, rejections = parse_control(text)
    assert changes == [] and len(rejections) == 1 and reason in rejections[0]["reason"], rejections


def test_a_list_of_changes_parses_and_bad_entries_do_not_spoil_good_ones():
    changes, rejections = parse_control(json.dumps([
        {"id": "lr", "lr_scale": 0.5}, {"id": "bad", "speed": 2}, {"id": "clip", "clip_norm": 0, "save": True},
        {"id": "halt", "eval": True, "stop": True}]))
    assert changes == [Change("lr", lr_scale=0.5), Change("clip", clip_norm=0.0, save=True),
                       Change("halt", eval=True, stop=True)]
    assert rejections == [{"id": "bad", "reason": rejections[0]["reason"]}] and "'speed'" in rejections[0]["reason"]


def test_each_change_applies_once_and_rejections_leave_the_state_unchanged(tmp_path):
    _, state = tiny_state()
    writer = JsonlWriter(tmp_path / "incidents.jsonl")
    hot = HotUpdates(tmp_path, [], writer, log=lambda msg: None)
    assert hot.poll(1).changes == ()  # no file: nothing due

    write_control(tmp_path, [{"id": "typo", "lr_scael": 0.1}])
    due = hot.poll(1)
    state = hot.apply(1, state)
    assert due.changes == () and float(state.lr_scale) == 1.0
    assert float(current_clip_norm(state.opt_state)) == 1.0

    write_control(tmp_path, [{"id": "typo", "lr_scael": 0.1}, {"id": "lr", "lr_scale": 0.5},
                             {"id": "clip", "clip_norm": 0.25}, {"id": "ops", "save": True, "eval": True}])
    due = hot.poll(2)
    assert (due.save, due.eval, due.stop) == (True, True, False)
    state = hot.apply(2, state)
    assert float(state.lr_scale) == 0.5 and float(current_clip_norm(state.opt_state)) == 0.25
    for step in (3, 4):  # the same ids again (a rewritten file): nothing new
        write_control(tmp_path, [{"id": "lr", "lr_scale": 0.5}, {"id": "stop", "stop": True}])
        due = hot.poll(step)
        state = hot.apply(step, state)
    assert float(state.lr_scale) == 0.5 and due.changes == ()  # "stop" was due at step 3, applied there
    assert [r["id"] for r in hot.applied] == ["lr", "clip", "ops", "stop"]

    lines = incidents(tmp_path / "incidents.jsonl")
    assert [(r["action"], r.get("id"), r["step"]) for r in lines] == [
        ("rejected", "typo", 1), ("applied", "lr", 2), ("applied", "clip", 2), ("applied", "ops", 2),
        ("applied", "stop", 3)]  # the rejection is logged once, not at every re-read
    assert lines[1]["lr_scale"] == [1.0, 0.5] and lines[2]["clip_norm"] == [1.0, 0.25]
    assert lines[3]["save"] is True and lines[3]["eval"] is True and lines[4]["stop"] is True

    resumed = HotUpdates(tmp_path, hot.applied, writer, log=lambda msg: None)  # from a checkpoint's metadata
    assert resumed.poll(10).changes == ()


def test_a_change_with_at_step_waits_for_its_step_and_a_late_one_applies_at_once(tmp_path):
    _, state = tiny_state()
    writer = JsonlWriter(tmp_path / "incidents.jsonl")
    hot = HotUpdates(tmp_path, [], writer, log=lambda msg: None)
    write_control(tmp_path, [{"id": "later", "lr_scale": 0.5, "at_step": 3}, {"id": "now", "clip_norm": 0.5}])
    for step in (1, 2, 3, 4):
        due = hot.poll(step)
        state = hot.apply(step, state)
        assert [c.id for c in due.changes] == {1: ["now"], 3: ["later"]}.get(step, []), step
        assert float(state.lr_scale) == (0.5 if step >= 3 else 1.0), step
    assert hot.applied == [{"id": "now", "clip_norm": 0.5, "step": 1},
                           {"id": "later", "lr_scale": 0.5, "at_step": 3, "step": 3}]
    write_control(tmp_path, [{"id": "late", "lr_scale": 0.5, "at_step": 2}])  # read after its step: applied now
    assert [c.id for c in hot.poll(5).changes] == ["late"]
    hot.apply(5, state)
    assert [(r["id"], r["step"], r.get("at_step")) for r in incidents(tmp_path / "incidents.jsonl")] == [
        ("now", 1, None), ("later", 3, 3), ("late", 5, 2)]


def test_a_rollback_past_a_change_re_applies_it(tmp_path):
    _, state = tiny_state()
    hot = HotUpdates(tmp_path, [], JsonlWriter(tmp_path / "incidents.jsonl"), log=lambda msg: None)
    write_control(tmp_path, [{"id": "lr", "lr_scale": 0.5}, {"id": "clip", "clip_norm": 2.0}])
    hot.poll(1)
    hot.apply(1, state)
    restored = state.replace(lr_scale=jnp.float32(0.25))  # an older checkpoint, with recovery's lower LR
    again = hot.after_rollback(restored, in_checkpoint=[{"id": "clip", "clip_norm": 2.0, "step": 1}])
    assert float(again.lr_scale) == 0.125 and float(current_clip_norm(again.opt_state)) == 1.0  # clip: in it


def test_the_clip_threshold_is_a_value_of_one_compiled_update_with_the_baked_clips_math():
    """Every threshold (0: off) runs one compiled update, bit for bit what the chain with optax's clipping baked
    in (jaxllm before the threshold moved into the state) computes."""
    grads = nnx.State({"w": nnx.Param(jnp.full((2, 3), 3.0)), "b": nnx.Param(jnp.full((3,), -2.0))})  # norm ~8.1
    cfg = optim_config()
    tx, state = tiny_state()
    update = jax.jit(lambda g, s: tx.update(g, s, PARAMS)[0])
    for clip in (1.0, 100.0, 0.0):
        ours = update(grads, state.opt_state._replace(hyperparams={**state.opt_state.hyperparams,
                                                                   "clip_norm": jnp.float32(clip)}))
        clipping = optax.clip_by_global_norm(clip) if clip else optax.identity()
        baked = optax.inject_hyperparams(lambda learning_rate: optax.chain(clipping, optax.adamw(
            learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)))(
            learning_rate=cfg.lr)
        theirs = jax.jit(lambda g, s: baked.update(g, s, PARAMS)[0])(grads, baked.init(PARAMS))
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(a, b)
    assert update._cache_size() == 1


def test_checkpoints_from_before_the_threshold_moved_into_the_state_restore(tmp_path):
    from jaxllm.config.schema import MeshConfig
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.train.state import state_shardings

    _, state = tiny_state(clip_norm=0.5)
    old = state.replace(opt_state=without_clip_norm(state.opt_state))
    checkpointer = Checkpointer(tmp_path / "checkpoints", async_save=False, log=lambda msg: None)
    checkpointer.save(1, old, {}, {})
    mesh = make_mesh(MeshConfig(data=8))
    abstract = jax.eval_shape(lambda: state)
    shardings = state_shardings(abstract, mesh)
    # Intact but of another layout: a mismatch naming the missing array, not an unreadable checkpoint.
    with pytest.raises(CheckpointMismatch, match="opt_state/hyperparams/clip_norm only in the config"):
        checkpointer.restore(1, abstract, mesh, shardings=shardings)
    restored = checkpointer.restore(1, abstract, mesh, shardings=shardings,
                                    older=older_layout(abstract, shardings, 0.5))["state"]
    assert float(current_clip_norm(restored.opt_state)) == 0.5
    np.testing.assert_array_equal(restored.params["w"][...], PARAMS["w"][...])
    checkpointer.close()


def test_a_run_steered_by_control_json_stops_and_resumes_with_the_changed_lr(shakespeare_store, tmp_path):
    """lr x0.5, save and eval at the first boundary; stop written mid-run (during a stalled step); the resumed
    run does not apply any id again (the stop would end it at once) and trains on at half the schedule."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    steps = 10
    command = train_command(shakespeare_store, workdir, f"--config.train.steps={steps}",
                            "--config.optim.warmup_steps=2", "--config.checkpoint.every=1000",
                            "--config.train.eval_every=1000")
    changes = [{"id": "lr-half", "lr_scale": 0.5}, {"id": "save-now", "save": True}, {"id": "eval-now", "eval": True}]
    write_control(workdir, changes)
    proc = subprocess.Popen([*command, "--config.debug.stall_at_step=4", "--config.debug.stall_s=6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env())
    wait_for_step(workdir, 2, proc)
    write_control(workdir, changes + [{"id": "stop-now", "stop": True}, {"id": "bad", "lr_scale": -1}])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = json.loads((workdir / "summary.json").read_text())["preempted_at"]
    assert 2 < stopped < steps
    assert (workdir / "checkpoints" / "1").is_dir()  # the hot save
    assert any(r["step"] == 1 and "eval_loss" in r for r in metrics(workdir))  # the hot eval

    resumed = subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from checkpoint step {stopped}" in resumed.stdout
    hot = [(r["action"], r["id"], r["step"]) for r in incidents(workdir / "incidents.jsonl")
           if r["kind"] == "hot_update"]
    assert hot == [("applied", "lr-half", 1), ("applied", "save-now", 1), ("applied", "eval-now", 1),
                   ("rejected", "bad", stopped), ("applied", "stop-now", stopped),
                   ("rejected", "bad", stopped + 1)]  # a new process reads the file again, logs the rejection again

    schedule = learning_rate_schedule(OptimConfig(**json.loads((workdir / "config.json").read_text())["optim"]),
                                      steps)
    lrs = {r["step"]: r["lr"] for r in metrics(workdir) if "lr" in r}
    assert sorted(lrs) == list(range(1, steps + 1))
    for step, lr in lrs.items():
        assert lr == pytest.approx(float(schedule(step - 1)) * (1.0 if step == 1 else 0.5), rel=1e-6), step
