"""Where a traced train step's GPU time goes: `python scripts/profile_breakdown.py TRACE.json.gz [--steps 3]`.

TRACE is a Perfetto/Chrome trace written by jax.profiler (`scripts/bench_grid.py --profile NAME`, or
`jax.profiler.trace(dir, create_perfetto_trace=True)` around `--steps` calls of one compiled step). The device's
kernels are split into the steps (each step launches the same kernels in the same order) and each kernel is put in
one class by its name:
  attention    cuDNN's fused attention kernels (sdpa, fmha, flash, cudnn's fusion helpers)
  matmul       cuBLAS (nvjet, cublas, sm90_xmma, cutlass) and XLA's Triton GEMM fusions (gemm_fusion, dot)
  collectives  NCCL
  copies       memcpy and memset
  optimizer    whatever else runs after a step's last matmul or attention kernel: the update of the parameters
               and moments, the in-step norms and the loss-scale bookkeeping
  elementwise  everything else: norms, rotations, activations, casts, the loss's reductions
and host gaps are the step's wall span less its kernels' busy time (kernels on several streams at once count once).
Prints a table of milliseconds per step and shares; ends with one JSON line.
"""

import argparse
import gzip
import json
import re
import sys

CLASSES = (("attention", re.compile(r"cudnn|fmha|sdpa|flash", re.I)),
           ("matmul", re.compile(r"nvjet|cublas|gemm|xmma|cutlass|^dot|_dot", re.I)),
           ("collectives", re.compile(r"nccl", re.I)),
           ("copies", re.compile(r"memcpy|memset", re.I)))
ORDER = ("matmul", "attention", "elementwise", "optimizer", "collectives", "copies", "host gaps")


def device_kernels(trace: dict) -> list[dict]:
    """The complete events of the trace's GPU process (named /device:GPU:...), in start order."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid for pid, name in names.items() if "/device:GPU" in name}
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in gpus),
                  key=lambda e: e["ts"])


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in CLASSES if pattern.search(name)), "elementwise")


def busy_us(kernels: list[dict]) -> float:
    """Microseconds during which at least one kernel ran (overlapping streams count once)."""
    total, end = 0.0, float("-inf")
    for e in kernels:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def step_breakdown(kernels: list[dict]) -> dict:
    """Microseconds of one step per class (see the module docstring)."""
    kinds = [kind_of(e["name"]) for e in kernels]
    last_compute = max((i for i, k in enumerate(kinds) if k in ("matmul", "attention")), default=len(kinds))
    times = dict.fromkeys(ORDER, 0.0)
    for i, (e, kind) in enumerate(zip(kernels, kinds)):
        late = i > last_compute and kind == "elementwise"
        times["optimizer" if late else kind] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
    # Kernels on several streams overlap: scale the classes to the busy time so that they and the gaps add up.
    busy = busy_us(kernels)
    scale = busy / sum(times.values())
    times = {k: v * scale for k, v in times.items()}
    times["host gaps"] = span - busy
    return times


def breakdown(trace: dict, steps: int) -> dict:
    """Mean milliseconds per step of each class."""
    kernels = device_kernels(trace)
    if not kernels:
        raise ValueError("no GPU kernels in this trace")
    per_step = len(kernels) // steps
    if per_step == 0 or len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels do not split into {steps} equal steps")
    parts = [step_breakdown(kernels[i * per_step:(i + 1) * per_step]) for i in range(steps)]
    return {kind: sum(p[kind] for p in parts) / steps / 1e3 for kind in ORDER}


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a jax.profiler Perfetto trace (.json.gz or .json)")
    p.add_argument("--steps", type=int, default=3, help="calls of the step the trace holds")
    args = p.parse_args(argv)
    try:
        opener = gzip.open if args.trace.endswith(".gz") else open
        with opener(args.trace, "rt") as f:
            ms = breakdown(json.load(f), args.steps)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.trace}: {exc}", file=sys.stderr)
        return 2
    total = sum(ms.values())
    print(f"{'class':<12} {'ms/step':>8} {'share':>6}")
    for kind, value in ms.items():
        print(f"{kind:<12} {value:>8.2f} {100 * value / total:>5.1f}%")
    print(f"{'step':<12} {total:>8.2f}")
    print(json.dumps({"bench": "profile_breakdown", "trace": args.trace, "ms_per_step": ms, "step_ms": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
