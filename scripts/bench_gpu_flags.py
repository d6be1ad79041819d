"""Measure a GPU preset's XLA flags: `python scripts/bench_gpu_flags.py --config configs/gpu/FILE.py [--steps N]`.

XLA reads XLA_FLAGS once per process, so every variant runs the bare train step (scripts/bench_step.py's
bare_step_throughput: the compiled step back to back on one device-resident batch) in a fresh process:
  all               every flag of the config's `xla_flags` (the baseline; run first and again last, to show drift)
  -<flag>           every flag but that one (XLA's default for it)
  scan_layers=<b>   every flag, with model.scan_layers flipped (the layer loop unrolled, or scanned)
It prints a table of step time, tokens/s, compile time and temporaries per device, with each variant's step time
over the baseline's (the mean of its two runs): above 1 the variant is slower, so the dropped flag was helping.
Ends with one JSON line. `--config.x=v` overrides reach every variant, so on a CPU a tiny shape
(`--config.model.preset=tiny --config.train.batch_size=2 --config.train.seq_len=32`) checks that the script
works; the figures mean nothing there (XLA's CPU backend ignores the GPU flags).
"""

import json
import os
import subprocess
import sys

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config.schema import ConfigError
from jaxllm.runtime.xla_flags import apply_xla_flags, check_xla_flags

RESULT = "RESULT "  # prefix of a variant process's one line of figures


def run_variant(config: str, overrides: list[tuple[str, str]], steps: int, drop: str | None) -> int:
    """In a fresh process: apply the config's flags less `drop`, time the bare step, print one RESULT line."""
    cd = build_config(config, overrides)
    flags = dict(cd.xla_flags.items())
    if drop is not None and flags.pop(drop, None) is None:
        raise UsageError(f"--drop: {drop} is not one of the config's xla_flags {sorted(flags)}")
    apply_xla_flags(flags)
    import jax

    from bench_step import bare_step_throughput
    from jaxllm.config.schema import validate

    cfg = validate(cd, jax.device_count())
    result = bare_step_throughput(cfg, steps)
    device = jax.devices()[0]
    print(RESULT + json.dumps(dict(result, platform=device.platform, device_kind=device.device_kind,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))), flush=True)
    return 0


def variants(cd) -> list[tuple[str, str | None, list[str]]]:
    """(name, flag to drop, extra overrides) of every run, the baseline first and last."""
    scan = cd.model.scan_layers
    return ([("all", None, [])] + [(f"-{name}", name, []) for name in cd.xla_flags]
            + [(f"scan_layers={not scan}", None, [f"--config.model.scan_layers={not scan}"]), ("all", None, [])])


def measure(args, argv_overrides: list[str], name: str, drop: str | None, extra: list[str]) -> dict:
    """Run one variant in a child process and return its figures; a failed child ends the benchmark."""
    command = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps), "--variant",
               *(["--drop", drop] if drop else []), *argv_overrides, *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        fail(f"variant {name!r} failed (exit {proc.returncode}); its stderr is above")
    return dict(json.loads(lines[-1][len(RESULT):]), variant=name)


def print_table(rows: list[dict], baseline_s: float) -> None:
    first = rows[0]
    print(f"{first['platform']} ({first['device_kind']}); step time over the baseline's mean {baseline_s:.4f} s"
          + ("; CPU: the figures mean nothing, XLA's CPU backend ignores GPU flags" if first["platform"] == "cpu"
             else ""))
    print(f"{'variant':<52} {'step s':>9} {'vs all':>7} {'tokens/s':>11} {'compile s':>10} {'temp MB/dev':>12}")
    for r in rows:
        print(f"{r['variant']:<52} {r['step_s']:>9.4f} {r['step_s'] / baseline_s:>7.3f} {r['tokens_per_sec']:>11,.0f} "
              f"{r['compile_s']:>10.2f} {r['temp_mb']:>12.2f}")


def main(argv):
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/gpu/*.py file (any config with xla_flags)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to one variant (default 1800)")
    p.add_argument("--variant", action="store_true", help="internal: run one variant in this process")
    p.add_argument("--drop", default=None, help="internal: the flag a variant leaves out")
    args = p.parse_args(args_list)
    try:
        if args.variant:
            return run_variant(args.config, overrides, args.steps, args.drop)
        cd = build_config(args.config, overrides)
        if not cd.get("xla_flags"):
            raise UsageError(f"--config: {args.config} sets no xla_flags to measure")
        check_xla_flags(cd.xla_flags)  # this process never starts JAX: the variants own the devices
    except (ConfigError, UsageError) as exc:
        fail(str(exc))
    argv_overrides = [f"--config.{key}={value}" for key, value in overrides]
    rows = [measure(args, argv_overrides, name, drop, extra) for name, drop, extra in variants(cd)]
    rows[-1]["variant"] = "all (again)"
    baseline_s = (rows[0]["step_s"] + rows[-1]["step_s"]) / 2
    print_table(rows, baseline_s)
    print(json.dumps({"bench": "gpu_flags", "config": args.config, "baseline_step_s": baseline_s,
                      "rows": [dict(r, vs_all=r["step_s"] / baseline_s) for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
