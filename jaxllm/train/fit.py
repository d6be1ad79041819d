"""The training loop every objective shares: compile once, dispatch step N+1 before reading step N's metrics,
evaluate, checkpoint, recover from anomalies, stop cleanly on preemption, sample.

Reading a metric blocks the host until that step finishes; fetching one step late keeps a step always queued
on the devices, so the host's Python (data, logging) overlaps device work instead of adding to it.

The parts, each small: `Run` (the mutable position of the run: state, data offset, rollbacks, batch source),
`StepRunner` (jaxllm/train/step_runner.py: the compiled step and its drill variants), `MetricsLog`
(jaxllm/train/metrics_log.py: metrics.jsonl, progress bar, timing), `HangWatchdog` (jaxllm/runtime/watchdog.py:
exits when steps stop completing), `AnomalyPolicy` (jaxllm/train/recovery.py: what a flagged step calls for),
`HotUpdates` (jaxllm/train/control.py: an operator's changes from `<workdir>/control.json`) and `fit`, whose loop
reads top to bottom as what happens in a step. `fit` takes a built objective and a config without "auto" values;
`jaxllm.train.loop.train` (jaxllm/launch/train.py) makes both from a config.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxllm.optim import powersgd
from jaxllm.observe.sizes import GB
from jaxllm.runs.tiers import open_checkpointer
from jaxllm.config.schema import AUTO_GRAD_ACCUM, AUTO_REMAT, AUTO_VOCAB, Config, ConfigError
from jaxllm.data.pipeline import packing_efficiency
from jaxllm.observe.comms import step_comms
from jaxllm.observe.memory import format_step_memory, step_memory
from jaxllm.observe.profiler import StepProfiler
from jaxllm.parallel.mesh import run_mesh
from jaxllm.observe.metrics import JsonlWriter
from jaxllm.model.visibility import resolve_attention
from jaxllm.parallel.offload import HOST, require_host_memory
from jaxllm.optim.chain import make_optimizer
from jaxllm.runtime.preemption import PreemptionGuard
from jaxllm.model.sample import greedy_generate
from jaxllm.parallel.sharding import format_replicated, replicated_rows, sharding_tree
from jaxllm.train.control import HOT_UPDATES, HotUpdates
from jaxllm.train.faults import planned_stalls
from jaxllm.train.metrics_log import MetricsLog
from jaxllm.train.step_runner import StepRunner
from jaxllm.train.objective import SFT_TASK, BatchRequest, Objective
from jaxllm.train.recovery import Recovery, restore_start
from jaxllm.train.state import abstract_objective_state, state_shardings
from jaxllm.train.step import batch_sharding, jit_eval_step, make_eval_step
from jaxllm.parallel.host_rows import process_rows, to_global
from jaxllm.runtime.watchdog import HangWatchdog

HOLD_TIMEOUT_S = 600.0


def live_bytes() -> int:
    """Bytes of every live jax array in this process's device memory (per shard, so replicas count on each
    device); arrays in host memory (an offloaded optimizer state) are not counted.

    Buffers are counted once each: reading a shard makes a single-device array that is itself live and shares
    the shard's buffer.
    """
    arrays = [x for x in jax.live_arrays() if x.sharding.memory_kind != HOST]
    # An array whose allocation failed (out of memory) raises here; reading its buffer pointer would wait forever.
    jax.block_until_ready(arrays)
    buffers = {(shard.device.id, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
               for x in arrays for shard in x.addressable_shards}
    return sum(buffers.values())


class PeakLiveBytes:
    """The largest `live_bytes()` seen at the moments it is sampled (memory_stats() is None on CPU)."""

    def __init__(self):
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, live_bytes())


@dataclasses.dataclass
class Run:
    """The mutable position of a run: the state the next step updates, the frozen variables, the data offset
    (data index = step - 1 + offset), the rollbacks so far, the open batch source, and the batch-source state
    and hot updates of the checkpoint the run last (re)started from."""

    objective: Objective
    steps: int
    rows: tuple[int, int]
    state: object
    frozen: object
    data_offset: int = 0
    rollbacks: int = 0
    batches: object = None
    data_state: dict | None = None
    hot_updates: list = dataclasses.field(default_factory=list)

    def variables(self):
        """Trainable and frozen variables together: the whole model's state."""
        return nnx.merge_state(self.state.params, self.frozen)

    def reopen_batches(self) -> None:
        """(Re)open the batch source for the steps after `state.step`."""
        if self.batches is not None:
            self.batches.close()
        first = int(self.state.step)
        self.batches = self.objective.open_batches(BatchRequest(
            first=first + self.data_offset, end=self.steps + self.data_offset + 1, rows=self.rows,
            current=self.variables, state=self.data_state, trained=lambda: self.state.params))


def host_metrics(batch: dict, source) -> dict:
    """What the host knows of a batch: its packing efficiency, and what its source measured making it (a
    source's optional `step_metrics()`, e.g. GRPO's rollout time)."""
    step_metrics = getattr(source, "step_metrics", None)
    return {"packing_efficiency": packing_efficiency(batch), **(step_metrics() if step_metrics else {})}


def evaluate(eval_step, params, frozen, batches) -> float:
    """Token-weighted mean loss over `batches` (already global arrays)."""
    sums = [eval_step(params, b, frozen) for b in batches]
    total, count = np.sum([jax.device_get(s) for s in sums], axis=0)
    return float(total / max(count, 1.0))


def periodic_due(objective: Objective, step: int, last: int) -> bool:
    """Whether the objective's periodic evaluation runs after `step`: every periodic_eval_every steps and after
    the last."""
    every = objective.periodic_eval_every
    return objective.periodic_eval is not None and every > 0 and (step % every == 0 or step == last)


def make_workdir(workdir: Path) -> None:
    """Create the run directory; one that cannot be created or written is a ConfigError on `workdir`."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / ".write_test").touch()
        (workdir / ".write_test").unlink()
    except OSError as exc:
        raise ConfigError("workdir", f"cannot create a run directory at {workdir}: {exc.strerror or exc}") from None


def check_run_setup(cfg: Config) -> None:
    """What fails before anything is built: a backend without the host memory `optim.offload` asks for, and a run
    directory that cannot be made (a bad --workdir); made by process 0."""
    require_host_memory(cfg)
    if jax.process_index() == 0:
        make_workdir(Path(cfg.workdir))


def main_log(stream):
    """`log(msg)`: a line to `stream` on process 0, nothing on the others. Each line is one write, so a line
    logged from another thread (an async checkpoint's) never lands inside another (print writes the text and its
    newline apart)."""
    if jax.process_index() != 0:
        return lambda msg: None

    def log(msg):
        stream.write(f"{msg}\n")
        stream.flush()

    return log


def fit(cfg: Config, objective: Objective, stream=sys.stdout) -> dict:
    """Train `objective` under `cfg` end to end (resuming from `<workdir>/checkpoints` if there are any); returns
    a summary. `cfg` holds no "auto" values any more (`jaxllm.train.loop.train` resolves them and builds the
    objective `train.objective` names)."""
    is_main = jax.process_index() == 0
    log = main_log(stream)
    check_run_setup(cfg)
    workdir = Path(cfg.workdir)
    if cfg.model.remat == AUTO_REMAT or cfg.optim.grad_accum == AUTO_GRAD_ACCUM:
        raise ConfigError("model.remat" if cfg.model.remat == AUTO_REMAT else "optim.grad_accum",
                          "auto is chosen when train() builds the objective itself: give a value")
    if cfg.model.vocab_size == AUTO_VOCAB:  # an objective that had no tokenizer to size it from
        raise ConfigError("model.vocab_size", f"auto needs a tokenizer, and train.objective={cfg.train.objective} "
                                              "found none (no base model): give a number")
    mesh = run_mesh(cfg)
    tc = cfg.train

    tx = make_optimizer(cfg.optim, tc.steps)
    abstract = abstract_objective_state(objective, tx, cfg.anomaly.window)
    compression = powersgd.from_config(cfg.optim)
    abstract = (powersgd.with_state(abstract[0], compression, mesh), abstract[1])
    shardings = state_shardings(abstract[0], mesh, cfg.optim.offload, cfg.optim.zero1)
    frozen_shardings = sharding_tree(abstract[1], mesh)
    replicated = [row for tree in (abstract[0].params, abstract[1]) for row in replicated_rows(tree, mesh)]
    if replicated:
        log(format_replicated(replicated))
    rows_sharding = batch_sharding(mesh)
    # Each process reads only the block of batch rows its devices hold (one block per host group on `data`).
    rows = process_rows(rows_sharding, tc.batch_size)
    # Every process says this (to its own log): which data it reads is per process.
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
          f"reading batch rows block {rows[0]} of {rows[1]}", file=stream if is_main else sys.stderr, flush=True)

    checkpointer = open_checkpointer(cfg.checkpoint, workdir, log, slow_mb_s=cfg.debug.slow_persistent_mb_s)
    incidents = JsonlWriter(workdir / "incidents.jsonl", enabled=is_main)
    peak_live = PeakLiveBytes()
    with jax.set_mesh(mesh):
        start = restore_start(cfg, objective, tx, checkpointer, abstract, mesh, log, on_loaded=peak_live.sample)
    if is_main:  # once the run's checkpoints are known to match this config: a refused resume writes nothing
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    state = powersgd.with_state(start.state, compression, mesh, shardings)  # fresh starts
    run = Run(objective, tc.steps, rows, state, start.frozen, start.data_offset, start.rollbacks,
              data_state=start.data_state, hot_updates=list(start.hot_updates))
    start_step = int(run.state.step)
    run.reopen_batches()
    eval_batches = ([to_global(b, rows_sharding, tc.batch_size) for b in objective.eval_batches(rows)]
                    if objective.eval_batches else [])

    local = next(run.batches)
    host = host_metrics(local, run.batches)
    batch = to_global(local, rows_sharding, tc.batch_size)
    t0 = time.perf_counter()
    runner = StepRunner(objective, tx, cfg, shardings, frozen_shardings, mesh, log)
    runner.compile(run.state, batch, run.frozen)
    # Recorded in summary.json for scripts/diagnose.py (memory headroom, communication). train.memory_budget_gb
    # stands in for the limit a CPU does not report.
    compiled = runner.compiled_for(batch)
    memory = step_memory(compiled, jax.local_devices()[0], int(tc.memory_budget_gb * GB))
    log(format_step_memory(memory, jax.local_devices()[0]))
    comms = step_comms(compiled, tuple(mesh.axis_sizes), run.state.params) if is_main else None
    eval_step = None
    if eval_batches:
        with jax.set_mesh(mesh):
            eval_step = jit_eval_step(make_eval_step(objective.graphdef, objective.loss_fn), shardings.params, mesh,
                                      frozen_shardings)
            eval_step = eval_step.lower(run.state.params, eval_batches[0], run.frozen).compile()
    compile_s = time.perf_counter() - t0
    peak_live.sample()
    log(f"compiled train+eval steps in {compile_s:.1f}s on mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}, "
        f"attention {resolve_attention(cfg.model.attention, cfg.precision.compute)}")

    watchdog = HangWatchdog(tc.hang_timeout_s, workdir / f"hang-stacks-{jax.process_index()}.txt")
    metrics_log = MetricsLog(cfg, mesh, workdir, is_main, stream, objective.progress_metrics,
                             on_step=watchdog.beat, stalls=planned_stalls(cfg.debug))
    summary: dict = {"compile_s": compile_s, "start_step": start_step, "startup_peak_live_bytes": peak_live.peak,
                     # which device ran it: the diagnosis judges MFU only against a known peak (jaxllm.observe.metrics)
                     "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                     "memory": memory, "comms": comms}
    if start.base is not None:
        summary["base"] = start.base
    eval_loss = lambda: evaluate(eval_step, run.state.params, run.frozen, eval_batches) if eval_step else float("nan")
    times = metrics_log.host_times  # data wait, checkpoint blocking and eval, into the step records
    with times.measure("eval_s"):
        summary["initial_eval_loss"] = initial_eval = eval_loss()
    if eval_step is not None:  # objectives without held-out batches (GRPO) report through their task metrics
        metrics_log.writer.write({"step": start_step, "eval_loss": initial_eval})
        log(f"step {start_step} held-out loss {initial_eval:.4f}")

    base_report = start.base_report
    if objective.report is not None and base_report is None and start_step == 0:
        base_report = objective.report(objective.graphdef, run.variables(), mesh)
    recover = Recovery(cfg, checkpointer, incidents, abstract[0], mesh, log)
    meta = lambda: {"seed": tc.seed, "data_offset": run.data_offset, "rollbacks": run.rollbacks,
                    "config": cfg.to_dict(), "base": start.base, "base_report": base_report, HOT_UPDATES: hot.applied}
    guard = PreemptionGuard()
    # Every process logs the changes it applies (the others to their own stderr): they must agree on the step.
    own_log = lambda msg: print(f"process {jax.process_index()}: {msg}", file=sys.stderr, flush=True)
    hot = HotUpdates(workdir, run.hot_updates, incidents, log if is_main else own_log, guard.check_every)
    read = lambda entry: runner.explain(metrics_log.report(*entry), run.state, run.frozen, metrics_log.writer)  # fetch one step
    profiler = StepProfiler(cfg.profile, workdir, log)
    pending = None  # (step, metrics on device, host metrics) of the step dispatched last, not yet read
    held = False
    step = start_step
    train_start = time.perf_counter()
    watchdog.start()  # after compiling and the first evaluation: only the loop's steps are timed
    try:
        while step < tc.steps:
            checkpointer.check_for_errors()  # a failed background save stops training here
            step += 1
            with profiler.step(step):
                run.state, metrics = runner(step, run.state, batch, run.frozen)  # dispatch this step ...
            profiler.after(step, metrics)
            current = (step, metrics, host, batch["tokens"].size)
            rolled_back = pending is not None and recover(run, read(pending))  # ... read the last
            pending = None
            if not rolled_back:
                holding = step == cfg.debug.hold_at_step and not held
                due = hot.poll(step)  # operator's changes, applied below before this boundary's save
                stop = guard.should_stop(step) or due.stop
                boundary = step % cfg.checkpoint.every == 0 or step == tc.steps or stop or due.save
                evaluating = (step % tc.eval_every == 0 or due.eval) and step < tc.steps and eval_step is not None
                tasks_due = periodic_due(objective, step, tc.steps)
                if boundary or evaluating or holding or tasks_due:  # known healthy before it is saved, evaluated, held
                    rolled_back = recover(run, read(current))
                else:
                    pending = current
            if rolled_back:
                metrics_log.restart_clock()
                step = int(run.state.step)
                run.state = hot.after_rollback(run.state, run.hot_updates)
            else:
                if holding:  # drills: this step's metrics are out, so whoever waits for them signals mid-run
                    held = True
                    log(f"holding after step {step} until a signal arrives (debug.hold_at_step)")
                    stop = guard.wait_for_signal(HOLD_TIMEOUT_S) or stop
                    boundary = boundary or stop
                    metrics_log.restart_clock()
                run.state = hot.apply(step, run.state, can_eval=eval_step is not None)
                if boundary:
                    with times.measure("checkpoint_block_s"):
                        checkpointer.save(step, run.state, run.batches.get_state(), meta())
                if evaluating:
                    with times.measure("eval_s"):
                        metrics_log.writer.write({"step": step, "eval_loss": eval_loss()})
                    metrics_log.restart_clock()  # eval time is not the next step's time
                if tasks_due:
                    with times.measure("eval_s"):
                        tasks = objective.periodic_eval(objective.graphdef, run.variables(), mesh)
                        metrics_log.writer.write({"step": step, **tasks})
                    log(f"step {step} tasks: " + ", ".join(f"{k} {v:.4g}" for k, v in tasks.items()))
                    metrics_log.restart_clock()
                if stop:
                    checkpointer.wait()
                    log(f"preempted: saved step {step}, exiting")
                    summary["preempted_at"] = step
                    break
            if step < tc.steps:
                with times.measure("data_wait_s"):
                    local = next(run.batches)
                    host = host_metrics(local, run.batches)
                    batch = to_global(local, rows_sharding, tc.batch_size)
        if pending is not None:
            recover(run, read(pending))
        checkpointer.wait()
    finally:
        profiler.stop()
        watchdog.stop()
        guard.restore()
        run.batches.close()
        metrics_log.close_bar()
    train_s = time.perf_counter() - train_start

    final_eval = eval_loss()
    if eval_step is not None:
        metrics_log.writer.write({"step": step, "eval_loss": final_eval})
    tps = metrics_log.steady_tokens_per_sec()
    losses = metrics_log.losses
    summary.update(
        final_step=step, final_eval_loss=final_eval, first_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"), train_s=train_s, tokens_per_sec=tps,
        mfu=metrics_log.mfu(tps), mfu_causal=metrics_log.mfu(tps, causal=True),
        checkpoint_saves=checkpointer.saves, rollbacks=run.rollbacks, lr_scale=float(run.state.lr_scale),
    )
    if checkpointer.copies:
        summary["checkpoint_copies"] = checkpointer.copies
    if recover.grad_spikes:
        summary["grad_spikes"] = recover.grad_spikes
    if recover.loss_spikes:
        summary["loss_spikes"] = recover.loss_spikes
    log(f"trained steps {start_step + 1}..{step} in {train_s:.1f}s: {tps:,.0f} tokens/s, MFU {100 * summary['mfu']:.2f}% "
        f"(causal {100 * summary['mfu_causal']:.2f}%)")
    if eval_step is not None:
        log(f"held-out loss {final_eval:.4f} (step {start_step}: {initial_eval:.4f}, ratio {final_eval / initial_eval:.2f})")
    if "preempted_at" not in summary:
        report_task(objective, run, mesh, base_report, summary, log)
        sample(cfg, objective, run, mesh, summary, log)
    checkpointer.close()
    metrics_log.writer.close()
    incidents.close()
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def report_task(objective: Objective, run: Run, mesh, base_report: dict | None, summary: dict, log) -> None:
    """The objective's task metrics of the trained model, next to the base model's (taken at step 0)."""
    if objective.report is None:
        return
    tuned = objective.report(objective.graphdef, run.variables(), mesh)
    base_report = base_report or {}
    base = base_report.get("scores", {})
    summary["task"] = {"base": base, "tuned": tuned["scores"], "samples": tuned["samples"]}
    log("task metrics, base model vs fine-tuned (held-out examples):\n" + format_task_table(base, tuned["scores"]))
    for s in tuned["samples"]:
        log(f"  [{s['task']}] reference {s['reference']!r}, response {s['response']!r}")
    if SFT_TASK in tuned:  # a post-training run on an SFT run: what it did to that run's task
        before = base_report.get(SFT_TASK, {})
        summary[SFT_TASK] = {"base": before, "tuned": tuned[SFT_TASK]}
        log("the base's SFT task, before vs after (its held-out examples; perplexity of its responses):\n"
            + format_task_table(before, tuned[SFT_TASK]))


def sample(cfg: Config, objective: Objective, run: Run, mesh, summary: dict, log) -> None:
    """A short greedy continuation of the sample prompt (`train.sample_prompt`, else the objective's own), for
    language-model objectives with a tokenizer."""
    tc = cfg.train
    prompt_text = tc.sample_prompt or objective.sample_prompt
    if tc.sample_tokens <= 0 or objective.tokenizer is None or prompt_text is None:
        return
    tokenizer = objective.tokenizer
    with jax.set_mesh(mesh):
        prompt = [tokenizer.bos_id] + tokenizer.encode(prompt_text)
        out = greedy_generate(objective.graphdef, run.variables(), prompt, tc.sample_tokens, eos_id=tokenizer.eos_id,
                              max_len=tc.seq_len, vocab_limit=tokenizer.vocab_size)
    summary["sample"] = tokenizer.decode(out)
    log("greedy sample:\n" + prompt_text + summary["sample"])


def format_task_table(base: dict, tuned: dict) -> str:
    """Base vs fine-tuned scores, one line per group ({group: {"examples": n, metric: value}}; a value that is
    missing or None, e.g. BLEU of one-word answers, shows as n/a). Metrics in percent (exact match, accuracies)
    end in "%"."""
    metrics = [m for m in next(iter(tuned.values()), {}) if m != "examples"]
    percent = lambda m: m == "exact_match" or m.endswith("accuracy")
    header = f"{'group':<16}{'examples':>9}" + "".join(f"{m + ' base':>{max(len(m) + 6, 12)}}{'tuned':>8}"
                                                          for m in metrics)
    lines = [header]
    for group, t in tuned.items():
        b = base.get(group, {})
        row = f"{group:<16}{t['examples']:>9}"
        for m in metrics:
            unit = "%" if percent(m) else ""
            width = max(len(m) + 6, 12) - len(unit)
            shown = lambda v, w: f"{'n/a':>{w + len(unit)}}" if v is None else f"{v:>{w}.{1 if unit else 2}f}{unit}"
            row += shown(b.get(m), width) + shown(t.get(m), 8 - len(unit))
        lines.append(row)
    return "\n".join(lines)
