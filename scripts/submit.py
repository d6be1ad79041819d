"""Submit a training job to SLURM: `python scripts/submit.py --config configs/pretrain.py [--config.a.b=v ...]`.

Renders scripts/launch/slurm.sbatch for the request and submits it with sbatch; prints the job id. The job trains
`scripts/train.py --config ... --workdir ...` on every task (the processes find each other from SLURM's variables),
saves and requeues itself on `scancel --signal=TERM <job>` or near its time limit, and resumes from its workdir.

  --nodes N --tasks_per_node T   processes: N x T
  --gpus_per_node G              GPU nodes: --gres=gpu:G a node (default 8)
  --cpu_devices D                CPU nodes instead: D JAX devices (and cores) a task
  --priority low|normal|high     the class; --priority_by partition (a partition a class, by PriorityTier: default)
                                 or nice (--partition P, and the class sets --nice)
  --after JOB[,JOB]              start only after these jobs completed successfully
  --status                       show the queue instead: each job's state, reason and position among pending ones

A job SLURM can never run (more nodes or CPUs than a partition has, an unknown partition) is refused at
submission: one line naming SLURM's reason, exit 2. SLURM_CONF in the environment picks the cluster.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxllm.cluster import slurm  # noqa: E402
from jaxllm.cluster.submit import add_request_arguments, request_from_args, submit  # noqa: E402
from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides  # noqa: E402
from jaxllm.config.schema import ConfigError  # noqa: E402


def format_queue(rows: list[dict]) -> str:
    """The queue as a table: running jobs, then pending ones in the order SLURM will consider them."""
    lines = [f"{'job':>8} {'name':<16} {'partition':<10} {'state':<10} {'reason':<22} {'position':>8}  start"]
    for r in rows:
        lines.append(f"{r['job_id']:>8} {r['name'][:16]:<16} {r['partition']:<10} {r['state']:<10} "
                     f"{r['reason'][:22]:<22} {str(r.get('position', '-')):>8}  {r['start_time']}")
    return "\n".join(lines)


def main(argv) -> int:
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", help="a configs/*.py file with get_config()")
    p.add_argument("--workdir", default=None, help="run directory on storage every node sees (runs/<config>)")
    add_request_arguments(p)
    p.add_argument("--after", default=None, help="comma-separated job ids that must complete first (afterok)")
    p.add_argument("--status", action="store_true", help="show the queue and exit")
    args = p.parse_args(args_list)
    try:
        if args.status:
            print(format_queue(slurm.queue()))
            return 0
        if not args.config:
            raise UsageError("--config: required (or --status)")
        build_config(args.config, overrides)  # a typo in a key fails here, not in the job after its wait in the queue
        request = request_from_args(args, args.config, args.workdir or f"runs/{Path(args.config).stem}",
                                    [f"--config.{k}={v}" for k, v in overrides])
        request.after = [j for j in (args.after or "").split(",") if j]
        job_id = submit(request)
    except (UsageError, ConfigError, slurm.SlurmError) as exc:
        fail(str(exc))
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
