"""Context parallelism's price and reach: `python scripts/bench_context.py --config configs/pretrain.py [--steps N]
[--seq_len 4096] [--memory_preset llama_1b] [--memory_seq_lens 8192,32768,131072] [--skip_memory] [--skip_step]
[--config.x=v]`.

Step: the bare train step (scripts/bench_step.py's) of the config's model on sequences of `--seq_len` tokens with
every device of the mesh on `context` (one row per step), for `model.context_attention` all_gather and ring,
interleaved over 3 rounds: the median tokens/s of each, the ring's over the all-gather's, and each compiled
step's collective bytes per device and step from its HLO (jaxllm/observe/comms.py) by kind.

Memory: `--memory_preset` (bf16, remat full, chunked loss, einsum attention) at each of `--memory_seq_lens`
with context 1, 2, 4, 8 (the other devices of 8 on fsdp; one row of T tokens per context group, so each device
holds T / context of a row): activation bytes per device (the step's temp less the gradients, whose size follows
fsdp, not context) from the memory planner's formula (jaxllm/plan/activation_memory.py) for both attention
kinds, and from `memory_analysis()` of the same step compiled ahead of time on this machine's CPU devices
(nothing allocated; up to `--compiled_max_seq_len`), and the planner's total per device. Then the largest T (a
power of two) whose planned total fits 141 GB (an H200) at each context size. One JSON line at the end.
"""

import dataclasses
import json
import sys

from bench_families import interleaved
from bench_step import bench_arguments

H200_BYTES = 141 * 10**9
CONTEXTS = (1, 2, 4, 8)
KINDS = ("all_gather", "ring")


def step_variants(cfg, seq_len: int) -> dict:
    """The step compared: the whole mesh on `context`, one row of `seq_len` tokens, each attention kind."""
    devices = cfg.mesh.num_devices
    mesh = dataclasses.replace(cfg.mesh, data=1, fsdp=1, tensor=1, stage=1, expert=1, context=devices,
                               sequence_parallel=False)
    train = dataclasses.replace(cfg.train, batch_size=1, seq_len=seq_len)
    return {kind: dataclasses.replace(cfg, mesh=mesh, train=train,
                                      model=dataclasses.replace(cfg.model, context_attention=kind))
            for kind in KINDS}


def collective_bytes(cfg) -> dict:
    """Per-device bytes per step of the compiled step's collectives, by kind, and their total."""
    from jaxllm.config.schema import MESH_AXES
    from jaxllm.observe.comms import collectives, summarize
    from jaxllm.plan.footprint import compiled_step

    found, unknown = collectives(compiled_step(cfg).as_text(), cfg.mesh.shape, MESH_AXES)
    summary = summarize(found, unknown)
    by_kind: dict[str, int] = {}
    for row in summary["by_kind_axes"]:
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + row["bytes_per_step"]
    return dict(by_kind, total=summary["total_bytes_per_step"])


def memory_config(cfg, preset: str, seq_len: int, context: int, kind: str):
    """`preset` on 8 devices as (fsdp = 8 / context, context), one row per context group, bf16, remat full."""
    from jaxllm.config.presets import PRESETS
    from jaxllm.config.schema import ModelConfig

    # the einsum attention at every context size (what runs over a split sequence), so the rows compare alike
    model = ModelConfig(**dict(PRESETS[preset], remat="full", loss_chunk=1024, context_attention=kind,
                               attention="xla"))
    mesh = dataclasses.replace(cfg.mesh, data=1, fsdp=8 // context, tensor=1, stage=1, expert=1, context=context,
                               sequence_parallel=False)
    train = dataclasses.replace(cfg.train, batch_size=8 // context, seq_len=seq_len)
    precision = dataclasses.replace(cfg.precision, params="float32", compute="bfloat16", output="float32")
    return dataclasses.replace(cfg, model=model, mesh=mesh, train=train, precision=precision)


def memory_rows(cfg, preset: str, seq_lens: list[int], compiled_max: int) -> list[dict]:
    from jaxllm.plan.footprint import compiled_step_memory, memory_plan

    rows = []
    for seq_len in seq_lens:
        for context in CONTEXTS:
            for kind in KINDS if context > 1 else KINDS[:1]:
                c = memory_config(cfg, preset, seq_len, context, kind)
                plan = memory_plan(c, compiled=False)
                gradients = plan["temp_parts"]["gradients"]
                planned = plan["temp_bytes_per_device"] - gradients
                compiled = compiled_step_memory(c)["temp"] - gradients if seq_len <= compiled_max else None
                rows.append(dict(seq_len=seq_len, context=context, kind=kind if context > 1 else "-",
                                 planned_activations=planned, compiled_activations=compiled,
                                 planned_total=plan["total_bytes_per_device"]))
                print(f"T {seq_len:>7} context {context} {rows[-1]['kind']:<10} activations (temp - gradients) "
                      f"planned {planned / 2**30:8.2f} GiB  compiled "
                      f"{'-' if compiled is None else f'{compiled / 2**30:8.2f} GiB'}  planned total "
                      f"{plan['total_bytes_per_device'] / 2**30:8.2f} GiB", flush=True)
    return rows


def largest_fitting(cfg, preset: str) -> dict:
    """{f"{context} {kind}": the largest power-of-two T whose planned bytes per device fit an H200}."""
    from jaxllm.plan.footprint import memory_plan

    out = {}
    for context in CONTEXTS:
        for kind in KINDS if context > 1 else KINDS[:1]:
            seq_len, best = 2048, 0
            while seq_len <= 2**22:
                plan = memory_plan(memory_config(cfg, preset, seq_len, context, kind), compiled=False)
                if plan["total_bytes_per_device"] > H200_BYTES:
                    break
                best, seq_len = seq_len, seq_len * 2
            out[f"{context} {kind}"] = best
    return out


def step_figures(cfg, seq_len: int, steps: int) -> dict:
    """Tokens/s of each attention kind (`step_variants`), their ratio, and their collective bytes, printed."""
    variants = step_variants(cfg, seq_len)
    runs = interleaved(variants, steps)
    comms = {kind: collective_bytes(c) for kind, c in variants.items()}
    ratio = runs["ring"]["tokens_per_sec"] / runs["all_gather"]["tokens_per_sec"]
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} N{m.num_heads}/K{m.num_kv_heads} | 1 x {seq_len} tokens | context "
          f"{cfg.mesh.num_devices} | compute {cfg.precision.compute}")
    for kind, r in runs.items():
        print(f"{kind:<10} {r['tokens_per_sec']:>8,.0f} tok/s  temp {r['temp_mb']:8.1f} MB/device  collectives "
              + "  ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in comms[kind].items()))
    print(f"ring / all_gather: {ratio:.3f}")
    return {"tokens_per_sec": {k: v["tokens_per_sec"] for k, v in runs.items()}, "ring_over_all_gather": ratio,
            "collective_bytes": comms}


def main(argv) -> int:
    def add(p):
        p.add_argument("--seq_len", type=int, default=4096)
        p.add_argument("--memory_preset", default="llama_1b")
        p.add_argument("--memory_seq_lens", default="8192,32768,131072")
        p.add_argument("--compiled_max_seq_len", type=int, default=32768)
        p.add_argument("--skip_memory", action="store_true")
        p.add_argument("--skip_step", action="store_true")

    args, cfg = bench_arguments(argv, __doc__, steps=3, add=add)
    result = {"bench": "context"}
    if not args.skip_step:
        result.update(step_figures(cfg, args.seq_len, args.steps))
    if not args.skip_memory:
        seq_lens = [int(s) for s in args.memory_seq_lens.split(",")]
        result["memory"] = memory_rows(cfg, args.memory_preset, seq_lens, args.compiled_max_seq_len)
        result["largest_fitting_h200"] = largest_fitting(cfg, args.memory_preset)
        print("largest T fitting 141 GB per device (planner):", result["largest_fitting_h200"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
