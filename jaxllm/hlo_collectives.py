"""Bytes a compiled program's reducing collectives move across one mesh axis, read from its HLO text.

`jax.jit(...).lower(...).compile().as_text()` is the partitioned program each device runs: every all-reduce and
reduce-scatter there names its replica groups (logical device ids: positions in the mesh's device array, row
major), so whether it crosses an axis is whether a group holds devices with different coordinates on it. A
collective inside a while loop (the layer scan) runs once per iteration: its bytes are multiplied by the loop's
`known_trip_count`; of a conditional's branches the costliest counts (one runs per execution). Bytes are per
device: the operands' sizes (a reduce-scatter's: its result times the group size).

Hand-written because neither jax nor XLA's Python API exposes per-collective replica groups of a compiled
program (`cost_analysis()` has no per-axis split).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

REDUCING = ("all-reduce", "all-reduce-start", "reduce-scatter")
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1,
               "u8": 1, "pred": 1, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One reducing collective of a computation: its op, operand bytes per device, replica groups."""

    op: str
    bytes: int
    groups: tuple[tuple[int, ...], ...]


def _array_bytes(text: str) -> int:
    return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(text))


def replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups of an HLO instruction `line` (explicit `{{0,1},{2,3}}` or iota `[2,2]<=[4]T(1,0)`);
    one group of every device when it names none."""
    iota = _GROUPS_IOTA.search(line)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        ids = np.arange(math.prod(shape)).reshape([int(x) for x in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    listed = _GROUPS_LIST.search(line)
    if listed and listed.group(1):
        return tuple(tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([0-9,]*)\}", listed.group(1)))
    return (tuple(range(num_devices)),)


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Instruction lines by computation name, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and "=" not in line.split("(")[0]:
                current = header.group(1)
                comps[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def step_collectives(hlo: str, num_devices: int) -> list[tuple[Collective, int]]:
    """(collective, executions per run) of every reducing collective the entry computation reaches."""
    comps, entry = _computations(hlo)
    memo: dict[str, list[tuple[Collective, int]]] = {}

    def walk(name: str) -> list[tuple[Collective, int]]:
        if name in memo:
            return memo[name]
        memo[name] = []  # no recursion in HLO; guards malformed text
        found = []
        for line in comps.get(name, []):
            inst = _INSTRUCTION.match(line)
            if not inst:
                continue
            op = inst.group(2)
            if op in REDUCING:
                groups = replica_groups(line, num_devices)
                size = _array_bytes(inst.group(1))  # compiled HLO names operands without their shapes
                found.append((Collective(op, size * (len(groups[0]) if op == "reduce-scatter" else 1), groups), 1))
            times = int(_TRIP.search(line).group(1)) if op == "while" and _TRIP.search(line) else 1
            for callee in _CALLS.findall(line):
                found += [(c, n * times) for c, n in walk(callee)]
            branches = _BRANCHES.search(line)
            if branches:
                options = [walk(b.strip().lstrip("%")) for b in branches.group(1).split(",")]
                found += max(options, key=lambda cs: sum(c.bytes * n for c, n in cs))
        memo[name] = found
        return found

    return walk(entry)


def crosses(groups, mesh_shape: tuple[int, ...], axis: int) -> bool:
    """True when some group holds devices at different coordinates on mesh dimension `axis`."""
    coords = [np.unravel_index(np.asarray(g), mesh_shape)[axis] for g in groups]
    return any(len(set(c.tolist())) > 1 for c in coords)


def bytes_across(hlo: str, mesh_shape: tuple[int, ...], axis: int) -> dict[str, int]:
    """Per-device bytes per run of the reducing collectives that cross mesh dimension `axis`, by op, with their
    `total`; `count` is how many such collectives run."""
    out = {"total": 0, "count": 0}
    for collective, times in step_collectives(hlo, math.prod(mesh_shape)):
        if crosses(collective.groups, mesh_shape, axis):
            out[collective.op] = out.get(collective.op, 0) + collective.bytes * times
            out["total"] += collective.bytes * times
            out["count"] += times
    return out
