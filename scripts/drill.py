"""Fault drill: `python scripts/drill.py --config FILE --faults kill9:20,sigterm:2,corrupt:1,nan:1 --seed S
[--workdir DIR] [--reference RUN] [--config.a.b=v ...]`.

Runs the training job of `--config` (scripts/train.py subprocesses, with the `--config.*` overrides) in
DIR/run and lands the faults on it at moments drawn from the seed: kill9 (SIGKILL, also inside async saves),
sigterm, corrupt (a file of the newest committed checkpoint truncated or deleted while the job is down), diskfull
(root only: the checkpoint directory on a tmpfs that fills up, so a save fails), peer (one process of a
2-process job killed: with peer faults the job and its reference run as 2 processes on this host, the fake CPU
devices of XLA_FLAGS split between them), local_wipe and slow_persistent (a job with checkpoint.local_dir: its
local tier deleted while it is down, or its persistent tier throttled from the restart on), host_down (one
process killed and its host down for --host_down_s seconds: with elastic.wait_s > 0 the job goes on without it,
then grows back; the final parameters must then be within 1e-5 relative of the reference, not bitwise), nan
and spike (the loop's injections, rolled back in process), hotlr (a hot update through the job's control.json
halving the LR at a drawn step, which every restart must keep; the reference gets it too). After each process
fault it restarts the job as SLURM --requeue would, until the last step; with --launcher slurm each start is one
`srun` of the job's tasks. The uninterrupted reference runs first in DIR/reference, unless --reference names a
finished run of the same config. Prints a table, then as the last line one JSON object (bitwise_equal,
corrupt_loads, recoveries, steps_lost, recover_s, goodput, ...). Exit 0 when the drill passed (every fault
injected and recovered from, no corrupt checkpoint loaded, final parameters and loss history bitwise equal to
the reference), 1 when it failed, 2 on a bad command line. See jaxllm/drill/.
"""

import json
import sys
from pathlib import Path

from jaxllm.config.cli import UsageError, fail, parser, split_overrides
from jaxllm.config.schema import ConfigError
from jaxllm.drill.plan import FaultSpecError


def main(argv):
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/*.py file with get_config()")
    p.add_argument("--faults", required=True,
                   help="kind:count,... (kill9, sigterm, corrupt, diskfull, peer, local_wipe, slow_persistent, "
                        "host_down, nan, spike, hotlr)")
    p.add_argument("--seed", type=int, default=0, help="draws the faults' steps and moments (default 0)")
    p.add_argument("--workdir", default="runs/drill", help="the drill's directory, empty or new (default runs/drill)")
    p.add_argument("--reference", default=None, help="a finished uninterrupted run of the same config")
    p.add_argument("--launcher", default="local", choices=("local", "slurm"),
                   help="start each start's processes here (local) or as one srun of the job's tasks (slurm)")
    p.add_argument("--host_down_s", type=float, default=60.0,
                   help="host_down faults: seconds the killed process's host stays down (default 60)")
    p.add_argument("--heartbeat_timeout", type=int, default=20,
                   help="with peer faults: seconds after which a process stops when a peer is gone (default 20)")
    args = p.parse_args(args_list)
    from jaxllm.drill.report import format_table
    from jaxllm.drill.run import plan_drill, run_drill
    from jaxllm.drill.supervisor import DrillError

    try:
        drill = plan_drill(str(Path(__file__).with_name("train.py")), args.config, overrides, args.faults,
                           args.seed, args.workdir, args.reference, args.heartbeat_timeout, args.host_down_s,
                           args.launcher)
    except (FaultSpecError, ConfigError, UsageError) as exc:
        fail(str(exc))
    try:
        result = run_drill(drill, log=lambda msg: print(msg, flush=True))
    except DrillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
