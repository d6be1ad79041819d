"""Pipeline schedules side by side: `python scripts/bench_schedules.py --config configs/pretrain.py [--steps N]
[--stages 4] [--microbatches 16] [--memory_preset llama_1b] [--memory_seq_len 2048]
[--memory_compute float32] [--skip_memory]
[--skip_step] [--config.x=v]`.

Memory: `--memory_preset` layers (`--memory_compute`, default float32: XLA:CPU's compiler aborts on the
pipelined step in bfloat16, "Invalid binary instruction opcode copy"; remat full, chunked loss) on 8 devices as
(data 8/p, stage p),
one row per micro-batch and data shard, compiled ahead of time on this machine's CPU devices (nothing
allocated): each schedule's temporary bytes per device (`memory_analysis()`), compile seconds, and the bubble
of its table (jaxllm/parallel/schedules.py; interleaved and circular at r = 2).

Step: the config's model on the same mesh shape, each schedule's median tokens/s over 3 interleaved rounds, as a
ratio to gpipe. The 8 "devices" here are threads sharing this machine's cores, so stages never run at once: the
ratio shows the work each schedule adds (recomputed forwards, lockstep ticks, permutes), not the bubble it saves.
One JSON line at the end.
"""

import dataclasses
import json
import sys
import time

from bench_families import interleaved
from bench_step import bench_arguments

SCHEDULES = {"gpipe": 1, "circular": 2, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1}  # name: repeats


def scheduled(cfg, name: str, stages: int, microbatches: int):
    """`cfg` on (data 8/stages, stage stages) with schedule `name`, one row per micro-batch and data shard."""
    from jaxllm.config.schema import PipelineConfig

    data = cfg.mesh.num_devices // stages
    mesh = dataclasses.replace(cfg.mesh, data=data, fsdp=1, tensor=1, stage=stages, expert=1, context=1,
                               sequence_parallel=False)
    pipeline = PipelineConfig(microbatches=microbatches, repeats=SCHEDULES[name], schedule=name)
    train = dataclasses.replace(cfg.train, batch_size=data * microbatches)
    return dataclasses.replace(cfg, mesh=mesh, pipeline=pipeline, train=train)


def memory_rows(cfg, preset: str, seq_len: int, stages: int, microbatches: int, compute: str) -> list[dict]:
    from jaxllm.config.presets import PRESETS
    from jaxllm.config.schema import ModelConfig
    from jaxllm.parallel.schedules import build
    from jaxllm.plan.footprint import compiled_step_memory

    model = ModelConfig(**dict(PRESETS[preset], remat="full", loss_chunk=1024, attention="xla"))
    precision = dataclasses.replace(cfg.precision, params="float32", compute=compute, output="float32")
    big = dataclasses.replace(cfg, model=model, precision=precision,
                              train=dataclasses.replace(cfg.train, seq_len=seq_len))
    rows = []
    for name, repeats in SCHEDULES.items():
        start = time.perf_counter()
        memory = compiled_step_memory(scheduled(big, name, stages, microbatches))
        rows.append(dict(schedule=name, bubble=build(name, stages, microbatches, repeats).bubble,
                         temp=memory["temp"], compile_s=time.perf_counter() - start))
        print(f"{name:<17} bubble {rows[-1]['bubble']:.3f}  temp {memory['temp'] / 2**30:7.2f} GiB/device  "
              f"compile {rows[-1]['compile_s']:5.1f} s", flush=True)
    return rows


def step_rows(cfg, steps: int, stages: int, microbatches: int) -> dict:
    runs = interleaved({name: scheduled(cfg, name, stages, microbatches) for name in SCHEDULES}, steps)
    base = runs["gpipe"]["tokens_per_sec"]
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} | p {stages} m {microbatches} | compute {cfg.precision.compute}")
    for name, r in runs.items():
        print(f"{name:<17} {r['tokens_per_sec']:>8,.0f} tok/s  {r['tokens_per_sec'] / base:.3f} of gpipe  "
              f"temp {r['temp_mb']:.1f} MB/device")
    return {name: {"tokens_per_sec": r["tokens_per_sec"], "of_gpipe": r["tokens_per_sec"] / base,
                   "temp_mb": r["temp_mb"]} for name, r in runs.items()}


def main(argv) -> int:
    def add(p):
        p.add_argument("--stages", type=int, default=4)
        p.add_argument("--microbatches", type=int, default=16)
        p.add_argument("--memory_preset", default="llama_1b")
        p.add_argument("--memory_seq_len", type=int, default=2048)
        p.add_argument("--memory_compute", default="float32")
        p.add_argument("--skip_memory", action="store_true")
        p.add_argument("--skip_step", action="store_true")

    args, cfg = bench_arguments(argv, __doc__, steps=3, add=add)
    result = {"bench": "schedules", "stages": args.stages, "microbatches": args.microbatches}
    if not args.skip_memory:
        result["memory"] = memory_rows(cfg, args.memory_preset, args.memory_seq_len, args.stages,
                                       args.microbatches, args.memory_compute)
    if not args.skip_step:
        result["step"] = step_rows(cfg, args.steps, args.stages, args.microbatches)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
