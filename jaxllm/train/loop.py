"""The training loop: compile once, dispatch step N+1 before reading step N's metrics, evaluate, sample.

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

from jaxllm.config import Config, ConfigError
from jaxllm.data.pipeline import make_eval_batches, make_train_iterator, packing_efficiency
from jaxllm.data.token_store import TokenStore
from jaxllm.data.tokenizer import Tokenizer
from jaxllm.mesh import make_mesh
from jaxllm.metrics import JsonlWriter, mfu, peak_flops_per_device
from jaxllm.model.transformer import train_flops_per_token
from jaxllm.optim import make_optimizer
from jaxllm.progress import ProgressBar
from jaxllm.sample import greedy_generate
from jaxllm.train.state import create_train_state
from jaxllm.train.step import batch_sharding, jit_eval_step, jit_train_step, make_eval_step, make_train_step


def to_global(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Process-local numpy rows -> one global jax.Array per field, split over the batch mesh axes."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


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
    """Train `cfg` end to end; returns a summary (losses, timings, throughput, sample)."""
    store, tokenizer = open_data(cfg)
    mesh = make_mesh(cfg.mesh)
    is_main = jax.process_index() == 0
    workdir = Path(cfg.workdir)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    log = (lambda msg: print(msg, file=stream, flush=True)) if is_main else (lambda msg: None)

    tc = cfg.train
    tx = make_optimizer(cfg.optim, tc.steps)
    with jax.set_mesh(mesh):
        graphdef, state, shardings = create_train_state(cfg.model, cfg.precision, tx, mesh, tc.seed)
    rows_sharding = batch_sharding(mesh)

    train_iter = make_train_iterator(
        cfg.data.path, split="train", global_batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed,
        process_index=jax.process_index(), process_count=jax.process_count(), start_step=0,
        num_steps=tc.steps, num_workers=cfg.data.num_workers,
    )
    local_eval = make_eval_batches(cfg.data.path, split="eval", batch_size=tc.batch_size, seq_len=tc.seq_len,
                                   max_batches=tc.eval_batches or None, process_index=jax.process_index(),
                                   process_count=jax.process_count())
    eval_batches = [to_global(b, rows_sharding) for b in local_eval]

    local = next(train_iter)
    packing = packing_efficiency(local)
    first = to_global(local, rows_sharding)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        train_step = jit_train_step(make_train_step(graphdef, tx, cfg.optim.grad_accum), shardings, mesh)
        train_step = train_step.lower(state, first).compile()
        eval_step = jit_eval_step(make_eval_step(graphdef), shardings.params, mesh)
        eval_step = eval_step.lower(state.params, eval_batches[0]).compile() if eval_batches else None
    compile_s = time.perf_counter() - t0
    log(f"compiled train+eval steps in {compile_s:.1f}s on mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}")

    flops_per_token = train_flops_per_token(cfg.model, tc.seq_len)
    flops_causal = train_flops_per_token(cfg.model, tc.seq_len, causal=True)
    peak = peak_flops_per_device(cfg.peak_flops)
    tokens_per_step = tc.batch_size * tc.seq_len
    writer = JsonlWriter(workdir / "metrics.jsonl", enabled=is_main)
    summary: dict = {"compile_s": compile_s}

    initial_eval = evaluate(eval_step, state.params, eval_batches) if eval_step else float("nan")
    summary["initial_eval_loss"] = initial_eval
    writer.write({"step": 0, "eval_loss": initial_eval})
    log(f"step 0 held-out loss {initial_eval:.4f}")

    bar = ProgressBar(tc.steps, stream=stream) if is_main else None
    pending = None  # (step, metrics on device, batch pad fraction)
    last_ready = time.perf_counter()
    step_times, losses = [], []
    batch = first
    train_start = time.perf_counter()

    def report(step_idx, metrics, packing):
        nonlocal last_ready
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = now - last_ready
        last_ready = now
        tps = tokens_per_step / step_time
        record = dict(values, step=step_idx, step_time_s=step_time, tokens_per_sec=tps,
                      mfu=mfu(tps, flops_per_token, mesh.size, peak),
                      mfu_causal=mfu(tps, flops_causal, mesh.size, peak), packing_efficiency=packing)
        writer.write(record)
        step_times.append(step_time)
        losses.append(values["loss"])
        if bar is not None and (step_idx % tc.log_every == 0 or step_idx == tc.steps):
            bar.update(step_idx, values["loss"], tps, record["mfu"], force=step_idx == tc.steps)
        return record

    for step in range(1, tc.steps + 1):
        state, metrics = train_step(state, batch)  # dispatch step `step` ...
        if pending is not None:
            report(*pending)  # ... then block on the previous one only
        pending = (step, metrics, packing)
        if step < tc.steps:
            local = next(train_iter)
            packing = packing_efficiency(local)
            batch = to_global(local, rows_sharding)
        if step % tc.eval_every == 0 and step < tc.steps and eval_step:
            report(*pending)
            pending = None
            eval_loss = evaluate(eval_step, state.params, eval_batches)
            writer.write({"step": step, "eval_loss": eval_loss})
            last_ready = time.perf_counter()  # do not charge eval time to the next step
    if pending is not None:
        report(*pending)
    train_s = time.perf_counter() - train_start
    if bar is not None:
        bar.close()

    final_eval = evaluate(eval_step, state.params, eval_batches) if eval_step else float("nan")
    writer.write({"step": tc.steps, "eval_loss": final_eval})
    # Wall-clock throughput after the first two steps (warm caches, first data fetches).
    steady = step_times[min(2, len(step_times) - 1):]
    tps = tokens_per_step * len(steady) / float(np.sum(steady))
    summary.update(
        final_eval_loss=final_eval,
        first_loss=losses[0],
        final_loss=losses[-1],
        train_s=train_s,
        tokens_per_sec=tps,
        mfu=mfu(tps, flops_per_token, mesh.size, peak),
        mfu_causal=mfu(tps, flops_causal, mesh.size, peak),
    )
    log(f"trained {tc.steps} steps in {train_s:.1f}s: {tps:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}% "
        f"(causal {100 * summary['mfu_causal']:.2f}%)")
    log(f"held-out loss {final_eval:.4f} (step 0: {initial_eval:.4f}, ratio {final_eval / initial_eval:.2f})")

    if tc.sample_tokens > 0:
        with jax.set_mesh(mesh):
            prompt = [tokenizer.bos_id] + tokenizer.encode(tc.sample_prompt)
            out = greedy_generate(graphdef, state.params, prompt, tc.sample_tokens,
                                  eos_id=tokenizer.eos_id, max_len=tc.seq_len)
        text = tokenizer.decode(out)
        summary["sample"] = text
        log("greedy sample:\n" + tc.sample_prompt + text)
    train_iter_close = getattr(train_iter, "close", None)
    if train_iter_close:
        train_iter_close()
    writer.close()
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
