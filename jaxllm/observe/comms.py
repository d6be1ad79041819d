"""Communication analysis from the compiler's side (the seed's NCCL_DEBUG step, without running anything):
every collective of the compiled train step, the bytes it moves per step, and the mesh axes it spans.

A collective is classified by the mesh axes its device groups span, not by its kind: backends lower the same
sharding differently (XLA:CPU lowers an FSDP gradient to all-gather plus all-reduce, with no reduce-scatter),
but the axes a group spans say which links carry it. Bytes are per device per execution, the size of the whole
buffer the op gathers or reduces: an all-gather's output, a reduce-scatter's input (its output times the group
size), an all-reduce's, collective-permute's and all-to-all's buffer. An op inside a loop (the `lax.scan` over
layers, gradient accumulation) runs once per iteration: its per-step count multiplies the loops' trip counts.
Async pairs (`all-gather-start` / `-done`) count once, at the start.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from jaxllm.observe.hlo_text import HloModule, Instruction, DTYPE_BYTES, array_shapes
from jaxllm.observe.replica_groups import groups_of
from jaxllm.observe.sizes import format_bytes
from flax import nnx
from jaxllm.config.schema import MESH_AXES

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
TOP = 10


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the compiled program."""

    kind: str  # one of KINDS
    name: str  # the HLO instruction's name
    bytes: int  # per device per execution (see the module docstring)
    runs: int  # executions per step
    axes: tuple[str, ...]  # the mesh axes its groups span, in mesh order
    partial: bool  # its groups cover only part of those axes (a sub-axis, or pairs of a permutation)
    shape: str  # the result shape, as XLA prints it
    op_name: str  # the JAX op it came from (metadata op_name)
    source: str  # "<parameter named there> @ file:line function", or the file:line alone

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.runs

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS and not opcode.endswith("-done") else None


def _buffer_bytes(ins: Instruction, kind: str, group_size: int) -> int:
    arrays = array_shapes(ins.shape)
    if ins.opcode == "all-gather-start":  # ((operands), (results)): the results are the second half
        arrays = arrays[len(arrays) // 2:]
    elif ins.opcode == "collective-permute-start":  # (operand, result, contexts...)
        arrays = arrays[1:2]
    size = sum(DTYPE_BYTES[dtype] * int(np.prod(dims)) for dtype, dims in arrays)
    return int(size * group_size if kind == "reduce-scatter" else size)


def mesh_axes_of(groups: list[list[int]], mesh_shape: tuple[int, ...],
                 axis_names: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """(the mesh axes along which devices of a group differ, whether the groups cover only part of them).

    Device id i is position i of the mesh's device array (row-major over `mesh_shape`): the device assignment
    JAX compiles a program over a mesh with."""
    spanned = np.zeros(len(mesh_shape), bool)
    sizes = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), mesh_shape)).T
        spanned |= (coords != coords[0]).any(axis=0)
        sizes.add(len(group))
    axes = tuple(name for name, s in zip(axis_names, spanned) if s)
    full = int(np.prod([size for size, s in zip(mesh_shape, spanned) if s]))
    return axes, any(size < full for size in sizes)


def _source(module: HloModule, ins: Instruction, parameter_names: set[str]) -> str:
    """Where a collective comes from: the innermost model-code frame (jaxllm/model/, past the matmul helpers
    `lora.project`, `base_quant.kernel_einsum` and `quant.weight_einsum`, whose callers name the parameter), else
    any jaxllm frame outside jaxllm/observe/, and the parameter that line uses (`self.<name>` of a known
    parameter), if any."""
    helpers = ("/jaxllm/model/lora.py", "/jaxllm/model/base_quant.py", "/jaxllm/model/quant.py")
    where = (module.source(ins, lambda f: "/jaxllm/model/" in f and not f.endswith(helpers))
             or module.source(ins, lambda f: "/jaxllm/" in f and "/observe/" not in f))
    if where is None:
        return ""
    file, line, function = where
    text = linecache.getline(file, line)
    named = [n for n in re.findall(r"self\.(\w+)", text) if n in parameter_names]
    place = f"{Path(file).name}:{line} {function}"
    buffers = len(array_shapes(ins.shape))
    if buffers > 1:  # XLA combined several collectives (e.g. every gradient of a layer) into one op
        return f"{buffers} buffers combined, the first from {place}"
    return f"{named[0]} @ {place}" if named else place


def collectives(hlo_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...],
                parameter_names: set[str] = frozenset()) -> tuple[list[Collective], int]:
    """Every collective of an optimised HLO module's text (`compiled.as_text()`) over a mesh of `mesh_shape`,
    and the number of loops whose trip count XLA did not record (their collectives are counted once)."""
    module = HloModule.parse(hlo_text)
    found = []
    for ins in module.instructions:
        kind = _kind(ins.opcode)
        if kind is None:
            continue
        groups = groups_of(ins.text) or [list(range(int(np.prod(mesh_shape))))]  # {} = all devices
        axes, partial = mesh_axes_of(groups, mesh_shape, axis_names)
        op_name = re.search(r'op_name="([^"]*)"', ins.text)
        found.append(Collective(
            kind=kind, name=ins.name, bytes=_buffer_bytes(ins, kind, len(groups[0])),
            runs=module.runs.get(ins.computation, 0), axes=axes, partial=partial, shape=ins.shape,
            op_name=op_name.group(1) if op_name else "", source=_source(module, ins, parameter_names)))
    return found, module.unknown_trip_counts


def reduced_bytes_across(found: list[Collective], axis: str) -> int:
    """Per-device bytes per step of the reducing collectives (all-reduce, reduce-scatter) among `found` whose
    groups span mesh axis `axis`: the gradient traffic across it (PowerSGD's figure, scripts/bench_powersgd.py)."""
    return sum(c.bytes_per_step for c in found if c.kind in ("all-reduce", "reduce-scatter") and axis in c.axes)


def axes_label(c: Collective) -> str:
    return ("+".join(c.axes) or "none") + (" (part)" if c.partial else "")


def summarize(found: list[Collective], unknown_loops: int = 0, top: int = TOP) -> dict:
    """Bytes per step by (kind, axes), the total, and the `top` collectives by bytes per step."""
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: dict(ops=0, runs=0, bytes_per_step=0))
    for c in found:
        row = groups[(c.kind, axes_label(c))]
        row["ops"] += 1
        row["runs"] += c.runs
        row["bytes_per_step"] += c.bytes_per_step
    by_kind_axes = [dict(kind=k, axes=a, **v) for (k, a), v in
                    sorted(groups.items(), key=lambda kv: (-kv[1]["bytes_per_step"], kv[0]))]
    ranked = sorted(found, key=lambda c: (-c.bytes_per_step, c.name))[:top]
    return dict(total_bytes_per_step=sum(c.bytes_per_step for c in found), by_kind_axes=by_kind_axes,
                top=[dict(dataclasses.asdict(c), bytes_per_step=c.bytes_per_step, axes_label=axes_label(c),
                          backward=c.backward) for c in ranked],
                unknown_loops=unknown_loops)


def _short_op(op_name: str) -> str:
    """The last step of an op_name (the JAX primitive, e.g. `BTD,DF->BTF/dot_general`), at most 48 characters."""
    tail = "/".join(op_name.split("/")[-2:]).strip("()")
    return tail if len(tail) <= 48 else tail[:45] + "..."


def format_comms(summary: dict, mesh: dict[str, int]) -> str:
    """The communication report: bytes per step by kind and mesh axes, then the largest collectives."""
    loops = ("every loop's trip count known" if not summary["unknown_loops"] else
             f"{summary['unknown_loops']} loops of unknown trip count counted once")
    lines = [f"collectives of the compiled train step on mesh "
             f"{' x '.join(f'{k}={v}' for k, v in mesh.items())}: {format_bytes(summary['total_bytes_per_step'])} per "
             f"device per step (ops inside loops counted once per iteration, {loops})",
             f"{'kind':<20} {'mesh axes':<22} {'ops':>5} {'runs/step':>10} {'bytes/step':>12}"]
    lines += [f"{r['kind']:<20} {r['axes']:<22} {r['ops']:>5} {r['runs']:>10} {format_bytes(r['bytes_per_step']):>12}"
              for r in summary["by_kind_axes"]]
    lines += ["", f"top {len(summary['top'])} collectives by bytes per step:",
              f"{'bytes/step':>12} {'runs':>5} {'kind':<18} {'mesh axes':<16} {'pass':<8} source (op)"]
    for c in summary["top"]:
        where = c["source"] or "?"
        lines.append(f"{format_bytes(c['bytes_per_step']):>12} {c['runs']:>5} {c['kind']:<18} {c['axes_label']:<16} "
                     f"{'backward' if c['backward'] else 'forward':<8} {where} ({_short_op(c['op_name'])})")
    return "\n".join(lines)


def step_comms(compiled, mesh_shape: tuple[int, ...], params) -> dict:
    """`summarize` of a compiled train step's collectives on a mesh of `mesh_shape` (`MESH_AXES` order), naming
    the parameter of `params` (an nnx.State, abstract or real) that each collective's source line uses."""
    names = {str(path[-1]) for path, _ in nnx.to_flat_state(params)}
    found, unknown = collectives(compiled.as_text(), mesh_shape, MESH_AXES, names)
    return summarize(found, unknown)


