"""Train a language model: `python scripts/train.py --config configs/pretrain.py [--config.a.b=v ...]`.

--dry_run      build the model abstractly and report parameters and per-device bytes for the mesh (no devices
               needed: the mesh may be larger than this machine)
--print_sharding  print every parameter's path, shape, PartitionSpec and bytes per device, then exit
"""

import os
import sys

from jaxllm.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config import ConfigError, validate


def main(argv):
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/*.py file with get_config()")
    p.add_argument("--workdir", default=None, help="run directory (same as --config.workdir)")
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--print_sharding", action="store_true")
    args = p.parse_args(args_list)
    try:
        cd = build_config(args.config, overrides, args.workdir)
        import math

        import jax

        sizes = [cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor, cd.mesh.stage]
        # A dry run plans for the mesh as written (it may be larger than this machine).
        num_devices = math.prod(sizes) if args.dry_run and -1 not in sizes else jax.device_count()
        cfg = validate(cd, num_devices, check_batch=not args.dry_run)
    except (ConfigError, UsageError) as exc:
        fail(str(exc))

    if args.dry_run:
        from jaxllm.plan import format_plan, memory_plan

        print(format_plan(memory_plan(cfg)))
        return 0
    if args.print_sharding:
        from flax import nnx

        from jaxllm.mesh import make_mesh
        from jaxllm.sharding import format_report, report_rows
        from jaxllm.train.state import abstract_model

        state = nnx.state(abstract_model(cfg.model, cfg.precision))
        print(format_report(report_rows(state, make_mesh(cfg.mesh))))
        return 0

    from jaxllm.checkpoint import CheckpointError
    from jaxllm.train.loop import train
    from jaxllm.train.recovery import AnomalyAbort

    try:
        train(cfg)
    except ConfigError as exc:
        fail(str(exc))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # orbax's failed background threads can wait minutes on their own timeouts: do not join them.
        os._exit(1)
    except AnomalyAbort as exc:
        print(f"error: training stopped: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
