"""Memory of a run, before it runs: the compiled step's bytes per device against the device's limit (logged at
start-up), and the largest parameter and optimizer-state buffers with their layout (`--print_memory`).

Both come from what XLA and the rules table decide, not from measuring: `memory_analysis()` of the compiled
step (DESIGN.md section 7: ground truth for per-device bytes) and the abstract train state's PartitionSpecs.
"""

from __future__ import annotations

import jax

from jaxllm.offload import HOST
from jaxllm.sharding import report_rows


def _size(n: float) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.2f} MiB" if n >= 1024**2 / 10 else f"{n / 1024:.1f} KiB"


def device_limit(device) -> int | None:
    """The bytes the backend lets jax use on `device` (`memory_stats()["bytes_limit"]`), None when it reports none
    (the CPU backend)."""
    stats = device.memory_stats()
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def format_step_memory(compiled, device) -> str:
    """One line: a compiled step's arguments, outputs, temporaries and aliased bytes per device (aliased: outputs
    that reuse a donated argument's buffer, counted in both) next to `device`'s limit."""
    stats = compiled.memory_analysis()
    if stats is None:
        return "compiled step memory per device: not reported by this backend"
    arguments, outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
    temporaries, aliased = stats.temp_size_in_bytes, stats.alias_size_in_bytes
    total = arguments + outputs - aliased + temporaries
    limit = device_limit(device)
    against = (f"device limit {_size(limit)}, {100 * total / limit:.1f}% used" if limit
               else f"no limit reported by {device.platform}")
    return (f"compiled step memory per device: arguments {_size(arguments)}, outputs {_size(outputs)}, "
            f"temporaries {_size(temporaries)}, aliased {_size(aliased)}; in all {_size(total)} ({against})")


def buffer_rows(state, frozen, mesh, shardings) -> list[dict]:
    """`jaxllm.sharding.report_rows` of every array of the train state `state` and the frozen variables (paths
    `params.*`, `opt_state.*`, `frozen.*`), each with `memory` ("device" or "host": `optim.offload=host`) from the
    state's `shardings`; largest bytes per device first."""
    rows = []
    for prefix, tree in (("", state), ("frozen.", frozen)):
        rows += [dict(row, path=prefix + row["path"]) for row in report_rows(tree, mesh)]
    kinds = [s.memory_kind for s in jax.tree.leaves(shardings)] + [None] * len(jax.tree.leaves(frozen))
    for row, kind in zip(rows, kinds, strict=True):
        row["memory"] = "host" if kind == HOST else "device"
    return sorted(rows, key=lambda r: -r["bytes_per_device"])


def format_buffers(rows: list[dict], count: int = 20) -> str:
    """A table of the `count` largest `buffer_rows`: path, shape, logical axes, PartitionSpec, bytes per device
    (and "host" for buffers in host memory), then the totals of all of them."""
    table = [("buffer", "shape", "logical axes", "PartitionSpec", "bytes/device")]
    for r in rows[:count]:
        logical = "(" + ", ".join(map(str, r["logical"])) + ")" if r["logical"] is not None else "-"
        spec = "P(" + ", ".join(repr(e) for e in r["spec"]) + ")"
        where = " host" if r["memory"] == "host" else ""
        table.append((r["path"], str(r["shape"]), logical, spec, f"{r['bytes_per_device']:,}{where}"))
    widths = [max(len(line[k]) for line in table) for k in range(5)]
    lines = ["  ".join(cell.ljust(w) if k < 4 else cell.rjust(w) for k, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    on_device = sum(r["bytes_per_device"] for r in rows if r["memory"] == "device")
    on_host = sum(r["bytes_per_device"] for r in rows if r["memory"] == "host")
    lines.append(f"{min(count, len(rows))} largest of {len(rows)} buffers; all of them: {on_device:,} bytes per "
                 f"device ({_size(on_device)})" + (f", {on_host:,} in host memory" if on_host else ""))
    return "\n".join(lines)


def memory_report(cfg, count: int = 20) -> str:
    """`format_buffers` of the run `cfg` describes, from its abstract train state: nothing is allocated."""
    from jaxllm.mesh import make_mesh
    from jaxllm.optim import make_optimizer
    from jaxllm.train.loop import objective_for
    from jaxllm.train.state import abstract_objective_state, state_shardings

    cfg, objective = objective_for(cfg, log=lambda _: None)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state, frozen = abstract_objective_state(objective, tx, cfg.anomaly.window)
    mesh = make_mesh(cfg.mesh)
    return format_buffers(buffer_rows(state, frozen, mesh, state_shardings(state, mesh, cfg.optim.offload)), count)
