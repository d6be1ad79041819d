"""Running `scripts/train.py` as real processes in tests: the command line, the environment, metrics, ports."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllm.runtime.distributed import free_port_pair  # noqa: F401  (the multi-process tests' ports)

ROOT = Path(__file__).resolve().parents[1]

# The tiny model on short rows with one eval batch and no sample: seconds per step on 8 fake CPU devices.
TINY = ("--config.model.preset=tiny", "--config.model.vocab_size=512", "--config.train.seq_len=32",
        "--config.train.eval_batches=1", "--config.train.sample_tokens=0")


# Test runs compile the same tiny programs over and over, one process at a time: an XLA compilation cache shared
# by the test run's subprocesses (tests/conftest.py makes it) turns a run's compiling into a read after the first.
# (JAX falls back to compiling, with a warning, if it ever reads a damaged entry.) Only the subprocesses use it:
# in the test processes themselves, writing every program to it cost as much as the hits saved.
COMPILATION_CACHE = os.environ["JAXLLM_TEST_XLA_CACHE"]


def train_command(store, workdir, *args: str) -> list[str]:
    """`python scripts/train.py` on configs/pretrain.py with the tiny model; later `args` override earlier ones."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
            "--workdir", str(workdir), f"--config.data.path={store}", *TINY, *args]


# The resume tests' job (tests/test_checkpoint.py, tests/test_drill.py and the shared `uninterrupted` reference
# of tests/conftest.py): saved every 2 steps, never evaluated mid-run.
RESUME = ("--config.train.eval_every=1000", "--config.checkpoint.every=2", "--config.optim.warmup_steps=2")


def resume_command(store, workdir, *args: str) -> list[str]:
    """`train_command` of the resume tests' job; later `args` override earlier ones."""
    return train_command(store, workdir, *RESUME, *args)


def run_drill(store, reference, workdir, faults: str, *args: str, seed: int = 0) -> dict:
    """`scripts/drill.py --faults faults` on the tiny job of the finished run `reference` (its config plus `args`,
    which must make it the same job); the drill's JSON object (its last line), asserting that the drill passed."""
    command = [sys.executable, str(ROOT / "scripts" / "drill.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
               "--faults", faults, "--seed", str(seed), "--workdir", str(workdir), "--reference", str(reference),
               f"--config.data.path={store}", *TINY, *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=900)
    print(proc.stdout[-3000:])
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), (proc.returncode, proc.stderr[-3000:])  # no JSON: the drill itself broke
    result = json.loads(last)
    assert proc.returncode == 0 and result["passed"], (proc.stderr[-3000:], proc.stdout[-3000:])
    return result


def train_env(devices: int = 8, **extra: str) -> dict[str, str]:
    """This environment on CPU with `devices` fake devices per process (keeping conftest's other XLA flags)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    # Single-threaded matmuls: 8 fake devices already share 2 cores. It was added against wedges (3 of 7 runs of
    # the reward resume test at load aborted at XLA's 180 s rendezvous limit), but XLA:CPU still runs parts of
    # each program on its intra-op pool with it (a hung 2-process job of 2026-12-07 had both stuck collectives on
    # tf_XLAEigen threads, two idle beside them): the wedges were collectives in another order on each device
    # (jaxllm/train/diagnostic_step.py), in the NaN replays those tests make.
    flags = f"{flags} --xla_force_host_platform_device_count={devices} --xla_cpu_multi_thread_eigen=false".strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags,
                JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", **extra)


def metrics(workdir) -> list[dict]:
    return [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> dict[int, float]:
    """Training loss by step from a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in metrics(workdir) if "loss" in r}


# Each post-training objective's fixture run injects a NaN at step 3 and its resume test repeats the injection, so
# one run per objective is the reference for both its rollback test and its bitwise resume (past a rollback).
NAN_AT_3 = ("--config.debug.inject_nan_at_step=3",)
# An RL run's rollback from step 3 to step 2 skips step 3's minibatch (as for every objective, the data that led to
# the anomaly), so with 4 minibatches an iteration, iteration 0 ends with the replayed step 3 and iteration 1
# samples its rollout at step 4.
RL_ITERATION_STARTS = (1, 4)


def assert_rolled_back_at_3(workdir) -> None:
    """The run in `workdir` (with NAN_AT_3, checkpoints every 2 steps) rolled back once, from the non-finite step 3
    to the checkpoint of step 2, and every step it kept is finite."""
    (incident,) = [json.loads(x) for x in (Path(workdir) / "incidents.jsonl").read_text().splitlines()]
    assert (incident["kind"], incident["action"], incident["restored_step"]) == ("nonfinite", "rollback", 2)
    logged = [r["loss"] for r in metrics(workdir) if r.get("step") == 3 and "loss" in r]
    assert len(logged) == 2 and not math.isfinite(logged[0]), logged  # the injected step, then its replay
    assert all(math.isfinite(v) for v in losses(workdir).values())


def wait_for_step(workdir, step, proc, timeout=300):
    """Wait until the run in `workdir` (process `proc`) has logged the loss of `step`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited early: {proc.stderr.read()[-2000:]}")
        path = Path(workdir) / "metrics.jsonl"
        if path.exists() and any(s >= step for s in losses(workdir)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def preempt_at(command: list[str], workdir, step: int) -> int:
    """Run `command` held after `step` (debug.hold_at_step), SIGTERM it there, and return the step it saved."""
    proc = subprocess.Popen([*command, f"--config.debug.hold_at_step={step}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=train_env())
    wait_for_step(workdir, step, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "preempted: saved step" in out, out[-2000:]
    return int(out.split("preempted: saved step ")[1].split(",")[0])


# LoRA SFT of a tiny pretrained base on a slice of the shipped SFT task (tests/conftest.py: bases, sft_task).
SFT = ("--config.train.seq_len=128", "--config.train.eval_batches=1", "--config.train.eval_every=1000",
       "--config.checkpoint.every=2", "--config.optim.warmup_steps=2", "--config.sft.eval_examples=4",
       "--config.sft.max_new_tokens=4", "--config.lora.dropout=0.1")


# The in-training harness callback, on the first base only (tests/test_harness.py reads its metrics): one task of
# the offline pack (eval_tasks/, whose data files are named from the repository root) after each step.
HARNESS = ("--config.eval.harness_every=1", "--config.eval.harness_tasks=jaxllm_shakespeare_cloze",
           "--config.eval.harness_limit=4", f"--config.eval.harness_include_path={ROOT / 'eval_tasks'}")


def pretrain_base(store, workdir, seed):
    """A tiny pretrained run of 2 steps in `workdir` (seed 0's runs the harness callback too: HARNESS)."""
    proc = subprocess.run(train_command(store, workdir, "--config.train.steps=2", "--config.checkpoint.every=2",
                                        "--config.train.eval_every=1000", f"--config.train.seed={seed}",
                                        *(HARNESS if seed == 0 else ())),
                          capture_output=True, text=True, env=train_env(), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def sft_command(base, task, workdir, *args):
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "sft_lora.py"),
            "--workdir", str(workdir), f"--config.checkpoint.restore_from={base}",
            f"--config.sft.train_file={task / 'train.jsonl'}", f"--config.sft.eval_file={task / 'eval.jsonl'}",
            f"--config.data.path={task / 'prepared'}", *SFT, *args]


def run_sft(base, task, workdir, *args):
    return subprocess.run(sft_command(base, task, workdir, *args), capture_output=True, text=True, env=train_env(),
                          timeout=600)


def rl_command(objective: str, base, prompts, workdir, *args: str) -> list[str]:
    """`python scripts/train.py` on configs/<objective>.py (ppo or grpo) from `base`, with the prompts in
    `prompts` (train.jsonl, eval.jsonl); later `args` override earlier ones."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / f"{objective}.py"),
            "--workdir", str(workdir), f"--config.checkpoint.restore_from={base}",
            f"--config.{objective}.train_file={prompts / 'train.jsonl'}",
            f"--config.{objective}.eval_file={prompts / 'eval.jsonl'}", *args]


def run_command(command: list[str], timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=timeout)


def checkpoint_leaves(workdir) -> list:
    """The trained arrays of a run's latest checkpoint, as numpy, in tree order."""
    import jax
    import numpy as np

    from jaxllm.runs.loader import load_checkpoint

    return [np.asarray(x) for x in jax.tree.leaves(load_checkpoint(str(workdir)).params)]


def assert_serves_the_tools(workdir, tmp_path) -> None:
    """A LoRA run's checkpoint (any objective's) is usable: the loader behind generate.py, eval.py and
    convert_hf.py export gives its model with the trained adapters on its base, that model's merged export gives
    the same logits in transformers (1e-4), and `checkpoint.restore_from` locates it as a base whose parameters
    are the merged ones and whose fingerprint is that of its stored arrays."""
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from jaxllm.interop import hf
    from jaxllm.model.lora import merge
    from jaxllm.parallel.mesh import single_device_mesh
    from jaxllm.runs import base_model
    from jaxllm.runs.loader import load_base, load_checkpoint

    loaded = load_checkpoint(str(workdir))
    model = loaded.model
    assert model.lora is not None and type(model).__name__ == "Transformer", type(model)
    adapters = nnx.state(model, nnx.LoRAParam)
    assert any(np.any(np.asarray(b) != 0) for b in jax.tree.leaves(adapters)), "the adapters are untrained"
    tokens = np.arange(1, 17, dtype=np.int32)[None]
    ours = np.asarray(model(tokens))
    hf.save_pretrained(model, tmp_path / "merged")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        theirs = exported(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    base = base_model.locate(str(workdir))
    assert base.kind == "jaxllm-lora", base
    merged = nnx.state(merge(model), nnx.Param)
    seeded, identity = load_base(base, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), merged),
                                 single_device_mesh())
    for a, b in zip(jax.tree.leaves(seeded), jax.tree.leaves(merged)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # The base is fingerprinted by its stored arrays, not by the merge (whose last bits follow the compiler); a
    # record of the merged values (runs before 2026-12-04) is the same base, any other fingerprint is not.
    assert identity == base_model.fingerprint(loaded.params) != base_model.fingerprint(seeded)
    merged_record = base.record(base_model.fingerprint(seeded))
    assert base_model.accepted(merged_record, identity, seeded) == base.record(identity)
    other = base.record("0" * 32)
    assert base_model.accepted(other, identity, seeded) == other


def assert_dry_run_plans_the_run(command: list[str], workdir) -> None:
    """What `scripts/train.py --dry_run` plans for a run's command line (its config built, validated and planned
    in-process as the script does) counts the trainable parameters, the frozen ones and the optimizer-state values
    of the state the run built: its checkpoint's parameters and optimizer state, and what its model took from its
    base."""
    import math

    import jax
    from flax import nnx

    from jaxllm.config.cli import build_config, split_overrides
    from jaxllm.config.schema import validate
    from jaxllm.objectives.registry import resolved_shape
    from jaxllm.plan.footprint import memory_plan
    from jaxllm.runs.checkpoint import Checkpointer, array_shapes
    from jaxllm.runs.loader import array_name, load_checkpoint

    args, overrides = split_overrides(command[2:])  # after python and scripts/train.py
    cd = build_config(args[args.index("--config") + 1], overrides, args[args.index("--workdir") + 1])
    cfg = resolved_shape(validate(cd, jax.device_count(), check_batch=False))
    plan = memory_plan(cfg, compiled=False)
    source = Checkpointer(Path(workdir) / "checkpoints", keep=1000, log=lambda *_: None)
    try:
        saved = source.manager.item_metadata(source.latest_step())["state"].tree
    finally:
        source.close()
    values = lambda shapes: sum(math.prod(shape) for shape in shapes.values())
    trainable, opt_state = values(array_shapes(saved["params"])), values(array_shapes(saved["opt_state"]))
    held = set(array_shapes({"params": saved["params"]}))
    model = nnx.state(load_checkpoint(str(workdir)).model, nnx.Param)
    frozen = sum(v[...].size for path, v in nnx.to_flat_state(model) if array_name(path, v) not in held)
    assert (plan["trainable_params"], plan["num_params"] - plan["trainable_params"], plan["opt_state_values"]) == (
        trainable, frozen, opt_state), (plan, trainable, frozen, opt_state)
    from jaxllm.plan.reports import memory_report

    biggest = max((v[...] for _, v in nnx.to_flat_state(model)), key=lambda x: x.size)  # --print_memory's plan
    report = memory_report(cfg)  # of the model that trains, with no data prepared or read
    assert str(tuple(biggest.shape)) in report and "largest of" in report.splitlines()[-1], report


def start_processes(command: list[str], workdir, processes: int = 2) -> list[subprocess.Popen]:
    """`command` as one job of `processes` processes on localhost (8 / processes CPU devices each, joined by the
    --coordinator_address flags), each logging to `<workdir>.p<i>.log`."""
    port = free_port_pair()
    procs = []
    for i in range(processes):
        flags = ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes),
                 "--process_id", str(i)]
        with open(f"{workdir}.p{i}.log", "w") as log:
            procs.append(subprocess.Popen([*command, *flags], stdout=log, stderr=subprocess.STDOUT, text=True,
                                          env=train_env(8 // processes, PYTHONPATH=str(ROOT / "tests"))))
    return procs


def process_logs(procs: list[subprocess.Popen], workdir, timeout=600) -> list[str]:
    """Wait for every process of `start_processes` (`timeout` seconds in all); their logs. Past the limit the
    job's processes are killed (a wedged job would otherwise outlive the test, holding CPU and ports for the rest
    of the suite) and the test fails with the tail of each log."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        tails = "\n".join(f"--- process {i}:\n{Path(f'{workdir}.p{i}.log').read_text()[-2000:]}"
                          for i in range(len(procs)))
        pytest.fail(f"the {len(procs)}-process job did not end within {timeout} s; killed\n{tails}")
    return [Path(f"{workdir}.p{i}.log").read_text() for i in range(len(procs))]


def rollout_rows(workdir, step: int) -> dict:
    """The iteration's rollout rows saved with checkpoint `step` (every process's block, in order, as one)."""
    import numpy as np

    state = json.loads((Path(workdir) / "checkpoints" / str(step) / "data" / "metadata").read_text())
    blocks = [np.load(io.BytesIO(base64.b64decode(text))) for text in state["rollout"]]
    return {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0].files}
