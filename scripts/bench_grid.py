"""Time the bare train step over a grid of settings, each in a fresh process:
`python scripts/bench_grid.py --config configs/gpu/llama_1b_h200.py --grid configs/gpu/llama_1b_h200_grid.json
--out DIR [--steps N] [--profile NAME] [--only NAME,...]`.

A grid file is a JSON list of {"name": ..., "overrides": ["--config.x=v", ...], "xla_flags": true}, in the order to
run: best guesses first, since a GPU lease may end before the last. Each variant times scripts/bench_step.py's
bare step (the compiled step back to back on one device-resident batch) in its own process, so its XLA_FLAGS
(the config's `xla_flags` unless `"xla_flags": false`) and the device's memory start clean, and its figures are
appended to DIR/grid.jsonl the moment it ends: tokens/s, MFU (PaLM's 6N + 12·L·H·Q·T FLOPs per token), causal MFU
(the attention term halved: what a causal kernel computes), compile seconds and the compiled step's memory per
device. A variant that fails (out of memory, a kernel XLA refuses) is recorded with the last line of its error,
and the grid goes on. `--profile NAME` traces 3 more steps of that variant with jax.profiler into DIR/profile/.
Ends with a table and one JSON line. On a CPU a tiny shape (`--config.model.preset=tiny
--config.train.batch_size=2 --config.train.seq_len=32 --steps 2`) checks the script; its figures mean nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config.schema import ConfigError
from jaxllm.runtime.xla_flags import apply_xla_flags

RESULT = "RESULT "  # prefix of a variant process's one line of figures


def run_variant(config: str, overrides: list[tuple[str, str]], steps: int, xla_flags: bool,
                profile_dir: str | None) -> int:
    """In this (fresh) process: set the XLA flags, time the bare step, print one RESULT line."""
    cd = build_config(config, overrides)
    apply_xla_flags(dict(cd.xla_flags.items()) if xla_flags else {})
    import jax

    from bench_step import bare_step_throughput
    from jaxllm.config.schema import validate

    cfg = validate(cd, jax.device_count())
    result = bare_step_throughput(cfg, steps, profile_dir=profile_dir)
    device = jax.devices()[0]
    print(RESULT + json.dumps(dict(result, platform=device.platform, device_kind=device.device_kind,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""))), flush=True)
    return 0


def read_grid(path: str, only: str | None) -> list[dict]:
    """The grid file's variants (those named in `only`, comma-separated, when given); UsageError if malformed."""
    try:
        grid = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--grid: {path}: {exc}") from None
    if not isinstance(grid, list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str)
                                             and isinstance(v.get("overrides", []), list) for v in grid):
        raise UsageError(f"--grid: {path} must hold a JSON list of {{\"name\": str, \"overrides\": [str, ...]}}")
    if only:
        wanted = only.split(",")
        unknown = sorted(set(wanted) - {v["name"] for v in grid})
        if unknown:
            raise UsageError(f"--only: {unknown} are not variants of {path}")
        grid = [v for v in grid if v["name"] in wanted]
    return grid


def measure(args, base_overrides: list[str], variant: dict, out: Path) -> dict:
    """Run one variant in a child process; its figures, or its failure, as one record appended to grid.jsonl."""
    profile = str(out / "profile") if variant["name"] == args.profile else None
    command = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps), "--variant",
               *(["--no_xla_flags"] if not variant.get("xla_flags", True) else []),
               *(["--profile_dir", profile] if profile else []), *base_overrides, *variant["overrides"]]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
        error = None if lines else ((proc.stderr.strip().splitlines() or ["no output"])[-1][:500]
                                    + f" (exit {proc.returncode})")
    except subprocess.TimeoutExpired:
        lines, error = [], f"timed out after {args.timeout:.0f} s"
    record = {"variant": variant["name"], "overrides": variant["overrides"], "xla_flags": variant.get("xla_flags", True)}
    record.update(json.loads(lines[-1][len(RESULT):]) if lines else {"error": error})
    with open(out / "grid.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{variant['name']}: " + (error or f"{record['tokens_per_sec']:,.0f} tokens/s, MFU {100 * record['mfu']:.1f}%"),
          flush=True)
    return record


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':<34} {'tokens/s':>10} {'MFU %':>6} {'causal %':>8} {'compile s':>9} {'args GB':>8} "
          f"{'temp GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<34} failed: {r['error'][:80]}")
            continue
        print(f"{r['variant']:<34} {r['tokens_per_sec']:>10,.0f} {100 * r['mfu']:>6.1f} {100 * r['causal_mfu']:>8.1f} "
              f"{r['compile_s']:>9.1f} {r['argument_mb'] / 1024:>8.1f} {r['temp_mb'] / 1024:>8.1f}")


def main(argv):
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--grid", help="JSON list of variants (see above)")
    p.add_argument("--out", help="directory for grid.jsonl (appended to) and profile/")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to one variant")
    p.add_argument("--profile", default=None, help="the variant whose 3 extra steps jax.profiler traces")
    p.add_argument("--only", default=None, help="comma-separated variant names to run, in the grid's order")
    p.add_argument("--variant", action="store_true", help="internal: run one variant in this process")
    p.add_argument("--no_xla_flags", action="store_true", help="internal: leave the config's xla_flags out")
    p.add_argument("--profile_dir", default=None, help="internal: where this variant's trace goes")
    args = p.parse_args(args_list)
    try:
        if args.variant:
            return run_variant(args.config, overrides, args.steps, not args.no_xla_flags, args.profile_dir)
        if not args.grid or not args.out:
            raise UsageError("--grid and --out are required")
        grid = read_grid(args.grid, args.only)
        build_config(args.config, overrides)  # a bad config or override fails here, once
    except (ConfigError, UsageError) as exc:
        fail(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_overrides = [f"--config.{key}={value}" for key, value in overrides]
    rows = [measure(args, base_overrides, variant, out) for variant in grid]
    print_table(rows)
    print(json.dumps({"bench": "grid", "config": args.config, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
