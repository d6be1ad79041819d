"""Benchmark the train step: `python scripts/bench_step.py --config configs/pretrain.py [--steps N] [--config.x=v]`.

Prints a table of compile time, step time, tokens/s, MFU and per-device memory (from the compiled executable's
memory_analysis), for the same train step run two ways in one process:
  bare  the compiled step called back to back on one device-resident batch, nothing around it;
  loop  jaxllm.train.loop.train: real data pipeline, host->device transfer, metrics one step late, JSONL, progress.
  plain an independent step of the same network in plain jax.numpy + optax (scripts/plain_step.py), data-parallel
        over the same devices: the yardstick of the bare step.
bare and plain run 3 times interleaved and report the median run; loop runs once. The loop/bare tokens/s ratio
is the loop's overhead (target >= 0.95), bare/plain jaxllm's cost over a minimal step (target >= 0.95; compare
on a data-only mesh, --config.mesh.data=N --config.mesh.fsdp=1 --config.mesh.tensor=1, for like with like).
Ends with one JSON line of the figures. A config's `xla_flags` (configs/gpu/) go into XLA_FLAGS before JAX starts.

With a LoRA fine-tuning config (train.objective="sft", lora.rank > 0, e.g. configs/sft_lora.py) it times instead
the bare step of the adapters (base frozen) against full fine-tuning of the same model, interleaved (lora, full,
lora), and prints their ratio; the base's architecture is taken from checkpoint.restore_from when it is set.
"""

import json
import sys
import tempfile
import time

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config.schema import ConfigError, validate
from jaxllm.runtime.float64 import use_float64
from jaxllm.runtime.xla_flags import use_xla_flags


def bench_config(path: str, overrides: list[str]):
    """The validated config of `path` with `overrides`, its `xla_flags` set before JAX starts (raises ConfigError,
    UsageError)."""
    cd = build_config(path, overrides)
    use_xla_flags(cd.get("xla_flags", {}))  # before anything starts JAX's backend
    use_float64(cd.precision)  # before anything makes an array
    import jax

    return validate(cd, jax.device_count())


def bench_arguments(argv, doc: str, steps: int | None = 10, add=lambda parser: None):
    """(arguments, validated config) of a bench script's command line: `--config FILE`, `--steps N` (timed steps
    per measurement, default `steps`; None: no such flag), what `add(parser)` adds, and `--config.x=v` overrides.
    A bad config is one line, exit 2."""
    args_list, overrides = split_overrides(argv)
    p = parser(doc.splitlines()[0])
    p.add_argument("--config", required=True)
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="timed steps per measurement")
    add(p)
    args = p.parse_args(args_list)
    try:
        return args, bench_config(args.config, overrides)
    except (ConfigError, UsageError) as exc:
        fail(str(exc))


def prepared_step(cfg, lora=None, compiler_options=None):
    """(StepRunner compiled for the batch, state, batch, frozen, compile seconds): the very step the loop runs,
    on one device-resident synthetic batch (`compiler_options`: XLA options of its compile, as StepRunner's)."""
    import jax

    from jaxllm.data.synthetic import synthetic_batch
    from jaxllm.optim.loss_scale import loss_scaling
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.optim.chain import make_optimizer
    from jaxllm.parallel.host_rows import to_global
    from jaxllm.train.step_runner import StepRunner
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.train.state import init_objective_state
    from jaxllm.train.step import batch_sharding

    tc = cfg.train
    mesh = make_mesh(cfg.mesh)
    tx = make_optimizer(cfg.optim, tc.steps)
    objective = lm_objective(cfg.model, cfg.precision, cfg.pipeline, lora, sequence_parallel=cfg.mesh.sequence_parallel)
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(
            objective, tx, mesh, tc.seed, cfg.anomaly.window, cfg.optim.offload, loss_scaling(cfg.precision).init_scale,
            cfg.optim.zero1)
        batch = to_global(synthetic_batch(0, tc.batch_size, tc.seq_len, cfg.model.vocab_size), batch_sharding(mesh),
                          tc.batch_size)
    runner = StepRunner(objective, tx, cfg, shardings, frozen_shardings, mesh, log=lambda _: None,
                        compiler_options=compiler_options)
    compile_s = runner.compile(state, batch, frozen)
    return runner, state, batch, frozen, compile_s


def timed_steps(compiled, state, batch, frozen, steps: int):
    """(seconds per step, last state, last metrics) of `steps` calls after two warm-up calls."""
    import jax

    for _ in range(2):
        state, metrics = compiled(state, batch, frozen)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch, frozen)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps, state, metrics


def profiled_steps(compiled, state, batch, frozen, directory: str, steps: int = 3):
    """Trace `steps` more calls with jax.profiler into `directory` (a Perfetto trace beside TensorBoard's)."""
    import jax

    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            state, metrics = compiled(state, batch, frozen)
        jax.block_until_ready(metrics)
    return state


def bare_step_throughput(cfg, steps: int, lora=None, profile_dir: str | None = None) -> dict:
    """Figures of the bare step (see the module docstring); with `profile_dir`, 3 more steps are traced there."""
    from jaxllm.observe.metrics import mfu, peak_flops_per_device
    from jaxllm.model.transformer import train_flops_per_token

    tc = cfg.train
    runner, state, batch, frozen, compile_s = prepared_step(cfg, lora)
    compiled = runner.compiled_for(batch)
    step_s, state, _ = timed_steps(compiled, state, batch, frozen, steps)
    if profile_dir:
        state = profiled_steps(compiled, state, batch, frozen, profile_dir)
    tokens_per_sec = tc.batch_size * tc.seq_len / step_s
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    peak = peak_flops_per_device(cfg.peak_flops, cfg.precision.compute)
    return dict(
        compile_s=compile_s,
        step_s=step_s,
        tokens_per_sec=tokens_per_sec,
        mfu=mfu(tokens_per_sec, train_flops_per_token(cfg.model, tc.seq_len), runner.mesh.size, peak),
        causal_mfu=mfu(tokens_per_sec, train_flops_per_token(cfg.model, tc.seq_len, causal=True), runner.mesh.size,
                       peak),
        argument_mb=memory.argument_size_in_bytes / 2**20,
        output_mb=memory.output_size_in_bytes / 2**20,
        temp_mb=memory.temp_size_in_bytes / 2**20,
        host_argument_mb=memory.host_argument_size_in_bytes / 2**20,  # optim.offload=host: the optimizer state
        xla_flops_per_device=float(cost.get("flops", 0.0)) if cost else 0.0,
    )


def loop_throughput(cfg, steps: int) -> dict:
    import dataclasses
    import io

    from jaxllm.train.loop import train

    with tempfile.TemporaryDirectory() as workdir:
        run = dataclasses.replace(
            cfg, workdir=workdir,
            train=dataclasses.replace(cfg.train, steps=steps + 2, eval_every=10**9, eval_batches=1, sample_tokens=0),
        )
        summary = train(run, stream=io.StringIO())
    return dict(compile_s=summary["compile_s"], step_s=cfg.train.batch_size * cfg.train.seq_len / summary["tokens_per_sec"],
                tokens_per_sec=summary["tokens_per_sec"], mfu=summary["mfu"])


def pipeline_report(cfg) -> dict:
    """Schedule, theoretical bubble and per-device bytes of the stacked layer weights, pipelined vs not."""
    import dataclasses

    from jaxllm.parallel.mesh import abstract_mesh
    from jaxllm.parallel.pipeline import bubble_fraction
    from jaxllm.parallel.sharding import bytes_per_device
    from jaxllm.model.build import abstract_model

    from flax import nnx

    p, m, r = cfg.mesh.stage, cfg.pipeline.microbatches, cfg.pipeline.repeats
    layers = nnx.state(abstract_model(cfg.model, cfg.precision).layers)
    unpipelined = dataclasses.replace(cfg.mesh, stage=1)  # the same data/fsdp/tensor split, no stages
    return dict(stages=p, microbatches=m, repeats=r, bubble=bubble_fraction(p, m, r),
                layer_bytes_per_device=bytes_per_device(layers, abstract_mesh(cfg.mesh)),
                layer_bytes_per_device_stage1=bytes_per_device(layers, abstract_mesh(unpipelined)),
                layer_bytes_total=bytes_per_device(layers, abstract_mesh(dataclasses.replace(
                    cfg.mesh, data=1, fsdp=1, tensor=1, stage=1))))


def lora_vs_full(cfg, steps: int) -> int:
    """Print the bare step of LoRA (adapters train, base frozen) vs full fine-tuning, interleaved."""
    import jax

    lora_a = bare_step_throughput(cfg, steps, cfg.lora)
    full = bare_step_throughput(cfg, steps)
    lora_b = bare_step_throughput(cfg, steps, cfg.lora)
    lora = dict(lora_a, step_s=(lora_a["step_s"] + lora_b["step_s"]) / 2,
                tokens_per_sec=(lora_a["tokens_per_sec"] + lora_b["tokens_per_sec"]) / 2)
    m, mesh = cfg.model, "x".join(str(s) for s in cfg.mesh.shape)
    print(f"model L{m.num_layers} D{m.dim} N{m.num_heads}/K{m.num_kv_heads} F{m.mlp_dim} V{m.vocab_size} | "
          f"batch {cfg.train.batch_size}x{cfg.train.seq_len} | mesh (data,fsdp,tensor,stage)={mesh} | "
          f"LoRA r{cfg.lora.rank} on {cfg.lora.targets} | compute {cfg.precision.compute} | {jax.devices()[0].platform}")
    print(f"{'step':<6} {'compile s':>10} {'step s':>9} {'tokens/s':>11} {'args MB/dev':>12} {'temp MB/dev':>12}")
    for name, r in (("lora", lora), ("full", full)):
        print(f"{name:<6} {r['compile_s']:>10.2f} {r['step_s']:>9.4f} {r['tokens_per_sec']:>11,.0f} "
              f"{r['argument_mb']:>12.2f} {r['temp_mb']:>12.2f}")
    ratio = lora["step_s"] / full["step_s"]
    print(f"LoRA / full step time = {ratio:.3f}; LoRA runs: {lora_a['step_s']:.4f} and {lora_b['step_s']:.4f} s")
    print(json.dumps({"bench": "lora_vs_full", "mesh": mesh, "lora": lora, "full": full, "lora_over_full": ratio}))
    return 0


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s."""
    return sorted(runs, key=lambda r: r["tokens_per_sec"])[len(runs) // 2]


def main(argv):
    args, cfg = bench_arguments(argv, __doc__, steps=20)
    import jax

    try:

        if cfg.train.objective == "sft" and cfg.lora.rank:
            from jaxllm.runs import base_model

            if cfg.checkpoint.restore_from:
                cfg = base_model.adopt_architecture(cfg, base_model.locate(cfg.checkpoint.restore_from))
            return lora_vs_full(cfg, args.steps)
        from jaxllm.objectives.pretrain import open_data

        open_data(cfg)  # the loop run needs the token store: check it before minutes of bare-step timing
    except (ConfigError, UsageError) as exc:
        fail(str(exc))

    from jaxllm.data.synthetic import synthetic_batch
    from plain_step import plain_step_throughput

    batch = synthetic_batch(0, cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size)
    devices = jax.devices()[:cfg.mesh.num_devices]
    bare_runs, plain_runs = [], []
    for i in range(3):  # interleaved: single runs here vary by 10-15%, so medians of three
        bare_runs.append(bare_step_throughput(cfg, args.steps))
        plain_runs.append(plain_step_throughput(cfg, batch, args.steps, devices))
        if i == 0:
            loop = loop_throughput(cfg, args.steps)
    bare, plain = _median_run(bare_runs), _median_run(plain_runs)
    ratio = loop["tokens_per_sec"] / bare["tokens_per_sec"]
    plain_ratio = bare["tokens_per_sec"] / plain["tokens_per_sec"]

    mesh = "x".join(str(s) for s in cfg.mesh.shape)
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} N{m.num_heads}/K{m.num_kv_heads} F{m.mlp_dim} V{m.vocab_size} | "
          f"batch {cfg.train.batch_size}x{cfg.train.seq_len} | mesh (data,fsdp,tensor,stage)={mesh} | "
          f"compute {cfg.precision.compute} | {jax.devices()[0].platform}")
    print(f"{'run':<6} {'compile s':>10} {'step s':>9} {'tokens/s':>11} {'MFU %':>7} {'args MB/dev':>12} "
          f"{'temp MB/dev':>12}")
    print(f"{'bare':<6} {bare['compile_s']:>10.2f} {bare['step_s']:>9.4f} {bare['tokens_per_sec']:>11,.0f} "
          f"{100 * bare['mfu']:>7.2f} {bare['argument_mb']:>12.2f} {bare['temp_mb']:>12.2f}")
    print(f"{'loop':<6} {loop['compile_s']:>10.2f} {loop['step_s']:>9.4f} {loop['tokens_per_sec']:>11,.0f} "
          f"{100 * loop['mfu']:>7.2f} {'':>12} {'':>12}")
    print(f"{'plain':<6} {plain['compile_s']:>10.2f} {plain['step_s']:>9.4f} {plain['tokens_per_sec']:>11,.0f} "
          f"{100 * bare['mfu'] / plain_ratio:>7.2f} {'':>12} {plain['temp_mb']:>12.2f}")
    print(f"loop / bare tokens/s = {ratio:.3f} (target >= 0.95)")
    print(f"bare / plain tokens/s = {plain_ratio:.3f} (target >= 0.95; plain: scripts/plain_step.py, data-parallel "
          f"over {len(devices)} device(s){'' if cfg.mesh.shape[1:] == (1, 1, 1) else ', bare on the mesh above'})")
    print("tokens/s of the 3 interleaved runs: bare " + ", ".join(f"{r['tokens_per_sec']:,.0f}" for r in bare_runs)
          + "; plain " + ", ".join(f"{r['tokens_per_sec']:,.0f}" for r in plain_runs))
    report = {"bench": "step", "mesh": mesh, "bare": bare, "loop": loop, "plain": plain, "loop_over_bare": ratio,
              "bare_over_plain": plain_ratio}
    if cfg.mesh.stage > 1:
        pp = pipeline_report(cfg)
        print(f"pipeline p={pp['stages']} m={pp['microbatches']} r={pp['repeats']} "
              f"({'GPipe' if pp['repeats'] == 1 else 'circular'}): theoretical bubble (p-1)/(r*m+p-1) = "
              f"{pp['bubble']:.3f}")
        print(f"layer weights per device: {pp['layer_bytes_per_device']:,} B with stage={pp['stages']} vs "
              f"{pp['layer_bytes_per_device_stage1']:,} B unpipelined (same data/fsdp/tensor, stage=1) "
              f"of {pp['layer_bytes_total']:,} B in all")
        report["pipeline"] = pp
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
