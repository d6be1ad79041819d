"""Hyperparameter sweep with optuna: `python scripts/sweep.py --config configs/pretrain.py --space FILE.toml
--study runs/sweep --trials 12 [--config.a.b=v ...]`.

Each trial is a scripts/train.py run of `--config` with the sweep's fixed `--config.*` overrides and the values
optuna draws from the search space (a TOML file: `[params."optim.lr"]` with `low`, `high`, `log`/`step`, or
`choices`; configs/sweeps/lr_warmup.toml), in `<study>/trials/<number>`. The objective is the run's final held-out
loss; the pruner reads the held-out losses the run writes to its metrics.jsonl as it trains and stops a trial that
falls behind.

  --sampler tpe|random|grid     --pruner median|halving|none (--prune_startup N finished trials first)
  --launcher local|slurm        trials as local processes, or as SLURM jobs (scripts/launch/slurm.sbatch; the job
                                flags of scripts/submit.py: --cpu_devices, --gpus_per_node, --priority, ...)
  --parallel K                  trials in flight from this worker at once
  --enqueue key=v[,key=v]       a trial with these values first (repeatable)
  --report                      only write the results of the study so far
  --submit_workers N            submit N workers as a SLURM job array instead, each running trials locally

The study lives in `<study>/study.db` (SQLite): start more workers on the same --study (another shell, a SLURM job)
to share it, or the same command again after it was killed to resume it (a trial whose worker died is run again
in its directory, resuming from its checkpoints), or with a larger --trials to grow it. At the end: the table of
trials (`<study>/trials.csv`), `importance.png`, `history.png`, and `best_config.py`, the best trial as a config
file for `scripts/train.py --config`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides  # noqa: E402
from jaxllm.config.schema import ConfigError  # noqa: E402


# What a worker of --submit_workers does not repeat from the command that submitted it.
DROPPED = ("--submit_workers", "--launcher", "--seed")


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` less `flags` and their values (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            out.append(arg)
    return out


def main(argv) -> int:
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", help="the base config (a configs/*.py file)")
    p.add_argument("--space", help="the search space (TOML)")
    p.add_argument("--study", required=True, help="the sweep's directory (study.db, trials/, results)")
    p.add_argument("--trials", type=int, default=12, help="finished trials (complete or pruned) the study holds")
    p.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--pruner", choices=("median", "halving", "none"), default="median")
    p.add_argument("--prune_startup", type=int, default=5, help="median: finished trials before any is pruned")
    p.add_argument("--prune_warmup_steps", type=int, default=0, help="median: steps before a trial may be pruned")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--parallel", type=int, default=1, help="trials this worker runs at once")
    p.add_argument("--enqueue", action="append", default=[], metavar="KEY=V[,KEY=V]")
    p.add_argument("--heartbeat_s", type=int, default=10,
                   help="seconds between a worker's heartbeats; 3 missed make its trials stale and run again")
    p.add_argument("--poll_s", type=float, default=2.0, help="seconds between looks at the trials")
    p.add_argument("--report", action="store_true", help="write the study's results and exit")
    p.add_argument("--submit_workers", type=int, default=0,
                   help="instead of working here, submit a SLURM job array of this many workers, each running its "
                        "trials as local processes on its own allocation (the job flags)")
    from jaxllm.cluster.submit import add_request_arguments, request_from_args

    add_request_arguments(p)
    p.set_defaults(name="sweep")
    args = p.parse_args(args_list)

    from jaxllm.cluster import slurm
    from jaxllm.cluster.sweep import (Launcher, load_space, make_pruner, make_sampler, open_study, parse_enqueue,
                                      record_base, run_worker, submit_workers)
    from jaxllm.cluster.sweep_results import write_results

    study_dir = Path(args.study).resolve()
    try:
        if args.report:
            if not (study_dir / "study.db").exists():
                raise UsageError(f"--study: no study in {study_dir}")
            write_results(open_study(study_dir), study_dir)
            return 0
        if not args.config or not args.space:
            raise UsageError("--config and --space: required (or --report)")
        if args.trials < 1 or args.parallel < 1 or args.submit_workers < 0:
            raise UsageError(f"--trials, --parallel (positive) and --submit_workers (0 or more): got {args.trials}, "
                             f"{args.parallel}, {args.submit_workers}")
        space = load_space(args.space)
        config = str(Path(args.config).resolve())
        for key, dist in space.items():  # every key must be a config key taking the space's values
            sample = dist.choices[0] if hasattr(dist, "choices") else dist.low
            build_config(config, [*overrides, (key, str(sample))])
        plants = parse_enqueue(args.enqueue, space)
        study = open_study(study_dir, None, make_pruner(args.pruner, args.prune_startup, args.prune_warmup_steps),
                           args.heartbeat_s)
        # Seeded by the trials already there: a worker that joins or resumes a study draws on from there instead of
        # repeating the first worker's draws.
        study.sampler = make_sampler(args.sampler, space, args.seed + len(study.trials))
        record_base(study, config, overrides)
        for params in plants:
            study.enqueue_trial(params, skip_if_exists=True)
        if args.submit_workers:
            request = request_from_args(args, config, str(study_dir), [])
            request.log_dir = str(study_dir / "logs")
            command = [sys.executable, str(Path(__file__).resolve()), *without(argv, DROPPED), "--launcher", "local"]
            print(submit_workers(request, command, args.submit_workers, args.seed))
            return 0
        fixed = [f"--config.{k}={v}" for k, v in overrides]
        request = request_from_args(args, config, str(study_dir), []) if args.launcher == "slurm" else None
        if request is not None:
            request.log_dir = str(study_dir / "logs")
        launcher = Launcher(config, request, cpu_devices=args.cpu_devices, fixed_args=fixed)
        run_worker(study, space, launcher, study_dir, args.trials, args.parallel, args.name, args.poll_s)
        write_results(study, study_dir)
    except (UsageError, ConfigError, slurm.SlurmError) as exc:
        fail(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
