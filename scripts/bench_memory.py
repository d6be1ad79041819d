"""Memory levers, measured: `python scripts/bench_memory.py [--tables chunk,remat,remat_1b,planner,offload] [--steps N]`.

Prints one table per lever, each against its baseline in the same run, from the compiled train step's
`memory_analysis()` (bytes per device; an ahead-of-time compile, nothing allocated) and, where the job fits
this machine, its step time:
  chunk     model.loss_chunk on a Llama-3 vocabulary (V 128256) and T 4096, on a 2-layer D512 model: one device,
            and 4 devices with the vocabulary (and heads, MLP) split over tensor=4.
  remat     model.remat policies on the default job (configs/pretrain.py, 8 devices): temp bytes and the median
            bare step time of 3 interleaved runs (scripts/bench_step.py's bare step).
  remat_1b  model.remat policies on the llama_1b shape, batch 4 x 2048 on one device, bfloat16 compute: bytes only.
  planner   the --dry_run formula for temporaries (jaxllm/plan/activation_memory.py) against compiled figures.
  sp        mesh.sequence_parallel off and on, on the default job's shape over tensor=4 (data=2; 4 kv heads, so
            that tensor divides them), T 128 and 1024, remat none and full: bytes only.
  offload   host offload on the default job: optim.offload=host and model.remat_offload=host (under
            save_qkv_proj) against on-device runs, device and host argument / temp bytes and the median bare
            step time of 3 interleaved runs; then the optimizer bytes the planner moves off each device for
            llama_1b and llama_8b (fsdp=8). On the CPU the "transfers" stay in the same RAM: the time is the
            cost of the extra copies only, real savings and costs show on a GPU.
Run it with 8 devices (make's CPU_DEVICES or XLA_FLAGS=--xla_force_host_platform_device_count=8). Ends with one
JSON line of the figures.
"""

import json
import statistics
import sys

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config.schema import ConfigError, validate

POLICIES = ("none", "save_qkv_proj", "minimal_with_context", "save_dots", "full")
TABLES = ("chunk", "remat", "remat_1b", "planner", "sp", "offload")
OFFLOAD_CASES = [  # (name, overrides), each against the one before it that has no offload
    ("on device", []),
    ("optim.offload=host", ["--config.optim.offload=host"]),
    ("save_qkv_proj", ["--config.model.remat=save_qkv_proj"]),
    ("save_qkv_proj, remat_offload=host", ["--config.model.remat=save_qkv_proj", "--config.model.remat_offload=host"]),
]
FSDP_8 = ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1", "--config.mesh.stage=1"]
LLAMA3_HEAD = ["--config.model.vocab_size=128256", "--config.model.num_layers=2", "--config.model.dim=512",
               "--config.model.num_heads=8", "--config.model.num_kv_heads=4", "--config.model.head_dim=64",
               "--config.model.mlp_dim=1536", "--config.train.batch_size=1", "--config.train.seq_len=4096"]
SP_MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=4", "--config.mesh.stage=1",
           "--config.model.num_kv_heads=4"]
LLAMA_1B = ["--config.model.preset=llama_1b", "--config.train.batch_size=4", "--config.train.seq_len=2048",
            "--config.precision.compute=bfloat16"]


def _config(overrides: list[str]):
    """configs/pretrain.py with `overrides`, validated for the device count of its mesh."""
    cd = build_config("configs/pretrain.py", split_overrides(overrides)[1])
    return validate(cd, cd.mesh.data * cd.mesh.fsdp * cd.mesh.tensor * cd.mesh.stage)


def _one_device(tensor: int = 1) -> list[str]:
    return ["--config.mesh.data=1", "--config.mesh.fsdp=1", f"--config.mesh.tensor={tensor}", "--config.mesh.stage=1"]


def _mib(n: int) -> float:
    return n / 1024**2


def chunk_table() -> list[dict]:
    from jaxllm.plan.footprint import compiled_step_memory

    rows = []
    for tensor in (1, 4):
        base = None
        for chunk in (0, 1024, 512, 256):
            cfg = _config(LLAMA3_HEAD + _one_device(tensor) + [f"--config.model.loss_chunk={chunk}"])
            temp = compiled_step_memory(cfg)["temp"]
            base = base or temp
            rows.append(dict(tensor=tensor, loss_chunk=chunk, temp_mib=_mib(temp), ratio=temp / base))
    logits = 4096 * 128256 * 4
    print(f"chunked cross-entropy: L2 D512 V128256, batch 1 x 4096, float32; temp MiB per device (the whole "
          f"logits are {_mib(logits):.0f} MiB, and their gradient as much, split over tensor)")
    print(f"{'tensor':>6} {'loss_chunk':>10} {'temp MiB':>10} {'vs 0':>6}")
    for r in rows:
        print(f"{r['tensor']:>6} {r['loss_chunk']:>10} {r['temp_mib']:>10.1f} {r['ratio']:>6.3f}")
    return rows


def remat_table(steps: int) -> list[dict]:
    from bench_step import bare_step_throughput

    times = {p: [] for p in POLICIES}
    temp = {}
    for round_ in range(3):  # interleaved, each round in another order: drift and position hit every policy alike
        for policy in POLICIES[round_:] + POLICIES[:round_]:
            result = bare_step_throughput(_config([f"--config.model.remat={policy}"]), steps)
            times[policy].append(result["step_s"])
            temp[policy] = result["temp_mb"]
    rows = [dict(remat=p, temp_mib=temp[p], step_s=statistics.median(times[p])) for p in POLICIES]
    cfg = _config([])
    m = cfg.model
    print(f"remat policies: default job L{m.num_layers} D{m.dim} V{m.vocab_size}, batch {cfg.train.batch_size} x "
          f"{cfg.train.seq_len}, mesh {'x'.join(map(str, cfg.mesh.shape))}; median of 3 interleaved runs")
    _print_remat(rows, with_time=True)
    return rows


def remat_1b_table() -> list[dict]:
    from jaxllm.plan.footprint import compiled_step_memory

    rows = []
    for policy in POLICIES:
        memory = compiled_step_memory(_config(LLAMA_1B + _one_device() + [f"--config.model.remat={policy}"]))
        rows.append(dict(remat=policy, temp_mib=_mib(memory["temp"]), argument_mib=_mib(memory["argument"])))
    print("remat policies: llama_1b, batch 4 x 2048, bfloat16 compute, one device (AOT compile on this backend)")
    _print_remat(rows, with_time=False)
    return rows


PLANNER_CASES = [
    ("default job, 8 devices", []),
    ("default job, remat full", ["--config.model.remat=full"]),
    ("default job, minimal_with_context", ["--config.model.remat=minimal_with_context"]),
    ("default job, 1 device", _one_device()),
    ("default job, 1 device, T 512", _one_device() + ["--config.train.seq_len=512", "--config.train.batch_size=4"]),
    ("V128256 T4096 head", LLAMA3_HEAD + _one_device()),
    ("V128256 T4096 head, loss_chunk 512", LLAMA3_HEAD + _one_device() + ["--config.model.loss_chunk=512"]),
    ("llama_1b 4x2048, remat full", LLAMA_1B + _one_device() + ["--config.model.remat=full"]),
    ("llama_1b 4x2048, save_qkv_proj", LLAMA_1B + _one_device() + ["--config.model.remat=save_qkv_proj"]),
    ("T1024 tensor 4, remat none", SP_MESH + ["--config.train.seq_len=1024"]),
    ("T1024 tensor 4, remat none, SP", SP_MESH + ["--config.train.seq_len=1024", "--config.mesh.sequence_parallel=true"]),
    ("T1024 tensor 4, remat full, SP", SP_MESH + ["--config.train.seq_len=1024", "--config.model.remat=full",
                                                  "--config.mesh.sequence_parallel=true"]),
]


def planner_table() -> list[dict]:
    from jaxllm.plan.activation_memory import step_temp_bytes
    from jaxllm.model.visibility import resolve_attention
    from jaxllm.plan.footprint import compiled_step_memory, memory_plan

    rows = []
    for name, overrides in PLANNER_CASES:
        cfg = _config(overrides)
        attention = resolve_attention(cfg.model.attention, cfg.precision.compute)
        formula = sum(step_temp_bytes(cfg, attention, memory_plan(cfg)["param_bytes_per_device"]).values())
        compiled = compiled_step_memory(cfg)["temp"]
        rows.append(dict(case=name, formula_mib=_mib(formula), compiled_mib=_mib(compiled),
                         error=formula / compiled - 1))
    print("memory planner: temp MiB per device, formula (jaxllm/plan/activation_memory.py) vs memory_analysis()")
    print(f"{'case':<38} {'formula':>10} {'compiled':>10} {'error':>7}")
    for r in rows:
        print(f"{r['case']:<38} {r['formula_mib']:>10.1f} {r['compiled_mib']:>10.1f} {100 * r['error']:>+6.0f}%")
    return rows


def sp_table() -> list[dict]:
    from jaxllm.plan.footprint import compiled_step_memory

    rows = []
    for seq_len in (128, 1024):
        for remat in ("none", "full"):
            shape = SP_MESH + [f"--config.train.seq_len={seq_len}", f"--config.model.remat={remat}"]
            temp = {sp: compiled_step_memory(_config(shape + [f"--config.mesh.sequence_parallel={sp}"]))["temp"]
                    for sp in ("false", "true")}
            rows.append(dict(seq_len=seq_len, remat=remat, off_mib=_mib(temp["false"]), on_mib=_mib(temp["true"]),
                             ratio=temp["true"] / temp["false"]))
    m = _config([]).model
    print(f"sequence parallelism: default job L{m.num_layers} D{m.dim} F{m.mlp_dim} V{m.vocab_size}, 4 heads and kv "
          f"heads, batch 16, mesh 2x1x4x1 (tensor 4); temp MiB per device")
    print(f"{'T':>5} {'remat':<6} {'SP off':>10} {'SP on':>10} {'on/off':>7}")
    for r in rows:
        print(f"{r['seq_len']:>5} {r['remat']:<6} {r['off_mib']:>10.1f} {r['on_mib']:>10.1f} {r['ratio']:>7.3f}")
    return rows


def offload_table(steps: int) -> dict:
    from bench_step import bare_step_throughput

    from jaxllm.plan.footprint import compiled_step_memory, memory_plan

    names = [name for name, _ in OFFLOAD_CASES]
    times = {name: [] for name in names}
    for round_ in range(3):  # interleaved, as the remat table
        for name, overrides in OFFLOAD_CASES[round_:] + OFFLOAD_CASES[:round_]:
            times[name].append(bare_step_throughput(_config(overrides), steps)["step_s"])
    rows = []
    for name, overrides in OFFLOAD_CASES:
        cfg = _config(overrides)
        memory = compiled_step_memory(cfg)
        rows.append(dict(case=name, step_s=statistics.median(times[name]), argument_mib=_mib(memory["argument"]),
                         temp_mib=_mib(memory["temp"]), host_mib=_mib(memory_plan(cfg)["host_bytes_per_device"])))
    # XLA:CPU's memory_analysis() counts host-memory arguments with the device's: the host column is the planner's.
    print("host offload: default job, per device: compiled argument and temp bytes (memory_analysis), bytes in "
          "host memory (planner), median step of 3 interleaved runs")
    print(f"{'case':<36} {'argument':>9} {'temp':>9} {'host MiB':>9} {'step s':>8} {'vs base':>8}")
    for i, r in enumerate(rows):
        base = rows[i - i % 2]  # the on-device row of the pair
        print(f"{r['case']:<36} {r['argument_mib']:>9.2f} {r['temp_mib']:>9.2f} {r['host_mib']:>9.2f} "
              f"{r['step_s']:>8.4f} {r['step_s'] / base['step_s']:>8.3f}")
    planned = {preset: memory_plan(_config([f"--config.model.preset={preset}", "--config.optim.offload=host"]
                                           + FSDP_8)) for preset in ("llama_1b", "llama_8b")}
    for preset, plan in planned.items():
        print(f"{preset}, fsdp=8: optimizer state {plan['opt_bytes_per_device'] / 1024**3:.3f} GiB per device moves "
              f"to host memory ({plan['total_bytes_per_device'] / 1024**3:.3f} GiB left on the device, planner)")
    return {"default": rows, **{p: {"opt_gib_per_device_to_host": plan["opt_bytes_per_device"] / 1024**3,
                                    "device_gib_left": plan["total_bytes_per_device"] / 1024**3}
                                for p, plan in planned.items()}}


def _print_remat(rows: list[dict], with_time: bool) -> None:
    base = rows[0]
    print(f"{'remat':<22} {'temp MiB':>10} {'vs none':>8}" + (f" {'step s':>8} {'vs none':>8}" if with_time else ""))
    for r in rows:
        line = f"{r['remat']:<22} {r['temp_mib']:>10.1f} {r['temp_mib'] / base['temp_mib']:>8.3f}"
        if with_time:
            line += f" {r['step_s']:>8.4f} {r['step_s'] / base['step_s']:>8.3f}"
        print(line)


def main(argv) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run of the remat and offload tables")
    args = p.parse_args(argv)
    tables = [t for t in args.tables.split(",") if t]
    try:
        unknown = [t for t in tables if t not in TABLES]
        if unknown:
            raise UsageError(f"--tables: unknown {unknown}, expected some of {list(TABLES)}")
        import jax

        if jax.device_count() < 8:
            raise UsageError(f"needs 8 devices, got {jax.device_count()} (set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    except (ConfigError, UsageError) as exc:
        fail(str(exc))
    report = {"bench": "memory"}
    for table in tables:
        report[table] = {"chunk": chunk_table, "remat": lambda: remat_table(args.steps),
                         "remat_1b": remat_1b_table, "planner": planner_table, "sp": sp_table,
                         "offload": lambda: offload_table(args.steps)}[table]()
        print()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
