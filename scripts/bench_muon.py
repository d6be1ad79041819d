"""Muon against AdamW on the default job: `python scripts/bench_muon.py [--steps 100] [--adamw_lrs 1e-3,3e-3,1e-2]
[--muon_lrs 1e-3,3e-3,1e-2] [--eval_every 10] [--step_only] [--config.x=v ...]`.

Convergence: the default job (configs/pretrain.py, its data=2 fsdp=2 tensor=2 mesh on 8 fake CPU devices, each
run `scripts/train.py` as its own process) for `--steps` steps with `optim.name=adamw` and `muon` at each
learning rate of its sweep, everything else the job's (warm-up, cosine schedule over the run, clipping, weight
decay, seed, data); the held-out loss is evaluated every `--eval_every` steps. Each optimizer's best learning rate
is the one with the lowest held-out loss after the last step; the table gives every run's final held-out loss,
and for each optimizer at its best rate the first evaluated step at which its held-out loss reaches AdamW's final
one (at AdamW's best rate).

Step time: the job's compiled train step (the loop's own, on one device-resident batch) with each optimizer at
the job's learning rate, in one process, interleaved (adamw, muon) x 3 rounds of `--timed_steps` steps; the ratio
of the medians. The same compiled steps give the collectives the Newton-Schulz iterations add (HLO lines from
jaxllm/optim/muon.py), per device per step. `--step_only`: these alone, without the convergence runs (e.g. with
`--config.optim.zero1=true` or another mesh).

Extra `--config.` overrides go to every run and to the timed steps. Prints the tables, then one JSON line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "pretrain.py")
DEVICES = 8  # the default job's mesh


def _env() -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), str(ROOT),
                                                         os.environ.get("PYTHONPATH")])))


def converge(name: str, lr: float, steps: int, eval_every: int, overrides: list[str]) -> dict:
    """{step: held-out loss} (every `eval_every` steps and after the last) of the default job under `name` at `lr`."""
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as workdir:
        command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", CONFIG, "--workdir", workdir,
                   f"--config.optim.name={name}", f"--config.optim.lr={lr}", f"--config.train.steps={steps}",
                   f"--config.train.eval_every={eval_every}", "--config.train.sample_tokens=0", *overrides]
        proc = subprocess.run(command, env=_env(), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"bench_muon: {name} at lr {lr} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def steps_to_reach(curve: dict[int, float], target: float) -> int | None:
    """The first evaluated step whose held-out loss is at most `target`; None if none is."""
    return next((step for step in sorted(curve) if curve[step] <= target), None)


def time_and_comms(timed_steps: int, overrides: list[str]) -> dict:
    """(run in a process with the job's devices) median step seconds of each optimizer, interleaved, and the
    per-device bytes per step of the collectives of each compiled step, in all and from jaxllm/optim/muon.py."""
    from bench_step import bench_config, prepared_step, timed_steps as timed
    from jaxllm.config.cli import split_overrides
    from jaxllm.config.schema import MESH_AXES
    from jaxllm.observe.comms import collectives

    prepared, out = {}, {"seconds": defaultdict(list), "comms": {}}
    for name in ("adamw", "muon"):
        cfg = bench_config(CONFIG, split_overrides([f"--config.optim.name={name}", *overrides])[1])
        runner, state, batch, frozen, _ = prepared_step(cfg)
        compiled = runner.compiled_for(batch)
        prepared[name] = [compiled, state, batch, frozen]
        found, _ = collectives(compiled.as_text(), tuple(runner.mesh.axis_sizes), MESH_AXES)
        ns = defaultdict(lambda: [0, 0])
        for c in found:
            if "muon.py" in c.source:
                ns[f"{c.kind} over {'+'.join(c.axes)}"][0] += 1
                ns[f"{c.kind} over {'+'.join(c.axes)}"][1] += c.bytes_per_step
        out["comms"][name] = {"total_bytes": sum(c.bytes_per_step for c in found), "ops": len(found),
                              "newton_schulz": dict(ns)}
    for _ in range(3):  # interleaved: single measurements on shared CPUs vary by 10-15%
        for name, (compiled, state, batch, frozen) in prepared.items():
            seconds, state, _ = timed(compiled, state, batch, frozen, timed_steps)
            prepared[name][1] = state
            out["seconds"][name].append(seconds)
    return out


def _timed_in_subprocess(timed_steps: int, overrides: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--_time", "--timed_steps", str(timed_steps), *overrides],
                          env=_env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"bench_muon: timing the steps failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _print_convergence(curves: dict, steps: int, eval_every: int):
    """Print the convergence table; (final held-out loss of each run, each optimizer's best run, AdamW's best
    final loss)."""
    final = {run: curve[max(curve)] for run, curve in curves.items()}
    best = {name: min((run for run in curves if run[0] == name), key=final.get) for name in ("adamw", "muon")}
    target = final[best["adamw"]]
    print(f"default job, {steps} steps each, held-out loss every {eval_every} steps")
    print(f"{'optimizer':<10}{'lr':>9}{'held-out loss':>15}{'steps to AdamW best':>21}")
    for (name, lr), curve in curves.items():
        mark = " (best)" if best[name] == (name, lr) else ""
        reach = steps_to_reach(curve, target)
        print(f"{name:<10}{lr:>9.0e}{final[(name, lr)]:>15.4f}{'-' if reach is None else reach:>21}{mark}")
    return final, best, target


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps of each run")
    parser.add_argument("--adamw_lrs", type=_lrs, default=_lrs("1e-3,3e-3,1e-2"), help="AdamW's learning rates")
    parser.add_argument("--muon_lrs", type=_lrs, default=_lrs("1e-3,3e-3,1e-2"), help="Muon's learning rates")
    parser.add_argument("--eval_every", type=int, default=10, help="held-out evaluation every N steps")
    parser.add_argument("--timed_steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--step_only", action="store_true", help="only the step time and the collectives")
    parser.add_argument("--_time", action="store_true", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args._time:
        print(json.dumps(time_and_comms(args.timed_steps, overrides)))
        return
    curves = {} if args.step_only else {
        (name, lr): converge(name, lr, args.steps, args.eval_every, overrides)
        for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)) for lr in lrs}
    timing = _timed_in_subprocess(args.timed_steps, overrides)
    median = {name: statistics.median(times) for name, times in timing["seconds"].items()}
    final, best, target = _print_convergence(curves, args.steps, args.eval_every) if curves else ({}, {}, None)
    print(f"step time (median of 3 x {args.timed_steps} steps, interleaved): adamw {median['adamw']:.4f} s, "
          f"muon {median['muon']:.4f} s, muon / adamw {median['muon'] / median['adamw']:.3f}")
    comms = timing["comms"]
    print(f"collectives per device per step: adamw {comms['adamw']['total_bytes'] / 1e6:.2f} MB, muon "
          f"{comms['muon']['total_bytes'] / 1e6:.2f} MB; from the Newton-Schulz iterations: "
          + ", ".join(f"{n} x {kind} ({b / 1e6:.2f} MB)" for kind, (n, b) in comms["muon"]["newton_schulz"].items()))
    print(json.dumps({"steps": args.steps, "final": {f"{n}@{lr:g}": round(v, 4) for (n, lr), v in final.items()},
                      "best": {n: run[1] for n, run in best.items()},
                      "steps_to_adamw_best": {n: steps_to_reach(curves[run], target) for n, run in best.items()},
                      "curves": {f"{n}@{lr:g}": {s: round(v, 4) for s, v in c.items()}
                                 for (n, lr), c in curves.items()},
                      "step_seconds": timing["seconds"], "muon_over_adamw": median["muon"] / median["adamw"],
                      "comms": comms}))


if __name__ == "__main__":
    main(sys.argv[1:])
