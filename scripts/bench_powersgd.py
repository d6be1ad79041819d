"""PowerSGD's traffic across `data`, measured in the compiled step, and its convergence on the default job:
`python scripts/bench_powersgd.py [--job default|data8|llama_8b|all] [--rank 4]` or
`python scripts/bench_powersgd.py --converge none 4:10 4:100 ...`.

Traffic: for each job, the train step is compiled ahead of time (nothing allocated) with optim.grad_compression
none and powersgd (compression from step 1, the steady state), and the per-device bytes per step of every
all-reduce / reduce-scatter whose replica groups span the `data` axis are summed from the HLO
(jaxllm.observe.comms: `collectives`, `reduced_bytes_across`):
  default   configs/pretrain.py on its 8-device (data=2, fsdp=2, tensor=2) mesh.
  data8     the same job on (data=8): the convergence runs' layout.
  llama_8b  the llama_8b preset on a (data=8, fsdp=8) mesh of 64 fake CPU devices (this script re-runs itself
            with XLA_FLAGS=--xla_force_host_platform_device_count=64), batch 64 x 256 (the traffic of gradients
            does not depend on the batch).
Measured here (rank 4): default 3.55 MB -> 0.18 MB (20x); llama_8b 35.9 GB -> 52 MB. The uncompressed llama_8b
figure is XLA:CPU's program, which all-reduces each layer's whole gradient over all 64 devices (data and fsdp
together) inside the layer loop; an all-reduce of the fsdp-split float32 gradients over `data` alone would be
8.03e9 * 4 / 8 = 4.0 GB, 77x the compressed figure.

Convergence (--converge): each run is `scripts/train.py` on configs/pretrain.py over (data=8) for --steps steps
(300), `none` uncompressed, `R:S` PowerSGD at rank R from step S; the table gives each run's final held-out
loss, its ratio to the uncompressed run's, and the HLO compression factor across data of the data8 job at rank
R. Measured here, 300 steps each, one run per row (see docs/benchmarks.md, PowerSGD):
  rank  start  held-out loss  vs none  compression (data8)
     -      -         3.3468    1.000
     4     10         3.8456    1.149        39.5x
     4     50         3.5389    1.057        39.5x
     4    100         3.4652    1.035        39.5x   (the default since: optim.powersgd_start_step=100)
     8     50         3.4627    1.035        20.0x
The gap to uncompressed training opens within ~50 steps of the start of compression and then stays: under AdamW
the compressed steps of early training cost progress that later steps do not make up.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA8 = ["--config.mesh.data=8", "--config.mesh.fsdp=1", "--config.mesh.tensor=1", "--config.mesh.stage=1"]
JOBS = {
    "default": (8, []),
    "data8": (8, DATA8),
    "llama_8b": (64, ["--config.model.preset=llama_8b", "--config.mesh.data=8", "--config.mesh.fsdp=8",
                      "--config.mesh.tensor=1", "--config.mesh.stage=1", "--config.train.batch_size=64",
                      "--config.train.seq_len=256", "--config.model.vocab_size=128256"]),
}


def measure(job: str, rank: int) -> dict:
    """Bytes across data per device per step of `job`, without and with compression (run with the job's device
    count)."""
    import jax

    from jaxllm.optim import powersgd
    from jaxllm.config.cli import build_config, split_overrides
    from jaxllm.config.schema import MESH_AXES, validate
    from jaxllm.data.synthetic import synthetic_batch
    from jaxllm.observe.comms import collectives, reduced_bytes_across
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.optim.chain import make_optimizer
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.train.state import abstract_objective_state, state_shardings
    from jaxllm.train.step import jit_train_step, make_train_step

    devices, overrides = JOBS[job]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(overrides)[1]), devices)
    mesh = make_mesh(cfg.mesh)
    objective = lm_objective(cfg.model, cfg.precision)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, v.dtype) for k, v in synthetic_batch(0, 1, 2, 8).items()}
    out = {"job": job, "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)), "rank": rank}
    for name, compression in (("none", None), ("powersgd", powersgd.PowerSGD(rank=rank, start_step=0))):
        abstract = powersgd.with_state(abstract_objective_state(objective, tx)[0], compression, mesh)
        shardings = state_shardings(abstract, mesh)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        with jax.set_mesh(mesh):
            step = jit_train_step(make_train_step(objective, tx, compression=compression), shardings, mesh)
            hlo = step.lower(state, batch).compile().as_text()
        out[name] = reduced_bytes_across(collectives(hlo, tuple(mesh.axis_sizes), MESH_AXES)[0], "data")
    out["ratio"] = out["none"] / out["powersgd"]
    return out


def _env(devices: int) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _in_subprocess(job: str, rank: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--job", job, "--rank", str(rank), "--_measure"],
                          env=_env(JOBS[job][0]), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"measuring {job} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def converge(run: str, steps: int) -> dict:
    """The final held-out loss of the default job over (data=8) for `steps` steps: `run` is `none` or `R:S`
    (rank R from step S)."""
    flags = [*DATA8, f"--config.train.steps={steps}", "--config.train.sample_tokens=0"]
    if run != "none":
        rank, start = run.split(":")
        flags += ["--config.optim.grad_compression=powersgd", f"--config.optim.powersgd_rank={rank}",
                  f"--config.optim.powersgd_start_step={start}"]
    with tempfile.TemporaryDirectory(prefix="bench-powersgd-") as workdir:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config",
                               str(ROOT / "configs" / "pretrain.py"), "--workdir", workdir, *flags],
                              env=_env(8), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"run {run} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    return {"run": run, "eval_loss": evals[-1]["eval_loss"], "eval_step": evals[-1]["step"],
            "eval_losses": {r["step"]: round(r["eval_loss"], 4) for r in evals},
            "train_loss_last20": sum(losses[-20:]) / len(losses[-20:]),
            "anomalies": sum(int(r.get("anomaly", 0)) for r in records if "loss" in r)}


def _print_traffic(rows, rank: int) -> None:
    print(f"{'job':<10} {'mesh (data, fsdp, tensor, stage)':<34} {'none MB':>12} {'powersgd MB':>12} {'ratio':>8}")
    for r in rows:
        mesh = ", ".join(str(v) for v in r["mesh"].values())
        print(f"{r['job']:<10} {mesh:<34} {r['none'] / 1e6:>12.3f} {r['powersgd'] / 1e6:>12.3f} {r['ratio']:>7.1f}x")
    print("(bytes per device per step in all-reduce / reduce-scatter ops whose groups span `data`, rank "
          f"{rank}, from the compiled HLO)")
    print(json.dumps({r["job"]: {"none": r["none"], "powersgd": r["powersgd"], "ratio": round(r["ratio"], 2)}
                      for r in rows}))


def _print_convergence(runs: list[str], steps: int, base: float | None) -> None:
    factors = {rank: _in_subprocess("data8", int(rank))["ratio"]
               for rank in {r.split(":")[0] for r in runs if r != "none"}}
    rows = []
    print(f"{'rank':>5} {'start':>6} {'held-out loss':>14} {'vs none':>8} {'compression':>12} "
          f"{'train loss (last 20)':>21} {'anomalies':>10}", flush=True)
    for run in runs:
        row = converge(run, steps)
        rank, start = run.split(":") if run != "none" else ("-", "-")
        base = row["eval_loss"] if run == "none" else base
        row["ratio_vs_none"] = row["eval_loss"] / base if base else None
        row["compression"] = factors.get(rank)
        rows.append(row)
        ratio = "" if base is None else f"{row['ratio_vs_none']:.3f}"
        factor = "" if row["compression"] is None else f"{row['compression']:.1f}x"
        print(f"{rank:>5} {start:>6} {row['eval_loss']:>14.4f} {ratio:>8} {factor:>12} "
              f"{row['train_loss_last20']:>21.4f} {row['anomalies']:>10}", flush=True)
    print(f"(default job over (data=8), {steps} steps; held-out loss at step {rows[-1]['eval_step']}; compression: "
          "bytes across data, uncompressed / compressed, from the compiled step)")
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=(*JOBS, "all"), default="all")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--converge", nargs="+", metavar="RUN",
                    help="convergence runs: none (uncompressed; put it first: it is the ratios' base) or R:S")
    ap.add_argument("--steps", type=int, default=300, help="steps of each convergence run")
    ap.add_argument("--baseline", type=float, default=None,
                    help="the uncompressed run's held-out loss, for the ratios when `none` is not among the runs")
    ap.add_argument("--_measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._measure:
        print(json.dumps(measure(args.job, args.rank)))
    elif args.converge:
        _print_convergence(args.converge, args.steps, args.baseline)
    else:
        _print_traffic([_in_subprocess(job, args.rank) for job in (JOBS if args.job == "all" else (args.job,))],
                       args.rank)


if __name__ == "__main__":
    main()
