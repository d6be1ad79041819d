"""jaxllm's train step against a bare JAX step and MaxText on the same Llama, interleaved: `make bench-peers`.

    python scripts/bench_peers.py [--configs small,medium] [--dtypes bfloat16,float32] [--devices 1,8] [--rounds 3]
                                  [--zero1 false]

For each config, dtype and device count, ROUNDS interleaved rounds of
  bare     scripts/peers/bare_llama.py, a minimal step of the same Llama in plain jax.numpy + optax;
  maxtext  MaxText 0.2.5's pretraining step (scripts/peers/maxtext_run.py, in its own environment);
  step     jaxllm's compiled train step, back to back on one batch (scripts/bench_step.py's bare row);
and once the jaxllm training loop on the shipped token store (loop), each in its own process on --devices forced
CPU devices (pure data parallelism, global batch 8). Prints the table of medians, tokens/s, with step / bare,
step / MaxText and loop / step, and appends every run as a JSON line to --out.

Every implementation must run on the same jax: `make bench-peers` builds two Python 3.12 environments with jax
0.12 (build/peers/jaxllm: this checkout, editable; build/peers/maxtext: scripts/peers/maxtext-requirements.txt).
The machine must be otherwise idle: the runs share its cores. See docs/benchmarks.md for the figures and targets
(step >= 0.97x bare and >= 1.1x MaxText; loop >= 0.95x step).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "build" / "peers"
# The shapes of the table: Llama blocks, untied head, head_dim = dim / heads; global batch 8.
CONFIGS = {
    "small": dict(layers=6, dim=256, heads=4, kv_heads=4, mlp_dim=688, vocab=8000, seq=256, batch=8),
    "medium": dict(layers=8, dim=512, heads=8, kv_heads=4, mlp_dim=1376, vocab=16000, seq=512, batch=8),
}
# Timed steps (jaxllm, bare) and MaxText's steps and untimed warm-up steps, per config: a small step takes ~0.5 s
# on 2 CPU cores, a medium one ~3-20 s.
STEPS = {"small": (12, 18, 3), "medium": (4, 8, 2)}
IMPLS = ("bare", "maxtext", "step")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="small,medium")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--devices", default="8,1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--zero1", choices=("true", "false"), default="true",
                   help="jaxllm's optim.zero1 (the optimizer update split over the data-parallel replicas; the "
                        "config's default is true)")
    p.add_argument("--jaxllm_python", default=str(PEERS / "jaxllm" / "bin" / "python"))
    p.add_argument("--maxtext_python", default=str(PEERS / "maxtext" / "bin" / "python"))
    p.add_argument("--out", default=str(PEERS / "results.jsonl"))
    a = p.parse_args(argv)
    for name in a.configs.split(","):
        if name not in CONFIGS:
            fail(f"--configs: unknown config {name!r}, expected some of {sorted(CONFIGS)}")
    for option, python in (("--jaxllm_python", a.jaxllm_python), ("--maxtext_python", a.maxtext_python)):
        if not Path(python).exists():
            fail(f"{option}: no Python at {python} (`make bench-peers` builds the environments)")
    return a


def fail(message: str) -> None:
    """One line on stderr and exit 2 (this script runs on any Python, without jaxllm installed)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run(a, impl: str, config: str, dtype: str, devices: int) -> dict:
    """One measurement in its own process; its JSON line, or {"error": ...}."""
    steps, maxtext_steps, warmup = STEPS[config]
    shape = [f"--{k}={v}" for k, v in CONFIGS[config].items()] + [f"--dtype={dtype}", f"--devices={devices}"]
    if impl == "maxtext":
        cmd = [a.maxtext_python, str(ROOT / "scripts" / "peers" / "maxtext_run.py"), *shape,
               f"--steps={maxtext_steps}", f"--warmup={warmup}"]
    elif impl == "bare":
        cmd = [a.jaxllm_python, str(ROOT / "scripts" / "peers" / "bare_llama.py"), *shape, f"--steps={steps}"]
    else:
        cmd = [a.jaxllm_python, str(ROOT / "scripts" / "peers" / "jaxllm_run.py"), f"--impl={impl}", *shape,
               f"--steps={steps}", f"--zero1={a.zero1}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (done.stdout + done.stderr)[-800:]}


def measure(a, config: str, dtype: str, devices: int) -> dict:
    """{impl: median tokens/s} over the rounds (loop: one run), every run appended to --out."""
    runs = {impl: [] for impl in (*IMPLS, "loop")}
    with open(a.out, "a") as out:
        for r in range(a.rounds):
            for impl in IMPLS + (("loop",) if r == 0 else ()):
                result = run(a, impl, config, dtype, devices)
                record = {"impl": impl, "config": config, "dtype": dtype, "devices": devices, "round": r, **result}
                out.write(json.dumps(record) + "\n")
                print(json.dumps(record), file=sys.stderr, flush=True)
                if "tokens_per_sec" in result:
                    runs[impl].append(result["tokens_per_sec"])
    return {impl: statistics.median(v) if v else float("nan") for impl, v in runs.items()}


def main(argv) -> int:
    a = parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in a.configs.split(","):
        for dtype in a.dtypes.split(","):
            for devices in (int(d) for d in a.devices.split(",")):
                rows.append((config, dtype, devices, measure(a, config, dtype, devices)))
    print(f"tokens/s, median of {a.rounds} interleaved rounds (loop: one run); jaxllm with optim.zero1={a.zero1}")
    print("| config | dtype | devices | bare JAX | MaxText | jaxllm step | jaxllm loop | step / bare | "
          "step / MaxText | loop / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config, dtype, devices, m in rows:
        print(f"| {config} | {dtype} | {devices} | {m['bare']:,.0f} | {m['maxtext']:,.0f} | {m['step']:,.0f} | "
              f"{m['loop']:,.0f} | {m['step'] / m['bare']:.3f} | {m['step'] / m['maxtext']:.3f} | "
              f"{m['loop'] / m['step']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
