"""Benchmark what the diagnostics cost: `python scripts/bench_diagnostics.py --config configs/pretrain.py
[--steps N] [--every 50] [--config.x=v ...]`.

Times three programs in one process on one device-resident batch, interleaved (three runs each, medians):
  hot       the production train step, with its global norms every step (gradient norm before and after
            clipping, parameter and update norms and their ratio: jaxllm.observe.norms.step_norms)
  no_norms  the same step with step_norms returning zeros (patched here: the framework has no switch for them,
            they are always on), the baseline of their cost. The step's in-place update waits on those norms
            (jaxllm/train/step.py); with constant zeros that wait folds away and XLA may copy the parameters on
            entry instead, so the ratio is the norms' cost net of that copy
  variant   the diagnostic variant the loop runs every diagnostics.every steps (per-layer and per-group norms,
            activation statistics, Adam's second moments; jaxllm.train.diagnostic_step), on the same state
The loop runs the variant next to the production step on a measured step, so `--every` N steps cost
N * hot + variant: the diagnostics' throughput factor is N * hot / (N * hot + variant).
Prints the table, the ratios, then one JSON line of the figures. On CPU set
XLA_FLAGS=--xla_force_host_platform_device_count=8, as for `make train`.
"""

import json
import statistics
import sys
import time


def hot_step_s(cfg, steps: int) -> float:
    from bench_step import prepared_step, timed_steps

    runner, state, batch, frozen, _ = prepared_step(cfg)
    return timed_steps(runner.compiled_for(batch), state, batch, frozen, steps)[0]


def no_norms_step_s(cfg, steps: int) -> float:
    import jax.numpy as jnp

    import jaxllm.train.step as step_module

    kept = step_module.step_norms
    # Traced when prepared_step compiles: the step reads these keys; zeros of their shapes leave the norms unused,
    # and XLA drops them.
    step_module.step_norms = lambda *args: {key: jnp.zeros_like(value) for key, value in kept(*args).items()}
    try:
        return hot_step_s(cfg, steps)
    finally:
        step_module.step_norms = kept


def variant_step_s(cfg, steps: int) -> float:
    import jax

    from bench_step import prepared_step

    runner, state, batch, frozen, _ = prepared_step(cfg)
    measure = runner.diagnostics.measure
    jax.block_until_ready(measure(state, batch, frozen))  # compiles it
    start = time.perf_counter()
    for _ in range(steps):
        stats = measure(state, batch, frozen)
    jax.block_until_ready(stats)
    return (time.perf_counter() - start) / steps


def main(argv):
    from bench_step import bench_arguments

    args, cfg = bench_arguments(argv, __doc__, add=lambda p: p.add_argument(
        "--every", type=int, default=50, help="diagnostics.every of the throughput figure"))
    import jax

    runs = {"hot": [], "no_norms": [], "variant": []}
    for _ in range(3):  # interleaved: single runs on shared CPUs vary by 10-15%
        runs["hot"].append(hot_step_s(cfg, args.steps))
        runs["no_norms"].append(no_norms_step_s(cfg, args.steps))
        runs["variant"].append(variant_step_s(cfg, args.steps))
    median = {name: statistics.median(times) for name, times in runs.items()}
    norms_ratio = median["hot"] / median["no_norms"]
    variant_ratio = median["variant"] / median["hot"]
    every = args.every
    throughput = every * median["hot"] / (every * median["hot"] + median["variant"])
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} V{m.vocab_size} | batch {cfg.train.batch_size}x{cfg.train.seq_len} | "
          f"mesh (data,fsdp,tensor,stage)={'x'.join(map(str, cfg.mesh.shape))} | {jax.devices()[0].platform}")
    print(f"{'program':<10}{'step s (median)':>16}{'runs':>30}")
    for name, times in runs.items():
        print(f"{name:<10}{median[name]:>16.4f}{'  '.join(f'{t:.4f}' for t in times):>30}")
    print(f"hot / no_norms step time = {norms_ratio:.3f} (the per-step global norms)")
    print(f"variant / hot step time = {variant_ratio:.3f}; with diagnostics.every={every}: "
          f"tokens/s x {throughput:.3f} of the hot step's")
    print(json.dumps({"bench": "diagnostics", "median_s": median, "runs_s": runs, "hot_over_no_norms": norms_ratio,
                      "variant_over_hot": variant_ratio, "every": every, "throughput_factor": throughput}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
