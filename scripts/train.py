"""Train a language model: `python scripts/train.py --config configs/pretrain.py [--config.a.b=v ...]`.

--dry_run      build the model abstractly and report parameters, optimizer state and the step's temporaries in
               bytes per device for the mesh, and whether that fits an H100 / H200 (no devices needed: the mesh
               may be larger than this machine; temporaries come from a compile on a GPU host that has the
               mesh's devices, else from a formula, see jaxllm/plan/activation_memory.py)
--print_sharding  print every parameter's path, shape, PartitionSpec and bytes per device, then exit
--print_memory  print the 20 largest parameter and optimizer-state buffers (path, logical axes, PartitionSpec,
               bytes per device) of the run's abstract train state, then exit (nothing is allocated)
--print_comms  compile the train step ahead of time (nothing allocated) and print the bytes its collectives move
               per step by kind and mesh axes, and the largest ones with their source, then exit

A config's `xla_flags` (configs/gpu/*.py) are checked against the installed XLA and put into XLA_FLAGS ahead of
the environment's own before JAX starts (jaxllm/runtime/xla_flags.py); both are printed.

Multi-process (one process per host): under SLURM (and Open MPI) the processes find each other by themselves;
elsewhere pass --coordinator_address host:port --num_processes N --process_id i, or set the same names in the
environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). Process 0 also listens on the
coordinator's port + 1 for a rendezvous that names processes that do not arrive within --init_timeout seconds.
A process that dies makes the others exit 1 at once, naming it (jaxllm/runtime/peer_watch.py); one that hangs, within
--heartbeat_timeout seconds.
"""

import os
import sys

from jaxllm.config.cli import UsageError, build_config, fail, parser, split_overrides
from jaxllm.config.schema import MESH_AXES, ConfigError, validate
from jaxllm.runtime.float64 import use_float64
from jaxllm.runtime.xla_flags import use_xla_flags


def main(argv):
    args_list, overrides = split_overrides(argv)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/*.py file with get_config()")
    p.add_argument("--workdir", default=None, help="run directory (same as --config.workdir)")
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--print_sharding", action="store_true")
    p.add_argument("--print_memory", action="store_true")
    p.add_argument("--print_comms", action="store_true")
    p.add_argument("--coordinator_address", default=None, help="host:port of process 0 (multi-process runs)")
    p.add_argument("--num_processes", type=int, default=None, help="number of processes in the job")
    p.add_argument("--process_id", type=int, default=None, help="this process's index in [0, num_processes)")
    p.add_argument("--init_timeout", type=float, default=300.0,
                   help="seconds to wait for all processes to start (default 300)")
    p.add_argument("--preempted_exit_code", type=int, default=0,
                   help="exit code after a SIGTERM/SIGINT made the run save and stop (default 0); a launcher that "
                        "restarts stopped runs tells them from finished ones by it (scripts/launch/jobset.yaml: 143)")
    p.add_argument("--heartbeat_timeout", type=int, default=100,
                   help="seconds of silence after which a process counts as dead and the job stops (default 100)")
    args = p.parse_args(args_list)
    from jaxllm.runtime.distributed import DistributedError, initialize, resolve_layout

    try:
        cd = build_config(args.config, overrides, args.workdir)
        use_xla_flags(cd.get("xla_flags", {}))  # before anything starts JAX's backend
        use_float64(cd.precision)  # before anything makes an array
        planning = args.dry_run or args.print_sharding or args.print_memory or args.print_comms  # no other processes
        layout = None if planning else resolve_layout(args.coordinator_address, args.num_processes,
                                                      args.process_id)
        if args.init_timeout <= 0:
            raise UsageError(f"--init_timeout: must be positive, got {args.init_timeout}")
        if args.heartbeat_timeout <= 0:
            raise UsageError(f"--heartbeat_timeout: must be positive, got {args.heartbeat_timeout}")
    except (ConfigError, UsageError, DistributedError) as exc:
        fail(str(exc))
    if layout is not None:
        try:
            initialize(layout, init_timeout=args.init_timeout, heartbeat_timeout=args.heartbeat_timeout)
        except DistributedError as exc:
            print(f"error: process {layout.process_id}: {exc}", file=sys.stderr)
            return 1
    try:
        import math

        import jax

        sizes = [cd.mesh[axis] for axis in MESH_AXES]
        # A dry run plans for the mesh as written (it may be larger than this machine).
        num_devices = math.prod(sizes) if args.dry_run and -1 not in sizes else jax.device_count()
        # The dry run and the comms plan take the mesh as written; the parameter reports lay it over this
        # machine's devices, less an RL run's rollout devices, as the run would.
        cfg = validate(cd, num_devices, check_batch=not args.dry_run,
                       num_processes=None if args.dry_run or args.print_comms else jax.process_count())
    except (ConfigError, UsageError) as exc:
        fail(str(exc))
    if cd.elastic.wait_s and -1 not in sizes and math.prod(sizes) > num_devices:  # elastic_shape shrank the mesh
        print(f"elastic: {num_devices} devices of the mesh's {math.prod(sizes)}: mesh "
              f"{'x'.join(map(str, sizes))} -> {'x'.join(map(str, cfg.mesh.shape))} ({', '.join(MESH_AXES)}), "
              f"optim.grad_accum {cd.optim.grad_accum} -> {cfg.optim.grad_accum} (global batch "
              f"{cfg.train.batch_size} kept)", flush=True)
    if cd.precision.compute == "auto":
        from jaxllm.config.auto_precision import resolve_compute

        print(f"precision.compute=auto: {cfg.precision.compute}, {resolve_compute()[1]}", flush=True)

    if planning:  # plans describe the model that will train; the dry run and comms plan the step as it will run
        from jaxllm.launch.train import resolve
        from jaxllm.objectives.registry import resolved_shape

        try:
            cfg = resolve(cfg) if args.dry_run or args.print_comms else resolved_shape(cfg)
        except ConfigError as exc:
            fail(str(exc))
    if args.dry_run:
        from jaxllm.plan.footprint import format_plan, memory_plan

        print(format_plan(memory_plan(cfg)))
        return 0
    if args.print_memory:
        from jaxllm.plan.reports import memory_report

        try:
            print(memory_report(cfg))
        except ConfigError as exc:
            fail(str(exc))
        return 0
    if args.print_sharding:
        from flax import nnx

        from jaxllm.parallel.mesh import run_mesh
        from jaxllm.parallel.sharding import format_report, report_rows
        from jaxllm.model.build import abstract_model

        state = nnx.state(abstract_model(cfg.model, cfg.precision))
        print(format_report(report_rows(state, run_mesh(cfg))))  # the trainer's devices only
        return 0
    if args.print_comms:
        from jaxllm.observe.comms import format_comms
        from jaxllm.plan.reports import comms_report

        print(format_comms(comms_report(cfg), dict(zip(MESH_AXES, cfg.mesh.shape))))
        return 0

    from jaxllm.runs.checkpoint import CheckpointError
    from jaxllm.train.loop import train
    from jaxllm.train.recovery import AnomalyAbort

    try:
        summary = train(cfg)
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
    except jax.errors.JaxRuntimeError as exc:
        from jaxllm.observe.oom import format_oom, is_oom

        if is_oom(exc):  # a summary instead of XLA's text (its first line stays in the summary)
            print(format_oom(str(exc), cfg, jax.local_devices()[0].memory_stats()), file=sys.stderr)
            return 1
        if jax.process_count() == 1:
            raise
        # Usually a peer died mid-collective: the peer watch names it and exits this process (within ms).
        from jaxllm.runtime.peer_watch import await_verdict

        await_verdict()
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: process {jax.process_index()}: lost the other processes ({first}); none is known to have "
              f"died", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return args.preempted_exit_code if "preempted_at" in summary else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
