"""Memory of a run, before it runs: the compiled step's bytes per device against the device's limit (logged at
start-up), and the largest parameter and optimizer-state buffers with their layout (`--print_memory`).

Both come from what XLA and the rules table decide, not from measuring: `memory_analysis()` of the compiled
step (DESIGN.md section 7: ground truth for per-device bytes) and the abstract train state's PartitionSpecs.
"""

from __future__ import annotations

import jax

from jaxllm.observe.sizes import format_bytes
from jaxllm.parallel.offload import HOST
from jaxllm.parallel.sharding import report_rows


def device_limit(device) -> int | None:
    """The bytes the backend lets jax use on `device` (`memory_stats()["bytes_limit"]`), None when it reports none
    (the CPU backend)."""
    stats = device.memory_stats()
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def step_memory(compiled, device, budget_bytes: int = 0) -> dict | None:
    """A compiled step's bytes per device (`memory_analysis()`): arguments, outputs, temporaries, aliased
    (outputs that reuse a donated argument's buffer, counted in both), `per_device_bytes` (all of them, aliased
    once) and `limit_bytes`: `budget_bytes` when given (`train.memory_budget_gb`, what a CPU run plans
    against), else `device`'s limit, else None. None when the backend reports no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    memory = dict(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                  temporaries=stats.temp_size_in_bytes, aliased=stats.alias_size_in_bytes)
    memory = {k: int(v) for k, v in memory.items()}
    memory["per_device_bytes"] = (memory["arguments"] + memory["outputs"] - memory["aliased"]
                                  + memory["temporaries"])
    memory["limit_bytes"] = int(budget_bytes) or device_limit(device)
    memory["limit_of"] = "train.memory_budget_gb" if budget_bytes else "device"
    return memory


def format_step_memory(memory: dict | None, device) -> str:
    """One line of `step_memory`: arguments, outputs, temporaries and aliased bytes per device next to the
    limit."""
    if memory is None:
        return "compiled step memory per device: not reported by this backend"
    total, limit = memory["per_device_bytes"], memory["limit_bytes"]
    against = (f"{memory['limit_of']} limit {format_bytes(limit)}, {100 * total / limit:.1f}% used" if limit
               else f"no limit reported by {device.platform}")
    return (f"compiled step memory per device: arguments {format_bytes(memory['arguments'])}, outputs "
            f"{format_bytes(memory['outputs'])}, temporaries {format_bytes(memory['temporaries'])}, aliased "
            f"{format_bytes(memory['aliased'])}; in all {format_bytes(total)} ({against})")


def buffer_rows(state, frozen, mesh, shardings) -> list[dict]:
    """`jaxllm.parallel.sharding.report_rows` of every array of the train state `state` and the frozen variables (paths
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
                 f"device ({format_bytes(on_device)})" + (f", {on_host:,} in host memory" if on_host else ""))
    return "\n".join(lines)


