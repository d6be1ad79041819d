"""The training loop: compile once, dispatch step N+1 before reading step N's metrics, evaluate, checkpoint,
recover from anomalies, stop cleanly on preemption, sample.

Reading a metric blocks the host until that step finishes; fetching one step late keeps a step always queued
on the devices, so the host's Python (data, logging) overlaps device work instead of adding to it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.checkpoint import Checkpointer
from jaxllm.config import Config, ConfigError
from jaxllm.data.pipeline import make_eval_batches, make_train_iterator, packing_efficiency
from jaxllm.data.token_store import TokenStore
from jaxllm.data.tokenizer import Tokenizer
from jaxllm.mesh import make_mesh
from jaxllm.metrics import JsonlWriter, mfu, peak_flops_per_device
from jaxllm.model.transformer import train_flops_per_token
from jaxllm.model.visibility import resolve_attention
from jaxllm.optim import make_optimizer
from jaxllm.preemption import PreemptionGuard
from jaxllm.progress import ProgressBar
from jaxllm.sample import greedy_generate
from jaxllm.train.anomaly import incident_kind
from jaxllm.train.recovery import AnomalyAbort, restore_latest, restore_start
from jaxllm.train.state import abstract_train_state, create_train_state
from jaxllm.train.step import (batch_sharding, jit_eval_step, jit_train_step, make_eval_step, make_train_step,
                               process_rows)

INJECT_NAN, INJECT_SPIKE = 1, 2
HOLD_TIMEOUT_S = 600.0


def to_global(batch: dict[str, np.ndarray], sharding, global_rows: int) -> dict[str, jax.Array]:
    """This process's block of rows (numpy) -> one global jax.Array per field, split over the batch mesh axes."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), (global_rows,) + np.shape(v)[1:])
            for k, v in batch.items()}


def open_data(cfg: Config) -> tuple[TokenStore, Tokenizer]:
    """The token store and its tokenizer, checked against the model's vocabulary."""
    store_path = Path(cfg.data.path)
    if not (store_path / "manifest.json").exists():
        raise ConfigError("data.path", f"no token store at {store_path} (run `make data` or scripts/prepare_data.py)")
    store = TokenStore.open(str(store_path))
    tokenizer = Tokenizer.load(str(store_path / store.manifest.get("tokenizer", "tokenizer.model")))
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} tokens in {store_path}",
        )
    return store, tokenizer


def evaluate(eval_step, params, batches) -> float:
    """Token-weighted mean loss over `batches` (already global arrays)."""
    sums = [eval_step(params, b) for b in batches]
    total, count = np.sum([jax.device_get(s) for s in sums], axis=0)
    return float(total / max(count, 1.0))


def train(cfg: Config, stream=sys.stdout) -> dict:
    """Train `cfg` end to end (resuming from `<workdir>/checkpoints` if there are any); returns a summary."""
    store, tokenizer = open_data(cfg)
    mesh = make_mesh(cfg.mesh)
    is_main = jax.process_index() == 0
    workdir = Path(cfg.workdir)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    log = (lambda msg: print(msg, file=stream, flush=True)) if is_main else (lambda msg: None)

    tc, ac = cfg.train, cfg.anomaly
    tx = make_optimizer(cfg.optim, tc.steps)
    window = ac.window
    with jax.set_mesh(mesh):
        graphdef, state, shardings = create_train_state(cfg.model, cfg.precision, tx, mesh, tc.seed, window,
                                                        cfg.pipeline)
    abstract = abstract_train_state(cfg.model, cfg.precision, tx, window)
    replicated = NamedSharding(mesh, PartitionSpec())
    rows_sharding = batch_sharding(mesh)
    # Each process reads only the block of batch rows its devices hold (one block per host group on `data`).
    shard_index, shard_count = process_rows(rows_sharding, tc.batch_size)
    # Every process says this (to its own log): which data it reads is per process.
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
          f"reading batch rows block {shard_index} of {shard_count}", file=stream if is_main else sys.stderr,
          flush=True)

    checkpointer = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep,
                                keep_every=cfg.checkpoint.keep_every, async_save=cfg.checkpoint.async_save, log=log)
    incidents = JsonlWriter(workdir / "incidents.jsonl", enabled=is_main)
    state, data_offset, rollbacks = restore_start(cfg, checkpointer, state, abstract, mesh, log)
    start_step = int(state.step)

    def data_iterator(first_step: int):
        """Batches for train steps first_step+1, ... (data index = step - 1 + data_offset)."""
        return make_train_iterator(
            cfg.data.path, split="train", global_batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed,
            process_index=shard_index, process_count=shard_count,
            start_step=first_step + data_offset, num_steps=tc.steps + data_offset + 1,
            num_workers=cfg.data.num_workers,
        )

    train_iter = data_iterator(start_step)
    local_eval = make_eval_batches(cfg.data.path, split="eval", batch_size=tc.batch_size, seq_len=tc.seq_len,
                                   max_batches=tc.eval_batches or None, process_index=shard_index,
                                   process_count=shard_count)
    eval_batches = [to_global(b, rows_sharding, tc.batch_size) for b in local_eval]

    local = next(train_iter)
    packing = packing_efficiency(local)
    batch = to_global(local, rows_sharding, tc.batch_size)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        # Under `rollback` too an anomalous update is skipped inside the step: the next step, already dispatched
        # when the anomaly is seen, then starts from a healthy state, which is the fallback with no checkpoint.
        step_fn = make_train_step(graphdef, tx, cfg.optim.grad_accum, ac,
                                  skip_anomalies=tc.on_anomaly in ("skip", "rollback"))
        train_step = jit_train_step(step_fn, shardings, mesh).lower(state, batch).compile()
        eval_step = jit_eval_step(make_eval_step(graphdef), shardings.params, mesh)
        eval_step = eval_step.lower(state.params, eval_batches[0]).compile() if eval_batches else None
    compile_s = time.perf_counter() - t0
    attention = resolve_attention(cfg.model.attention, cfg.precision.compute)
    log(f"compiled train+eval steps in {compile_s:.1f}s on mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}, "
        f"attention {attention}")

    flops_per_token = train_flops_per_token(cfg.model, tc.seq_len)
    flops_causal = train_flops_per_token(cfg.model, tc.seq_len, causal=True)
    peak = peak_flops_per_device(cfg.peak_flops)
    tokens_per_step = tc.batch_size * tc.seq_len
    writer = JsonlWriter(workdir / "metrics.jsonl", enabled=is_main)
    summary: dict = {"compile_s": compile_s, "start_step": start_step}

    initial_eval = evaluate(eval_step, state.params, eval_batches) if eval_step else float("nan")
    summary["initial_eval_loss"] = initial_eval
    writer.write({"step": start_step, "eval_loss": initial_eval})
    log(f"step {start_step} held-out loss {initial_eval:.4f}")

    bar = ProgressBar(tc.steps, start=start_step, stream=stream) if is_main else None
    injected: set[int] = set()
    held: set[int] = set()
    step_times, losses = [], []
    last_ready = time.perf_counter()

    def meta() -> dict:
        return {"seed": tc.seed, "data_offset": data_offset, "rollbacks": rollbacks, "config": cfg.to_dict()}

    def report(step_idx, metrics, packing_eff) -> dict:
        """Fetch one step's metrics (blocks on that step only), log them, return them."""
        nonlocal last_ready
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time, last_ready = now - last_ready, now
        tps = tokens_per_step / step_time
        record = dict(values, step=step_idx, step_time_s=step_time, tokens_per_sec=tps,
                      mfu=mfu(tps, flops_per_token, mesh.size, peak),
                      mfu_causal=mfu(tps, flops_causal, mesh.size, peak), packing_efficiency=packing_eff)
        writer.write(record)
        step_times.append(step_time)
        losses.append(values["loss"])
        if bar is not None and (step_idx % tc.log_every == 0 or step_idx == tc.steps):
            bar.update(step_idx, values["loss"], tps, record["mfu"], force=step_idx == tc.steps)
        return record

    def handle_anomaly(record) -> bool:
        """Act on an anomalous step per `train.on_anomaly`; True when the state was rolled back."""
        nonlocal state, data_offset, rollbacks, train_iter
        kind = incident_kind(record)
        incident = dict(step=record["step"], kind=kind, loss=record["loss"], grad_norm=record["grad_norm"],
                        action=tc.on_anomaly)
        if tc.on_anomaly == "skip":
            incidents.write(dict(incident, skipped_steps=[record["step"]]))
            log(f"step {record['step']}: {kind} (loss {record['loss']:.4g}), update skipped")
            return False
        if tc.on_anomaly == "rollback" and rollbacks < ac.max_rollbacks:
            checkpointer.wait()
            restored = restore_latest(checkpointer, abstract, mesh, log)
            if restored is not None:
                new_state, _ = restored
                rollbacks += 1
                bad = record["step"]
                # Skip the data window that led here: the restored step's successor reads the data after what
                # step `bad` consumed (the current offset already accounts for earlier rollbacks).
                data_offset = data_offset + (bad - int(new_state.step))
                lr_scale = float(new_state.lr_scale) * ac.lr_factor
                state = new_state.replace(lr_scale=jax.device_put(np.float32(lr_scale), replicated))
                incidents.write(dict(incident, restored_step=int(new_state.step),
                                     skipped_steps=list(range(int(new_state.step) + 1, bad + 1)),
                                     lr_scale=lr_scale, rollbacks=rollbacks))
                log(f"step {bad}: {kind} (loss {record['loss']:.4g}); rolled back to step {int(new_state.step)}, "
                    f"skipping data of steps {int(new_state.step) + 1}..{bad}, LR scale now {lr_scale:g}")
                train_iter.close()
                train_iter = data_iterator(int(new_state.step))
                return True
            # The compiled step already left the state as it was (see make_train_step): carry on without it.
            incidents.write(dict(incident, action="skip (no healthy checkpoint to roll back to)",
                                 skipped_steps=[record["step"]]))
            log(f"step {record['step']}: {kind} (loss {record['loss']:.4g}), update skipped (no healthy checkpoint "
                f"to roll back to)")
            return False
        elif tc.on_anomaly == "rollback":
            incident["action"] = f"abort (gave up after {rollbacks} rollbacks)"
        incidents.write(incident)
        checkpointer.wait()
        raise AnomalyAbort(f"step {record['step']}: {kind} (loss {record['loss']:.4g}, grad norm "
                           f"{record['grad_norm']:.4g}); {incident['action']}")

    def check(record) -> bool:
        """True when `record`'s step was anomalous and the state got rolled back."""
        if record["grad_spike"] and not record["anomaly"]:  # counted and reported, not acted on
            summary["grad_spikes"] = summary.get("grad_spikes", 0) + 1
            incidents.write(dict(step=record["step"], kind="grad_spike", loss=record["loss"],
                                 grad_norm=record["grad_norm"], action="reported"))
            log(f"step {record['step']}: gradient-norm spike ({record['grad_norm']:.4g}, loss {record['loss']:.4g}); "
                f"reported only (clipping bounds the update)")
        return bool(record["anomaly"]) and handle_anomaly(record)

    guard = PreemptionGuard()
    pending = None  # (step, metrics on device, packing) of the step dispatched last, not yet read
    step = start_step
    train_start = time.perf_counter()
    try:
        while step < tc.steps:
            checkpointer.check_for_errors()  # a failed background save stops training here
            step += 1
            inject = (INJECT_NAN if step == cfg.debug.inject_nan_at_step else
                      INJECT_SPIKE if step == cfg.debug.inject_spike_at_step else 0)
            if inject and step not in injected:
                injected.add(step)
                state = state.replace(inject=jax.device_put(np.int32(inject), replicated))
            state, metrics = train_step(state, batch)  # dispatch this step ...
            current = (step, metrics, packing)
            rolled_back = pending is not None and check(report(*pending))  # ... then wait for the previous one
            pending = None
            stop = boundary = evaluating = False
            if not rolled_back and step == cfg.debug.hold_at_step and step not in held:
                # Drills: the step's metrics are out before the hold, so whoever waits for them signals mid-run.
                held.add(step)
                rolled_back = check(report(*current))
                current = None
                if not rolled_back:
                    log(f"holding after step {step} until a signal arrives (debug.hold_at_step)")
                    guard.wait_for_signal(HOLD_TIMEOUT_S)
            if not rolled_back:
                stop = guard.should_stop(step)
                boundary = step % cfg.checkpoint.every == 0 or step == tc.steps or stop
                evaluating = step % tc.eval_every == 0 and step < tc.steps and eval_step is not None
                if current is not None and (boundary or evaluating):  # known healthy before saved or evaluated
                    rolled_back = check(report(*current))
                else:
                    pending = current
            if rolled_back:
                step = int(state.step)
            else:
                if boundary:
                    checkpointer.save(step, state, train_iter.get_state(), meta())
                if evaluating:
                    writer.write({"step": step, "eval_loss": evaluate(eval_step, state.params, eval_batches)})
                    last_ready = time.perf_counter()  # eval time is not the next step's time
                if stop:
                    checkpointer.wait()
                    log(f"preempted: saved step {step}, exiting")
                    summary["preempted_at"] = step
                    break
            if step < tc.steps:
                local = next(train_iter)
                packing = packing_efficiency(local)
                batch = to_global(local, rows_sharding, tc.batch_size)
        if pending is not None:
            check(report(*pending))
        checkpointer.wait()
    finally:
        guard.restore()
        train_iter.close()
        if bar is not None:
            bar.close()
    train_s = time.perf_counter() - train_start

    final_eval = evaluate(eval_step, state.params, eval_batches) if eval_step else float("nan")
    writer.write({"step": step, "eval_loss": final_eval})
    steady = step_times[min(2, len(step_times) - 1):] if step_times else [float("nan")]
    tps = tokens_per_step * len(steady) / float(np.sum(steady))
    summary.update(
        final_step=step, final_eval_loss=final_eval, first_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"), train_s=train_s, tokens_per_sec=tps,
        mfu=mfu(tps, flops_per_token, mesh.size, peak), mfu_causal=mfu(tps, flops_causal, mesh.size, peak),
        checkpoint_saves=checkpointer.saves, rollbacks=rollbacks, lr_scale=float(state.lr_scale),
    )
    log(f"trained steps {start_step + 1}..{step} in {train_s:.1f}s: {tps:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}% "
        f"(causal {100 * summary['mfu_causal']:.2f}%)")
    log(f"held-out loss {final_eval:.4f} (step {start_step}: {initial_eval:.4f}, ratio {final_eval / initial_eval:.2f})")

    if tc.sample_tokens > 0 and "preempted_at" not in summary:
        with jax.set_mesh(mesh):
            prompt = [tokenizer.bos_id] + tokenizer.encode(tc.sample_prompt)
            out = greedy_generate(graphdef, state.params, prompt, tc.sample_tokens,
                                  eos_id=tokenizer.eos_id, max_len=tc.seq_len)
        summary["sample"] = tokenizer.decode(out)
        log("greedy sample:\n" + tc.sample_prompt + summary["sample"])
    checkpointer.close()
    writer.close()
    incidents.close()
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
