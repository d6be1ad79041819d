"""An out-of-memory error as a readable summary instead of a wall of XLA text: what was asked and what is
available, the largest buffers mapped back to parameter paths or layer scopes, and what to change.

XLA reports an OOM as a `JaxRuntimeError` whose text starts `RESOURCE_EXHAUSTED:`. A runtime allocation says how
many bytes it wanted (XLA:CPU: "Out of memory allocating N bytes."; a GPU's allocator: "Out of memory while
trying to allocate N bytes."); a GPU compile that cannot fit adds its buffer assignment ("BufferAssignment
stats", then "Peak buffers" with each buffer's size, shape, op_name and source line, or "Entry Parameter
Subshape" for an argument). A buffer is named by the parameter whose per-device shape or size it has (the
optimizer state has the same shapes), else by the layer scope of its op_name and its source line.
"""

from __future__ import annotations

import re

from flax import nnx

from jaxllm.model.build import abstract_model
from jaxllm.observe.sizes import BYTE_UNITS, format_bytes
from jaxllm.parallel.mesh import abstract_mesh
from jaxllm.parallel.sharding import mesh_sizes, report_rows, shard_shape

UNITS = {"B": 1, **BYTE_UNITS}
_REQUESTED = re.compile(r"(?:allocating|allocate)\s+(\d+)\s+bytes")
_REQUESTED_ROUNDED = re.compile(r"rounded to (\d+)\)")
_STAT = re.compile(r"^\s*([a-z_ ]+?) allocation:\s+([\d.]+)(B|KiB|MiB|GiB|TiB)", re.MULTILINE)
_BUFFER = re.compile(r"Buffer \d+:\s*\n(.*?)(?:={5,}|\Z)", re.DOTALL)


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is XLA's out-of-memory error (at compile or run time)."""
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text and "memory" in text.lower()


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * UNITS[unit])


def parse_oom(text: str) -> dict:
    """The facts in an XLA OOM message: `requested` bytes (None if not said), the buffer assignment's `stats`
    ({"parameter": bytes, "preallocated temp": ..., "total": ...}) and its peak `buffers` (size, shape, op_name,
    source, parameter_shape), largest first."""
    requested = _REQUESTED.search(text) or _REQUESTED_ROUNDED.search(text)
    buffers = []
    for body in _BUFFER.findall(text):
        size = re.search(r"Size:\s*([\d.]+)(B|KiB|MiB|GiB|TiB)", body)
        field = lambda pattern: (m.group(1) if (m := re.search(pattern, body)) else "")
        source = field(r'source_file="([^"]*)"')
        line = field(r"source_line=(\d+)")
        buffers.append(dict(size=_bytes(*size.groups()) if size else 0, shape=field(r"\n\s*Shape:\s*(\S+)"),
                            op_name=field(r'op_name="([^"]*)"'), source=f"{source}:{line}" if source else "",
                            parameter_shape=field(r"Entry Parameter Subshape:\s*(\S+)")))
    return dict(requested=int(requested.group(1)) if requested else None,
                stats={name.strip(): _bytes(n, u) for name, n, u in _STAT.findall(text)},
                buffers=sorted(buffers, key=lambda b: -b["size"]))


def _dims(shape: str) -> tuple[int, ...] | None:
    match = re.search(r"\[([\d,]*)\]", shape)
    return tuple(int(d) for d in match.group(1).split(",") if d) if match else None


def name_buffer(buffer: dict, parameters: list[dict]) -> str:
    """What a buffer is: the parameters (`jaxllm.parallel.sharding.report_rows` of the model on the run's mesh) whose
    per-device shape, else per-device bytes, it has, or the layer scope of its op_name and its source."""
    dims = _dims(buffer.get("parameter_shape") or buffer.get("shape") or "")
    same = [p["path"] for p in parameters if dims and tuple(p["local_shape"]) == dims]
    same = same or [p["path"] for p in parameters if buffer["size"] and p["bytes_per_device"] == buffer["size"]]
    if same:
        return f"parameter {' / '.join(same[:4])}{' ...' if len(same) > 4 else ''} (or its optimizer state)"
    scope = "/".join(part for part in buffer.get("op_name", "").split("/")
                     if not re.match(r"(p?jit\(|jvp\(|transpose\(|while|body|closed_call|remat)", part))
    where = " at ".join(x for x in (scope, buffer.get("source", "")) if x)
    return where or "an intermediate of the step (no op named)"


def suggestions(cfg) -> list[str]:
    """What to change in `cfg` to need less memory per device, most effective first."""
    mesh, out = cfg.mesh, []
    if mesh.fsdp < mesh.num_devices:
        out.append(f"raise mesh.fsdp (now {mesh.fsdp} of {mesh.num_devices} devices): parameters, gradients and "
                   "optimizer state are split over it")
    else:
        out.append(f"more devices on mesh.fsdp (now all {mesh.num_devices}): parameters, gradients and optimizer "
                   "state are split over it")
    if cfg.model.remat != "full":
        out.append(f"model.remat=full (now {cfg.model.remat}): keep only each layer's input for the backward pass")
    accum = cfg.optim.grad_accum
    if cfg.train.batch_size // (mesh.batch_shards * max(accum, 1)) > 1:  # a micro-batch has rows to spare
        out.append(f"a smaller train.batch_size (now {cfg.train.batch_size}) or more micro-batches: "
                   f"optim.grad_accum={2 * accum if accum else 2} (now {accum or 'auto'}), or optim.grad_accum=auto")
    if cfg.optim.offload == "none":
        out.append("optim.offload=host: the optimizer state in pinned host memory")
    return out


def _parameters(cfg) -> list[dict]:
    """Every parameter's path, per-device shape and bytes on `cfg`'s mesh (no devices needed)."""
    mesh = abstract_mesh(cfg.mesh)
    rows = report_rows(nnx.state(abstract_model(cfg.model, cfg.precision)), mesh)
    return [dict(r, local_shape=shard_shape(r["shape"], r["spec"], mesh_sizes(mesh))) for r in rows]


def format_oom(text: str, cfg, device_limit: dict | None = None, top: int = 5) -> str:
    """The summary of XLA OOM message `text` for a run of `cfg`; `device_limit` is a device's memory_stats()
    (None: the backend reports none, as a CPU does)."""
    facts = parse_oom(text)
    asked = facts["requested"]
    lines = ["error: out of device memory (XLA RESOURCE_EXHAUSTED)",
             f"  asked for: {format_bytes(asked) + f' ({asked:,} bytes)' if asked else 'not said'}"]
    if facts["stats"].get("total"):
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in facts["stats"].items() if k != "total" and v)
        lines.append(f"  the compiled program needs {format_bytes(facts['stats']['total'])} per device ({parts})")
    limit = (device_limit or {}).get("bytes_limit")
    if limit:
        in_use = device_limit.get("bytes_in_use", 0)
        lines.append(f"  available: {format_bytes(limit - in_use)} of {format_bytes(limit)} per device "
                     f"({format_bytes(in_use)} in use)")
    else:
        lines.append("  available: not reported by this backend (a CPU has no device limit; the host ran out)")
    parameters = _parameters(cfg) if cfg.model.vocab_size else []  # "auto" vocabularies are sized later
    buffers = facts["buffers"] or ([dict(size=asked, shape="")] if asked else [])
    if buffers:
        lines.append("  largest buffers:" if facts["buffers"] else "  the allocation that failed:")
        lines += [f"    {format_bytes(b['size']):>10}  " + (f"{b['shape']}  " if b.get("shape") else "")
                  + name_buffer(b, parameters) for b in buffers[:top]]
    if parameters:
        biggest = sorted(parameters, key=lambda p: -p["bytes_per_device"])[:top]
        lines.append("  largest parameters per device (AdamW keeps two more buffers of each):")
        lines += [f"    {format_bytes(p['bytes_per_device']):>10}  {p['path']} {tuple(p['local_shape'])}"
                  for p in biggest]
    lines.append("  to need less memory per device:")
    lines += [f"    - {s}" for s in suggestions(cfg)]
    return "\n".join(lines)
